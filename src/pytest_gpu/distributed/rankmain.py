"""A rank process of a warm pool: ``python -m pytest_gpu.distributed.rankmain``.

Started by the pool (directly, or by torchrun / mpirun / srun), it connects back to
its pytest process over an authenticated Unix socket — never through stdout, which
NCCL and user code write to — sets up the process group once, then runs test bodies
on request and cleans up between them (the messages, and the files it writes:
:mod:`.protocol`).

A second connection, the *lifeline*, is only read by a daemon thread: when the pytest
process dies (even by SIGKILL) the kernel closes it, and the rank kills its whole
process group, so no rank outlives its pool.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import inspect
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..base import importhook, privates
from ..base.wording import join
from ..gpu.torchstats import set_fractions, torch_peak
from ..vendors import registry as vendors
from ..wire.client import Client, Garbled
from . import cover, protocol, residue
from .rankinfo import RankInfo, RankPlaceholder

RANK_VARS = ("PYTEST_GPU_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
SIZE_VARS = ("PYTEST_GPU_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
LOCAL_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def _first_int(names: tuple[str, ...], default: int | None = None) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    if default is None:
        raise SystemExit(f"pytest-gpu rank: none of {', '.join(names)} is set")
    return default


#: torch.distributed backends whose ranks each have a GPU: NCCL (RCCL on ROCm), and on Intel GPUs
#: torch's XCCL (torch >= 2.8) or oneCCL's bindings' ccl.
XPU_BACKENDS = ("xccl", "ccl")
GPU_BACKENDS = ("nccl", *XPU_BACKENDS)


def _cap_torch(torch: Any, cap: int) -> None:
    """Cap torch's allocator at ``cap`` bytes on each GPU this rank sees, once CUDA has started
    (a rank that starts CUDA only in a test body runs under its pool's lease uncapped: a fraction
    set here would open a context on every GPU of a rank that may never use them)."""
    if not cap or not torch.cuda.is_initialized():
        return
    _set_fractions(torch.cuda, cap)


def _set_fractions(cuda: Any, cap: int) -> None:
    """``cap`` bytes as torch's memory fraction on each GPU ``cuda`` sees; also from a callback
    of torch's lazy init (before it counts as initialised): its total is the accessor that
    init defines (see gpu.adapters), cudaMemGetInfo's."""
    properties = getattr(cuda, "_get_device_properties", None) or cuda.get_device_properties
    totals = {ordinal: int(properties(ordinal).total_memory) for ordinal in range(cuda.device_count())}
    # torch < 2.10 moved the current device with each fraction: the body must start on cuda:0
    set_fractions(cuda, {ordinal: min(cap / total, 1.0) for ordinal, total in totals.items() if total})


def _cap_torch_when_started(cap: int) -> None:
    """An isolated test's rank: cap torch's allocator at ``cap`` bytes on each GPU it sees once
    torch starts CUDA (queued on torch's lazy init, so a body that never starts CUDA opens no
    context), whenever the body imports torch: the memory cap a test process's lease gives it."""

    def apply(torch: Any) -> None:
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_available():
            return
        if cuda.is_initialized():
            _set_fractions(cuda, cap)
        else:
            cuda._lazy_call(lambda: _set_fractions(cuda, cap))

    torch = sys.modules.get("torch")
    if torch is not None:
        apply(torch)
    else:
        importhook.on_import("torch", apply)


