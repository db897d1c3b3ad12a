"""pytest_gpu.machine.placement: examples and hypothesis properties of the pure placement policy.

The properties drive a :class:`Allocator` the way the broker does (after every change, turn
away what :meth:`Allocator.blocked_forever` says can never be placed) and check, with their
own bookkeeping rather than the pool's counters:

1. never over-committed, whatever the sequence of submit / release / forget / contexts;
2. every request that fits is eventually granted once leases are given back;
3. no request is overtaken by more than ``policy.max_bypass`` later requests.
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import shared, whole
from pytest_gpu.base.requests import GpuRequest
from pytest_gpu.machine.placement import (
    Allocator,
    Deadlock,
    GpuState,
    Lease,
    Placement,
    Policy,
    Unsatisfiable,
    Waiting,
    checked_preference,
    place,
)

MiB, GiB = 2**20, 2**30


def granted_keys(leases: list[Lease]) -> list[str]:
    return [lease.key for lease in leases]


# -- Policy ----------------------------------------------------------------------------


def test_context_limit() -> None:
    policy = Policy(overhead=500 * MiB, context_fraction=0.25)
    assert policy.context_limit(16 * GiB) == 8  # 4GiB of contexts at 500MiB each
    assert policy.context_limit(80 * GiB) == 40
    assert policy.context_limit(GiB) == 1  # never below one context
    assert Policy(overhead=0).context_limit(GiB) == 1 << 30


def test_default_policy() -> None:
    assert Policy() == Policy(overhead=500 * MiB, context_fraction=0.25, max_bypass=16)


# -- place(): which GPUs ---------------------------------------------------------------


def gpus(*capacities: int) -> list[GpuState]:
    return [GpuState(i, c) for i, c in enumerate(capacities)]


def test_place_shared_on_empty_gpus_prefers_the_tightest_fit() -> None:
    policy = Policy(overhead=GiB)
    states = gpus(16 * GiB, 8 * GiB, 16 * GiB)
    assert place(states, shared(2 * GiB), "a", policy) == Placement((1,), 2 * GiB, False)


def test_place_returns_none_when_nothing_fits() -> None:
    policy = Policy(overhead=GiB)
    assert place(gpus(4 * GiB), shared(3 * GiB + 1), "a", policy) is None
    assert place(gpus(4 * GiB), shared(3 * GiB), "a", policy) == Placement((0,), 3 * GiB, False)


def test_place_multi_gpu_indices_are_sorted() -> None:
    policy = Policy(overhead=0)
    states = gpus(8 * GiB, 4 * GiB, 2 * GiB, 16 * GiB)
    assert place(states, shared(3 * GiB, count=2), "a", policy) == Placement((0, 1), 3 * GiB, False)


def test_place_exclusive_takes_what_the_contexts_leave() -> None:
    policy = Policy(overhead=GiB, context_fraction=1.0)
    states = gpus(16 * GiB, 16 * GiB)
    states[0].contexts = {"x", "y"}
    # GPU 1 has no other context: 15GiB to give, GPU 0 only 13GiB
    assert place(states, whole(), "a", policy) == Placement((1,), 15 * GiB, True)
    # over two GPUs the lease gives the smaller of the two
    assert place(states, whole(2), "a", policy) == Placement((0, 1), 13 * GiB, True)


def test_place_exclusive_skips_gpus_with_tenants() -> None:
    policy = Policy(overhead=0)
    states = gpus(16 * GiB, 8 * GiB)
    states[0].tenants = 1
    states[0].leased = GiB
    assert place(states, whole(), "a", policy) == Placement((1,), 8 * GiB, True)
    assert place(states, whole(2), "a", policy) is None


def test_place_exclusive_with_a_minimum_only_takes_gpus_that_give_that_much() -> None:
    policy = Policy(overhead=500 * MiB, context_fraction=1.0)
    states = gpus(24 * GiB, 80 * GiB, 24 * GiB, 80 * GiB)
    assert place(states, whole(at_least=40 * GiB), "a", policy) == Placement((1,), 80 * GiB - 500 * MiB, True)
    assert place(states, whole(2, at_least=40 * GiB), "a", policy) == Placement((1, 3), 80 * GiB - 500 * MiB, True)
    assert place(states, whole(3, at_least=40 * GiB), "a", policy) is None
    # the minimum is what the lease gets: other processes' contexts count against it
    states[1].contexts = {"x", "y"}
    assert place(states, whole(at_least=80 * GiB - GiB), "a", policy) == Placement((3,), 80 * GiB - 500 * MiB, True)
    states[3].tenants = 1
    assert place(states, whole(at_least=80 * GiB - GiB), "a", policy) is None


def test_place_shared_skips_exclusive_gpus() -> None:
    policy = Policy(overhead=0)
    states = gpus(16 * GiB, 16 * GiB)
    states[1].exclusive, states[1].tenants = True, 1
    assert place(states, shared(GiB), "a", policy) == Placement((0,), GiB, False)
    assert place(states, shared(GiB, count=2), "a", policy) is None


def test_place_counts_the_clients_own_new_context() -> None:
    policy = Policy(overhead=GiB, context_fraction=1.0)
    states = gpus(4 * GiB)
    states[0].contexts = {"a"}
    assert place(states, shared(3 * GiB), "a", policy) is not None  # a's context is already counted
    assert place(states, shared(3 * GiB), "b", policy) is None  # b would add a second one


# -- affinity --------------------------------------------------------------------------


def test_affinity_client_goes_where_it_has_a_context() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB, 2: 16 * GiB}, Policy(overhead=GiB))
    pool.set_contexts("a", {2})
    assert pool.submit("a/1", "a", shared(GiB))[0].placement.indices == (2,)


def test_affinity_beats_a_tighter_fit() -> None:
    pool = Allocator({0: 4 * GiB, 1: 16 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    pool.set_contexts("a", {1})
    assert pool.submit("a/1", "a", shared(GiB))[0].placement.indices == (1,)


def test_affinity_for_exclusive_requests() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    pool.set_contexts("a", {1})
    pool.set_contexts("b", {0})
    lease = pool.submit("a/1", "a", whole())[0]
    assert lease.placement == Placement((1,), 15 * GiB, True)


def test_affinity_falls_back_when_the_home_gpu_is_full() -> None:
    pool = Allocator({0: 8 * GiB, 1: 8 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    pool.submit("a/1", "a", shared(6 * GiB))  # a's home: GPU 0
    assert pool.leases["a/1"].placement.indices == (0,)
    lease = pool.submit("a/2", "a", shared(2 * GiB))[0]
    assert lease.placement.indices == (1,)
    assert pool.gpus[0].contexts == {"a"}
    assert pool.gpus[1].contexts == {"a"}


def test_worker_home_gpus_spread_and_stick() -> None:
    pool = Allocator({i: 16 * GiB for i in range(4)}, Policy(overhead=500 * MiB))
    homes = {}
    for worker in ("w0", "w1", "w2", "w3"):
        homes[worker] = pool.submit(f"{worker}/1", worker, shared(GiB))[0].placement.indices
    assert sorted(homes.values()) == [(0,), (1,), (2,), (3,)]  # one new context per GPU
    for worker in homes:
        pool.release(f"{worker}/1")
    for round_ in range(2, 5):
        for worker in ("w3", "w1", "w0", "w2"):
            lease = pool.submit(f"{worker}/{round_}", worker, shared(GiB))[0]
            assert lease.placement.indices == homes[worker]
            pool.release(lease.key)
    assert all(len(gpu.contexts) == 1 for gpu in pool.gpus.values())


def test_release_with_reported_contexts_replaces_the_assumed_ones() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", shared(GiB, count=2))
    assert {i for i, g in pool.gpus.items() if "a" in g.contexts} == {0, 1}
    pool.release("a/1", contexts={1})
    assert {i for i, g in pool.gpus.items() if "a" in g.contexts} == {1}
    assert pool.used(0) == 0
    assert pool.used(1) == GiB


def test_set_contexts_keeps_the_gpus_a_client_holds() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", shared(GiB))
    held = pool.leases["a/1"].placement.indices[0]
    pool.set_contexts("a", set())
    assert "a" in pool.gpus[held].contexts


# -- the soft context budget -----------------------------------------------------------


def test_context_budget_makes_a_request_wait_for_a_gpu_with_room_for_contexts() -> None:
    # 8GiB GPUs, 1GiB contexts, budget 25% -> at most 2 contexts per GPU when it can be helped
    pool = Allocator({0: 8 * GiB, 1: 8 * GiB}, Policy(overhead=GiB, context_fraction=0.25))
    assert pool.policy.context_limit(8 * GiB) == 2
    assert pool.submit("a/1", "a", shared(GiB))[0].placement.indices == (0,)
    assert pool.submit("b/1", "b", shared(6 * GiB))[0].placement.indices == (1,)  # new contexts spread
    assert pool.submit("c/1", "c", shared(GiB))[0].placement.indices == (0,)  # GPU 1 is full
    # GPU 0 has room (8 - 2 leased - 3 contexts = 3GiB) but already 2 contexts; GPU 1 will have room
    assert pool.submit("d/1", "d", shared(GiB)) == []
    assert [w.key for w in pool.queue] == ["d/1"]
    granted = pool.release("b/1")
    assert [(lease.key, lease.placement.indices) for lease in granted] == [("d/1", (1,))]


def test_context_budget_is_soft_when_it_can_never_be_met() -> None:
    pool = Allocator({0: 8 * GiB, 1: 8 * GiB}, Policy(overhead=GiB, context_fraction=0.25))
    for client in "abcd":
        pool.submit(f"{client}/1", client, shared(GiB))
    assert all(len(gpu.contexts) == 2 for gpu in pool.gpus.values())
    # no GPU can take a new context within the budget even when drained: placed by capacity
    granted = pool.submit("e/1", "e", shared(GiB))
    assert granted_keys(granted) == ["e/1"]
    assert len(pool.gpus[granted[0].placement.indices[0]].contexts) == 3


def test_context_budget_never_applies_to_a_client_with_a_context() -> None:
    pool = Allocator({0: 8 * GiB}, Policy(overhead=GiB, context_fraction=0.25))
    pool.set_contexts("a", {0})
    pool.set_contexts("b", {0})
    assert granted_keys(pool.submit("a/1", "a", shared(GiB))) == ["a/1"]


# -- never_fits / blocked_forever / Unsatisfiable --------------------------------------


def test_never_fits_too_many_gpus() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=500 * MiB))
    assert pool.never_fits(whole(3)) == (
        "needs 3 GPUs (whole GPU each) but the inventory has 2 GPU(s) [16GiB, 16GiB] "
        "with 500MiB of context overhead each"
    )
    assert pool.never_fits(whole(2)) is None


def test_never_fits_too_much_memory() -> None:
    pool = Allocator({0: 16 * GiB, 1: 24 * GiB}, Policy(overhead=GiB))
    assert pool.never_fits(shared(23 * GiB)) is None
    assert pool.never_fits(shared(23 * GiB + 1)) == (
        "needs 1 GPU (23GiB) but the inventory has 2 GPU(s) [16GiB, 24GiB] with 1GiB of context overhead each"
    )
    assert pool.never_fits(shared(15 * GiB, count=2)) is None
    assert pool.never_fits(shared(16 * GiB, count=2)) == (
        "needs 2 GPUs (16GiB each) but the inventory has 2 GPU(s) [16GiB, 24GiB] with 1GiB of context overhead each"
    )


def test_never_fits_exclusive_with_a_minimum() -> None:
    pool = Allocator({0: 80 * GiB, 1: 80 * GiB, 2: 24 * GiB, 3: 24 * GiB}, Policy(overhead=500 * MiB))
    assert pool.never_fits(whole(2, at_least=40 * GiB)) is None
    assert pool.never_fits(whole(at_least=80 * GiB - 500 * MiB)) is None
    assert pool.never_fits(whole(at_least=80 * GiB - 500 * MiB + 1)) is not None
    assert pool.never_fits(whole(3, at_least=40 * GiB)) == (
        "needs 3 GPUs (whole GPU of at least 40GiB each) but the inventory has 4 GPU(s) "
        "[80GiB, 80GiB, 24GiB, 24GiB] with 500MiB of context overhead each"
    )


def test_never_fits_without_gpus() -> None:
    pool = Allocator({}, Policy(overhead=500 * MiB))
    assert pool.never_fits(whole()) == (
        "needs 1 GPU (whole GPU) but the inventory has 0 GPU(s) [none] with 500MiB of context overhead each"
    )


def test_never_fits_when_the_context_fills_the_gpu() -> None:
    pool = Allocator({0: GiB}, Policy(overhead=GiB))
    assert pool.never_fits(whole()) is not None
    assert pool.never_fits(shared(1)) is not None


def test_never_fits_ignores_current_leases_and_contexts() -> None:
    pool = Allocator({0: 4 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    pool.submit("a/1", "a", whole())
    pool.set_contexts("b", {0})
    assert pool.never_fits(shared(3 * GiB)) is None


def test_submit_raises_unsatisfiable_and_queues_nothing() -> None:
    pool = Allocator({0: 16 * GiB}, Policy(overhead=500 * MiB))
    with pytest.raises(Unsatisfiable) as info:
        pool.submit("a/1", "a", whole(2))
    assert str(info.value) == (
        "needs 2 GPUs (whole GPU each) but the inventory has 1 GPU(s) [16GiB] with 500MiB of context overhead each"
    )
    assert pool.queue == []
    assert pool.leases == {}


def _crowded_pool() -> Allocator:
    """One 4GiB GPU with 1GiB contexts, three other clients keeping theirs open."""
    pool = Allocator({0: 4 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    for client in "abc":
        pool.submit(f"{client}/1", client, shared(512 * MiB))
        pool.release(f"{client}/1")
    assert pool.gpus[0].contexts == {"a", "b", "c"}
    return pool


def test_blocked_forever_explains_the_contexts() -> None:
    pool = _crowded_pool()
    assert pool.submit("d/1", "d", shared(2 * GiB)) == []  # fits an empty GPU: queued, not refused
    (waiting,) = pool.queue
    assert pool.blocked_forever(waiting) == (
        "1 GPU (2GiB) cannot fit beside the CUDA contexts that other processes keep open "
        "(GPU 0: 3; 1GiB each). Use fewer workers, or lower --gpu-context-overhead if contexts "
        "are smaller on this machine"
    )


def test_blocked_forever_is_none_when_leases_are_in_the_way() -> None:
    pool = Allocator({0: 4 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", whole())
    pool.submit("b/1", "b", shared(2 * GiB))
    (waiting,) = pool.queue
    assert pool.blocked_forever(waiting) is None


def test_a_blocked_request_is_granted_once_contexts_go_away() -> None:
    pool = _crowded_pool()
    pool.submit("d/1", "d", shared(2 * GiB))
    held, granted = pool.forget_client("a")
    assert (held, granted) == ([], [])  # 4 - 2 contexts (b, c) - d's own = 1GiB: still too little
    held, granted = pool.forget_client("b")
    assert held == []
    assert granted_keys(granted) == ["d/1"]


def test_set_contexts_then_serve_grants() -> None:
    pool = _crowded_pool()
    pool.submit("d/1", "d", shared(2 * GiB))
    pool.set_contexts("a", set())
    pool.set_contexts("b", set())
    assert granted_keys(pool.serve()) == ["d/1"]


# -- hold-and-wait: deadlock() ----------------------------------------------------------


def _fixtures_on_two_gpus() -> Allocator:
    """The migration guide's cycle: two workers' module-scoped models (6GiB each) spread
    over two 16GiB GPUs, both workers about to ask for a whole GPU for a test of the module."""
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=500 * MiB))
    assert [g.placement.indices for g in pool.submit("gw0/model", "gw0", shared(6 * GiB))] == [(0,)]
    assert [g.placement.indices for g in pool.submit("gw1/model", "gw1", shared(6 * GiB))] == [(1,)]  # spread
    return pool


def test_deadlock_two_workers_each_holding_what_the_other_waits_for() -> None:
    pool = _fixtures_on_two_gpus()
    assert pool.submit("gw0/full", "gw0", whole()) == []
    assert pool.deadlock() is None  # gw1 does not wait: its model goes back once it leaves its module
    assert pool.submit("gw1/full", "gw1", whole()) == []
    deadlock = pool.deadlock()
    assert deadlock is not None
    assert [w.key for w in deadlock.waiting] == ["gw0/full", "gw1/full"]
    assert [lease.key for lease in deadlock.held] == ["gw0/model", "gw1/model"]
    assert deadlock.victim.key == "gw1/full"  # the request that closed the cycle
    # refused, gw1's test gives up and its module ends: gw0 gets gw1's GPU
    assert pool.cancel("gw1/full")
    assert pool.deadlock() is None
    assert granted_keys(pool.release("gw1/model")) == ["gw0/full"]


def test_deadlock_of_one_worker_with_itself() -> None:
    pool = Allocator({0: 16 * GiB}, Policy(overhead=500 * MiB))
    pool.submit("gw0/model", "gw0", shared(6 * GiB))
    pool.submit("gw0/full", "gw0", whole())  # its own model is in the way, and stays while it waits
    deadlock = pool.deadlock()
    assert deadlock is not None and deadlock.victim.key == "gw0/full"
    assert pool.blocked_forever(deadlock.victim) is None  # not the contexts: the lease it holds itself


def test_no_deadlock_while_a_holder_does_not_wait() -> None:
    pool = _fixtures_on_two_gpus()
    # gw2 runs beside gw0's model and waits for nothing
    assert [g.placement.indices for g in pool.submit("gw2/x", "gw2", shared(8 * GiB))] == [(0,)]
    pool.submit("gw0/full", "gw0", whole())
    pool.submit("gw1/both", "gw1", shared(4 * GiB, count=2))  # GPU 0 has room once gw2 is done
    assert pool.deadlock() is None
    assert granted_keys(pool.release("gw2/x", contexts=set())) == ["gw1/both"]


def test_a_request_waiting_behind_the_cycle_is_named_but_not_refused() -> None:
    pool = _fixtures_on_two_gpus()
    pool.submit("gw0/full", "gw0", whole())
    pool.submit("gw1/full", "gw1", whole())
    pool.submit("gw2/full", "gw2", whole())  # holds nothing: refusing it would free nothing
    deadlock = pool.deadlock()
    assert deadlock is not None
    assert [w.key for w in deadlock.waiting] == ["gw0/full", "gw1/full", "gw2/full"]
    assert deadlock.victim.key == "gw1/full"


def test_no_deadlock_where_foreign_usage_or_exiting_contexts_are_in_the_way() -> None:
    pool = Allocator({0: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("gw0/model", "gw0", shared(4 * GiB))
    pool.set_foreign({0: 10 * GiB})
    pool.submit("gw0/more", "gw0", shared(4 * GiB))  # 4 + 4 + 10 + 1 > 16: waits for the foreign process
    assert pool.deadlock() is None
    pool.set_foreign({})
    pool.set_contexts("gone~exiting", {0})
    pool.exiting.add("gone~exiting")
    assert pool.deadlock() is None


def test_no_deadlock_while_paused_or_for_a_client_with_several_waits() -> None:
    pool = _fixtures_on_two_gpus()
    pool.submit("gw0/full", "gw0", whole())
    pool.submit("gw1/full", "gw1", whole())
    pool.paused = True  # a new arbiter waits for the runs that held leases: their leases may go
    assert pool.deadlock() is None
    pool.paused = False
    pool.submit("gw1/again", "gw1", whole())  # not a worker that waits for one thing at a time
    assert pool.deadlock() is None


def test_deadlock_counts_the_host_resources_waiting_clients_hold() -> None:
    pool = Allocator({0: 16 * GiB}, Policy(overhead=0))
    pool.set_host(8, 64 * GiB)
    cpus = GpuRequest(count=0, memory=None, exclusive=False, cpus=6)
    pool.submit("gw0/cpus", "gw0", cpus)
    pool.submit("gw1/cpus", "gw1", cpus)  # waits for gw0's CPUs
    assert pool.deadlock() is None  # gw0 does not wait
    pool.submit("gw0/more", "gw0", GpuRequest(count=0, memory=None, exclusive=False, cpus=4))
    deadlock = pool.deadlock()
    assert deadlock is not None and deadlock.victim.key == "gw0/more"


# -- queue, release, cancel, forget ----------------------------------------------------


def test_queued_then_granted_on_release() -> None:
    pool = Allocator({0: 16 * GiB}, Policy(overhead=GiB))
    assert granted_keys(pool.submit("a/1", "a", whole())) == ["a/1"]
    assert pool.submit("b/1", "b", whole()) == []
    assert [w.key for w in pool.queue] == ["b/1"]
    granted = pool.release("a/1")
    assert granted_keys(granted) == ["b/1"]
    # a keeps its context: b's exclusive lease gets what is left beside both contexts
    assert granted[0].placement == Placement((0,), 14 * GiB, True)
    assert pool.queue == []


def test_release_unknown_key_is_harmless() -> None:
    pool = Allocator({0: 16 * GiB})
    assert pool.release("nobody/1") == []


def test_cancel() -> None:
    pool = Allocator({0: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", whole())
    pool.submit("b/1", "b", whole())
    assert pool.cancel("b/1") is True
    assert pool.cancel("b/1") is False
    assert pool.cancel("a/1") is False  # granted, not waiting
    assert pool.release("a/1") == []


def test_forget_client_returns_its_leases_and_grants_the_waiting() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("dead/1", "dead", whole(2))
    pool.submit("dead/2", "dead", shared(GiB))  # queued, dropped with its client
    pool.submit("b/1", "b", whole())
    pool.submit("c/1", "c", shared(4 * GiB))
    held, granted = pool.forget_client("dead")
    assert granted_keys(held) == ["dead/1"]
    assert sorted(granted_keys(granted)) == ["b/1", "c/1"]
    assert pool.queue == []
    assert all("dead" not in gpu.contexts for gpu in pool.gpus.values())
    # the dead client's context is gone: the exclusive lease gets all but its own context
    assert pool.leases["b/1"].placement.memory == 15 * GiB


def test_forget_client_with_several_leases_grants_everything_that_fits() -> None:
    pool = Allocator({0: 8 * GiB, 1: 8 * GiB}, Policy(overhead=0))
    pool.submit("dead/1", "dead", whole())
    pool.submit("dead/2", "dead", whole())
    pool.submit("x/1", "x", whole())
    pool.submit("y/1", "y", whole())
    held, granted = pool.forget_client("dead")
    assert sorted(granted_keys(held)) == ["dead/1", "dead/2"]
    assert sorted(granted_keys(granted)) == ["x/1", "y/1"]
    assert sorted(pool.leases) == ["x/1", "y/1"]


def test_holders() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", whole())
    pool.submit("b/1", "b", whole())
    by_gpu = {lease.placement.indices[0]: lease.key for lease in pool.holders()}
    assert sorted(by_gpu.values()) == ["a/1", "b/1"]
    assert [lease.key for lease in pool.holders([0])] == [by_gpu[0]]
    assert pool.holders([]) == []


def test_used_counts_leases_exclusive_grants_and_contexts() -> None:
    pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    pool.submit("a/1", "a", shared(3 * GiB))
    pool.submit("b/1", "b", shared(2 * GiB))  # new context spreads to GPU 1
    pool.submit("c/1", "c", shared(GiB))
    a, b, c = (pool.leases[k].placement.indices[0] for k in ("a/1", "b/1", "c/1"))
    assert (a, b) == (0, 1)
    expected = {0: 3 * GiB + GiB, 1: 2 * GiB + GiB}
    expected[c] += GiB + GiB
    assert {i: pool.used(i) for i in (0, 1)} == expected
    pool.release("a/1")
    pool.release("b/1")
    pool.release("c/1")
    pool.submit("d/1", "d", whole())
    d = pool.leases["d/1"].placement
    assert pool.used(d.indices[0]) == 16 * GiB


# -- fairness: examples ----------------------------------------------------------------


def test_backfill_is_bounded_by_max_bypass() -> None:
    pool = Allocator({0: 8 * GiB}, Policy(overhead=0, max_bypass=2))
    pool.submit("a/1", "a", shared(2 * GiB))
    assert pool.submit("big/1", "big", whole()) == []
    assert granted_keys(pool.submit("s/1", "s1", shared(GiB))) == ["s/1"]  # backfill 1
    assert granted_keys(pool.submit("s/2", "s2", shared(GiB))) == ["s/2"]  # backfill 2
    assert pool.queue[0].bypassed == 2
    assert pool.submit("s/3", "s3", shared(GiB)) == []  # it would fit, but big has waited enough
    assert [(w.key, w.bypassed) for w in pool.queue] == [("big/1", 2), ("s/3", 0)]
    assert pool.release("a/1") == []
    assert pool.release("s/1") == []
    assert granted_keys(pool.release("s/2")) == ["big/1"]
    assert granted_keys(pool.release("big/1")) == ["s/3"]


def test_max_bypass_zero_is_strict_fifo() -> None:
    pool = Allocator({0: 8 * GiB}, Policy(overhead=0, max_bypass=0))
    pool.submit("a/1", "a", shared(GiB))
    pool.submit("big/1", "big", whole())
    assert pool.submit("s/1", "s", shared(GiB)) == []
    assert granted_keys(pool.release("a/1")) == ["big/1"]


def test_in_order_grants_do_not_count_as_bypass() -> None:
    pool = Allocator({0: 8 * GiB}, Policy(overhead=0, max_bypass=1))
    pool.submit("a/1", "a", whole())
    for i in range(3):
        pool.submit(f"q/{i}", f"q{i}", shared(GiB))
    assert granted_keys(pool.release("a/1")) == ["q/0", "q/1", "q/2"]


# -- properties ------------------------------------------------------------------------


@dataclass
class Driver:
    """Drives a pool as the broker does, keeping its own books of arrival and grant order."""

    pool: Allocator
    arrival: dict[str, int] = field(default_factory=dict)
    granted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    withdrawn: set[str] = field(default_factory=set)
    overtaken: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    unsatisfiable: int = 0

    def _apply(self, granted: list[Lease], waiting_before: list[str]) -> None:
        """Record grants in order: each one overtakes every earlier arrival still waiting."""
        still_waiting = [k for k in waiting_before if k in self.arrival]
        for lease in granted:
            assert lease.key not in self.granted, f"{lease.key} granted twice"
            for key in still_waiting:
                if self.arrival[key] < self.arrival[lease.key] and key not in self.granted:
                    self.overtaken[key].add(lease.key)
            self.granted.append(lease.key)
        # then, like the broker, turn away what can never be placed
        for waiting in list(self.pool.queue):
            reason = self.pool.blocked_forever(waiting)
            if reason:
                assert self.pool.cancel(waiting.key)
                self.rejected[waiting.key] = reason

    def _queued(self) -> list[str]:
        return [w.key for w in self.pool.queue]

    def submit(self, client: str, request: GpuRequest) -> None:
        key = f"{client}/r{len(self.arrival)}"
        before = self._queued()
        try:
            granted = self.pool.submit(key, client, request)
        except Unsatisfiable as exc:
            assert self.pool.never_fits(request) == str(exc)
            self.unsatisfiable += 1
            return
        self.arrival[key] = len(self.arrival)
        self._apply(granted, [*before, key])

    def release(self, key: str, contexts: set[int] | None = None) -> None:
        before = self._queued()
        self._apply(self.pool.release(key, contexts), before)

    def forget(self, client: str) -> None:
        gone = {w.key for w in self.pool.queue if w.client == client}
        self.withdrawn |= gone
        before = [k for k in self._queued() if k not in gone]
        held, granted = self.pool.forget_client(client)
        assert all(lease.client == client for lease in held)
        assert all(lease.client != client for lease in self.pool.leases.values())
        self._apply(granted, before)

    def report_contexts(self, client: str, contexts: set[int]) -> None:
        before = self._queued()
        self.pool.set_contexts(client, contexts)
        self._apply(self.pool.serve(), before)

    def cancel(self, key: str) -> None:
        assert self.pool.cancel(key)
        self.withdrawn.add(key)

    def contexts_of(self, client: str) -> list[int]:
        return sorted(i for i, gpu in self.pool.gpus.items() if client in gpu.contexts)


def check_never_overcommitted(pool: Allocator) -> None:
    for index, gpu in pool.gpus.items():
        on_gpu = [lease for lease in pool.leases.values() if index in lease.placement.indices]
        shared_bytes = sum(lease.placement.memory for lease in on_gpu if not lease.placement.exclusive)
        exclusive = [lease for lease in on_gpu if lease.placement.exclusive]
        # our own sum, not only the pool's
        committed = shared_bytes + len(gpu.contexts) * pool.policy.overhead
        committed += sum(lease.placement.memory for lease in exclusive)
        assert pool.used(index) == committed
        assert committed <= gpu.capacity, f"GPU {index} over-committed: {committed} > {gpu.capacity}"
        assert gpu.tenants == len(on_gpu)
        assert gpu.leased == shared_bytes
        assert gpu.exclusive == bool(exclusive)
        if exclusive:
            assert len(on_gpu) == 1, f"exclusive GPU {index} has {len(on_gpu)} tenants"
        for lease in on_gpu:
            assert lease.client in gpu.contexts  # a lease holder has a context where it holds
    for lease in pool.leases.values():
        indices = lease.placement.indices
        assert len(indices) == lease.request.count == len(set(indices))
        assert lease.placement.exclusive == lease.request.exclusive
        if lease.request.exclusive:
            assert lease.placement.memory > 0
            assert lease.placement.memory >= (lease.request.min_memory or 0)
        else:
            assert lease.placement.memory == lease.request.memory


def check_fairness(driver: Driver) -> None:
    limit = driver.pool.policy.max_bypass
    for key, overtakers in driver.overtaken.items():
        assert len(overtakers) <= limit, f"{key} overtaken by {sorted(overtakers)} (max_bypass={limit})"
    for waiting in driver.pool.queue:
        assert waiting.bypassed == len(driver.overtaken.get(waiting.key, ()))


def check_no_idle_wait(pool: Allocator) -> None:
    """Nothing waits while nothing is leased: a waiting request always waits *for* a lease."""
    if not pool.leases:
        assert pool.queue == [], f"waiting with no lease out: {[w.key for w in pool.queue]}"


CLIENTS = [f"c{i}" for i in range(5)]

policies = st.builds(
    Policy,
    overhead=st.sampled_from([0, 256 * MiB, 512 * MiB, GiB]),
    context_fraction=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    max_bypass=st.integers(0, 4),
)
capacities = st.lists(st.sampled_from([2 * GiB, 4 * GiB, 8 * GiB, 16 * GiB]), min_size=1, max_size=4).map(
    lambda sizes: dict(enumerate(sizes))
)
gpu_requests = st.one_of(
    st.builds(whole, count=st.integers(1, 3)),
    st.builds(whole, count=st.integers(1, 3), at_least=st.integers(1, 32).map(lambda k: k * 512 * MiB)),
    st.builds(shared, memory=st.integers(1, 24).map(lambda k: k * 512 * MiB), count=st.integers(1, 3)),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(CLIENTS), gpu_requests),
        st.tuples(st.just("submit"), st.sampled_from(CLIENTS), gpu_requests),
        st.tuples(st.just("release"), st.integers(0, 1000), st.integers(-1, 15)),
        st.tuples(st.just("release"), st.integers(0, 1000), st.integers(-1, 15)),
        st.tuples(st.just("forget"), st.sampled_from(CLIENTS)),
        st.tuples(st.just("contexts"), st.sampled_from(CLIENTS), st.integers(0, 15)),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
    ),
    max_size=40,
)


# mostly arrivals, few departures: long queues, where backfill and its bound matter
busy_operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(CLIENTS), gpu_requests),
        st.tuples(st.just("submit"), st.sampled_from(CLIENTS), gpu_requests),
        st.tuples(st.just("submit"), st.sampled_from(CLIENTS), gpu_requests),
        st.tuples(st.just("release"), st.integers(0, 1000), st.just(-1)),
    ),
    max_size=40,
)


def subset(items: list[int], mask: int) -> set[int]:
    return {item for bit, item in enumerate(items) if mask >> bit & 1}


def run_operations(driver: Driver, ops: list[tuple], after_each=None) -> None:  # type: ignore[no-untyped-def]
    for op in ops:
        kind = op[0]
        if kind == "submit":
            driver.submit(op[1], op[2])
        elif kind == "release" and driver.pool.leases:
            keys = sorted(driver.pool.leases)
            key = keys[op[1] % len(keys)]
            client = driver.pool.leases[key].client
            # the client reports where it really has contexts: some of those it is known to have
            contexts = None if op[2] < 0 else subset(driver.contexts_of(client), op[2])
            driver.release(key, contexts)
        elif kind == "forget":
            driver.forget(op[1])
        elif kind == "contexts":
            driver.report_contexts(op[1], subset(driver.contexts_of(op[1]), op[2]))
        elif kind == "cancel" and driver.pool.queue:
            driver.cancel(driver.pool.queue[op[1] % len(driver.pool.queue)].key)
        if after_each is not None:
            after_each(driver)


def check_all(driver: Driver) -> None:
    check_never_overcommitted(driver.pool)
    check_fairness(driver)
    check_no_idle_wait(driver.pool)


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(caps=capacities, policy=policies, ops=operations)
def test_property_never_overcommitted(caps: dict[int, int], policy: Policy, ops: list[tuple]) -> None:
    driver = Driver(Allocator(caps, policy))
    check_never_overcommitted(driver.pool)
    run_operations(driver, ops, after_each=lambda d: check_never_overcommitted(d.pool))


@PROPERTY
@given(caps=capacities, policy=policies, ops=operations, seed=st.integers(0, 2**32 - 1))
def test_property_every_request_that_fits_is_granted(
    caps: dict[int, int], policy: Policy, ops: list[tuple], seed: int
) -> None:
    driver = Driver(Allocator(caps, policy))
    run_operations(driver, ops, after_each=check_all)
    # give every lease back, in random order, until nothing is left
    rng = random.Random(seed)
    while driver.pool.leases:
        driver.release(rng.choice(sorted(driver.pool.leases)))
        check_all(driver)
    assert driver.pool.queue == []
    submitted = set(driver.arrival)
    assert submitted == set(driver.granted) | set(driver.rejected) | driver.withdrawn
    assert len(driver.granted) == len(set(driver.granted))
    for key, reason in driver.rejected.items():
        assert key not in driver.granted
        assert "cannot fit beside the CUDA contexts" in reason


@PROPERTY
@given(caps=capacities, policy=policies, ops=busy_operations, seed=st.integers(0, 2**32 - 1))
def test_property_fairness_bound(caps: dict[int, int], policy: Policy, ops: list[tuple], seed: int) -> None:
    driver = Driver(Allocator(caps, policy))
    run_operations(driver, ops, after_each=check_fairness)
    rng = random.Random(seed)
    while driver.pool.leases:
        driver.release(rng.choice(sorted(driver.pool.leases)))
        check_fairness(driver)
    # the bound from arrival and grant order alone
    position = {key: i for i, key in enumerate(driver.granted)}
    for key in driver.granted:
        later_first = [
            other
            for other in driver.granted
            if driver.arrival[other] > driver.arrival[key] and position[other] < position[key]
        ]
        assert len(later_first) <= policy.max_bypass, f"{key} overtaken by {later_first}"


@PROPERTY
@given(
    caps=capacities,
    requests=st.lists(st.tuples(st.sampled_from(CLIENTS), gpu_requests), min_size=1, max_size=30),
    policy=policies,
    seed=st.integers(0, 2**32 - 1),
)
def test_property_burst_then_drain(
    caps: dict[int, int], requests: list[tuple[str, GpuRequest]], policy: Policy, seed: int
) -> None:
    """Many requests at once, then leases come back in random order: everything is served."""
    driver = Driver(Allocator(caps, policy))
    for client, request in requests:
        driver.submit(client, request)
        check_all(driver)
    assert driver.unsatisfiable + len(driver.arrival) == len(requests)
    rng = random.Random(seed)
    while driver.pool.leases:
        driver.release(rng.choice(sorted(driver.pool.leases)))
        check_all(driver)
    assert driver.pool.queue == []
    assert set(driver.granted) | set(driver.rejected) == set(driver.arrival)
    if policy.overhead == 0:
        assert driver.rejected == {}  # without contexts nothing can block a request that fits


@settings(max_examples=100, deadline=None)
@given(caps=capacities, policy=policies, request=gpu_requests)
def test_property_never_fits_agrees_with_an_empty_pool(
    caps: dict[int, int], policy: Policy, request: GpuRequest
) -> None:
    pool = Allocator(caps, policy)
    fits_empty = place(list(Allocator(caps, policy).gpus.values()), request, "x", policy, within_budget=False)
    assert (pool.never_fits(request) is None) == (fits_empty is not None)
    if fits_empty is not None:
        granted = pool.submit("x/1", "x", request)
        assert granted_keys(granted) == ["x/1"]  # a request that fits an empty pool is granted at once


# -- hold-and-wait: deadlock() against clients that behave like workers ----------------------


@dataclass
class Workers:
    """Drives a pool as the arbiter does, with clients that behave as workers do: one wait at
    a time, nothing given back while waiting (a fixture's lease stays while its test waits)."""

    pool: Allocator
    rng: random.Random
    refused: list[str] = field(default_factory=list)

    def waits(self, client: str) -> bool:
        return any(w.client == client for w in self.pool.queue)

    def settle(self) -> None:
        """After every change, as the arbiter does: refuse what can never be placed, then
        the victim of a deadlock (after checking it is one), and serve again."""
        while True:
            hopeless = [w.key for w in self.pool.queue if self.pool.blocked_forever(w)]
            for key in hopeless:
                self.pool.cancel(key)
            if not hopeless:
                deadlock = self.pool.deadlock()
                if deadlock is None:
                    return
                check_stuck(self.pool, deadlock, self.rng)
                assert self.pool.cancel(deadlock.victim.key)
                self.refused.append(deadlock.victim.key)
            self.pool.serve()

    def holding(self) -> list[str]:
        """Clients that do not wait and hold a lease or a context: they may give it back."""
        clients = {lease.client for lease in self.pool.leases.values()}
        clients |= {c for gpu in self.pool.gpus.values() for c in gpu.contexts}
        return sorted(c for c in clients if not self.waits(c))


def check_stuck(pool: Allocator, deadlock: Deadlock, rng: random.Random) -> None:
    """Whatever order the others give everything back in (every client that does not wait,
    then every client served), the deadlock's requests are never served: on a copy."""
    fork = copy.deepcopy(pool)
    fork.set_foreign({})
    granted = {lease.key for lease in fork.serve()}
    while True:
        movers = Workers(fork, rng).holding()
        if not movers:
            break
        granted |= {lease.key for lease in fork.forget_client(rng.choice(movers))[1]}
    assert not granted & {w.key for w in deadlock.waiting}, "a request named in a deadlock was served"
    assert deadlock.victim in deadlock.waiting
    victims = [w for w in deadlock.waiting if any(lease.client == w.client for lease in deadlock.held)]
    assert deadlock.victim == (victims or list(deadlock.waiting))[-1]


# few workers, mostly asking: they come to hold leases while they wait
WORKERS = CLIENTS[:3]
worker_operations = st.lists(
    st.one_of(
        *[st.tuples(st.just("submit"), st.sampled_from(WORKERS), gpu_requests)] * 4,
        st.tuples(st.just("release"), st.integers(0, 1000), st.integers(-1, 15)),
        st.tuples(st.just("forget"), st.sampled_from(WORKERS)),
        st.tuples(st.just("contexts"), st.sampled_from(WORKERS), st.integers(0, 15)),
    ),
    min_size=4,
    max_size=40,
)


@PROPERTY
@given(
    caps=capacities,
    policy=policies,
    unbounded=st.booleans(),
    ops=worker_operations,
    seed=st.integers(0, 2**32 - 1),
)
def test_property_deadlocks_are_real_and_none_is_missed(
    caps: dict[int, int], policy: Policy, unbounded: bool, ops: list[tuple], seed: int
) -> None:
    """Every deadlock named is one (no order of the others giving back serves its requests),
    and, once every client that does not wait has given everything back, nothing waits: what
    was stuck was refused, as a deadlock or as never fitting. (The bypass bound can keep a
    request that would be served behind one that waits for its client: such a wait is not
    named, so the drain is checked without the bound.)"""
    if unbounded:
        policy = Policy(policy.overhead, policy.context_fraction, max_bypass=10_000)
    rng = random.Random(seed)
    workers = Workers(Allocator(caps, policy), rng)
    pool = workers.pool
    for n, op in enumerate(ops):
        kind = op[0]
        if kind == "submit" and not workers.waits(op[1]):
            try:
                pool.submit(f"{op[1]}/r{n}", op[1], op[2])
            except Unsatisfiable:
                continue
        elif kind == "release":
            keys = sorted(k for k, lease in pool.leases.items() if not workers.waits(lease.client))
            if not keys:
                continue
            key = keys[op[1] % len(keys)]
            client = pool.leases[key].client
            mine = sorted(i for i, gpu in pool.gpus.items() if client in gpu.contexts)
            pool.release(key, None if op[2] < 0 else subset(mine, op[2]))
        elif kind == "forget":  # a crash: everything goes back, waiting or not
            pool.forget_client(op[1])
        elif kind == "contexts" and not workers.waits(op[1]):
            mine = sorted(i for i, gpu in pool.gpus.items() if op[1] in gpu.contexts)
            pool.set_contexts(op[1], subset(mine, op[2]))
            pool.serve()
        workers.settle()
        check_never_overcommitted(pool)
    while movers := workers.holding():
        pool.forget_client(rng.choice(movers))  # a worker leaves: its leases and its contexts go
        workers.settle()
    event(f"deadlocks refused: {min(len(workers.refused), 3)}")
    if unbounded:
        assert pool.queue == [], [w.key for w in pool.queue]


def test_waiting_dataclass_defaults() -> None:
    assert Waiting("k", "c", whole()).bypassed == 0


# -- preferences -----------------------------------------------------------------------


def test_a_preference_is_honoured_where_the_request_fits_now() -> None:
    policy = Policy(overhead=0)
    gpus = [GpuState(0, 16 * GiB), GpuState(1, 16 * GiB, leased=12 * GiB, tenants=1), GpuState(2, 16 * GiB)]
    small = shared(1 * GiB)
    assert place(gpus, small, "c", policy).indices == (0,)  # its own rule: an idle GPU
    assert place(gpus, small, "c", policy, prefer=(1,)).indices == (1,)  # the scheduler's plan
    assert place(gpus, small, "c", policy, prefer=(2,)).indices == (2,)
    assert place(gpus, shared(5 * GiB), "c", policy, prefer=(1,)).indices == (0,)  # no room there: own rule
    assert place(gpus, whole(), "c", policy, prefer=(1,)).indices == (0,)  # a tenant there: own rule
    assert place(gpus, whole(2), "c", policy, prefer=(0, 2)).indices == (0, 2)
    assert place(gpus, shared(GiB, 2), "c", policy, prefer=(0, 2)).indices == (0, 2)
    assert place(gpus, shared(GiB, 2), "c", policy, prefer=(0, 1)).indices == (0, 1)
    assert place(gpus, shared(5 * GiB, 2), "c", policy, prefer=(0, 1)).indices == (0, 2)  # half fits: own rule


def test_a_preference_never_makes_a_request_wait_or_keeps_a_gpu() -> None:
    allocator = Allocator({0: 16 * GiB, 1: 16 * GiB}, Policy(overhead=0))
    allocator.submit("a", "c1", shared(12 * GiB), prefer=(0,))
    [lease] = allocator.submit("b", "c2", shared(8 * GiB), prefer=(0,))  # GPU 0 is full: granted on 1 at once
    assert lease.placement.indices == (1,)
    assert allocator.submit("c", "c3", shared(9 * GiB), prefer=(1,)) == []  # waits: no GPU has 9 free
    released = allocator.release("a")
    assert [(x.key, x.placement.indices) for x in released] == [("c", (0,))]  # a waiting preference, served anyway


def test_a_preference_from_another_process_is_checked() -> None:
    two = shared(GiB, 2)
    assert checked_preference(None, two, None) == (None, None)
    assert checked_preference([2, 0], two, frozenset({0, 1, 2})) == ((0, 2), None)
    for bad, why in [([0], "for a request of 2"), ([0, 0], "for a request of 2"), ([0, 5], "[5] the run cannot see")]:
        kept, reason = checked_preference(bad, two, frozenset({0, 1, 2}))
        assert kept is None and reason is not None and why in reason
    assert checked_preference([0], GpuRequest(count=0, memory=None, exclusive=False, cpus=1), None)[0] is None
