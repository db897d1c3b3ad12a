"""pytest-gpu: run GPU-heavy test suites in parallel on every GPU, without OOMs or port clashes.

The package, one folder per layer, lowest first. "(pure)": no pytest and no I/O,
transitively (tests/project/test_layout.py checks it, and that this map names every module).

    base/               words and the operating system, used by every layer
        requests        sizes and GPU requests (pure)
        distspec        the ``distributed`` marker, the run's settings for it (pure)
        spans           a test's leases, and other holders' it judged, as its report carries them (pure)
        wording         counts that read right (pure)
        procs           process trees and owner liveness
        safefiles       files in directories other users can write, never following their links
        importhook      run a callback right after a module is imported
        launch          is this process a rank of a launcher (srun, mpirun, torchrun)
        privates        pytest's and pytest-xdist's private names, each used through here (tested on the floors)
    wire/               how processes talk: one framing, one server loop, one client, schemas both ways
        frames          length-prefixed JSON frames, bounded (pure)
        schema          what each message must be, declared per protocol, checked on arrival (pure)
        sockets         the Unix sockets frames travel on: peer credentials, addresses of any length
        handshake       the key's challenge and answer both ways, as multiprocessing.connection's
        server          one server: authentication apart (key or peer credentials), one serving thread, bounds
        client          one client: calls with ids and timeouts, one-way tells, events
    machine/            every run of a machine shares one view of its GPUs
        placement       which GPUs a request gets, fairness (pure)
        ports           run-unique TCP ports
        domain          where the runs of a machine meet, who may meet there, what one user may hold
        arbiter         the one allocator of the machine: GPUs, host resources, ports
        messages        the arbiter's protocol: every message, both ways, declared (pure)
        server          the arbiter's socket: a handler per message, the kernel's word for who is there
        link            a run's side: lead, attach, fail over
        remote          a run's connection to the arbiter in another process
        mirror          what a run holds and waits for, brought to a new arbiter
    vendors/            what each vendor's GPUs and drivers are: everything that differs by vendor
        kinds           the one list of vendors: each one's name, words, simulated machine (pure)
        devices         a machine's GPUs (Device) and the run's share of them (Inventory) (pure)
        sampling        a driver opened for memory and process samples: what every one answers (pure)
        vendor          the Vendor interface every vendor implements, and what they share (pure)
        nvidia          NVIDIA: NVML's GPUs and process lists, CUDA_VISIBLE_DEVICES, MIG, cuInit
        amd             AMD ROCm: amdsmi's GPUs and process list, ROCm's visibility variables, hipInit
        intel           Intel XPU: Level Zero Sysman's GPUs and process list, ZE_AFFINITY_MASK, zeInit
        registry        the vendor objects, one per vendor, by name
        nvmlversion     which NVML the driver has
        libraries       pynvml and amdsmi imported when needed, warnings to pytest; libraries kept open per process
    sim/                simulated GPUs as strict as CUDA, NVML, AMD SMI and Level Zero
        spec            ``sim:4x16GiB``, ``amd:sim:8x192GiB``, ``xpu:sim:4x64GiB``, their options and devices (pure)
        ledger          the machine's memory and contexts: the tests' physics
        cuda            a process's simulated CUDA runtime
        nvml            a fake libnvidia-ml.so.1, built from C
        amdsmi          a fake libamd_smi.so for the amdsmi package, built from C
        hip             a fake libamdhip64.so: the devices HIP enumerates, built from C
        zes             a fake Level Zero loader (Sysman, and the core API's devices), built from C
        torch_cuda      torch.cuda (torch.xpu on Intel GPUs) for the CPU build of torch
        torch_tensors   tensors on a simulated GPU: host tensors charged to it through torch_cuda's allocator
        cupy_cuda       a CuPy stand-in: devices and memory pools as CuPy drives CUDA
        fake            the PYTEST_GPU_FAKE_GPUS switch
    gpu/                a process and its GPUs
        discovery       --gpus: one vendor's GPUs (NVIDIA's, AMD's or Intel's), or simulated ones
        runtime         the process's GPU runtime (CUDA, HIP, Level Zero), pinned before a lease
        isolation       a lease in the test process, what confining to it changed, each lease's cap
        adapters        torch's and CuPy's confinement (pytest_gpu_confine)
        confine         applying a lease to the test process: pin, environment, the frameworks' hook
        verification    did a test (or a rank pool) stay within its lease: every verifier
        torchstats      torch's allocator counters, read once per device
        calibration     one runtime context's size (CUDA, HIP, Level Zero), measured on a GPU's first lease
        foreign         what processes outside pytest-gpu use, through NVML or amdsmi
        share           a launched rank's share of the node's GPUs
    leasing/            the run's lease service
        host            the machine's CPUs and RAM as leases, thread counts
        broker          a run's lease service: a handler per message of its protocol
        view            one node's GPUs as the scheduler reads them, the broker's GPU indices translated (pure)
        protocol        the broker's protocol: every message, both ways, declared
        client          the broker's test-process side
    run/                one run in each of its processes
        options         command-line options and ini keys, validated into Settings
        keys            what the plugin keeps in config.stash and hands to workers
        history         durations and peaks of earlier runs
        written         --gpu-requests: the file of written requests, its format (parse, render) and I/O
        bisect          --gpu-bisect: the smallest memory a test passes with, each try a fresh pytest
        leftovers       what a process still holds of the leases that ended, charged to their holders
        session         the run's state in one process (GpuRun); ``GpuRun.hold``: every lease
        record          a test's own record, built once at collection (TestNeeds)
        holding         who holds leases (Owner) and how: hold, Holding, a test's state, the verdicts' wording
        feature         what every feature's hook object shares: its config, the run it reads
        lifecycle       one test's life with a lease; tests this run can never run, skipped (Leases)
        required        --gpu-required: GPU tests and no GPUs stop the run at start (Required)
        conventions     requests from a suite's own markers and the item-request hook
        fixture_leases  leases held by fixtures of any scope
        rundir          the run directory and its owner
        artifacts       data built once per run (shared_artifact)
        quarantine      a process a sticky CUDA error broke, until it exits: its record, the refusal, the probe
        sticky          the quarantine's hooks: after each test, is CUDA still usable (StickyErrors)
        transient       whether a failure's cause was outside the test (infrastructure) or its own (pure)
        infra           infrastructure failures: their evidence, report and --gpu-retry-infra (Infrastructure)
    distributed/        distributed test bodies on a warm pool of ranks
        backends        what backend="auto" picks here; what nccl lacks where it cannot run
        protocol        what a pool and its ranks send each other (declared), and the files they write
        launchers       spawn, torchrun, mpirun, srun: commands, environments, ending them
        pool            the warm pool of rank processes
        rankmain        a rank process
        rankinfo        the ``rank`` fixture's value
        runner          a distributed test in the test process (Distributed); the process's pools
        cover           coverage in rank processes
        residue         what a test left on a rank (torch defaults, process groups, environment, seeding)
        contamination   a failure on a warm pool after other tests: rerun alone, contamination or its own
    launched/           pytest itself under srun, mpirun or torchrun
        markers         which tests may run where (pure)
        selection       deselecting by those markers (Selection)
        shard           splitting a suite over the ranks (pure)
        torchenv        torch.distributed's variables (RANK, MASTER_ADDR, ...) under mpirun and srun
        gather          ranks publishing to each other through files
        session         a launched rank's main process (LaunchedRank)
    raycluster/         Ray clusters for tests (the ``ray_cluster`` fixture)
        head            what a head is: the fixture's value, command, environment, files
        readiness       this process's Ray driver: connect, wait, disconnect
        driver          the fixture: which cluster the driver joins
        startonce       the run's own head, started once
        stop            stopping a head and its processes; the run's owner stops its own (RayHead)
        watchdog        ``-m pytest_gpu.raycluster.watchdog``: runs the head, stops it if the run dies
    report/             what the run tells its user
        summary         the terminal summary
        feature         the owner's report: summary, trace, history (RunReport)
        timeline        one record per test, the summary's figures (pure)
        trace           the Perfetto trace
        gantt           the Gantt chart of a trace
        written         written requests in the run's owner: where requests came from, writing and checking the file
    scheduling/         which worker runs which test when
        planner         the plan over each node's view (pure)
        scheduler       xdist's scheduler, driven by the planner, reading the run's nodes (Scheduling)
        catalog         what each collected test needs, told by each worker (Catalog)
        dependencies    tests that depend on others
        autoworkers     GPU-aware ``-n auto``
    nodes/              the run's nodes: one machine's, or several (--gpu-nodes)
        spec            the option, the nodes, the workers' execnet specs (pure)
        sshgate         a process started on a host through ssh, quoted for its shell
        messages        what the controller and a node's host say to each other, declared (pure)
        agent           a node's host: that node's run (inventory, broker, arbiter link)
        hosts           the controller's side: the node hosts, each worker's node and run
        worker          a worker's node: checked, its temp directory there, named in its reports (NodeWorker)
        feature         the run's nodes as its owner drives them, one or many; node mode's hooks
    roles/              one plugin object per role a process plays: who owns the run, which features apply
        base            what every role shares: its features, foreseen then settled, its run, ending it
        owner           the run's owner (controller, lone): starts the run, hands it to the workers
        tester          processes that run tests: worker, lone
    hookspecs           hooks for conftests: pytest_gpu_item_request, pytest_gpu_confine
    plugin              the ``pytest11`` entry point ``gpu``: options, markers, fixtures;
                        the role's registration, early and at pytest_configure
    cli                 the ``pytest-gpu`` command (inventory, report, status)

Layers, lowest first. A module imports from its own folder and from the layers below it:
never from a layer above, nor from another folder of its own layer (folders of one layer are
peers), and no modules import each other in a circle. Every kind of import counts: at module
level, inside functions and under ``TYPE_CHECKING`` alike. A function-local import of the
package is only for a module that is slow to import and not needed by every process, and
says why on its line (``# local: ...``). tests/project/test_layout.py checks all of it. A name is a
folder (all its modules) or a top-level module:

    1. base: base
    2. wire: wire
    3. machine: machine
    4. vendors: vendors
    5. sim: sim
    6. gpu: gpu
    7. leasing: leasing
    8. run: run
    9. features: distributed launched raycluster
    10. planning: scheduling report
    11. nodes: nodes
    12. roles: roles
    13. entry: hookspecs plugin cli
"""

from typing import TYPE_CHECKING, Any

from .base.privates import keep_out_of_rewriting

# before any other module of the package is imported, the plugin's included
keep_out_of_rewriting(__name__)

if TYPE_CHECKING:
    from .base.requests import GpuRequest, parse_size
    from .gpu.isolation import GpuLease

__all__ = ["GpuLease", "GpuRequest", "parse_size"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # lazily: the plugin is loaded into every pytest process, CPU-only suites included
    if name == "GpuLease":
        from .gpu.isolation import GpuLease  # local: the package's __init__ runs in every process: it loads nothing

        return GpuLease
    if name in ("GpuRequest", "parse_size"):
        from .base import requests  # local: the package's __init__ runs in every process: it loads nothing

        return getattr(requests, name)
    raise AttributeError(f"module 'pytest_gpu' has no attribute {name!r}")
