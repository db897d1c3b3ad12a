"""A fake ``libnvidia-ml.so.1`` for simulated GPUs, loaded by the real ``nvidia-ml-py`` (pynvml).

The library is compiled on demand from ``fake_nvml.c`` (next to this file) with the C compiler
``cc`` (or ``$CC``) and cached per user.  It implements the NVML C API that pynvml and the
plugin use, as strictly as the real one: same signatures, struct layouts, return codes and
two-call size protocol.  Its data is the text file ``$PYTEST_GPU_SIM_LEDGER/nvml.state``, which
the simulated-GPU ledger replaces atomically on every write and the library re-reads on every
device call.  Without that variable or file, ``nvmlInit`` fails with "Driver Not Loaded".
``nvmlInit`` and ``nvmlShutdown`` count (NVML's reference count); NVML is not fork-safe, so a
forked child's copy is not initialised: its calls answer "Uninitialized" until it calls
``nvmlInit`` itself (its parent's handles are not to be used).

State file format (one record per line, space-separated; a name is the rest of its line)::

    v1
    option pidns <offset>         # NVML reports pid + offset (host pids seen from a container)
    option no_v3 1                # the machine's driver lacks the *RunningProcesses_v3 symbols
    option no_usage 1             # process lists give usedGpuMemory as NVML_VALUE_NOT_AVAILABLE (WDDM)
    option vendor amd             # whose machine; not nvidia: nvmlInit answers "Driver Not Loaded"
                                  # (the fake libamd_smi.so reads this file then: pytest_gpu.sim.amdsmi)
    gpu <nvml_index> <uuid> <total_bytes> <reserved_bytes> <used_bytes> <mig 0|1> <fault> <name...>
    mig <parent_nvml_index> <slot> <uuid> <total_bytes> <used_bytes> <name...>
    proc <uuid> <pid> <used_bytes|na>
    gfx <uuid> <pid> <used_bytes|na>

``gpu`` lines come in index order 0..n-1; ``fault`` is ``none``, ``no_permission``,
``gpu_is_lost`` or ``unknown`` (the GPU is counted, but getting its handle fails with that
error).  A gpu line's ``used`` excludes ``reserved``; a MIG-mode GPU's used memory is the sum of
its instances'.  ``proc`` lines name a GPU or MIG UUID; processes that are gone (zombies included)
are not reported, and their memory is not counted in the device's ``used`` (the driver frees it
at exit; the ledger forgets them only on its next write); compute processes of a MIG-mode GPU
or MIG device are refused (NVML_ERROR_NO_PERMISSION, as for an unprivileged user).  ``na``
lists a process without its memory (``usedGpuMemory`` NVML_VALUE_NOT_AVAILABLE, as some drivers,
MIG and WSL report some processes); ``gfx`` lines are the graphics list's (a process in both
lists holds one amount of memory; the ledger writes none: only tests do).  The ``no_v3``
option is read here, not by the library: it selects the library variant built without those
symbols (see :func:`library_dir`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from filelock import FileLock

from ...base.safefiles import Unsafe, open_own_file, own_tree, private_dir, user_temp_dir
from ...vendors import libraries

__all__ = ["LIBRARY", "SOURCE", "FakeLibrary", "build_library", "library_dir", "load_library", "preload"]

#: The library's file name and soname, as pynvml loads it.
LIBRARY = "libnvidia-ml.so.1"
#: The C source of the fake library.
SOURCE = Path(__file__).with_name("fake_nvml.c")

_loaded: dict[Path, ctypes.CDLL] = {}


def _cache_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def _cache_root(kind: str = "fake-nvml") -> Path:
    return _cache_base() / "pytest-gpu" / kind


class _NoFallback(Exception):
    """The temporary directory cannot hold this user's cache (the message says why)."""


def _fallback_base() -> Path:
    """``$TMPDIR/pytest-gpu-<uid>``, private to this user; :class:`_NoFallback` says why not."""
    try:
        return private_dir(user_temp_dir())  # another user may have made the name first, as a link or theirs
    except OSError as exc:  # gettempdir's "No usable temporary directory", or a name taken
        raise _NoFallback(str(exc)) from None


