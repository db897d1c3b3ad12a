"""What every role's plugin object shares: the run it belongs to, and ending it."""

from __future__ import annotations

from typing import ClassVar

import pytest

from ..base.launch import LaunchContext
from ..machine import domain
from ..run.keys import Role
from ..run.record import RUN_KEY
from ..run.session import GpuRun


class RoleBase:
    """A role's plugin object. Subclasses extend :meth:`attach`, :meth:`finish_session` and
    :meth:`close` cooperatively (``super()``), so a process with two roles' duties (``Lone``)
    runs both.

    Registered before the initial conftests load (so a conftest's hooks run before these,
    as they ran before the plugin module's), its run is attached at ``pytest_configure``;
    no hook of it fires in between."""

    role: ClassVar[Role]  # each concrete role's class says which it is

    def __init__(self, config: pytest.Config, launch: LaunchContext | None) -> None:
        self.config = config
        self.launch = launch
        self._run: GpuRun | None = None
        domain.hold_warnings()  # the owner's summary says them; a worker's would repeat the controller's

    @property
    def run(self) -> GpuRun:
        assert self._run is not None, "a role's hook ran before pytest_configure attached the run"
        return self._run

    def attach(self, run: GpuRun) -> None:
        """The run is known (``pytest_configure``)."""
        self._run = run

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.finish_session(session)

    def finish_session(self, session: pytest.Session) -> None:
        """At the end of the session (also after Ctrl-C)."""

    def close(self) -> None:
        """What must end before the run closes."""

    def pytest_unconfigure(self) -> None:
        if self._run is None:
            return  # pytest_configure failed before the run existed
        try:
            self.close()
        finally:
            self.run.close()
            self.config.stash.__delitem__(RUN_KEY)
            domain.hold_warnings(False)


def register(config: pytest.Config, plugin: object, name: str) -> None:
    """Register ``plugin`` for this config's life: it is unregistered at config cleanup."""
    config.pluginmanager.register(plugin, name)

    def unregister() -> None:
        if config.pluginmanager.is_registered(plugin):
            config.pluginmanager.unregister(plugin)

    config.add_cleanup(unregister)
