"""One pytest process's pytest-gpu state: settings, inventory, broker or its address.

Roles: the xdist controller and a run without xdist own the broker; xdist workers get
its address through ``workerinput``. Nothing is connected until a test needs a GPU or a
port, so a CPU-only suite pays for one idle thread in the controller and nothing else.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from .. import sim
from ..base.requests import GpuRequest, format_size
from ..gpu import runtime
from ..gpu.calibration import Calibration
from ..gpu.confine import confine as confine_lease
from ..gpu.discovery import discover
from ..gpu.isolation import Confinement, GpuLease, make_lease
from ..gpu.share import node_share
from ..gpu.verification import (
    NvmlRankVerifier,
    NvmlVerifier,
    SimRankVerifier,
    SimVerifier,
    Verdict,
    Verifier,
    standing,
)
from ..leasing.client import BrokerClient
from ..leasing.host import HostCapacity, capacity, confine_threads
from ..machine.domain import Domain, claim_run_machines, placement_spreads, release_run_machines
from ..machine.messages import PART
from ..machine.placement import HostState, Policy
from ..sim import fake
from ..sim.spec import SpecError, check_context, parse
from ..vendors import registry as vendors
from ..vendors.devices import DeviceSpecError, Inventory
from ..vendors.sampling import Unavailable
from . import quarantine as quarantine_
from . import rundir
from .leftovers import Leftovers
from .options import Settings
from .written import Written

if TYPE_CHECKING:
    from ..base.launch import LaunchContext
    from ..leasing.broker import Broker
    from ..machine.link import MachineLink

WIRE_KEY = "pytest_gpu"


class RunWire(TypedDict):
    """What the xdist controller hands each worker under ``workerinput[WIRE_KEY]``
    (:meth:`GpuRun.to_wire`, :meth:`GpuRun.join`); execnet carries plain values only."""

    settings: dict[str, Any]  # Settings.to_wire
    inventory: dict[str, object]  # Inventory.to_wire
    address: str  # the broker's socket
    authkey: str  # hex
    run_dir: str
    env: dict[str, str]  # the run's environment variables a worker must see too (WORKER_ENV)


# set by the controller's run (the simulated machine, CUDA's device order), read by workers
WORKER_ENV = (
    sim.LEDGER_ENV,
    sim.SPEC_ENV,
    sim.OVERHEAD_ENV,
    "CUDA_DEVICE_ORDER",
    "PYTEST_GPU_FAKE_GPUS",
    "LD_LIBRARY_PATH",
)


@dataclass
class ActiveLease:
    """A lease applied to this process, until :meth:`GpuRun.finish`."""

    lease: GpuLease
    confinement: Confinement
    verifier: Verifier | None  # None: a lease of host resources only
    asked: float = 0.0  # wall-clock times, for the run's timeline
    granted: float = 0.0
    released: float = 0.0  # stamped before the release is sent: a waiter may be granted at once
    owner_pid: int = 0  # whose own CUDA contexts the verifier leaves out (this process's)
    confined: bool = True  # False: held for other processes (a rank pool's), this one is not confined


def host_lease(key: str, waited: float, simulated: bool) -> GpuLease:
    """The ``gpu``-fixture-shaped value of a lease of host resources only (no GPU)."""
    return GpuLease(
        key=key,
        indices=(),
        uuids=(),
        memory=0,
        exclusive=False,
        device="",
        visible_devices="",
        env={},
        waited=waited,
        simulated=simulated,
    )


def _refuse_tiny_gpus(inventory: Inventory, settings: Settings) -> None:
    """A simulated or fake machine whose GPUs are no larger than the CUDA context the run
    assumes (``--gpu-context-overhead``, unless the spec's ``context=`` says) is a typo
    (``sim:4x1KiB``): a usage error now, not "-500MiB after the CUDA context" at every test."""
    source = inventory.source if inventory.simulated else fake.requested()
    if not source:
        return
    label = "--gpus" if inventory.simulated else fake.FAKE_ENV + ":"
    try:
        if parse(source).context is None:  # with context=, parse checked it against that
            sizes = [d.capacity for d in inventory.devices]
            check_context(source, sizes, settings.context_overhead, "--gpu-context-overhead")
    except SpecError as exc:
        raise DeviceSpecError(f"{label} {exc}") from None


def machine_link(inventory: Inventory, policy: Any) -> MachineLink:
    """This run's way to the machine's arbiter: the real GPUs' domain, or the simulated
    machine's (the one ``PYTEST_GPU_SIM_MACHINE`` names, else the run's own); joined when the first
    lease is asked."""
    from ..machine.link import MachineLink  # local: slow (with the broker): only the run's owner links

    spec = inventory.source if inventory.simulated else fake.requested()

    def domain() -> Domain:
        return Domain.sim(spec) if spec else Domain.real()

    command = " ".join(["pytest", *sys.argv[1:]])
    label = f"{command if len(command) <= 80 else command[:77] + '...'} in {os.getcwd()}"
    return MachineLink(domain, policy, label=label, foreign=ForeignSource(), truth=MachineTruth(inventory, spec))


class MachineTruth:
    """What this process measures of the machine's GPUs, by UUID: when this run is the
    arbiter, every run's declared GPUs are checked against it (see :mod:`pytest_gpu.machine.arbiter`).

    The run's own record of the machine first; a UUID it lacks is looked up once in the
    simulated machine's spec (``spec``) or through the run's vendor's driver (NVML, amdsmi,
    Sysman: a run that is the arbiter may itself have asked for no GPU). The drivers' path runs
    against the fake libraries in CI; it was not run on a real GPU machine (none was lent to
    the session that wrote it)."""

    def __init__(self, inventory: Inventory, spec: str | None) -> None:
        self._known = {d.uuid: d.capacity for d in (inventory.machine or inventory.devices)}
        self._spec = spec
        self._vendor = vendors.of(inventory.vendor)
        self._looked = False  # GPUs do not come and go: the machine is looked at once
        self._blind = False  # neither the run's record nor NVML could say

    def __call__(self, uuids: list[str]) -> dict[str, int] | None:
        """Capacities of the ``uuids`` this process knows; ``None`` where it cannot measure at all."""
        if not self._looked and any(u not in self._known for u in uuids):
            self._looked = True
            try:
                found = parse(self._spec).devices()[0] if self._spec else self._vendor.devices()[0]
            except (SpecError, Unavailable):
                found = ()
                self._blind = not self._known
            self._known.update({d.uuid: d.capacity for d in found})
        if self._blind:
            return None
        return {u: self._known[u] for u in uuids if u in self._known}


def machine_names(inventory: Inventory, local_rank: int) -> dict[int, str]:
    """What the machine's arbiter calls each GPU of the run: its UUID; or, for a launched
    rank's fixed part of a GPU it shares with other ranks of the node (see
    :mod:`pytest_gpu.gpu.share`), a name of that part alone, since the ranks run each
    test together and must each get their own part at once."""
    physical = {d.uuid: d.capacity for d in inventory.machine}
    return {
        d.index: d.uuid if physical.get(d.uuid, d.capacity) == d.capacity else f"{d.uuid}{PART}{local_rank}"
        for d in inventory.devices
    }


class ForeignSource:
    """What processes outside pytest-gpu use on each GPU, through NVML (the fake NVML on
    simulated GPUs): the arbiter's foreign source. NVML is started on the first sample,
    in the arbiter's process only."""

    def __init__(self) -> None:
        self._sampler: Any = None

    def __call__(self, uuids: list[str], roots: set[int], accounted: dict[str, int]) -> dict[str, int]:
        from ..gpu.foreign import ForeignSampler  # local: only the machine's arbiter samples other processes

        if self._sampler is None:
            self._sampler = ForeignSampler()
        whole = [u for u in uuids if PART not in u]  # a rank's part: its neighbours are foreign to it, by design
        found = self._sampler.sample(roots, accounted, uuids=whole) if whole else {}
        return {uuid: usage.bytes for uuid, usage in found.items()}

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()


