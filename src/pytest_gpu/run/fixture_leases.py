"""Leases for fixtures of any scope: ``gpu_lease_factory`` and ``ports_factory``.

pytest's own pattern for resources wider than a test (``tmp_path_factory``): two
session-scoped fixtures whose values a module-, class- or session-scoped fixture calls
while it is set up::

    @pytest.fixture(scope="module")
    def model(gpu_lease_factory):
        lease = gpu_lease_factory(memory="6GiB")   # a GpuLease, as the gpu fixture's
        m = load_model(lease.device)
        yield m
        del m                                       # freed before the lease goes back

What a call gets belongs to the fixture being set up (the innermost one, as pytest's
``pytest_fixture_setup`` hook sees it) and is given back at that fixture's teardown —
once pytest has dropped the fixture's value, after the test whose teardown ended it has
been verified. It is acquired from the run's broker like a test's lease, so a worker
that dies gives it back with everything else it held.

While the fixture is alive:

- *confinement*: the fixture's budget stays added to the process's caps on its GPUs (as a
  ``gpu_request`` section's does); a test that uses the fixture sees the fixture's GPUs
  next to its own lease in ``CUDA_VISIBLE_DEVICES`` (its own first), keeps its own
  lease's current device, and one without a lease of its own computes on the fixture's
  GPU, under the fixture's budget and attributed to the fixture;
- *verification*: memory allocated while the fixture is set up is the fixture's (its
  own lease's tag), never the first test's; a test's use of a fixture's GPUs is not
  "outside its lease" (``others``); the fixture's lease is verified at its teardown and
  a violation fails the teardown of the test that ended the fixture, naming the fixture;
- *scheduling*: at collection, a test whose fixture closure holds a module-, class- or
  package-scoped fixture that requests ``gpu_lease_factory`` joins a group per instance of
  that fixture (:func:`group_tags`), so the scheduler runs those tests on one worker, back
  to back; when the fixture leases, the worker tells the scheduler what the group holds
  (``held:<group>`` catalog entries), and the planner counts it for the group's tests.
  The module's (class's) GPU tests that use none of its leasing fixtures are handed out
  before the group (``catalog.firsts``): after it, on its worker, they would wait for
  their GPUs while the fixture, alive until the worker leaves the module, holds its lease.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from ..base.requests import GpuRequestError, build_request
from ..base.spans import LeaseSpan
from ..gpu import runtime
from ..gpu.isolation import GpuLease, visibility_env
from ..gpu.runtime import LeaseUnreachable
from ..gpu.verification import Verdict
from ..leasing.client import BrokerError
from ..machine.ports import PortOwner
from ..sim import cuda
from .holding import STATE_KEY, Holding, Owner, broke, hold, separate
from .record import RUN_KEY, skip_at_run_time

if TYPE_CHECKING:
    from .session import GpuRun

Ended = tuple[Owner, Verdict, list[LeaseSpan]]  # a holder's verdict and its leases' spans

FACTORY = "gpu_lease_factory"
PORTS_FACTORY = "ports_factory"
FACTORY_FORM = f'{FACTORY}(count=1, memory="8GiB", exclusive=False)'
HELD_PREFIX = "held:"  # catalog key of what a group's fixtures hold (see catalog.HeldNeeds)
GROUP_PREFIX = "fixture:"
# scopes whose fixture instance is shared by the tests under one node: grouped for the scheduler
GROUPED: dict[str, type[pytest.Collector]] = {
    "module": pytest.Module,
    "class": pytest.Class,
    "package": pytest.Package,
}


@dataclass(eq=False)
class FixtureLeases:
    """What one instance of a fixture holds: its GPU leases (each a :class:`Holding` of its
    :class:`Owner`) and its ports."""

    fixture: str
    scope: str
    owner: Owner  # kind "fixture": its label names it; node: the test whose setup set it up
    leases: list[Holding] = field(default_factory=list)
    ports_owner: str | None = None
    others: set[int] = field(default_factory=set)  # GPUs other leases used while this one was held
    test_gpus: set[int] = field(default_factory=set)  # GPUs of the tests that ran meanwhile

    @property
    def label(self) -> str:
        return self.owner.name

    @property
    def indices(self) -> list[int]:
        return [i for held in self.leases for i in held.lease.indices]


@dataclass(eq=False)
class _Frame:
    fixturedef: Any
    request: Any
    holding: FixtureLeases | None = None
    saved_env: dict[str, str | None] = field(default_factory=dict)  # before this fixture's first lease


@dataclass(eq=False)
class Registry:
    """This process's fixture leases (one per pytest config)."""

    frames: list[_Frame] = field(default_factory=list)  # fixtures being set up, innermost last
    held: list[FixtureLeases] = field(default_factory=list)
    ending: list[FixtureLeases] = field(default_factory=list)  # torn down during the current test's teardown
    item: pytest.Item | None = None  # the test being set up or run
    tearing: pytest.Item | None = None  # the test whose teardown is under way
    groups: dict[str, str] = field(default_factory=dict)  # node id -> scheduler group (xdist workers)
    group_needs: dict[str, dict[str, list[int | None]]] = field(default_factory=dict)
    seq: itertools.count[int] = field(default_factory=itertools.count)


