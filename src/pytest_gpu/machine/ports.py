"""TCP ports for tests: unique across the run, checked bindable when handed out."""

from __future__ import annotations

import hmac
import os
import random
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

DEFAULT_RANGE = (20000, 32767)  # below Linux's default ephemeral range (32768-60999)
_KEY = secrets.token_bytes(32)  # this process's own: see owner_digest


@dataclass(frozen=True)
class PortOwner:
    """Who asked for ports, as a ``ports`` message names it: ``"<holder>@<tag>"``.

    ``holder`` is what a crash report names (a test's node id, a fixture, a rank pool);
    ``tag`` keeps two holders of one name apart (the process id, a pool's id). The broker
    reads the holder back when the process dies holding ports.
    """

    holder: str
    tag: str

    SEP: ClassVar[str] = "@"  # the last one: a node id may contain "@" itself (a parameter)

    def __str__(self) -> str:
        return f"{self.holder}{self.SEP}{self.tag}"

    @classmethod
    def of_this_process(cls, holder: str) -> PortOwner:
        return cls(holder, str(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> PortOwner:
        """The inverse of ``str()``; a name without a tag is all holder."""
        holder, sep, tag = text.rpartition(cls.SEP)
        return cls(holder, tag) if sep else cls(text, "")


def owner_digest(text: str) -> str:
    """How a run names a port's holder (``<test or fixture>@<tag>``) to an arbiter that is
    another user's process: a digest keyed with a secret of this process (the run's, whose
    link says every owner), so the same holder is the same name for the run's whole life
    (its ports are given back by it) but that arbiter cannot find the test and pid behind
    it by trying node ids and pids, nor make up another run's."""
    return "#" + hmac.new(_KEY, text.encode(), "sha256").hexdigest()[:16]


def parse_port_range(value: str) -> tuple[int, int]:
    """``"20000-32767"`` → (20000, 32767); raises ValueError naming the expected form."""
    try:
        lo_text, hi_text = value.split("-")
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        raise ValueError(f"expected a port range LOW-HIGH such as 20000-32767, got {value!r}") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"expected 1024 <= LOW <= HIGH <= 65535, got {value!r}")
    return lo, hi


def bindable(port: int) -> bool:
    """True if nothing listens on ``port`` (TCP, all interfaces) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out ports round-robin from a range, never one that is leased or busy.

    Round-robin (from a random start, so concurrent runs rarely meet) keeps a port that
    was just given back out of circulation for as long as possible, which lets sockets
    in TIME_WAIT drain before the port is handed out again.
    """

    def __init__(
        self,
        port_range: tuple[int, int] = DEFAULT_RANGE,
        check: Callable[[int], bool] = bindable,
        seed: int | None = None,
    ) -> None:
        self.lo, self.hi = port_range
        self._check = check
        self._random = random.Random(seed)
        self._next = {(self.lo, self.hi): self._random.randint(self.lo, self.hi)}  # per range
        self.owners: dict[int, str] = {}

    def take(self, n: int, owner: str, port_range: tuple[int, int] | None = None) -> list[int]:
        """``n`` ports for ``owner`` from ``port_range`` (default: the allocator's); raises
        RuntimeError if the range has too few free."""
        lo, hi = port_range or (self.lo, self.hi)
        if (lo, hi) not in self._next:
            if len(self._next) > 64:  # runs use a few ranges; a stranger's many must not grow this
                self._next.clear()
            self._next[(lo, hi)] = self._random.randint(lo, hi)
        got: list[int] = []
        size = hi - lo + 1
        for _ in range(size):
            if len(got) == n:
                break
            port = self._next[(lo, hi)]
            self._next[(lo, hi)] = lo if port >= hi else port + 1
            if port in self.owners or not self._check(port):
                continue
            self.owners[port] = owner
            got.append(port)
        if len(got) < n:
            for port in got:
                del self.owners[port]
            leased = sum(lo <= p <= hi for p in self.owners)
            raise RuntimeError(
                f"only {len(got)} of {n} ports free in {lo}-{hi} ({leased} leased); widen --gpu-port-range"
            )
        return got

    def adopt(self, port: int, owner: str) -> bool:
        """Take over a port handed out before (by an arbiter that is gone); ``False`` if another holds it."""
        if self.owners.get(port, owner) != owner:
            return False
        self.owners[port] = owner
        return True

    def give_back(self, owner: str) -> list[int]:
        mine = [p for p, o in self.owners.items() if o == owner]
        for port in mine:
            del self.owners[port]
        return mine

    def give_back_prefix(self, prefix: str) -> list[int]:
        """Return every port whose owner key starts with ``prefix`` (a client's keys)."""
        mine = [p for p, o in self.owners.items() if o.startswith(prefix)]
        for port in mine:
            del self.owners[port]
        return mine
