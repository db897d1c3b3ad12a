"""Deselect the tests that may not run here (launcher and strategy markers)."""

from __future__ import annotations

from collections import Counter

import pytest

from .detect import LaunchContext
from .markers import DEFAULT_MAPPING, LauncherMarkerError, allowed, parse_mapping

REASONS_KEY = pytest.StashKey[Counter[str]]()


def mapping(config: pytest.Config) -> dict[str, tuple[str, ...]]:
    lines = config.getini("launcher_markers") or list(DEFAULT_MAPPING)
    try:
        return parse_mapping(lines)
    except LauncherMarkerError as exc:
        raise pytest.UsageError(str(exc)) from None


def register_markers(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", 'launcher(*names): the launchers ("torchrun", "srun", "mpirun", "ray") this test may run under.'
    )
    config.addinivalue_line("markers", "hpc: runs only under a launcher, or when -m hpc asks for it.")
    for name, launchers in mapping(config).items():
        config.addinivalue_line("markers", f"{name}: runs under {' or '.join(launchers)} (ini: launcher_markers).")


def deselect(config: pytest.Config, items: list[pytest.Item], ctx: LaunchContext | None) -> None:
    """Drop the items that may not run under ``ctx``'s launcher; count the reasons."""
    table = mapping(config)
    current = ctx.launcher if ctx is not None else None
    hpc_selected = "hpc" in (config.getoption("markexpr", "") or "")
    keep, drop = [], []
    reasons: Counter[str] = Counter()
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if not (names & set(table)) and "launcher" not in names and "hpc" not in names:
            keep.append(item)
            continue
        try:
            verdict = allowed(
                names,
                [m.args for m in item.iter_markers("launcher")],
                table,
                current,
                hpc_selected=hpc_selected,
                runs_on_pool=item.get_closest_marker("distributed") is not None,
            )
        except LauncherMarkerError as exc:
            raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
        if verdict.keep:
            keep.append(item)
        else:
            drop.append(item)
            reasons[verdict.reason] += 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash.setdefault(REASONS_KEY, Counter()).update(reasons)


def summary_lines(config: pytest.Config) -> list[str]:
    reasons = config.stash.get(REASONS_KEY, Counter())
    return [f"pytest-gpu: deselected {n}: {reason}" for reason, n in sorted(reasons.items())]
