"""One node's GPUs as the scheduler reads them (pure): what its broker serves.

A run on one machine is a run with one node, whose view its own broker serves
(:meth:`pytest_gpu.leasing.broker.Broker.view`); under ``--gpu-nodes`` each node's host
sends its broker's view over the node's channel (:meth:`NodeView.to_wire`) and the
controller reads it back (:meth:`NodeView.from_wire`). The scheduler and its planner read
only this type, a mapping from node to view, whatever the number of nodes.

GPUs have two numberings here: the broker's GPU indices (``--gpus 0,2,3`` keeps 0, 2 and 3;
a lease names them) and the planner's positions 0..n-1 in :attr:`NodeView.order`. The
view translates between them, both ways, and nothing else does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

# what a node's broker says each worker holds: (GPU indices, bytes each; None: whole GPUs)
Placement = tuple[tuple[int, ...], int | None]


@dataclass(frozen=True)
class NodeView:
    """One node's broker now, in its GPU indices.

    ``room``: what each GPU of ``order`` can give leases now (beside the contexts open
    there and usage outside the run); ``order``: the broker's GPU indices, as the planner
    numbers them 0..n-1 (empty: ``room``'s positions are the indices); ``placements``:
    worker -> the leases its processes hold; ``contexts``: worker -> the GPUs its processes
    have a CUDA context on; ``context_sizes``: what a new context takes on each GPU of
    ``order`` (empty: contexts are not counted); ``limits``: the most one lease can ever
    get on each (its capacity less a context; empty: not known); ``spread``: whether the
    broker places a lease on an idle GPU before a busy one its worker has a context on
    (:attr:`pytest_gpu.machine.placement.Policy.spread`: the planner's plans follow; not sent on a
    node's channel: a node's broker spreads); ``catalog``: what the
    node's workers told the scheduler of their tests (a live mapping, see
    :mod:`pytest_gpu.scheduling.catalog`)."""

    room: tuple[int, ...]
    order: tuple[int, ...] = ()
    placements: Mapping[str, Sequence[Placement]] = field(default_factory=dict)
    contexts: Mapping[str, frozenset[int]] = field(default_factory=dict)
    context_sizes: tuple[int, ...] = ()
    limits: tuple[int, ...] = ()
    catalog: Mapping[str, Any] = field(default_factory=dict, compare=False)
    spread: bool = True

    def __post_init__(self) -> None:
        if not self.order:  # frozen: set once, as the dataclass would
            object.__setattr__(self, "order", tuple(range(len(self.room))))
        if len(self.order) != len(self.room):
            raise ValueError(f"a node view of {len(self.room)} GPUs' room names {len(self.order)} GPU indices")

    # -- the one translation of GPU indices --------------------------------------------

    @cached_property
    def _position(self) -> dict[int, int]:
        return {index: k for k, index in enumerate(self.order)}

    def positions(self, indices: Sequence[int]) -> tuple[int, ...]:
        """The planner's positions of the broker's GPU ``indices`` (GPUs not of this node dropped)."""
        at = self._position
        return tuple(at[i] for i in indices if i in at)

    def indices(self, positions: Sequence[int]) -> tuple[int, ...] | None:
        """The broker's GPU indices of the planner's ``positions``; ``None`` where one is not
        a GPU of this node (a plan made for another node's GPUs goes nowhere)."""
        if any(not 0 <= k < len(self.order) for k in positions):
            return None
        return tuple(self.order[k] for k in positions)

    @cached_property
    def placed(self) -> dict[str, list[Placement]]:
        """:attr:`placements` at the planner's positions."""
        return {w: [(self.positions(gpus), memory) for gpus, memory in rows] for w, rows in self.placements.items()}

    @cached_property
    def opened(self) -> dict[str, frozenset[int]]:
        """:attr:`contexts` at the planner's positions."""
        return {w: frozenset(self.positions(sorted(gpus))) for w, gpus in self.contexts.items()}

    def can_ever(self, count: int, memory: int | None) -> bool:
        """Whether ``count`` GPUs of ``memory`` bytes each (``None``: whole GPUs) can ever be
        leased here (always, where :attr:`limits` are not known)."""
        if not self.limits:
            return True
        return sum(memory is None or limit >= memory for limit in self.limits) >= count

    # -- on a node's channel -----------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """Plain values (execnet carries them), the catalog left out: a node host sends only
        what changed of it (:mod:`pytest_gpu.nodes.agent`)."""
        return {
            "room": list(self.room),
            "order": list(self.order),
            "placements": {w: [[list(gpus), memory] for gpus, memory in rows] for w, rows in self.placements.items()},
            "contexts": {w: sorted(gpus) for w, gpus in self.contexts.items()},
            "context_sizes": list(self.context_sizes),
            "limits": list(self.limits),
        }

    @classmethod
    def from_wire(cls, figures: Mapping[str, Any], catalog: Mapping[str, Any] | None = None) -> NodeView:
        """The inverse of :meth:`to_wire`; ``catalog``: the node's catalog as the controller keeps it."""
        room = tuple(int(b) for b in figures["room"])
        return cls(
            room=room,
            order=tuple(int(i) for i in figures.get("order", range(len(room)))),
            placements={
                str(w): [(tuple(int(i) for i in gpus), None if m is None else int(m)) for gpus, m in rows]
                for w, rows in figures["placements"].items()
            },
            contexts={str(w): frozenset(int(i) for i in gpus) for w, gpus in (figures.get("contexts") or {}).items()},
            context_sizes=tuple(int(b) for b in figures.get("context_sizes", ())),
            limits=tuple(int(b) for b in figures.get("limits", ())),
            catalog={} if catalog is None else catalog,
        )