REGISTRY_KEY = pytest.StashKey[Registry]()


def registry(config: pytest.Config) -> Registry:
    reg = config.stash.get(REGISTRY_KEY, None)
    if reg is None:
        reg = config.stash[REGISTRY_KEY] = Registry()
    return reg


def _run(config: pytest.Config) -> GpuRun:
    return config.stash[RUN_KEY]


# -- the factories ----------------------------------------------------------------------


class GpuLeaseFactory:
    """``gpu_lease_factory(count=1, memory=None, exclusive=False) -> GpuLease``: a lease for
    the fixture being set up, held until that fixture's teardown (arguments as ``gpu_request``)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def __call__(self, *args: Any, **kwargs: Any) -> GpuLease:
        return lease(self._config, args, kwargs)

    def __repr__(self) -> str:
        return f"<{FACTORY}: call it in a fixture, e.g. {FACTORY_FORM}>"


class PortsFactory:
    """``ports_factory(n=1) -> list[int]``: run-unique TCP ports for the fixture being set up,
    reclaimed at that fixture's teardown."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def __call__(self, n: int = 1) -> list[int]:
        return ports(self._config, n)

    def __repr__(self) -> str:
        return f"<{PORTS_FACTORY}: call it in a fixture, e.g. {PORTS_FACTORY}(2)>"


def _frame(config: pytest.Config, what: str, instead: str) -> _Frame:
    reg = registry(config)
    if not reg.frames:
        pytest.fail(
            f"pytest-gpu: {what} was called outside a fixture's setup; call it in the body of a fixture "
            f"(any scope) that requests it, before its yield; in a test, use {instead}",
            pytrace=False,
        )
    return reg.frames[-1]


def _who(frame: _Frame) -> str:
    node = getattr(frame.request, "node", None)
    where = getattr(node, "nodeid", "") if frame.fixturedef.scope != "session" else ""
    return f"fixture '{frame.fixturedef.argname}' ({frame.fixturedef.scope} scope{', ' + where if where else ''})"


def _holding(config: pytest.Config, frame: _Frame) -> FixtureLeases:
    """The fixture instance's holding, made (and tied to the fixture's teardown) on first use."""
    if frame.holding is not None:
        return frame.holding
    reg = registry(config)
    holding = FixtureLeases(
        fixture=frame.fixturedef.argname,
        scope=frame.fixturedef.scope,
        owner=Owner("fixture", _who(frame), reg.item.nodeid if reg.item is not None else ""),
    )
    frame.holding = holding
    reg.held.append(holding)
    # runs after the fixture's own teardown code (finalizers run last-in, first-out)
    frame.request.addfinalizer(lambda: _ended(config, holding))
    return holding


