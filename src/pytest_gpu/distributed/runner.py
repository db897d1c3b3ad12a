"""pytest side of distributed tests: send the body and fixture values to a pool, report every rank."""

from __future__ import annotations

import pickle
import time
import zlib
from typing import TYPE_CHECKING, Any

import pytest

from ..requests import GpuRequestError
from .rankinfo import RankPlaceholder
from .spec import DistSpec, build_spec

if TYPE_CHECKING:  # the pool machinery is imported when the first distributed test runs
    from ..session import GpuRun
    from .pool import PoolManager, RankRun

SPEC_KEY = pytest.StashKey[DistSpec]()
MANAGER_KEY = pytest.StashKey["PoolManager"]()
RUN_RESULT_KEY = pytest.StashKey["RankRun"]()


class DistributedFailure(Exception):
    """A distributed test failed; the message lists every failing rank."""


def stash_spec(item: pytest.Item, run: GpuRun) -> None:
    """Collection check: validate the ``distributed`` marker and remember the spec."""
    spec = item_spec(item, run)
    if spec is not None:
        item.stash[SPEC_KEY] = spec


def item_spec(item: pytest.Item, run: GpuRun) -> DistSpec | None:
    """The ``distributed`` marker of ``item`` as a spec; raises GpuRequestError naming the test."""
    marker = item.get_closest_marker("distributed")
    if marker is None:
        return None
    have_gpus = bool(run.inventory.devices) and not run.inventory.simulated
    try:
        spec = build_spec(marker.args, marker.kwargs, have_gpus=have_gpus)
    except GpuRequestError as exc:
        raise GpuRequestError(f"{item.nodeid}: {exc}") from None
    if item.get_closest_marker("gpu") is not None:
        raise GpuRequestError(
            f"{item.nodeid}: a distributed test gets its GPUs through distributed(gpus_per_rank=...), not a gpu marker"
        )
    if not isinstance(item, pytest.Function):
        raise GpuRequestError(f"{item.nodeid}: the distributed marker only applies to test functions")
    return spec


def manager(config: pytest.Config, run: GpuRun) -> PoolManager:
    found = config.stash.get(MANAGER_KEY, None)
    if found is None:
        from .pool import DistSettings, PoolManager

        settings = DistSettings(
            timeout=run.settings.dist_timeout,
            pool=run.settings.dist_pool,
            idle=run.settings.dist_pool_idle,
            wait_timeout=run.settings.wait_timeout,
        )
        args = ["--rootdir", str(config.rootpath)]
        if config.inipath is not None:
            args += ["-c", str(config.inipath)]
        args += [f"--import-mode={config.getoption('importmode')}"]
        found = PoolManager(run, settings, args, run.run_dir / "pools")
        config.stash[MANAGER_KEY] = found
    return found


def close(config: pytest.Config) -> None:
    found = config.stash.get(MANAGER_KEY, None)
    if found is not None:
        found.close()
        del config.stash[MANAGER_KEY]


def _payload(item: pytest.Function) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in item._fixtureinfo.argnames:
        value = item.funcargs[name]
        kwargs[name] = value
        problem = None
        try:
            _dumps(value)
        except Exception as exc:
            problem = str(exc)
        if problem is not None:  # failed outside the except: no chained pickling tracebacks
            pytest.fail(
                f"pytest-gpu: {item.nodeid}: the value of fixture {name!r} ({type(value).__name__}) cannot be "
                f"sent to the ranks: {problem}. Build it inside the test body, or make it picklable.",
                pytrace=False,
            )
    return {
        "module_file": str(item.path),
        "module_name": item.module.__name__,
        "cls": item.cls.__qualname__ if item.cls is not None else "",
        "func": item.obj.__name__,
        "kwargs": _dumps(kwargs),
        "seed": zlib.crc32(item.nodeid.encode()),
        "nodeid": item.nodeid,
        "tbstyle": item.config.getoption("tbstyle", "auto"),
    }


def _dumps(value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception:
        try:
            import cloudpickle
        except ImportError:
            raise
        return cloudpickle.dumps(value)


def run_item(item: pytest.Function, run: GpuRun) -> None:
    """Run a distributed test's body on its pool; raise the outcome as pytest expects."""
    started = time.perf_counter()
    spec = item.stash[SPEC_KEY]
    body = _payload(item)
    timeout = spec.timeout or run.settings.dist_timeout
    pools = manager(item.config, run)
    before = pools.started
    from .pool import PoolError

    try:
        result, notes = pools.execute(spec, body, timeout)
    except PoolError as exc:
        raise DistributedFailure(f"pytest-gpu: {exc}") from None
    except BaseException:
        # interrupted (pytest-timeout, Ctrl-C): the pool was killed; show where its ranks were
        for name, content in pools.abandoned:
            item.add_report_section("call", name, content)
        raise
    item.stash[RUN_RESULT_KEY] = result
    body_seconds = max((r.get("body_seconds", 0.0) for r in result.results.values()), default=0.0)
    item.user_properties.extend(
        [
            ("dist_ranks", spec.world_size),
            ("dist_pool", "fresh" if pools.started != before else "warm"),
            ("dist_body_seconds", round(body_seconds, 6)),
            ("dist_overhead_seconds", round(time.perf_counter() - started - body_seconds, 6)),
        ]
    )
    for name, content in result.sections:
        item.add_report_section("call", name, content)
    for note in notes:
        item.add_report_section("call", "pytest-gpu pool", note)
    outcome = result.outcome
    if outcome == "failed":
        raise DistributedFailure(failure_text(spec, result))
    if outcome == "skipped":
        reasons = sorted({r["message"] for r in result.results.values() if r["outcome"] == "skipped"})
        # reported at the test's location, as for a skip marker, not at this line of the plugin
        raise pytest.skip.Exception("; ".join(reasons), _use_item_location=True)
    if outcome == "xfailed":
        pytest.xfail(result.results[min(result.results)]["message"])


def failure_text(spec: DistSpec, result: RankRun) -> str:
    failed = {r: res for r, res in sorted(result.results.items()) if res["outcome"] == "failed"}
    count = len(failed) + (spec.world_size - len(result.results))
    lines = [f"distributed test failed on {count} of {spec.world_size} ranks ({spec.describe()})"]
    lines += [f"  {problem}" for problem in result.problems]
    for rank, res in failed.items():
        lines.append(f"{'=' * 30} rank {rank} {'=' * 30}")
        lines.append(res["longrepr"] or res["message"])
    return "\n".join(lines)


def make_report(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    if call.when == "call" and call.excinfo is not None and call.excinfo.errisinstance(DistributedFailure):
        if not hasattr(report, "wasxfail"):
            report.longrepr = str(call.excinfo.value)


def rank_fixture() -> RankPlaceholder:
    return RankPlaceholder()
