"""The GPUs one rank of a launch may lease: its share of the node's (pure).

Under a launcher every rank runs its own broker over the GPUs it discovered, and the
brokers of one node do not see each other's leases. Disjoint shares keep them from
promising the same GPU memory twice.
"""

from __future__ import annotations

from dataclasses import replace

from ..base.launch import LaunchContext
from ..vendors.devices import Inventory


def share(inventory: Inventory, local_rank: int, local_size: int) -> Inventory:
    """Local rank ``local_rank`` of ``local_size``'s part of ``inventory``.

    With G GPUs and L ranks on the node: if G >= L, rank r gets the whole GPUs r, r+L,
    r+2L, ...; otherwise rank r gets GPU r % G, whose allocatable memory is split evenly
    between the ranks mapped to it. Alone on the node (or given no place on it): everything.
    """
    devices = inventory.devices
    if local_size <= 1 or not devices or not 0 <= local_rank < local_size:
        return inventory
    if len(devices) >= local_size:
        return replace(inventory, devices=devices[local_rank::local_size])
    gpu = devices[local_rank % len(devices)]
    sharers = len(range(local_rank % len(devices), local_size, len(devices)))
    # the driver's reserve stays whole on every share: the capacities add up to the GPU's
    narrowed = replace(gpu, total_memory=gpu.reserved + gpu.capacity // sharers)
    return replace(inventory, devices=(narrowed,))


def node_share(inventory: Inventory, ctx: LaunchContext | None) -> Inventory:
    """This process's share of ``inventory`` under the launch ``ctx`` (everything outside one)."""
    return inventory if ctx is None else share(inventory, ctx.local_rank, ctx.local_size)