@dataclass
class GpuRun:
    settings: Settings
    inventory: Inventory
    address: str
    authkey: bytes
    worker: str
    run_dir: Path
    broker: Broker | None = None
    _client: BrokerClient | None = None
    _client_lock: threading.Lock = field(default_factory=threading.Lock)
    _saved_env: dict[str, str | None] = field(default_factory=dict)
    _sim_run: str | None = None  # the run name of the simulated machines this run made its own
    learned_peaks: dict[str, int] = field(default_factory=dict)  # --gpu-learn: node id -> bytes
    written: Written | None = None  # --gpu-requests: the file's requests (not in a run that writes it)
    # the pytest_gpu_confine hook (config.hook's), set by the plugin; None: torch and CuPy alone
    frameworks: Callable[..., object] | None = None
    _host: HostCapacity | None = None
    # set once a test left this process's CUDA unusable: no lease is given back or granted since
    quarantine: quarantine_.Quarantine | None = None
    # what this process gives up when one of its own requests must wait (its idle warm rank pools)
    on_wait: list[Callable[[], bool]] = field(default_factory=list)
    calibration: Calibration = field(default_factory=Calibration)  # the CUDA contexts this process measured
    # --gpu-nodes: the node whose GPUs give one lease the most, and that most (a request is
    # checked against it, not this node's: the scheduler keeps it off nodes too small for it)
    largest_node: tuple[str, int] | None = None
    node: str | None = None  # --gpu-nodes: the node whose run this is (its inventory is that node's)
    # what this process still holds of leases that ended (their verdicts' leaks), charged to them
    leftovers: Leftovers = field(default_factory=Leftovers)
    _confined: dict[str, ActiveLease] = field(default_factory=dict)  # lease key -> one this process is confined to
    # GPUs this process's leases should not be on, where the run has others enough: a retry's
    # (--gpu-retry-infra) after an infrastructure failure there (see pytest_gpu.run.infra)
    avoid: frozenset[int] = frozenset()

    def __repr__(self) -> str:
        # short: a traceback's locals show it, and the settings and inventory fill a screen
        return f"<GpuRun {self.worker} gpus={self.settings.gpus!r} run_dir={str(self.run_dir)!r}>"

    # -- construction ---------------------------------------------------------------

    @classmethod
    def start(cls, settings: Settings, worker: str = "main", launch: LaunchContext | None = None) -> GpuRun:
        """Controller or single process: discover, make the run directory, start the broker.

        ``launch``: the launcher this process is a rank of (its share of the node's GPUs)."""
        from ..leasing.broker import Broker  # local: slow (its server, the machine link): only the run's owner

        # (PYTEST_GPU_FAKE_GPUS was switched on by the plugin, before conftest.py files load)
        inventory = node_share(discover(settings.gpus), launch)  # under a launcher: this rank's share of the node
        _refuse_tiny_gpus(inventory, settings)
        run_dir = rundir.create()
        address = str(run_dir / "broker.sock")
        authkey = secrets.token_bytes(32)
        policy = Policy(
            overhead=settings.context_overhead, fixed=settings.context_overhead_given, spread=placement_spreads()
        )
        broker = Broker(
            {d.index: d.capacity for d in inventory.devices},
            address,
            authkey,
            policy,
            settings.port_range,
            link=machine_link(inventory, policy),
            uuids=machine_names(inventory, launch.local_rank if launch else 0),
            host=capacity(settings.host_cpus, settings.host_memory).to_wire(),
        ).start()
        run = cls(settings, inventory, address, authkey, worker, run_dir, broker)
        if inventory.simulated:
            # The simulated machine the run names (PYTEST_GPU_SIM_MACHINE), else its own (one
            # per run and spec, gone with the run): runs naming the same one share its GPUs'
            # memory, as runs on one real machine share its GPUs. Every process of the run
            # (workers, ranks, subprocesses) sees it through the fake-GPU switch.
            try:
                try:
                    run._sim_run = claim_run_machines(f"{launch.launcher}:{launch.run_id}" if launch else None)
                except OSError as exc:  # no private directory for it: as for the machine's ledger
                    raise sim.LedgerWriteError(
                        exc.errno or 13,
                        f"{exc.strerror or exc}; set PYTEST_GPU_MACHINE_DIR to a writable directory",
                        exc.filename,
                    ) from None
                ledger = sim.machine_ledger(inventory.source, settings.context_overhead)
            except sim.SimMachineError as exc:  # in use with another spec: a usage error
                run.close()  # the broker and run directory made above
                raise DeviceSpecError(str(exc)) from None
            except BaseException:
                run.close()
                raise
            run._set_env(
                {
                    sim.LEDGER_ENV: str(ledger.path),
                    sim.SPEC_ENV: inventory.source,
                    sim.OVERHEAD_ENV: str(settings.context_overhead),
                    fake.FAKE_ENV: inventory.source,
                    "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),  # restored at close
                }
            )
            fake.activate(inventory.source)
        if fake.notes:  # what the fake machine could not provide here (no C compiler, ...)
            run.inventory = replace(inventory, note="; ".join(filter(None, [inventory.note, *fake.notes])))
        run._set_env({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        return run

    @classmethod
    def join(cls, data: RunWire, worker: str) -> GpuRun:
        """An xdist worker: use the controller's broker and inventory."""
        run = cls(
            Settings.from_wire(data["settings"]),
            Inventory.from_wire(data["inventory"]),
            data["address"],
            bytes.fromhex(data["authkey"]),
            worker,
            Path(data["run_dir"]),
        )
        run._set_env(data["env"])
        return run

    def to_wire(self) -> RunWire:
        return RunWire(
            settings=self.settings.to_wire(),
            inventory=self.inventory.to_wire(),
            address=self.address,
            authkey=self.authkey.hex(),
            run_dir=str(self.run_dir),
            env={k: os.environ[k] for k in WORKER_ENV if k in os.environ},
        )

    def _set_env(self, values: dict[str, str]) -> None:
        for name, value in values.items():
            self._saved_env.setdefault(name, os.environ.get(name))
            os.environ[name] = value

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self.broker is not None:
            self.broker.close()
            rundir.remove(self.run_dir)
        if self.broker is not None and fake.active():
            fake.deactivate()  # the run's fake machine ends with it (in-process runs follow each other)
        if self._sim_run is not None:  # its own simulated machines go with it
            release_run_machines(self._sim_run)
            self._sim_run = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    # -- talking to the broker ----------------------------------------------------------

    @property
    def client(self) -> BrokerClient:
        with self._client_lock:
            if self._client is None:
                self._client = BrokerClient(self.address, self.authkey, self.worker)
            return self._client

    @property
    def usable_memory(self) -> int:
        """The most one GPU can give a lease: the largest GPU less one CUDA context (0 without GPUs)."""
        if not self.inventory.devices:
            return 0
        return max(d.capacity for d in self.inventory.devices) - self.settings.context_overhead

    @property
    def host(self) -> HostCapacity:
        """The machine's CPUs and RAM as this run sees them (see :mod:`pytest_gpu.leasing.host`)."""
        if self._host is None:
            self._host = capacity(self.settings.host_cpus, self.settings.host_memory)
        return self._host

    @property
    def _here(self) -> str:
        """What :meth:`never_fits` calls the GPUs it checked: the node's, under ``--gpu-nodes``."""
        return f"node {self.node}" if self.node else "this run"

    def never_fits(self, request: GpuRequest) -> str | None:
        """Why this inventory (and machine) can never satisfy ``request``, or ``None``."""
        if request.host:
            reason = HostState(self.host.cpus, self.host.memory).never_fits(request)
            if reason is not None:
                return reason
        if request.count > len(self.inventory.devices):  # also: no GPUs at all
            return f"needs {request.describe()} but {self._here} has {self.inventory.describe()}"
        usable = self.usable_memory
        if request.memory is not None and request.memory > usable:
            whose = f" of node {self.node}" if self.node else ""
            return (
                f"needs {format_size(request.memory)} per GPU but the largest GPU{whose} offers "
                f"{format_size(usable)} after the {self.inventory.runtime} context ({self.inventory.describe()})"
            )
        # on a mixed machine only some GPUs may be large enough (the placement's formula: capacity less a context)
        need = request.memory if request.min_memory is None else request.min_memory
        if need is not None:
            overhead = self.settings.context_overhead
            enough = sum(d.capacity - overhead >= need for d in self.inventory.devices)
            if enough < request.count:
                return (
                    f"needs {request.describe()} but {self._here} has {enough} GPU{'' if enough == 1 else 's'} "
                    f"offering {format_size(need)} after the {self.inventory.runtime} context "
                    f"({self.inventory.describe()})"
                )
        return None

    def hold(self, holder: str, request: GpuRequest, *, confine: bool = True) -> ActiveLease:
        """Wait for ``request`` on behalf of ``holder`` (as the broker names it), confine this
        process to it (or, with ``confine=False``, leave this process as it is: a lease for the
        processes it starts) and start verifying; :func:`pytest_gpu.run.holding.hold` is its
        one caller, :meth:`finish` the one way it ends."""
        asked = time.time()
        quarantine_.refuse(self.quarantine)  # a sticky CUDA error: no lease would be usable here
        grant = self.client.acquire(request, holder, self.settings.wait_timeout, on_wait=self.waiting, avoid=self.avoid)
        try:  # anything raised from here on (pytest-timeout included) gives the lease back
            granted = time.time()
            tag = f"{self.run_dir.name}-{self.client.client_id}-{grant.key}"  # unique on a shared machine
            verifier: Verifier | None = None
            confinement = Confinement()
            if grant.indices:
                lease = make_lease(
                    grant.key, grant.indices, grant.memory, grant.exclusive, grant.waited, self.inventory, tag
                )
                verifier = self._verifier(confine)
                if confine:
                    confinement = confine_lease(lease, self.inventory, self.frameworks)
                    if not self.settings.context_overhead_given:  # given, it wins: nothing is measured
                        tell, assumed = self.client.context_size, self.settings.context_overhead
                        self.calibration.report(lease, self.inventory, tell, assumed)
                # the baseline once the lease is applied: confinement empties torch's cache, and
                # blocks freed after the baseline would hide as much of a leak outside torch
                if verifier is not None and self.settings.verify != "off":
                    try:
                        verifier.begin(lease, os.getpid())
                    except BaseException:
                        confinement.undo()
                        raise
            else:  # host resources only: no GPU to confine to or to verify
                lease = host_lease(grant.key, grant.waited, self.inventory.simulated)
            if request.cpus and confine:
                try:
                    confine_threads(request.cpus, confinement)
                except BaseException:
                    confinement.undo()
                    raise
        except BaseException:
            self.client.release(grant.key)
            raise
        active = ActiveLease(lease, confinement, verifier, asked, granted, 0.0, os.getpid(), confine)
        if confine and grant.indices:
            self._confined[grant.key] = active
        return active

    def _verifier(self, confined: bool) -> Verifier:
        """What checks a lease: this process's (confined), or that of the processes it starts (a
        rank pool's ranks, whose NVML usage is told from the test's by their claim,
        :func:`~pytest_gpu.gpu.verification.claim_processes`)."""
        overhead, lag, wait = self.settings.context_overhead, self.settings.amd_process_lag, self.settings.amd_lag_wait
        if self.inventory.simulated:
            return SimVerifier() if confined else SimRankVerifier(overhead)
        # contexts as measured where they were (read when used: the calibration fills in), unless
        # --gpu-context-overhead fixed their size
        measured = {} if self.settings.context_overhead_given else self.calibration.measured
        if confined:  # lag and wait: AMD's only
            return NvmlVerifier(self.inventory, overhead, lag=lag, wait=wait, contexts=measured)
        return NvmlRankVerifier(self.inventory, overhead, lag=lag, wait=wait, contexts=measured)

    def waiting(self) -> bool:
        """A request of this process must wait: give up what the process holds idle (its warm
        pools' leases), which may be what it waits for, instead of waiting out their idle
        timeout. Whether anything was given up."""
        gave = False
        for give_up in list(self.on_wait):
            gave = give_up() or gave
        return gave

    def finish(self, active: ActiveLease, others: set[int] | frozenset[int] = frozenset(), holder: str = "") -> Verdict:
        """Undo the confinement, measure, and give the lease back; ``others``: GPUs other
        leases of the same process held (their usage is theirs); ``holder``: who held it (its
        leftovers are named after it). Called by :meth:`Holding.release`."""
        verdict = Verdict()
        try:
            active.confinement.undo()
            if self.settings.verify != "off" and active.verifier is not None:
                verdict = active.verifier.end(active.lease, others, active.confinement.peaks)
            verdict.notes.extend(active.confinement.notes)
            if self.quarantine is not None:  # what broken CUDA still holds is the quarantine's to report
                verdict = Verdict()
            elif active.confined and not verdict.violations and not self.settings.context_overhead_given:
                self.calibration.report_opened(
                    active.lease, self.inventory, self.client.context_size, self.settings.context_overhead
                )
        finally:
            self._confined.pop(active.lease.key, None)
            # this process's contexts stay charged until it exits; a pool's ranks were killed first
            contexts = sim.cuda.contexts() if active.confined and runtime.simulated(self.inventory) else None
            active.released = time.time()
            if self.quarantine is None:  # quarantined: the memory is held until the process exits, and so is the lease
                left = None
                if active.confined:
                    try:
                        left = self._left_behind(active, verdict, holder)
                    except Exception:  # the lease goes back whatever its accounting met
                        left = None
                self.client.release(active.lease.key, contexts, left)
        return verdict

    def _left_behind(self, active: ActiveLease, verdict: Verdict, holder: str) -> dict[int, tuple[int, str]] | None:
        """What this process still holds of the leases that ended, as the broker is to count
        it beside the leases (``None``: what it was told last): the lease's own leftovers are
        added; where no other lease of the process is on one of its GPUs, what the process
        holds there is measured, and what was given back since is forgotten."""
        for index, nbytes in verdict.left.items():
            self.leftovers.add(index, holder or active.lease.key, nbytes)
        busy = {i for other in self._confined.values() for i in other.lease.indices}
        check = [i for i in active.lease.indices if i not in busy and self.leftovers.on(i)]
        if check:
            context = {i: self.calibration.measured.get(i, self.settings.context_overhead) for i in check}
            try:
                held = standing(self.inventory, context, check)
            except Exception:  # the driver cannot say now: what is left stays charged
                held = {}
            for index, nbytes in held.items():
                self.leftovers.shrink(index, nbytes)
        return self.leftovers.wire()
