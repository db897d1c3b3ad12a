"""pytest_gpu.machine.placement: spread compute, pack memory.

A shared lease goes to an idle GPU (no lease) where one has room for it and the context it
opens there within the budget; it is packed beside others only where memory or contexts leave
none; among busy GPUs a client's context GPU comes first, then the least loaded. The rule
before (``Policy(spread=False)``: a client's context GPUs first, busy or not) stays for the
makespan bench: each example checks the two disagree where the new rule matters.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import shared, whole
from pytest_gpu.machine.placement import Allocator, GpuState, Policy, place

MiB, GiB = 2**20, 2**30
SPREAD = Policy(overhead=500 * MiB)
AFFINITY = Policy(overhead=500 * MiB, spread=False)


def busy(index: int, capacity: int, *clients: str, leased: int = 4 * GiB) -> GpuState:
    """A GPU where ``clients`` have contexts and one lease of ``leased`` bytes runs."""
    return GpuState(index, capacity, leased=leased, tenants=1, contexts=set(clients))


def test_an_idle_gpu_beats_the_busy_gpu_a_worker_has_its_context_on() -> None:
    # the issue's case: gw1 ran a test on GPU 0 and holds its context there; gw0's test runs there now
    gpus = [busy(0, 16 * GiB, "gw0", "gw1"), GpuState(1, 16 * GiB)]
    assert place(gpus, shared(4 * GiB), "gw1", SPREAD).indices == (1,)
    assert place(gpus, shared(4 * GiB), "gw1", AFFINITY).indices == (0,)  # the rule before: shares GPU 0


def test_two_workers_in_turn_get_different_gpus() -> None:
    for first, second in (("gw0", "gw1"), ("gw1", "gw0")):
        pool = Allocator({0: 16 * GiB, 1: 16 * GiB}, SPREAD)
        pool.set_contexts("gw0", {0})  # both workers opened a context on GPU 0 in earlier tests
        pool.set_contexts("gw1", {0})
        [a] = pool.submit("a", first, shared(4 * GiB))
        [b] = pool.submit("b", second, shared(4 * GiB))
        assert {a.placement.indices, b.placement.indices} == {(0,), (1,)}


def test_memory_binds_the_context_gpu_when_the_idle_one_has_no_room_for_a_new_context() -> None:
    gpus = [busy(0, 16 * GiB, "a"), GpuState(1, 8 * GiB)]
    room = 8 * GiB - 500 * MiB  # what GPU 1 gives a after opening a context there
    assert place(gpus, shared(room), "a", SPREAD).indices == (1,)  # fits with its new context: spread
    assert place(gpus, shared(room + MiB), "a", SPREAD).indices == (0,)  # does not: packed, context saved


def test_the_context_budget_binds_the_context_gpu() -> None:
    policy = Policy(overhead=4 * GiB, context_fraction=0.25)  # one context per 16 GiB GPU within budget
    gpus = [busy(0, 16 * GiB, "a", leased=GiB), GpuState(1, 16 * GiB, contexts={"b"})]
    assert place(gpus, shared(GiB), "a", policy).indices == (0,)  # GPU 1 idle, but its budget is spent
    assert place(gpus, shared(GiB), "a", policy, within_budget=False).indices == (1,)


def test_among_idle_gpus_the_context_gpu_first() -> None:
    gpus = [GpuState(0, 16 * GiB), GpuState(1, 16 * GiB, contexts={"a"}), GpuState(2, 16 * GiB, contexts={"b"})]
    assert place(gpus, shared(4 * GiB), "a", SPREAD).indices == (1,)
    assert place(gpus, shared(4 * GiB), "c", SPREAD).indices == (0,)  # a new context: where there are fewest


def test_when_every_gpu_is_busy_the_context_gpu_first_then_the_least_loaded() -> None:
    loaded = GpuState(0, 16 * GiB, leased=8 * GiB, tenants=2, contexts={"a", "x"})
    light = busy(1, 16 * GiB, "y")
    lighter = GpuState(2, 16 * GiB, leased=GiB, tenants=1, contexts={"z"})
    assert place([loaded, light, lighter], shared(GiB), "a", SPREAD).indices == (0,)  # its context saved
    assert place([loaded, light, lighter], shared(GiB), "b", SPREAD).indices == (2,)  # fewest tenants, least leased


def test_exclusive_requests_are_unchanged() -> None:
    gpus = [GpuState(0, 16 * GiB, contexts={"b"}), GpuState(1, 16 * GiB, contexts={"a"})]
    assert place(gpus, whole(), "a", SPREAD) == place(gpus, whole(), "a", AFFINITY)


def test_multi_gpu_requests_take_the_idle_gpus() -> None:
    gpus = [busy(0, 16 * GiB, "a"), GpuState(1, 16 * GiB), busy(2, 16 * GiB, "a"), GpuState(3, 16 * GiB)]
    assert place(gpus, shared(2 * GiB, 2), "a", SPREAD).indices == (1, 3)
    assert place(gpus, shared(2 * GiB, 2), "a", AFFINITY).indices == (0, 2)


@settings(max_examples=300, deadline=None)
@given(
    gpus=st.lists(
        st.tuples(
            st.integers(1, 24),  # capacity, GiB
            st.integers(0, 3),  # tenants
            st.integers(0, 20),  # leased, GiB
            st.sets(st.sampled_from(["a", "b", "c", "d"]), max_size=4),  # contexts
        ),
        min_size=1,
        max_size=4,
    ),
    memory=st.integers(1, 12),
    client=st.sampled_from(["a", "b", "e"]),
)
def test_a_busy_gpu_only_where_no_idle_gpu_has_room_for_the_request_and_its_context(
    gpus: list[tuple[int, int, int, set[str]]], memory: int, client: str
) -> None:
    states = [
        GpuState(i, cap * GiB, leased=min(leased, cap) * GiB if tenants else 0, tenants=tenants, contexts=set(ctx))
        for i, (cap, tenants, leased, ctx) in enumerate(gpus)
    ]
    placed = place(states, shared(memory * GiB), client, SPREAD)
    if placed is None:
        assert place(states, shared(memory * GiB), client, AFFINITY) is None  # the same GPUs qualify
        return
    [index] = placed.indices
    if states[index].tenants:
        for gpu in states:
            if gpu.tenants:
                continue
            budget = client in gpu.contexts or len(gpu.contexts) + 1 <= SPREAD.context_limit(gpu.capacity)
            assert not (budget and gpu.room_for(client, SPREAD) >= memory * GiB), (index, gpu)


def test_a_plan_beside_a_running_test_is_followed_while_a_gpu_is_idle() -> None:
    # the scheduler packs on purpose where a pending test needs the idle GPU's memory
    gpus = [busy(0, 16 * GiB, "gw0"), GpuState(1, 16 * GiB)]
    assert place(gpus, shared(GiB), "gw1", SPREAD).indices == (1,)
    assert place(gpus, shared(GiB), "gw1", SPREAD, prefer=(0,)).indices == (0,)


def test_a_gpu_a_foreign_process_uses_is_not_idle() -> None:
    gpus = [GpuState(0, 16 * GiB, foreign=GiB), busy(1, 16 * GiB, "b")]
    assert place(gpus, shared(GiB), "a", SPREAD).indices == (1,)  # busy both: the foreign-free first
    gpus.append(GpuState(2, 16 * GiB))
    assert place(gpus, shared(GiB), "a", SPREAD).indices == (2,)
