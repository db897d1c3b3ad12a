"""Which tests may run where: ``launcher`` markers and strategy markers (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

LAUNCHERS = ("torchrun", "srun", "mpirun", "ray")
DEFAULT_MAPPING = (
    "torch_dist: torchrun srun mpirun",
    "deepspeed_dist: torchrun srun mpirun",
    "horovod_dist: srun mpirun",
    "ray_dist: ray",
)
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
        bad = [x for x in launchers if x not in LAUNCHERS]
        if bad:
            raise LauncherMarkerError(
                f"ini key 'launcher_markers': unknown launcher {', '.join(map(repr, bad))} in {raw!r}; "
                f"expected some of {', '.join(LAUNCHERS)}"
            )
        mapping[name.strip()] = launchers
    return mapping


@dataclass(frozen=True)
class Verdict:
    keep: bool
    reason: str = ""


def allowed(
    marker_names: Iterable[str],
    launcher_args: Sequence[Sequence[object]],
    mapping: Mapping[str, tuple[str, ...]],
    current: str | None,
    *,
    hpc_selected: bool,
    runs_on_pool: bool,
) -> Verdict:
    """May a test with these markers run under launcher ``current`` (``None``: no launcher)?

    ``ray`` stands for "no process launcher, a Ray cluster": ray_dist tests run outside a
    launcher and are deselected under one.
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
        if current is None and runs_on_pool:
            continue  # a warm rank pool runs it without a launcher
        if current is None:
            return Verdict(False, f"{label} needs a launcher ({' or '.join(sorted(ok))})")
        return Verdict(False, f"{label} cannot run under {current} (allowed: {' '.join(sorted(ok))})")
    if "hpc" in names and current is None and not hpc_selected:
        return Verdict(False, "hpc tests run only under a launcher or with -m hpc")
    return Verdict(True)
