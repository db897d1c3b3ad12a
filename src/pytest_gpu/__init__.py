"""pytest-gpu: run GPU-heavy test suites in parallel on every GPU, without OOMs or port clashes.

The package, one folder per subsystem, roughly from what a test asks for to what the user
reads. "(pure)": no pytest and no I/O, transitively (tests/test_layout.py checks it, and
that this map names every module).

    plugin              the ``pytest11`` entry point ``gpu``: options, markers, fixtures;
                        registers the role's plugin object
    hookspecs           hooks for conftests: pytest_gpu_item_request, pytest_gpu_confine
    options             command-line options and ini keys, validated into Settings
    cli                 the ``pytest-gpu`` command (inventory, report, status)
    importhook          run a callback right after a module is imported
    procs               process trees and owner liveness, for every layer
    safefiles           files in directories other users can write, never following their links
    service/            an authenticated Unix-socket service (the broker's transport)
        authserver      the listener, handshakes apart, one serving thread
        handshake       multiprocessing.connection's key challenge and answer, a frame at a time
    roles/              one plugin object per role a process plays
        base            what every role shares: its run, ending it
        keys            what the roles keep in config.stash and hand to workers
        owner           the run's owner (controller, lone): summary, history, trace
        tester          processes that run tests: worker, lone
    leasing/            what a test asks for and how a run grants it
        requests        sizes and GPU requests (pure)
        placement       which GPUs a request gets, fairness (pure)
        host            the machine's CPUs and RAM as leases, thread counts
        ports           run-unique TCP ports
        broker          a run's lease service (its protocol: protocol)
        protocol        the bodies of the broker's messages
        client          the broker's test-process side
        spans           a test's leases, and other holders' it judged, as its report carries them
    machine/            every run of a machine shares one view of its GPUs
        domain          where the runs of a machine meet, and who may meet there
        arbiter         the one allocator of the machine: GPUs, host resources, ports
        wire            the arbiter's frames (JSON) and sockets
        messages        every field of a run's requests to the arbiter, checked (pure)
        server          the arbiter's socket
        link            a run's side: lead, attach, fail over
        remote          a run's connection to the arbiter in another process
        mirror          what a run holds and waits for, brought to a new arbiter
    gpu/                real GPUs
        vendors         one interface per vendor: devices, visibility variables, view, lease variables
        discovery       --gpus by vendor: NVIDIA's, AMD's or Intel's GPUs, never two vendors' at once
        devices         NVML, index lists, MIG
        libraries       pynvml and amdsmi, imported when needed; their import warnings handed to pytest
        runtime         the process's CUDA, pinned before a lease
        isolation       applying a lease in the test process
        adapters        torch's and CuPy's confinement (pytest_gpu_confine)
        verification    did the test stay within its lease
        torchstats      torch's allocator counters, read once per device
        calibration     one runtime context's size (CUDA, HIP, Level Zero), measured on a GPU's first lease
        foreign         what processes outside pytest-gpu use, through NVML or amdsmi
        sampling        each vendor's driver opened for memory and process samples
        nvmlversion     which NVML the driver has
        rocm            AMD ROCm: amdsmi's GPUs and process list, ROCm's visibility variables
        xpu             Intel XPU: Level Zero Sysman's GPUs and process list, ZE_AFFINITY_MASK
    sim/                simulated GPUs as strict as CUDA, NVML, AMD SMI and Level Zero Sysman
        spec            ``sim:4x16GiB``, ``amd:sim:8x192GiB``, ``xpu:sim:4x64GiB`` and their options (pure)
        ledger          the machine's memory and contexts: the tests' physics
        cuda            a process's simulated CUDA runtime
        nvml            a fake libnvidia-ml.so.1, built from C
        amdsmi          a fake libamd_smi.so for the amdsmi package, built from C
        hip             a fake libamdhip64.so: the devices HIP enumerates, built from C
        zes             a fake Level Zero loader (Sysman), built from C
        torch_cuda      torch.cuda (torch.xpu on Intel GPUs) for the CPU build of torch
        torch_tensors   tensors on a simulated GPU: host tensors charged to it through torch_cuda's allocator
        cupy_cuda       a CuPy stand-in: devices and memory pools as CuPy drives CUDA
        fake            the PYTEST_GPU_FAKE_GPUS switch
    run/                one run in each of its processes
        session         the run's state in one process (GpuRun); ``GpuRun.hold``: every lease
        record          a test's own record, built once at collection (TestNeeds)
        holding         who holds leases (Owner) and how: Holding, a test's state, the verdicts' wording
        lifecycle       one test's life with a lease; tests this run can never run, skipped
        required        --gpu-required: GPU tests and no GPUs stop the run at start
        conventions     requests from a suite's own markers and the item-request hook
        fixture_leases  leases held by fixtures of any scope
        rundir          the run directory and its owner
        artifacts       data built once per run (shared_artifact)
        quarantine      a process a sticky CUDA error broke, until it exits; the probe
    scheduling/         which worker runs which test when
        planner         the plan (pure)
        scheduler       xdist's scheduler, driven by the planner
        catalog         what each collected test needs
        dependencies    tests that depend on others
        history         durations and peaks of earlier runs
        autoworkers     GPU-aware ``-n auto``
    report/             what the run tells its user
        summary         the terminal summary
        wording         counts that read right (pure)
        timeline        one record per test, the summary's figures (pure)
        trace           the Perfetto trace
        gantt           the Gantt chart of a trace
    distributed/        distributed test bodies on a warm pool of ranks
        spec            the ``distributed`` marker, the run's settings for it (pure)
        backends        what backend="auto" picks here; what nccl lacks where it cannot run
        protocol        what a pool and its ranks send each other, and the files they write
        launchers       spawn, torchrun, mpirun, srun: commands, environments, ending them
        pool            the warm pool of rank processes
        rankmain        a rank process
        rankinfo        the ``rank`` fixture's value
        runner          a distributed test in the test process; the process's pools
        cover           coverage in rank processes
    launched/           pytest itself under srun, mpirun or torchrun
        detect          is this process a rank of a launcher
        markers         which tests may run where (pure)
        selection       deselecting by those markers
        share           a rank's share of the node's GPUs
        shard           splitting a suite over the ranks (pure)
        torchenv        torch.distributed's variables (RANK, MASTER_ADDR, ...) under mpirun and srun
        gather          ranks publishing to each other through files
        session         the launched-rank role (LaunchedRank)
    nodes/              one run over several nodes (--gpu-nodes)
        spec            the option, the nodes, the workers' execnet specs (pure)
        sshgate         a process started on a host through ssh, quoted for its shell
        agent           a node's host: that node's run (inventory, broker, arbiter link)
        hosts           the controller's side: the node hosts, each worker's node and run
        worker          a worker's node: checked, its temp directory there
    raycluster/         Ray clusters for tests (the ``ray_cluster`` fixture)
        head            what a head is: the fixture's value, command, environment, files
        readiness       this process's Ray driver: connect, wait, disconnect
        driver          the fixture: which cluster the driver joins
        startonce       the run's own head, started once
        stop            stopping a head and its processes
        watchdog        ``-m pytest_gpu.raycluster.watchdog``: runs the head, stops it if the run dies

Layers, lowest first. A module imports from its own layer and the layers below it, never
from one above, at module level and inside functions alike (``TYPE_CHECKING`` imports
aside: types only); tests/test_layout.py checks it, and that no modules import each other
in a circle. A name is a folder (its modules) or one module, which then leaves its
folder's layer for this one:

    1. words: hookspecs procs safefiles importhook service leasing.requests leasing.placement
       leasing.ports leasing.host leasing.spans leasing.protocol report.wording launched.detect
       scheduling.history nodes.spec nodes.sshgate
    2. machine: machine
    3. devices: sim gpu
    4. leasing: leasing
    5. settings: options run.conventions roles.keys
    6. run: run launched distributed raycluster nodes
    7. planning: scheduling report
    8. roles: roles
    9. entry: plugin cli
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .gpu.isolation import GpuLease
    from .leasing.requests import GpuRequest, parse_size

__all__ = ["GpuLease", "GpuRequest", "parse_size"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # lazily: the plugin is loaded into every pytest process, CPU-only suites included
    if name == "GpuLease":
        from .gpu.isolation import GpuLease

        return GpuLease
    if name in ("GpuRequest", "parse_size"):
        from .leasing import requests

        return getattr(requests, name)
    raise AttributeError(f"module 'pytest_gpu' has no attribute {name!r}")