class Rank:
    def __init__(self) -> None:
        self.rank = _first_int(RANK_VARS)
        self.world_size = _first_int(SIZE_VARS)
        self.local_rank = _first_int(LOCAL_VARS, self.rank)
        self.log_dir = Path(os.environ["PYTEST_GPU_RANK_LOG_DIR"])
        self.backend = os.environ["PYTEST_GPU_RANK_BACKEND"]
        self._redirect_output()
        slices = os.environ.get("PYTEST_GPU_RANK_GPUS")
        mine = slices.split(";")[self.rank] if slices is not None else ""
        # a rank without GPUs gets "" (CUDA and HIP then see no GPU at all): an unset variable
        # would show it every GPU of the machine, leased to others or excluded by the user
        vendor = vendors.of(os.environ.get(protocol.RANK_VENDOR_ENV) or vendors.DEFAULT.name)
        os.environ.update(vendor.lease_env(mine.split(",") if mine else []))  # AMD's: ROCR_VISIBLE_DEVICES by UUID, ...
        self.device = f"{vendor.device_kind}:0" if mine else "cpu"  # Intel GPUs: torch names them xpu:N
        self.cap = int(os.environ.get(protocol.RANK_MEMORY_ENV) or 0)  # bytes per GPU (0: uncapped)
        if os.environ.get("PYTEST_GPU_FAKE_GPUS"):  # fake GPUs: NVML and torch.cuda as the run sees them
            from ..sim import cuda, fake  # local: slow; only ranks on fake GPUs load the simulated machine

            fake.activate()
            if mine and self.cap:
                # its GPUs as CUDA enumerates CUDA_VISIBLE_DEVICES (indices or, as on a real machine, UUIDs)
                for unit in cuda.init():
                    cuda.set_memory_cap(unit, self.cap)  # as a test's lease caps the test process
        self.isolated = bool(os.environ.get(protocol.RANK_ISOLATED_ENV))
        if mine and self.cap and self.isolated:
            _cap_torch_when_started(self.cap)  # after the fake GPUs' own hook: torch.cuda is theirs first
        self._stack_file = open(protocol.rank_file(self.log_dir, self.rank, "stack"), "w")
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        address = os.environ["PYTEST_GPU_RANK_ADDRESS"]
        authkey = bytes.fromhex(os.environ["PYTEST_GPU_RANK_AUTHKEY"])
        self.conn = protocol.connect(address, authkey)  # the pool proves the key too
        self.conn.tell(protocol.HELLO, {"rank": self.rank, "pid": os.getpid(), "pgid": os.getpgrp()})
        lifeline = protocol.connect(address, authkey)
        lifeline.tell(protocol.LIFELINE, {"rank": self.rank})
        threading.Thread(target=self._watch, args=(lifeline,), daemon=True).start()
        self.group: Any = None
        self.modules: dict[str, Any] = {}
        self.residue = residue.Tracker()  # torch's defaults as the pool started, and who changed them

    def _redirect_output(self) -> None:
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            file = protocol.rank_file(self.log_dir, self.rank, stream)
            target = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)

    def _watch(self, lifeline: Client) -> None:
        try:
            while True:
                lifeline.receive()  # the pool sends nothing here: until the connection closes
        except (OSError, ValueError):  # closed, or garbled
            pass
        # The pytest process is gone: take the rank's whole process group down with it.
        if os.getpgrp() != int(os.environ.get("PYTEST_GPU_OWNER_PGID", "-1")):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    # -- setup ------------------------------------------------------------------------

    def setup(self, body: dict[str, Any]) -> None:
        sys.path[:] = body["sys_path"]
        os.chdir(body["cwd"])
        self.cwd = body["cwd"]
        self.config = _pytest_config(body)
        if self.backend in ("gloo", *GPU_BACKENDS):
            import torch.distributed as dist

            if self.backend == "nccl":
                import torch

                torch.cuda.set_device(0)
                _cap_torch(torch, self.cap)
            elif self.backend in XPU_BACKENDS:  # Intel GPUs: torch.xpu
                import torch

                if self.backend == "ccl":
                    import oneccl_bindings_for_pytorch  # noqa: F401 - registers the "ccl" backend

                torch.xpu.set_device(0)
                if self.cap:
                    _set_fractions(torch.xpu, self.cap)
            if self.rank != 0:
                _await_store(body["group_timeout"])
            dist.init_process_group(
                self.backend,
                init_method="env://",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=body["group_timeout"]),  # every collective's, too: see pool.group_timeout
                **eager_device(dist, self.backend),
            )
            self.group = dist.group.WORLD
        elif self.backend == "mpi":
            from mpi4py import MPI

            self.group = MPI.COMM_WORLD
            if self.group.Get_size() != self.world_size:
                raise RuntimeError(f"MPI world has {self.group.Get_size()} ranks, expected {self.world_size}")
        self.info = RankInfo(self.rank, self.world_size, self.local_rank, self.device, self.backend, self.group)
        self.residue.begin()
        # Long-lived objects (torch, the process group) out of the collector's sight: the
        # full collection between tests then costs ~1 ms instead of ~100 ms.
        gc.freeze()

    # -- one test ---------------------------------------------------------------------

    def run(self, body: dict[str, Any]) -> dict[str, Any]:
        env = dict(os.environ)
        cwd = os.getcwd()
        groups = _groups()
        world = _world()
        tainted = self.residue.tainted()  # what earlier tests left: a failure here may be theirs
        modules = len(sys.modules)
        if self.isolated:
            _torch_peaks(reset=True)  # each test's own peak, as a test process's lease starts it
        _reseed(body["seed"])
        result: dict[str, Any] = {"rank": self.rank, "outcome": "passed", "message": "", "longrepr": ""}
        result["run_id"] = body.get("run_id")  # echoed: the pool takes only the current run's results
        started = time.perf_counter()
        moved = False  # the body left another working directory
        try:
            func = self._resolve(body)
            kwargs = pickle.loads(body["kwargs"])  # from the pool, which proved the key: see protocol
            kwargs = {k: (self.info if isinstance(v, RankPlaceholder) else v) for k, v in kwargs.items()}
            result["body_started"] = time.perf_counter() - started
            t0 = time.perf_counter()
            func(**kwargs)
            result["body_seconds"] = time.perf_counter() - t0
        except BaseException as exc:
            moved = _cwd() != cwd
            try:
                os.chdir(cwd)  # paths in the traceback relative to where pytest runs
            except OSError:
                pass
            result.update(_outcome(exc, body.get("module_file"), body.get("tbstyle", "auto")))
        finally:
            result["poisoned"] = result.get("poisoned", False)
            found = self._residue(body, env, moved or _cwd() != cwd, groups, world)
            self._clean(env, cwd, groups, modules)
            result.update(residue=found.lines, put_back=found.put_back, tainted=tainted, unusable=found.unusable)
            peaks = _torch_peaks() if self.isolated else None
            if peaks is not None:
                result["torch_peaks"] = peaks
        return result

    def _resolve(self, body: dict[str, Any]) -> Any:
        name = body["module_name"]
        module = self.modules.get(name) or sys.modules.get(name)
        if module is None:
            module = _import_module(body, self.config, self.cwd)
            self.modules[name] = module
            gc.freeze()
        if body["cls"]:
            owner: Any = module
            for part in body["cls"].split("."):
                owner = getattr(owner, part)
            return getattr(owner(), body["func"])
        return getattr(module, body["func"])

    def _residue(
        self, body: dict[str, Any], env: dict[str, str], moved: bool, groups: set[Any], world: Any
    ) -> residue.Found:
        """What the test left on this rank (see :mod:`.residue`), before :meth:`_clean` puts back
        what it puts back; a default process group the test set up is destroyed here."""
        found = residue.Found()
        lines, put_back = found.lines, found.put_back
        lines += self.residue.torch_after(body["nodeid"])
        put_back += [f"{line} (put back)" for line in residue.env_changes(env, os.environ)]
        if moved:
            put_back.append("working directory changed (put back)")
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            left = len(_groups() - groups)
            if left:
                what = "process-group sub-group" if left == 1 else "process-group sub-groups"
                put_back.append(f"{left} {what} not destroyed (destroyed now)")
            now = _world()
            if world is not None and now is None:
                lines.append("default process group destroyed (the pool is replaced)")
                found.unusable = True
            elif world is not None and now is not world:
                lines.append("default process group replaced (the pool is replaced)")
                found.unusable = True
            elif world is None and now is not None:
                put_back.append("default process group set up and not destroyed (destroyed now)")
                try:
                    dist.destroy_process_group()
                except Exception:
                    found.unusable = True
        replaced = self.residue.reseeding_after()
        if replaced:
            lines.append(f"{join(replaced)} replaced: the pool's reseeding no longer holds (the pool is replaced)")
            found.unusable = True
        return found

    def _clean(self, env: dict[str, str], cwd: str, groups: set[Any], modules: int) -> None:
        """Put the process back as the test found it (see docs/distributed.md's list); ``modules``:
        how many modules were loaded when the test started."""
        if self.backend in ("gloo", *GPU_BACKENDS):
            import torch.distributed as dist

            for group in _groups() - groups:
                try:
                    dist.destroy_process_group(group)
                except Exception:
                    pass
        os.environ.clear()
        os.environ.update(env)
        try:
            os.chdir(cwd)
        except OSError:
            pass
        gc.collect()
        if len(sys.modules) > modules:
            # the body imported modules (torch, first in a body: ~0.2 s for each later full
            # collection): long-lived, out of the next tests' collections' sight, as at setup
            gc.freeze()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            # cuBLAS keeps a workspace per stream in torch's allocator (allocated, so empty_cache
            # keeps it): given back first, as the test process's adapter does, or each stream a
            # test used stays on the GPU as the rank's leak
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
        sys.stdout.flush()
        sys.stderr.flush()

    def check(self, timeout: float) -> tuple[bool, str]:
        """Is the world still usable after a failed test? A barrier that must complete in time."""
        try:
            if self.backend == "gloo":
                import torch.distributed as dist

                dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
            elif self.backend in GPU_BACKENDS:
                import torch.distributed as dist

                dist.barrier()
            elif self.backend == "mpi":
                self.group.Barrier()
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return True, ""

    def close(self) -> None:
        if self.backend in ("gloo", "nccl"):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        elif self.backend == "mpi":
            from mpi4py import MPI

            if not MPI.Is_finalized():
                MPI.Finalize()

    def serve(self) -> None:
        """Answer the pool's messages (see :mod:`.protocol`) until CLOSE.

        A message it has no answer for, or whose fields are not what :data:`.protocol.POOL`
        says, raises :class:`~.protocol.ProtocolError`: the rank exits with it in its stderr,
        and the pool, reading the rank's end as DIED, is killed with that stderr in its
        report, instead of waiting for a reply that never comes.
        """
        kind, body = self._receive()
        if kind != protocol.SETUP:
            raise protocol.unexpected("the pool", kind, (protocol.SETUP,))
        try:
            self.setup(body)
        except BaseException:
            self.conn.tell(protocol.SETUP_FAILED, {"rank": self.rank, "error": traceback.format_exc()})
            raise
        self.conn.tell(protocol.READY, {"rank": self.rank})
        while True:
            kind, body = self._receive()
            match kind:
                case protocol.RUN:
                    self.conn.tell(protocol.RESULT, self.run(body))
                case protocol.CHECK:
                    ok, detail = self.check(body["timeout"])
                    self.conn.tell(protocol.CHECKED, {"rank": self.rank, "ok": ok, "detail": detail})
                case protocol.CLOSE:
                    self.close()
                    cover.save_in_rank()  # before the reply: the pool kills the ranks once all have replied
                    self.conn.tell(protocol.CLOSED, {"rank": self.rank})
                    return
                case _:
                    raise protocol.unexpected("the pool", kind, (protocol.RUN, protocol.CHECK, protocol.CLOSE))

    def _receive(self) -> tuple[str, dict[str, Any]]:
        """The pool's next message (``OSError`` once its end closed)."""
        try:
            found = self.conn.receive()
        except Garbled as exc:
            raise protocol.ProtocolError(f"protocol error: {exc}") from None
        assert found is not None  # no timeout: it waits
        return found