@dataclass(frozen=True)
class FakeLibrary:
    """How one fake driver library is built: :func:`build_library` compiles and caches it."""

    kind: str  # the cache's folder: fake-nvml, fake-amdsmi
    what: str  # the library in messages: "the fake NVML"
    library: str  # its file name and soname
    sources: tuple[Path, ...]
    generated: str = ""  # C source made at build time (compiled with ``sources``), "" for none
    defines: tuple[str, ...] = ()
    suffix: str = ""  # of the cache key: a variant's name ("-nov3")

    def flags(self) -> tuple[str, ...]:
        return ("-shared", "-fPIC", "-O2", f"-Wl,-soname,{self.library}")


_NVML = FakeLibrary("fake-nvml", "the fake NVML", LIBRARY, (SOURCE,))


def _compiler(what: str = _NVML.what) -> list[str]:
    cc = shlex.split(os.environ.get("CC", "").strip()) or ["cc"]
    if shutil.which(cc[0]) is None:
        raise RuntimeError(
            f"{what} for simulated GPUs needs a C compiler: {cc[0]!r} was not found on PATH "
            "(install cc, e.g. gcc, or point $CC at a C compiler)"
        )
    return cc


def library_dir(*, no_v3: bool = False) -> Path:
    """The directory holding the compiled fake ``libnvidia-ml.so.1``, building it on first use.

    The build is cached under ``${XDG_CACHE_HOME:-~/.cache}/pytest-gpu/fake-nvml/<hash>[-nov3]``,
    keyed by the source and the variant, and done once across concurrent processes; where that
    cannot be written (a read-only home), under ``$TMPDIR/pytest-gpu-<uid>/fake-nvml`` (0700,
    this user's).  ``no_v3`` selects the variant without
    ``nvmlDevice{Compute,Graphics}RunningProcesses_v3`` (an old driver).  Raises
    :class:`RuntimeError` when no C compiler is available, compiling fails, or neither cache
    can be written.
    """
    if no_v3:
        return build_library(replace(_NVML, defines=("-DFAKE_NVML_NO_V3",), suffix="-nov3"))
    return build_library(_NVML)


def build_library(fake: FakeLibrary) -> Path:
    """The directory holding ``fake``'s compiled library, building it on first use (cached by its
    sources and flags under ``${XDG_CACHE_HOME:-~/.cache}/pytest-gpu/<kind>``, else this user's
    private temporary directory; see :func:`library_dir`).

    Every directory from the cache's base down is this user's and no one else's to write
    (:func:`~pytest_gpu.base.safefiles.own_tree`): a cache in a world-writable place (``HOME=/tmp``)
    or with a name another user made first is passed over for the temporary directory, so no
    one else can put a library where this user's processes load it."""
    source = b"".join(path.read_bytes() for path in fake.sources) + fake.generated.encode()
    key = hashlib.sha256(source + repr((fake.flags(), fake.defines)).encode()).hexdigest()[:16]
    name = key + fake.suffix
    try:
        base = _cache_base()
        if base.is_symlink() and base.lstat().st_uid == os.geteuid():
            base = base.resolve()  # the user's own link (a ~/.cache on another disk); another's is refused
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        return _build(own_tree(base, ("pytest-gpu", fake.kind, name)), fake)
    except OSError as exc:
        first = f"{_cache_root(fake.kind) / name} ({_why(exc)})"
    try:
        return _build(own_tree(_fallback_base(), (fake.kind, name)), fake)
    except _NoFallback as exc:
        why = str(exc)
    except OSError as exc:
        why = _why(exc)
    raise RuntimeError(
        f"cannot cache {fake.what} in {first} nor in the temporary directory ({why}); "
        "point XDG_CACHE_HOME at a directory of this user's that no one else can write"
    )


