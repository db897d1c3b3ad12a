"""The ``rank`` fixture's value inside a rank process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankInfo:
    """Who this rank is: ``rank``, ``world_size``, ``local_rank``, ``device``, ``backend``.

    ``group`` is the process group (torch's ``WORLD``) or the MPI communicator
    (``COMM_WORLD``); ``None`` for ``backend="none"``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: str
    backend: str
    group: Any = None

    def __reduce__(self) -> Any:  # a process group cannot cross processes: drop it
        return (RankInfo, (self.rank, self.world_size, self.local_rank, self.device, self.backend, None))


class RankPlaceholder:
    """Stands for the ``rank`` fixture in the pytest process; each rank swaps in its RankInfo."""

    def __repr__(self) -> str:
        return "<rank: resolved inside each rank process>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankPlaceholder)

    def __hash__(self) -> int:
        return 0
