"""Coverage of test bodies that run in rank processes (``pytest --cov``, ``coverage run -m pytest``).

The pytest process hands the configuration of the coverage measurement running in it to its
ranks (:func:`rank_config`, in ``PYTEST_GPU_RANK_COVERAGE``); each rank starts measuring with
coverage's own start-up entry point, :func:`coverage.process_startup` (:func:`start_in_rank`),
and saves its data (a parallel data file beside the pytest process's own) when its pool closes
it, before it says it has closed (:func:`save_in_rank`): the pool then kills it, and it ends
with ``os._exit``, which runs no ``atexit`` handler. Pools are closed when the test loop ends,
before pytest-cov combines the data files (see ``runner.PoolsEnd``).

Nothing here imports coverage into a process that has not imported it already: without a
coverage measurement in the pytest process, the ranks are told nothing.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

ENV = "PYTEST_GPU_RANK_COVERAGE"


def rank_config() -> str | None:
    """The running coverage's configuration, serialized for the ranks; None if nothing measures.

    The data file is made absolute (the ranks write beside this process's data, wherever they
    run) and parallel (each rank writes a file of its own, which a combine takes up).
    """
    module = sys.modules.get("coverage")
    if module is None:
        return None
    try:
        cov = module.Coverage.current()
        if cov is None or not hasattr(cov.config, "serialize"):  # serialize: coverage >= 7.10
            return None
        config = copy.copy(cov.config)
        data = getattr(cov, "_data", None)  # its file, made absolute where the measurement started
        base = data.base_filename() if data is not None and hasattr(data, "base_filename") else None
        config.data_file = base or os.path.abspath(config.data_file)
        config.parallel = True
        return str(config.serialize())
    except Exception:  # a coverage we do not understand: measure nothing rather than break the pool
        return None


def start_in_rank() -> None:
    """In a rank, first thing: start coverage if the pytest process measures (coverage's own way).

    A measurement already started at interpreter start-up (coverage's ``patch = subprocess``
    .pth file) is kept. ``COVERAGE_PROCESS_CONFIG`` is set only for the call: the rank's own
    subprocesses are measured only if the user's configuration asks for it.
    """
    data = os.environ.pop(ENV, None)
    if data is None:
        return
    try:
        import coverage

        if coverage.Coverage.current() is not None:
            return
        before = os.environ.get("COVERAGE_PROCESS_CONFIG")
        os.environ["COVERAGE_PROCESS_CONFIG"] = data
        try:
            coverage.process_startup()
        finally:
            if before is None:
                os.environ.pop("COVERAGE_PROCESS_CONFIG", None)
            else:
                os.environ["COVERAGE_PROCESS_CONFIG"] = before
    except Exception:
        sys.stderr.write("pytest-gpu rank: could not start coverage:\n" + traceback.format_exc())


def save_in_rank() -> None:
    """Stop and save the rank's coverage measurement, if there is one."""
    module = sys.modules.get("coverage")
    if module is None:
        return
    try:
        cov = module.Coverage.current()
        if cov is not None:
            cov.stop()
            cov.save()
    except Exception:
        sys.stderr.write("pytest-gpu rank: could not save coverage data:\n" + traceback.format_exc())
