"""What a test process still holds of the leases that ended, charged to their holders.

A lease's verdict says what it left in the process (:attr:`~pytest_gpu.gpu.verification.Verdict.left`);
:class:`Leftovers` keeps it per GPU until a later measure says it was given back, and tells
the broker with each release (:meth:`Leftovers.wire`), so no lease is placed in that memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..base.requests import format_size


@dataclass
class Leftover:
    """Memory a holder left in this process: ``nbytes`` on one GPU, left by ``holder`` (a
    test's node id, a fixture's label), whose verdict reported it."""

    holder: str
    nbytes: int


@dataclass
class Leftovers:
    """What this process still holds of the leases that ended, per GPU, oldest first.

    The verdict of each lease says what it left (:attr:`~pytest_gpu.gpu.verification.Verdict.left`);
    the process keeps it charged to that holder, at the broker too (every release of a
    confined lease says what is left, :meth:`wire`), so no lease is placed in that memory and
    the next test's cap is its own budget on top of it. A later measure of what the process
    holds there shrinks it (:meth:`shrink`: given back, oldest first); the process's exit ends
    it all."""

    by_gpu: dict[int, list[Leftover]] = field(default_factory=dict)
    _sent: dict[int, tuple[int, str]] = field(default_factory=dict)  # what the broker was told last

    def add(self, index: int, holder: str, nbytes: int) -> None:
        if nbytes > 0:
            self.by_gpu.setdefault(index, []).append(Leftover(holder, nbytes))

    def on(self, index: int) -> int:
        """Bytes left on GPU ``index``."""
        return sum(left.nbytes for left in self.by_gpu.get(index, []))

    def shrink(self, index: int, held: int) -> None:
        """The process holds ``held`` bytes on GPU ``index`` beyond its contexts while no lease of
        it is there: what is left can be no more (the oldest leftovers went first)."""
        gone = self.on(index) - max(held, 0)
        rows = self.by_gpu.get(index, [])
        while gone > 0 and rows:
            take = min(rows[0].nbytes, gone)
            rows[0].nbytes -= take
            gone -= take
            if rows[0].nbytes == 0:
                rows.pop(0)
        if not rows:
            self.by_gpu.pop(index, None)

    def wire(self) -> dict[int, tuple[int, str]] | None:
        """What to tell the broker: GPU index -> (bytes, who left them) for every GPU where
        something is left, or ``None`` when that is what it was told last."""
        now = {index: (self.on(index), _holders(rows)) for index, rows in self.by_gpu.items()}
        if now == self._sent:
            return None
        self._sent = now
        return dict(now)

    def described(self, indices: Iterable[int]) -> list[str]:
        """One line per GPU of ``indices`` where something is left, naming who left it."""
        lines = []
        for index in sorted(set(indices)):
            for left in self.by_gpu.get(index, []):
                lines.append(
                    f"this process still held {format_size(left.nbytes)} on GPU {index} left by {left.holder} "
                    "(reported there)"
                )
        return lines


def _holders(rows: list[Leftover]) -> str:
    names = list(dict.fromkeys(left.holder for left in rows))
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
