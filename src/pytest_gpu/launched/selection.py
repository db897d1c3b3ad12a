"""Deselect the tests that may not run here (launcher and strategy markers).

The feature's hook object is :class:`Selection`, in every process of a run: where tests are
collected it deselects them (and, in an xdist worker of a launched rank under ``--shard``,
keeps the rank's share); the xdist controller gathers its workers' reasons for its summary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from ..base import privates
from ..base.launch import LaunchContext
from .markers import DEFAULT_MAPPING, SELECTED, LauncherMarkerError, allowed, parse_mapping
from .session import select_share

REASONS_KEY = pytest.StashKey[Counter[str]]()
WORKEROUTPUT_KEY = "pytest_gpu_deselected"  # an xdist worker's reasons, for the controller's summary
_NOT_GIVEN = object()


class Selection:
    """The feature's hooks (see the module docstring); ``worker``: this process is an xdist worker."""

    def __init__(self, config: pytest.Config, launch: LaunchContext | None, worker: bool = False) -> None:
        self.config = config
        self.launch = launch
        self.worker = worker

    @pytest.hookimpl(trylast=True)  # after pytest's -m/-k: the reasons count only the tests they kept
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        deselect(config, items, self.launch)
        workeroutput = getattr(config, "workeroutput", None)
        if workeroutput is not None:  # the controller prints the reasons (a worker's terminal is not shown)
            workeroutput[WORKEROUTPUT_KEY] = dict(config.stash.get(REASONS_KEY, {}))
        if self.worker and self.launch is not None and config.getoption("shard"):
            select_share(config, self.launch, items)  # xdist workers collect: each takes the rank's share

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """A worker's deselection reasons, for this process's summary (a worker's terminal is not shown)."""
        reasons = getattr(node, "workeroutput", {}).get(WORKEROUTPUT_KEY)
        if reasons:
            add_reasons(self.config, reasons)


def m_expression(config: pytest.Config) -> Callable[[Iterable[pytest.Mark]], bool] | None:
    """The run's ``-m`` expression as a test of a test's marks, or ``None`` without ``-m``."""
    text = (config.getoption("markexpr", "") or "").strip()
    if not text:
        return None
    evaluate_with = privates.mark_matcher(text)  # pytest's own -m grammar
    if evaluate_with is None:
        return None  # pytest's own -m deselection reports the bad expression

    def evaluate(marks: Iterable[pytest.Mark]) -> bool:
        by_name: dict[str, list[pytest.Mark]] = {}
        for mark in marks:
            by_name.setdefault(mark.name, []).append(mark)

        # -m "device(serial='123')" (pytest 8.3+) matches a marker's keyword arguments too
        def matcher(name: str, /, **kwargs: object) -> bool:
            return any(all(m.kwargs.get(k, _NOT_GIVEN) == v for k, v in kwargs.items()) for m in by_name.get(name, []))

        return bool(evaluate_with(matcher))

    return evaluate


def selected_by_m(expression: Callable[[Iterable[pytest.Mark]], bool] | None, item: pytest.Item) -> bool:
    """Does ``-m`` select ``item`` by a marker it carries?

    True when the expression holds for the item's marks and would not hold for a test
    with no marks at all: ``-m hpc`` and ``-m ray_dist`` select a test marked ``hpc`` and
    ``ray_dist``; ``-m "not slow"`` selects it too, but by what it lacks, so not here;
    ``-m "not hpc"`` never selects it.
    """
    if expression is None:
        return False
    return expression(item.iter_markers()) and not expression(())


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
    for name, places in mapping(config).items():
        where = " or ".join(p if p != SELECTED else "without a launcher when -m selects it" for p in places)
        config.addinivalue_line("markers", f"{name}: runs under {where} (ini: launcher_markers).")


def deselect(config: pytest.Config, items: list[pytest.Item], ctx: LaunchContext | None) -> None:
    """Drop the items that may not run under ``ctx``'s launcher; count the reasons.

    Called after pytest's own ``-m``/``-k`` deselection, so the reasons count only tests
    those kept.
    """
    table = mapping(config)
    current = ctx.launcher if ctx is not None else None
    expression = m_expression(config)
    keep, drop = [], []
    reasons: Counter[str] = Counter()
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if not (names & set(table)) and "launcher" not in names:
            keep.append(item)
            continue
        try:
            admission = allowed(
                names,
                [m.args for m in item.iter_markers("launcher")],
                table,
                current,
                selected_by_m=selected_by_m(expression, item),
                runs_on_pool=item.get_closest_marker("distributed") is not None,
            )
        except LauncherMarkerError as exc:
            raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
        if admission.keep:
            keep.append(item)
        else:
            drop.append(item)
            reasons[admission.reason] += 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash.setdefault(REASONS_KEY, Counter()).update(reasons)


def add_reasons(config: pytest.Config, reasons: dict[str, int]) -> None:
    """An xdist worker's reasons, heard by the controller. Every worker collects the same
    tests (a replaced worker collects them again): each reason counts as often as the
    worker that saw it most."""
    mine = config.stash.setdefault(REASONS_KEY, Counter())
    for reason, count in reasons.items():
        mine[reason] = max(mine[reason], int(count))


def summary_lines(config: pytest.Config) -> list[str]:
    reasons = config.stash.get(REASONS_KEY, Counter())
    return [f"pytest-gpu: deselected {n}: {reason}" for reason, n in sorted(reasons.items())]
