"""Data built once for the whole run (and kept across runs): the ``shared_artifact`` fixture.

``path = shared_artifact("dataset", build, version="3")`` returns a directory that
``build(path)`` filled. Across all processes of a run it is built once: the first caller
takes a file lock (``flock``, so the kernel releases it if the builder dies and a waiter
takes over), builds into a fresh directory beside the final one and renames it into place,
so no one ever sees a half-built artifact. The others wait on the lock. Later runs reuse
it while ``version`` is unchanged; ``--gpu-rebuild-artifacts`` builds each artifact anew
once per run. A failing build fails every test that asks for that artifact in this run,
with the builder's traceback; the next run tries again.
"""

from __future__ import annotations

import os
import re
import shutil
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from ..base.procs import owner_alive
from . import history


class ArtifactBuildError(RuntimeError):
    """The artifact's build failed in this run (here or in another process)."""


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:100] or "_"


class ArtifactStore:
    """Artifacts under ``root`` (kept across runs); this run's notes under ``run_dir``."""

    def __init__(self, root: Path, run_dir: Path, rebuild: bool) -> None:
        self.root = root
        self.run_dir = run_dir
        self.rebuild = rebuild

    def get(self, name: str, build: Callable[[Path], object], version: str = "1") -> Path:
        if not name or not isinstance(name, str):
            raise ValueError(f"shared_artifact: name must be a non-empty string, got {name!r}")
        if not callable(build):
            raise TypeError(f"shared_artifact({name!r}): build must be a callable taking a Path, got {build!r}")
        home = self.root / _safe(name)
        final = home / f"v-{_safe(str(version))}"
        notes = self.run_dir / "artifacts"
        failed = notes / f"{_safe(name)}-{_safe(str(version))}.failed"
        rebuilt = notes / f"{_safe(name)}-{_safe(str(version))}.rebuilt"
        if failed.exists():
            raise ArtifactBuildError(failed.read_text())
        if final.is_dir() and (not self.rebuild or rebuilt.exists()):
            return final
        from filelock import FileLock

        home.mkdir(parents=True, exist_ok=True)
        notes.mkdir(parents=True, exist_ok=True)
        with FileLock(str(home / ".lock")):
            if failed.exists():  # built and failed while we waited
                raise ArtifactBuildError(failed.read_text())
            if final.is_dir() and (not self.rebuild or rebuilt.exists()):
                return final  # built while we waited
            self._sweep(home)
            fresh = home / f".build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            fresh.mkdir()
            try:
                build(fresh)
            except BaseException as exc:
                shutil.rmtree(fresh, ignore_errors=True)
                text = (
                    f"shared_artifact({name!r}, version={version!r}): the build failed in process {os.getpid()}:\n"
                    + "".join(traceback.format_exception(exc))
                )
                failed.write_text(text)
                if isinstance(exc, Exception):
                    raise ArtifactBuildError(text) from None
                raise
            if final.exists():  # --gpu-rebuild-artifacts: move the old one aside, then drop it
                old = home / f".old-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(fresh, final)
            if self.rebuild:
                rebuilt.write_text(str(os.getpid()))
            return final

    @staticmethod
    def _sweep(home: Path) -> None:
        """Remove half-built directories of builders that died (we hold the lock now)."""
        for leftover in home.glob(".build-*"):
            pid = leftover.name.split("-")[1]
            if not pid.isdigit() or not owner_alive(int(pid), None):
                shutil.rmtree(leftover, ignore_errors=True)
        for leftover in home.glob(".old-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def store(config: object, run_dir: Path) -> ArtifactStore:
    """The store of this pytest process: pytest's cache directory (kept across runs), or
    the run directory when the cache plugin is off (``-p no:cacheprovider``)."""
    cache = history.cache(config)
    root = cache.mkdir("pytest_gpu_artifacts") if cache is not None else run_dir / "artifact-store"
    rebuild = bool(config.getoption("gpu_rebuild_artifacts", False))  # type: ignore[attr-defined]
    return ArtifactStore(Path(root), run_dir, rebuild)