def _await_store(timeout: float) -> None:
    """Before a rank other than 0 joins the ``env://`` rendezvous: wait until rank 0's store
    listens on ``MASTER_ADDR:MASTER_PORT``.

    Rank 0 starts the store once it has imported torch; a rank whose connect comes first is
    refused, and torch's client then backs off before it tries again: 0.3 to 0.5 s of ~2 in 3 pool
    starts here (measured with torch 2.13 on 2 cores; every fresh rank start pays it too). A
    plain TCP connect, closed at once, polled every 2 ms finds the store as soon as it
    listens. Without the variables nothing waits; past ``timeout`` seconds the rendezvous
    itself is left to fail and say why.
    """
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.002)


def eager_device(dist: Any, backend: str) -> dict[str, Any]:
    """``device_id`` for ``init_process_group`` where this torch takes it (2.3 and later) and the
    backend is NCCL: NCCL's communicator is then made at once, when the pool starts, not inside
    the first test's first collective, where its buffers would grow the rank's memory during a
    test (torch/distributed/distributed_c10d.py: ``device_id`` binds the group to the device and
    connects eagerly)."""
    if backend != "nccl":
        return {}
    try:
        params = inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):
        return {}
    if "device_id" not in params:
        return {}
    import torch

    return {"device_id": torch.device("cuda", torch.cuda.current_device())}


