"""What a pool (:mod:`.pool`) and its rank processes (:mod:`.rankmain`) say to each other.

Transport: :mod:`pytest_gpu.wire` over the pool's Unix socket, the key the pool hands its
ranks in their environment proven both ways; every message is ``{"op": kind, ...body}``,
checked on arrival against :data:`POOL` (a rank's one-way messages to the pool, the
pool's events to a rank). The one binary field, a test body's pickled fixture values
(``RunBody.kwargs``), travels as base64 and is unpickled by a rank only, which has
authenticated its pool by then. Each rank opens two connections: its control connection,
which carries everything below, and its lifeline, which carries only :data:`LIFELINE` and
whose closing (the pytest process died) makes the rank kill its process group.

A rank's life, one line per exchange (the pool waits for every rank's reply)::

    rank -> pool   HELLO      on connecting                        HelloBody
    rank -> pool   LIFELINE   on its second connection             LifelineBody
    pool -> rank   SETUP      once every rank has connected        SetupBody
    rank -> pool   READY | SETUP_FAILED                            ReadyBody | SetupFailedBody
    pool -> rank   RUN        one test body                        RunBody
    rank -> pool   RESULT     once the body ended, however         ResultBody (with what it left)
    pool -> rank   CHECK      after a failed test: health barrier  CheckBody
    rank -> pool   CHECKED                                         CheckedBody
    pool -> rank   CLOSE      a graceful end                       CloseBody
    rank -> pool   CLOSED     then the pool kills every rank       ClosedBody

A kind the receiver does not expect at that point is a protocol error (:func:`unexpected`),
and so is a message whose fields are not what :data:`POOL` says: the two sides are out of
step, and the pool is not trusted any further.

Output never travels over the connection: each rank sends its stdout and stderr to
``rank<N>.stdout`` and ``rank<N>.stderr`` in the pool's directory (not to a launcher's
pipe, which NCCL and MPI write to as well), faulthandler writes its stack to
``rank<N>.stack`` on SIGUSR1, and a launcher program's own output goes to ``launcher.log``.
A test's report gets what the ranks wrote while it ran (:func:`offsets`, :func:`written_since`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict

from ..wire.client import Client
from ..wire.schema import Blob, Bool, Call, Choice, Float, Int, List, Obj, Opt, Protocol, Str

Message = tuple[str, dict[str, Any]]  # (kind, body)

# a rank's budget on each of its GPUs (bytes): the pool's lease's per-GPU memory, set by the pool
RANK_MEMORY_ENV = "PYTEST_GPU_RANK_MEMORY"
RANK_VENDOR_ENV = "PYTEST_GPU_RANK_VENDOR"  # whose GPUs the ranks have: which variables a rank sets
# set ("1") for an isolated test's one-rank pool: torch is capped at RANK_MEMORY_ENV on every GPU
# of the rank once it starts CUDA, as the pytest_gpu_confine adapters cap a test process
RANK_ISOLATED_ENV = "PYTEST_GPU_RANK_ISOLATED"

HELLO = "hello"
"""rank -> pool, first message on its control connection: which rank this connection is."""
LIFELINE = "lifeline"
"""rank -> pool, only message on its second connection; the pool never answers nor reads it again."""
SETUP = "setup"
"""pool -> rank, once all ranks said hello: join the process group, configure pytest."""
READY = "ready"
"""rank -> pool, reply to SETUP: the process group is up."""
SETUP_FAILED = "setup-failed"
"""rank -> pool, reply to SETUP: setting up raised; the rank exits after sending it."""
RUN = "run"
"""pool -> rank: run one test body (the runner's payload) and answer with RESULT."""
RESULT = "result"
"""rank -> pool, reply to RUN, whatever the body did (passed, failed, skipped, xfailed)."""
CHECK = "check"
"""pool -> rank, after a failed or poisoned test: is the world still usable? (a timed barrier)"""
CHECKED = "checked"
"""rank -> pool, reply to CHECK."""
CLOSE = "close"
"""pool -> rank: leave the process group (and save coverage); a graceful end."""
CLOSED = "closed"
"""rank -> pool, reply to CLOSE, the rank's last message: the pool then kills the ranks."""
DIED = "died"
"""Never sent: what the pool reads in place of a reply when a rank's connection closed."""
INVALID = "invalid"
"""Never sent: what the pool reads in place of a message whose fields are not what :data:`POOL` says."""


class HelloBody(TypedDict):
    rank: int
    pid: int  # the pool signals it (SIGUSR1: faulthandler's stacks) and kills it
    pgid: int


class LifelineBody(TypedDict):
    rank: int


class SetupBody(TypedDict):
    sys_path: list[str]  # the pytest process's, so test modules import alike
    cwd: str
    config_args: list[str]  # a pytest configuration like the pytest process's (assertion rewriting)
    group_timeout: float  # the process group's timeout, past the longest test the pool runs


class ReadyBody(TypedDict):
    rank: int


class SetupFailedBody(TypedDict):
    rank: int
    error: str  # the traceback


class RunBody(TypedDict):
    module_file: str
    module_name: str
    cls: str  # qualified name of the test's class, "" for a function
    func: str
    kwargs: bytes  # the fixture values, pickled; the ``rank`` fixture's is a placeholder
    seed: int  # random, numpy and torch are reseeded with it
    nodeid: str
    tbstyle: str
    run_id: str  # echoed in RESULT: a result for another run is never taken for this one


class _Timings(TypedDict, total=False):
    body_started: float  # seconds from RUN to the body's first line
    body_seconds: float  # the body's own time, when it returned
    # an isolated test's rank whose torch started CUDA: torch's peak on each of its GPUs during
    # the test, by ordinal (= the lease's order), as a test process's verifier reads it
    torch_peaks: list[int]


class Tainted(TypedDict):
    test: str  # the node id of an earlier test on the pool
    what: str  # what it left that is still so: "default dtype float64 (was float32)"


class _Residue(TypedDict, total=False):
    # what the test left on the rank (see residue), one line each for its report: what later
    # tests meet (or what replaces the pool), and what the rank put back
    residue: list[str]
    put_back: list[str]
    # what earlier tests on the pool left that was still so when this test started
    tainted: list[Tainted]
    unusable: bool  # the rank cannot run another test (its default process group is gone)


class ResultBody(_Timings, _Residue):
    rank: int
    outcome: str  # "passed", "failed", "skipped" or "xfailed"
    message: str
    longrepr: str
    run_id: str | None  # RunBody's, echoed
    poisoned: bool  # the failure came from the process group: the pool checks its health


class CheckBody(TypedDict):
    timeout: float


class CheckedBody(TypedDict):
    rank: int
    ok: bool
    detail: str  # what failed, when not ok


class CloseBody(TypedDict):
    pass


class ClosedBody(TypedDict):
    rank: int


MAX_FRAME = 1 << 30  # a test body's pickled fixture values are the largest message
TEXT = Str(MAX_FRAME)  # a traceback, a test's output: no limit of its own
RANK = Int(0, 1 << 20)
PID = Int(0, 1 << 31)
_RANK = {"rank": RANK}

POOL = Protocol(
    "the rank pool",
    calls={  # a rank's, all one-way
        HELLO: Call(Obj({**_RANK, "pid": PID, "pgid": PID})),
        LIFELINE: Call(Obj(_RANK)),
        READY: Call(Obj(_RANK)),
        SETUP_FAILED: Call(Obj({**_RANK, "error": TEXT})),
        RESULT: Call(
            Obj(
                {**_RANK, "outcome": Choice("passed", "failed", "skipped", "xfailed"), "message": TEXT},
                {
                    "run_id": Opt(Str(1024)),
                    "longrepr": TEXT,
                    "poisoned": Bool(),
                    "body_started": Float(),
                    "body_seconds": Float(),
                    "torch_peaks": List(Int(), 4096),
                    "residue": List(Str(4096), 256),
                    "put_back": List(Str(4096), 256),
                    "tainted": List(Obj({"test": TEXT, "what": Str(4096)}), 256),
                    "unusable": Bool(),
                },
                {"run_id": None, "longrepr": "", "poisoned": False},
            )
        ),
        CHECKED: Call(Obj({**_RANK, "ok": Bool(), "detail": TEXT})),
        CLOSED: Call(Obj(_RANK)),
    },
    events={  # the pool's, to a rank
        SETUP: Obj(
            {
                "sys_path": List(TEXT, 1 << 16),
                "cwd": TEXT,
                "config_args": List(TEXT, 1 << 16),
                "group_timeout": Float(),
            }
        ),
        RUN: Obj(
            {
                "module_file": TEXT,
                "module_name": TEXT,
                "cls": TEXT,
                "func": TEXT,
                "kwargs": Blob(MAX_FRAME),
                "seed": Int(0, 1 << 64),
                "nodeid": TEXT,
                "tbstyle": Str(64),
                "run_id": Str(1024),
            }
        ),
        CHECK: Obj({"timeout": Float()}),
        CLOSE: Obj(),
    },
)


def connect(address: str, authkey: bytes) -> Client:
    """A rank's connection to its pool (each side proves the key to the other)."""
    return Client(address, POOL, key=authkey, limit=MAX_FRAME, max_request=MAX_FRAME, max_brackets=None)


class ProtocolError(RuntimeError):
    """A message its receiver has no use for at that point: pool and rank are out of step."""


def garbled(sender: str, kind: object, why: object) -> ProtocolError:
    """The error for a message of ``kind`` from ``sender`` whose fields are not what :data:`POOL` says."""
    return ProtocolError(
        f"protocol error: {sender} sent a {str(kind)[:40]!r} that is not what the protocol says ({why}); "
        "pool and rank out of step, or not the same pytest-gpu"
    )


def unexpected(sender: str, kind: object, expected: Iterable[str]) -> ProtocolError:
    """The error for ``kind`` from ``sender`` where only one of ``expected`` may come."""
    allowed = " or ".join(repr(k) for k in expected)
    return ProtocolError(
        f"protocol error: {sender} sent {kind!r} where only {allowed} may come "
        "(pool and rank out of step, or not the same pytest-gpu)"
    )


# -- the files ------------------------------------------------------------------------------

STREAMS = ("stdout", "stderr", "stack")
LAUNCHER_LOG = "launcher.log"

Offsets = dict[Path, int]  # each rank file's size when a test started


def rank_file(directory: Path, rank: int, stream: str) -> Path:
    """The file of ``rank``'s ``stream`` (one of :data:`STREAMS`)."""
    return directory / f"rank{rank}.{stream}"


def tail(file: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of ``file`` ("" when there is none)."""
    try:
        text = file.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def offsets(directory: Path, world_size: int) -> Offsets:
    """Where each rank file ends now: what comes after is the next test's."""
    sizes = {}
    for rank in range(world_size):
        for stream in STREAMS:
            file = rank_file(directory, rank, stream)
            sizes[file] = file.stat().st_size if file.exists() else 0
    return sizes


def written_since(since: Offsets) -> list[tuple[str, str]]:
    """What the ranks wrote after ``since``, as report sections ("rank 1 stderr", text)."""
    sections = []
    for file, start in since.items():
        if not file.exists():
            continue
        with open(file, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode(errors="replace")
        if text.strip():
            rank, stream = file.stem.removeprefix("rank"), file.suffix[1:]
            sections.append((f"rank {rank} {stream}", text))
    return sections


def summary(directory: Path) -> str:
    """The tail of every rank's output and of the launcher's log: why a pool could not start."""
    parts = []
    for file in [*sorted(directory.glob("*.std*")), directory / LAUNCHER_LOG]:
        text = tail(file)
        if text.strip():
            parts.append(f"--- {file.name} ---\n{text}")
    return "\n".join(parts)
