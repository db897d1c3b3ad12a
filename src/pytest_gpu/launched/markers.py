"""Which tests may run where: ``launcher`` markers and strategy markers (pure).

A ``launcher_markers`` line maps a marker to the places its tests may run: launchers
(``torchrun``, ``srun``, ``mpirun``), ``ray`` (no process launcher: a Ray cluster), and
``-m`` (no launcher, when the run's ``-m`` expression selects the test by a marker it
carries). ``hpc`` is one such line of the defaults, not a rule of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

LAUNCHERS = ("torchrun", "srun", "mpirun", "ray")
DEFAULT_MAPPING = (
    "torch_dist: torchrun srun mpirun",
    "deepspeed_dist: torchrun srun mpirun",
    "horovod_dist: srun mpirun",
    "ray_dist: ray",
    "hpc: torchrun srun mpirun -m",
)
SELECTED = "-m"  # a place, not a launcher: outside any launcher, when -m selects the test
LAUNCHER_MARKER_FORM = '@pytest.mark.launcher("torchrun", "srun", "mpirun")'


class LauncherMarkerError(ValueError):
    """A bad ``launcher`` marker or ``launcher_markers`` ini line."""


def parse_mapping(lines: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``["torch_dist: torchrun srun"]`` → ``{"torch_dist": ("torchrun", "srun")}``."""
    mapping: dict[str, tuple[str, ...]] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition(":")
        launchers = tuple(rest.split())
        if not sep or not name.strip().isidentifier() or not launchers:
            raise LauncherMarkerError(
                f"ini key 'launcher_markers': cannot read {raw!r}; expected 'MARKER: LAUNCHER ...' "
                f"such as 'torch_dist: torchrun srun mpirun'"
            )
        bad = [x for x in launchers if x not in (*LAUNCHERS, SELECTED)]
        if bad:
            raise LauncherMarkerError(
                f"ini key 'launcher_markers': unknown launcher {', '.join(map(repr, bad))} in {raw!r}; "
                f"expected some of {', '.join(LAUNCHERS)}, or {SELECTED} (outside a launcher when -m selects "
                "the test)"
            )
        mapping[name.strip()] = launchers
    return mapping


@dataclass(frozen=True)
class Admission:
    """Whether a test may run here (``keep``), and why not (``reason``: the deselection's words)."""

    keep: bool
    reason: str = ""


def allowed(
    marker_names: Iterable[str],
    launcher_args: Sequence[Sequence[object]],
    mapping: Mapping[str, tuple[str, ...]],
    current: str | None,
    *,
    selected_by_m: bool,
    runs_on_pool: bool,
) -> Admission:
    """May a test with these markers run under launcher ``current`` (``None``: no launcher)?

    ``ray`` stands for "no process launcher, a Ray cluster": ray_dist tests run outside a
    launcher and are deselected under one. ``-m`` in a marker's places lets its tests run
    outside a launcher when ``selected_by_m``: the run's ``-m`` expression selects this
    test by a marker it carries (see :func:`pytest_gpu.launched.selection.selected_by_m`).
    """
    names = set(marker_names)
    sets: list[tuple[str, set[str]]] = []
    for args in launcher_args:
        if not args:
            raise LauncherMarkerError(f"launcher marker needs at least one launcher; expected {LAUNCHER_MARKER_FORM}")
        bad = [a for a in args if a not in LAUNCHERS]
        if bad:
            raise LauncherMarkerError(
                f"launcher marker: unknown launcher {', '.join(map(repr, bad))}; expected some of "
                f"{', '.join(LAUNCHERS)} as in {LAUNCHER_MARKER_FORM}"
            )
        sets.append(("launcher(" + ", ".join(map(str, args)) + ")", {str(a) for a in args}))
    for name in sorted(names):
        if name in mapping:
            sets.append((name, set(mapping[name])))
    where = current or "ray"
    for label, ok in sets:
        if where in ok:
            continue
        if current is None and (runs_on_pool or (SELECTED in ok and selected_by_m)):
            continue  # a warm rank pool runs it without a launcher; or -m asked for it
        launchers = sorted(ok - {SELECTED})
        if current is None and SELECTED in ok:
            where_else = f"a launcher ({' or '.join(launchers)}) or " if launchers else ""
            return Admission(False, f"{label} needs {where_else}-m selecting it")
        if current is None:
            return Admission(False, f"{label} needs a launcher ({' or '.join(launchers)})")
        return Admission(False, f"{label} cannot run under {current} (allowed: {' '.join(launchers) or 'none'})")
    return Admission(True)