def _torch_peaks(reset: bool = False) -> list[int] | None:
    """torch's peak on each GPU of this rank (None: torch has not started CUDA); ``reset``:
    start each peak anew from what is reserved now."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    ordinals = range(cuda.device_count())
    if reset:
        for ordinal in ordinals:
            cuda.reset_peak_memory_stats(ordinal)
        return None

    return [torch_peak(cuda, ordinal) for ordinal in ordinals]


def _groups() -> set[Any]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return set()
    world = dist.group.WORLD
    return {pg for pg in dist.distributed_c10d._world.pg_map if pg is not world}


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # the body removed it
        return ""


def _world() -> Any:
    """The default process group, where torch.distributed is imported and has one (else None)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD


def _reseed(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def _pytest_config(body: dict[str, Any]) -> Any:
    """A pytest config like the parent's, for assertion rewriting of the test modules.

    Only what decides how a test module is imported comes from the pytest process (root, ini
    file, import and assertion modes, in ``config_args``); the ini file's ``addopts`` and
    ``PYTEST_ADDOPTS`` are left out (they name options of plugins a rank does not load: ``-n``,
    ``--gpus``) and no plugin is loaded from entry points: a rank runs test bodies, never
    fixtures or hooks, and loading them cost ~0.13 s of every rank's start. The initial
    conftests are imported, as in the pytest process: what they set at import holds in the
    ranks too.
    """
    args = ["-p", "no:gpu", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", *body["config_args"]]
    saved = {name: os.environ.pop(name, None) for name in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        config = privates.prepare_config(args)
        if config.getoption("assertmode") == "rewrite":  # ``--assert=plain``: as the pytest process, none
            privates.rewrite_asserts(config)
        return config
    except Exception:
        sys.stderr.write("pytest-gpu rank: assertion rewriting unavailable:\n" + traceback.format_exc())
        return None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import_module(body: dict[str, Any], config: Any, cwd: str) -> Any:
    if config is not None:
        mode = config.getoption("importmode")
        root = Path(config.rootpath)
    else:  # no config: the pool's working directory stands for the root
        mode, root = "prepend", Path(cwd)
    try:
        return privates.import_test_module(body["module_file"], mode, root)
    except Exception:
        return importlib.import_module(body["module_name"])


def _outcome(exc: BaseException, module_file: str | None, tbstyle: str) -> dict[str, Any]:
    import pytest

    if isinstance(exc, pytest.skip.Exception):
        return {"outcome": "skipped", "message": str(exc.msg)}
    if isinstance(exc, pytest.xfail.Exception):
        return {"outcome": "xfailed", "message": str(exc.msg)}
    info = pytest.ExceptionInfo.from_exception(exc)
    style = "long" if tbstyle == "auto" else tbstyle
    privates.trim_traceback(info, module_file, full_ends=tbstyle == "auto")  # as pytest does
    if isinstance(exc, pytest.fail.Exception) and not exc.pytrace:
        longrepr = str(exc.msg)
    else:
        longrepr = str(info.getrepr(style=style, chain=True, truncate_locals=True))  # type: ignore[arg-type]
    return {
        "outcome": "failed",
        "message": info.exconly(),
        "longrepr": longrepr,
        "poisoned": type(exc).__module__.startswith("torch.distributed") or "DistBackendError" in type(exc).__name__,
    }


def main() -> None:
    cover.start_in_rank()  # before the test modules (and what they import) are imported
    rank = Rank()
    code = 0
    try:
        rank.serve()
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    except protocol.ProtocolError:
        traceback.print_exc()  # into the rank's stderr file, which the pool reports
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a half-closed NCCL/MPI world can hang in it


if __name__ == "__main__":
    main()