def lease(config: pytest.Config, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GpuLease:
    """Acquire a lease for the fixture being set up (see the module docstring)."""
    frame = _frame(config, f"{FACTORY}(...)", "the gpu fixture, or gpu_request for a section")
    who = _who(frame)
    run = _run(config)
    problem = ""
    try:
        request = build_request(args, kwargs, run.settings.default_memory, what=FACTORY, form=FACTORY_FORM)
    except GpuRequestError as exc:
        problem = str(exc)
    if problem:  # outside the except block: the error alone, not "during handling of ..."
        pytest.fail(f"pytest-gpu: {who}: {problem}", pytrace=False)
    reason = run.never_fits(request)
    if reason is not None:
        if run.settings.oversize == "skip":
            skip_at_run_time(registry(config).item, request, run)
            pytest.skip(f"pytest-gpu: {who} {reason}")
        pytest.fail(f"pytest-gpu: {who} {reason} (--gpu-oversize=fail)", pytrace=False)
    holding = _holding(config, frame)
    problem = ""
    try:
        held = hold(run, holding.owner, request)
    except BrokerError as exc:
        problem = f"could not get {request.describe()}: {exc}"
    except LeaseUnreachable as exc:
        problem = f"was given {request.describe()}, but {exc}"
    if problem:
        pytest.fail(f"pytest-gpu: {who} {problem}", pytrace=False)
    # The environment is this module's to manage from now on: the fixture's own while it is
    # set up (its allocations carry its tag), the test's view once its setup returns.
    confinement = held.active.confinement
    for name, value in confinement.saved_env.items():
        frame.saved_env.setdefault(name, value)
    confinement.saved_env.clear()
    reg = registry(config)
    new = set(held.lease.indices)
    for other in reg.held:
        if other is not holding:
            other.others |= new
            holding.others |= set(other.indices)
    holding.others |= set(holding.indices)  # the fixture's earlier leases, for this one
    holding.leases.append(held)
    _tell_scheduler(reg, run, holding, held)
    return held.lease


def ports(config: pytest.Config, n: int) -> list[int]:
    frame = _frame(config, f"{PORTS_FACTORY}(...)", "the ports or port fixture")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        pytest.fail(f"pytest-gpu: {_who(frame)}: {PORTS_FACTORY}(n) expects a positive int, got {n!r}", pytrace=False)
    holding = _holding(config, frame)
    if holding.ports_owner is None:  # the broker names the holder after a crash
        holding.ports_owner = str(PortOwner.of_this_process(f"{holding.label}#{next(registry(config).seq)}"))
    return _run(config).client.ports(n, holding.ports_owner)


# -- a fixture's setup --------------------------------------------------------------------


@contextmanager
def setting_up(fixturedef: Any, request: Any) -> Iterator[None]:
    """Around every fixture's setup (``pytest_fixture_setup``): factory calls are this fixture's."""
    reg = registry(request.config)
    frame = _Frame(fixturedef, request)
    reg.frames.append(frame)
    try:
        yield
    finally:
        reg.frames.remove(frame)
        if frame.holding is not None and frame.holding.leases:
            _restore(frame.saved_env)
            if reg.item is not None and reg.tearing is None:
                _resume(reg.item)
                apply_view(reg.item, _run(request.config))


def _resume(item: pytest.Item) -> None:
    """The fixture's lease was the one its process worked for while it was set up; the test
    works for its own again (the latest last): each of its caps is its own budget on top of
    what the process holds now, the fixture's tensors included."""
    state = item.stash.get(STATE_KEY, None)
    if state is None:
        return
    for held in [state.main, *state.sections]:
        if held is not None and held.active.confined:
            held.active.confinement.resume()


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# -- a test's view ------------------------------------------------------------------------


def begin(item: pytest.Item) -> None:
    """A test's setup starts (before its fixtures)."""
    reg = registry(item.config)
    reg.item = item
    reg.tearing = None


def _used(reg: Registry, item: pytest.Item) -> list[FixtureLeases]:
    names = set(getattr(item, "fixturenames", ()))
    return [h for h in reg.held if h.leases and (h.fixture in names or h.owner.node == item.nodeid)]


def apply_view(item: pytest.Item, run: GpuRun) -> None:
    """Let the test see the GPUs of the leasing fixtures it uses, next to its own lease."""
    reg = registry(item.config)
    state = item.stash.get(STATE_KEY, None)
    if state is None:
        return
    used = _used(reg, item)
    if not used:
        return
    leases = [held.lease for h in used for held in h.leases]
    state.fixture_gpus.update(i for lease_ in leases for i in lease_.indices)
    own = state.main.lease if state.main is not None else None
    env = dict(own.env if own is not None else leases[0].env)
    visible: list[str] = []
    for lease_ in ([own] if own is not None else []) + leases:
        visible += [v for v in lease_.visible_devices.split(",") if v and v not in visible]
    env.update(visibility_env(leases[0].vendor, visible))
    if state.view_saved is None:
        state.view_saved = {}
    for name in env:
        state.view_saved.setdefault(name, os.environ.get(name))
    os.environ.update(env)
    _use_device(run, own if own is not None else leases[0])


def _use_device(run: GpuRun, lease_: GpuLease) -> None:
    """Make the lease's first GPU the current device (a fixture's confinement moved it)."""
    try:
        ordinals = runtime.in_process(run.inventory, lease_.indices)
    except runtime.LeaseUnreachable:
        return
    if not ordinals:
        return
    if runtime.simulated(run.inventory):
        cuda.set_device(ordinals[0])
    torch = sys.modules.get("torch")
    cuda_mod = getattr(torch, "cuda", None)
    if cuda_mod is not None and cuda_mod.is_available() and cuda_mod.is_initialized():
        cuda_mod.set_device(ordinals[0])
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.Device(ordinals[0]).use()


def leave(item: pytest.Item) -> None:
    """A test's teardown starts: its view ends; fixtures torn down now are released after it."""
    reg = registry(item.config)
    reg.tearing = item
    state = item.stash.get(STATE_KEY, None)
    if state is None:
        return
    if state.view_saved is not None:
        _restore(state.view_saved)
        state.view_saved = None
    for holding in reg.held:
        holding.test_gpus |= state.indices


# -- a fixture's end ----------------------------------------------------------------------


def _ended(config: pytest.Config, holding: FixtureLeases) -> None:
    """The fixture was torn down: release now, or once the test whose teardown this is is verified."""
    reg = registry(config)
    if holding in reg.held:
        reg.held.remove(holding)
    if reg.tearing is not None:
        reg.ending.append(holding)
        return
    for owner, verdict, _ in _finish(_run(config), [holding], None):  # outside any test (the session's end)
        texts = [broke(owner, verdict.violations)] if verdict.violations else []
        texts += [f"pytest-gpu: {owner.name}: not verified: {note}" for note in verdict.notes]
        for text in texts:
            warnings.warn(pytest.PytestWarning(text), stacklevel=2)


def end(item: pytest.Item, run: GpuRun) -> list[Ended]:
    """After the test's teardown: give back what fixtures torn down during it held.

    Returns each fixture's owner, verdict and lease spans, for the test's report."""
    reg = registry(item.config)
    reg.item = reg.tearing = None
    ending, reg.ending = reg.ending, []
    if not ending:
        return []
    return _finish(run, ending, item)


def _finish(run: GpuRun, ending: list[FixtureLeases], item: pytest.Item | None) -> list[Ended]:
    funcargs = getattr(item, "funcargs", None)
    if isinstance(funcargs, dict):  # the test's reference to a fixture value ended with it
        for holding in ending:
            funcargs.pop(holding.fixture, None)
    # no gc.collect() here: a value only a reference cycle still holds is collected by each
    # lease's undo, and only when torch still counts memory there (adapters.collect_while)
    out: list[Ended] = []
    for holding in reversed(ending):
        verdict = Verdict()
        spans: list[LeaseSpan] = []
        try:
            for held in reversed(holding.leases):
                own = set(held.lease.indices)
                others = holding.others - own
                if not run.inventory.simulated:
                    others |= holding.test_gpus - own  # NVML counts per process: the tests' GPUs are theirs
                    separate(held.active, holding.test_gpus, "tests that ran meanwhile", run)
                try:
                    verdict.merge(held.release(run, others))
                finally:
                    if held.span is not None:
                        spans.insert(0, held.span)
        finally:
            holding.leases.clear()
            if holding.ports_owner is not None:
                run.client.release_ports(holding.ports_owner)
                holding.ports_owner = None
        out.append((holding.owner, verdict, spans))
    return out


def remember_groups(config: pytest.Config, groups: dict[str, str]) -> None:
    """An xdist worker under the GPU scheduler: node id -> group, to report what a group holds."""
    registry(config).groups = dict(groups)


def _tell_scheduler(reg: Registry, run: GpuRun, holding: FixtureLeases, held: Holding) -> None:
    """Tell the scheduler what the group of the test being set up holds while it runs."""
    if holding.scope not in GROUPED or not reg.groups or reg.item is None:
        return
    group = reg.groups.get(reg.item.nodeid)
    if group is None:
        return
    lease_ = held.lease
    needs = reg.group_needs.setdefault(group, {})
    needs[f"{holding.label}#{len(holding.leases) - 1}"] = [
        len(lease_.indices),
        None if lease_.exclusive else lease_.memory,
    ]
    run.client.catalog({f"{HELD_PREFIX}{group}": {"held": list(needs.values())}})