def _why(exc: OSError) -> str:
    return str(exc) if isinstance(exc, Unsafe) else f"{exc.strerror or exc}"


def _build(directory: Path, fake: FakeLibrary) -> Path:
    """Compile the library into ``directory`` (this user's alone) unless it is there; OSError:
    ``directory`` is not writable, or holds a library that is not this user's alone."""
    target = directory / fake.library
    if _built(target):
        return directory
    if not os.access(directory, os.W_OK | os.X_OK):  # else the compiler fails, saying less
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))
    with FileLock(str(directory) + ".lock"):
        if _built(target):  # another process built it while we waited
            return directory
        temp = directory / f".{fake.library}.{os.getpid()}.tmp"
        sources = [str(path) for path in fake.sources]
        generated = directory / f".generated.{os.getpid()}.c"
        if fake.generated:
            generated.write_text(fake.generated)
            sources.append(str(generated))
        command = [*_compiler(fake.what), *fake.flags(), *fake.defines, "-o", str(temp), *sources]
        try:
            try:
                done = subprocess.run(command, capture_output=True, text=True, check=False)
            except OSError as exc:
                raise RuntimeError(f"{fake.what} needs a C compiler; running {command[0]!r} failed: {exc}") from exc
            if done.returncode != 0:
                raise RuntimeError(f"building {fake.what} failed ({shlex.join(command)}):\n{done.stdout}{done.stderr}")
            os.chmod(temp, 0o755)  # the linker's mode went through the umask: a group-writable one is refused
            os.replace(temp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            with contextlib.suppress(FileNotFoundError):
                generated.unlink()
    return directory


def _built(target: Path) -> bool:
    """Whether ``target`` is a built library this user may load (OSError: something else is there)."""
    try:
        os.close(open_own_file(target))
    except FileNotFoundError:
        return False
    return True


def load_library(path: Path) -> ctypes.CDLL:
    """Load the library ``path`` ``RTLD_GLOBAL`` where it is this user's and no one else can write
    it (else :class:`RuntimeError`, as for a library that cannot be built): the file checked is
    the file loaded (through its descriptor, ``/proc/self/fd/N``, where there is one), so it
    cannot be swapped in between. Its soname still names it for a later ``dlopen``."""
    try:
        fd = open_own_file(path)
    except OSError as exc:
        raise RuntimeError(f"not loaded: {exc}") from None
    through = f"/proc/self/fd/{fd}"
    if not os.path.exists(through):
        os.close(fd)
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    # the descriptor stays open, as the library stays loaded: dlopen knows a library by the
    # name it was loaded as, and a number used again would give the library loaded before
    try:
        return ctypes.CDLL(through, mode=ctypes.RTLD_GLOBAL)
    except BaseException:
        os.close(fd)
        raise


def preload(*, no_v3: bool = False) -> Path:
    """Make this process's pynvml, and its subprocesses', use the fake NVML; returns the library's path.

    The library is loaded ``RTLD_GLOBAL`` (so a later ``dlopen("libnvidia-ml.so.1")`` resolves to
    it by soname) and installed as ``pynvml.nvmlLib``, replacing any library pynvml already
    loaded (a library replaced after ``nvmlInit`` needs a new ``nvmlInit``).  Its directory is
    put first on ``LD_LIBRARY_PATH`` for subprocesses.  Calling it again is harmless.
    """
    pynvml: Any = libraries.load("pynvml")  # nvmlLib is assigned below
    directory = library_dir(no_v3=no_v3)
    path = directory / LIBRARY
    lib = _loaded.get(path)
    if lib is None:
        lib = _loaded[path] = load_library(path)
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is not lib:
            pynvml.nvmlLib = lib
            # function pointers pynvml cached point into the previous library
            getattr(pynvml, "_nvmlGetFunctionPointer_cache", {}).clear()
    roots = {_cache_root(), directory.parent}  # the cache's, or the temporary fallback's
    kept = [
        entry
        for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
        if entry and Path(entry).parent not in roots  # drop other variants' directories
    ]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(directory), *kept])
    return path
