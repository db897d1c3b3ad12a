"""What every role's plugin object shares: the features it registers, its run, and ending it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest

from ..base.launch import LaunchContext
from ..machine import domain
from ..run import options
from ..run.keys import Role
from ..run.record import RUN_KEY
from ..run.session import GpuRun

PREFIX = "pytest-gpu-"  # a feature's plugin name is its name in RoleBase.wanted, after this


@dataclass(frozen=True)
class Switches:
    """What decides the features a role registers besides those it always does: foreseen from
    the command line before the initial conftests load (:func:`foresee`), then read from the
    run once it is known (:meth:`RoleBase.switches`)."""

    required: bool = False  # --gpu-required, and the run runs tests (not --collect-only)
    schedule: bool = False  # pytest-gpu's scheduler hands the tests out (--gpu-schedule=on, no --dist chosen)
    nodes: bool = False  # --gpu-nodes (known once the nodes started, or a worker knows its node)
    known: bool = False  # the run is known (pytest_configure): features made from it can be registered


def foresee(config: pytest.Config) -> Switches:
    """The switches as the command line says them before pytest has parsed it (an xdist worker
    is started with its controller's command line, so it foresees as the controller decides)."""
    ns = getattr(config, "known_args_namespace", config.option)
    collect_only = bool(getattr(ns, "collectonly", False))
    dist_chosen = str(getattr(ns, "dist", "no")) != "no"
    return Switches(
        required=options.foreseen_flag(config, "gpu_required") and not collect_only,
        schedule=options.foreseen(config, "gpu_schedule").strip().lower() != "off" and not dist_chosen,
    )


class RoleBase:
    """A role's plugin object: who owns the run (start or join it, close it, hand it to
    workers) and which features apply (:meth:`wanted`).

    Registered before the initial conftests load (so a conftest's hooks run before these, as
    they ran before the plugin module's) with the features it foresees (:func:`foresee`);
    at ``pytest_configure`` it starts or joins the run (:meth:`start`) and settles its
    features from the run (:meth:`attach`); no hook of it or of its features fires in
    between. Subclasses extend :meth:`wanted` cooperatively (``super()``'s first), so a
    process with two roles' duties (``Lone``) registers both's features."""

    role: ClassVar[Role]  # each concrete role's class says which it is

    def __init__(self, config: pytest.Config, launch: LaunchContext | None) -> None:
        self.config = config
        self.launch = launch
        self._run: GpuRun | None = None
        self.features: dict[str, object] = {}  # name -> the registered feature, in registration order
        domain.hold_warnings()  # the owner's summary says them; a worker's would repeat the controller's

    @property
    def run(self) -> GpuRun:
        assert self._run is not None, "a role's hook ran before pytest_configure attached the run"
        return self._run

    def start(self) -> GpuRun:
        """Start the run, or join the one this process belongs to (``pytest_configure``)."""
        raise NotImplementedError

    def wanted(self, switches: Switches) -> dict[str, Callable[[], object]]:
        """The features this role registers under ``switches``: name -> how to make it, in the
        order they are registered (hook order follows registration: among plain hooks the
        feature registered last is called first; among wrappers it is the outermost)."""
        return {}

    def switches(self) -> Switches:
        """The switches once the run is known."""
        return Switches(
            required=self.run.settings.required and not self.config.getoption("collectonly", False), known=True
        )

    def settle(self, switches: Switches) -> None:
        """Register the features ``switches`` want that are not yet, unregister those they no
        longer want (foreseen wrongly: no hook of theirs ran)."""
        wanted = self.wanted(switches)
        for name in [n for n in self.features if n not in wanted]:
            unregister(self.config, self.features.pop(name))
        for name, make in wanted.items():
            if name not in self.features:
                self.features[name] = feature = make()
                register(self.config, feature, PREFIX + name)

    def attach(self, run: GpuRun) -> None:
        """The run is known (``pytest_configure``): settle the features from it."""
        self._run = run
        self.settle(self.switches())

    def withdraw(self) -> None:
        """Unregister this object and its features (the role was foreseen wrongly)."""
        for feature in reversed(self.features.values()):
            unregister(self.config, feature)
        self.features.clear()
        unregister(self.config, self)

    def pytest_unconfigure(self) -> None:
        # the features' own unconfigure ran first (registered after this object), the run's still open
        if self._run is None:
            return  # pytest_configure failed before the run existed
        try:
            self.run.close()
        finally:
            self.config.stash.__delitem__(RUN_KEY)
            domain.hold_warnings(False)


def register(config: pytest.Config, plugin: object, name: str) -> None:
    """Register ``plugin`` for this config's life: it is unregistered at config cleanup."""
    config.pluginmanager.register(plugin, name)

    def cleanup() -> None:
        unregister(config, plugin)

    config.add_cleanup(cleanup)


def unregister(config: pytest.Config, plugin: object) -> None:
    if config.pluginmanager.is_registered(plugin):
        config.pluginmanager.unregister(plugin)
