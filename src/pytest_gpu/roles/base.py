"""What every role's plugin object shares: the run it belongs to, and ending it."""

from __future__ import annotations

import pytest

from ..launched.detect import LaunchContext
from ..run.lifecycle import RUN_KEY
from ..run.session import GpuRun


class RoleBase:
    """A role's plugin object. Subclasses extend :meth:`finish_session` and :meth:`close`
    cooperatively (``super()``), so a process with two roles' duties (``Lone``) runs both."""

    def __init__(self, config: pytest.Config, run: GpuRun, launch: LaunchContext | None) -> None:
        self.config = config
        self.run = run
        self.launch = launch

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.finish_session(session)

    def finish_session(self, session: pytest.Session) -> None:
        """At the end of the session (also after Ctrl-C)."""

    def close(self) -> None:
        """What must end before the run closes."""

    def pytest_unconfigure(self) -> None:
        try:
            self.close()
        finally:
            self.run.close()
            self.config.stash.__delitem__(RUN_KEY)


def register(config: pytest.Config, plugin: object, name: str) -> None:
    """Register ``plugin`` for this config's life: it is unregistered at config cleanup."""
    config.pluginmanager.register(plugin, name)

    def unregister() -> None:
        if config.pluginmanager.is_registered(plugin):
            config.pluginmanager.unregister(plugin)

    config.add_cleanup(unregister)
