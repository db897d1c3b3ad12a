"""pytest_gpu.scheduling.planner: which test an xdist worker holds next (pure policy, simulated time only)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import NODE, one_node, see
from pytest_gpu.leasing.view import NodeView
from pytest_gpu.scheduling.planner import AHEAD_WINDOW, Grant, Job, Need, Order, Planner

EXCLUSIVE = None  # Need.memory for whole GPUs
GPU_MEMORY = 16  # per GPU in the simulations (units are arbitrary)


def cpu(index: int, duration: float, **kw: str) -> Job:
    return Job(index, duration, None, **kw)


def gpu(index: int, duration: float, memory: int | None, count: int = 1, **kw: str) -> Job:
    return Job(index, duration, Need(count, memory), **kw)


def drain(planner: Planner, workers: Sequence[str]) -> dict[str, list[int]]:
    """Round-robin: each worker in turn completes its oldest test and is topped up to two (CPU suites)."""
    got: dict[str, list[int]] = {w: [] for w in workers}
    now = 0.0
    for w in workers:
        planner.add_worker(w, NODE)
    for _ in range(1000):
        for w in workers:
            while len(planner.queue(w)) < 2 and (index := planner.pick(w, now)) is not None:
                got[w].append(index)
        if not planner.pending:
            return got
        now += 1.0
        for w in workers:
            if planner.queue(w):
                planner.complete(w, planner.queue(w)[0], now)
    raise AssertionError("drain did not finish")


# -- choosing --------------------------------------------------------------------------


def test_longest_first_among_cpu_jobs() -> None:
    planner = one_node([cpu(0, 1.0), cpu(1, 5.0), cpu(2, 3.0), cpu(3, 5.0)], [])
    planner.add_worker("A", NODE)
    assert planner.pick("A", 0.0) == 1
    assert planner.pick("A", 0.0) == 3  # a tie goes to the first collected
    planner.complete("A", 1, 5.0)
    assert planner.pick("A", 5.0) == 2
    planner.complete("A", 3, 10.0)
    assert planner.pick("A", 10.0) == 0
    assert planner.pick("A", 10.0) is None and planner.pending == 0


def test_gpu_job_only_when_predicted_to_fit_at_the_workers_start() -> None:
    jobs = [cpu(0, 6.0), gpu(1, 4.0, 8), gpu(2, 3.0, 8), cpu(3, 1.0), cpu(4, 0.5)]
    planner = one_node(jobs, [10])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 0  # A is busy until 6
    assert planner.pick("B", 0.0) == 1  # GPU 0: 8 of 10 until 4
    assert planner.pick("C", 0.0) == 3  # 2 would start now, next to 1: CPU work instead
    assert planner.pick("A", 0.0) == 2  # A starts it at 6, once 1 is predicted done


def test_fit_is_checked_over_the_whole_predicted_run() -> None:
    # A holds its group: 1 is predicted on GPU 0 from 2 to 12; 2 would fit at B's start (0), not at 2
    jobs = [cpu(0, 2.0, group="g"), gpu(1, 10.0, 8, group="g"), gpu(2, 5.0, 8), cpu(3, 1.0)]
    planner = one_node(jobs, [10])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("A", 0.0) == 1
    assert planner.pick("B", 0.0) == 3


def test_nothing_fits_a_holding_worker_gets_the_soonest_fit() -> None:
    # GPU 0 busy until 40, GPU 1 until 30: 3 (two GPUs, higher priority) fits at 40, 4 at 30
    jobs = [gpu(0, 40.0, 8), gpu(1, 30.0, 8), cpu(2, 1.0), gpu(3, 20.0, 8, count=2), gpu(4, 5.0, 8)]
    planner = one_node(jobs, [10, 10])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("B", 0.0) == 1
    assert planner.pick("C", 0.0) == 2
    # C's held test only runs once C holds a successor: it gets one though nothing fits
    assert planner.pick("C", 0.0) == 4
    assert planner.queue("C") == [2, 4]


def test_idle_worker_waits_while_another_is_busy_but_never_deadlocks() -> None:
    planner = one_node([gpu(0, 10.0, 8), gpu(1, 5.0, 8)], [10])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("B", 0.0) is None  # A's completion will ask again
    assert planner.queue("B") == [] and planner.pending == 1
    planner.complete("A", 0, 10.0)
    see(planner, room=(6,))  # memory taken outside the run: 1 fits nowhere now
    assert planner.pick("B", 10.0) == 1  # nobody is busy: given anyway (the broker waits if need be)


def test_exclusive_needs_a_whole_empty_gpu() -> None:
    jobs = [gpu(0, 10.0, 1), gpu(1, 9.0, EXCLUSIVE), gpu(2, 8.0, EXCLUSIVE), cpu(3, 1.0)]
    planner = one_node(jobs, [10, 10])
    for w in "ABCD":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 0  # 1 byte on one GPU
    assert planner.pick("B", 0.0) == 1  # the other GPU, whole
    assert planner.pick("C", 0.0) == 3  # no empty GPU left for 2
    assert planner.pick("D", 0.0) is None


def test_count_two_needs_two_gpus() -> None:
    jobs = [gpu(0, 10.0, 8), gpu(1, 9.0, 4, count=2), gpu(2, 8.0, 2, count=2), cpu(3, 1.0)]
    planner = one_node(jobs, [10, 10])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("B", 0.0) == 2  # 4 GiB on two GPUs is not there, 2 GiB is
    assert planner.pick("C", 0.0) == 3


def test_count_two_is_refused_when_only_one_gpu_has_room() -> None:
    jobs = [gpu(0, 10.0, EXCLUSIVE), gpu(1, 9.0, 1, count=2), gpu(2, 8.0, 1), cpu(3, 1.0)]
    planner = one_node(jobs, [10, 10])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 0  # GPU 0, whole
    assert planner.pick("B", 0.0) == 2  # 1 needs room on two GPUs
    assert planner.pick("C", 0.0) == 3


def test_capacity_respected_with_several_concurrent_needs() -> None:
    jobs = [gpu(0, 10.0, 3), gpu(1, 9.0, 3), gpu(2, 8.0, 3), gpu(3, 7.0, 3), cpu(4, 1.0)]
    planner = one_node(jobs, [10])
    for w in "ABCD":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "ABCD"] == [0, 1, 2, 4]  # a fourth 3 would make 12 of 10


def test_refreshed_capacities_are_used() -> None:
    planner = one_node([gpu(0, 5.0, 8), cpu(1, 1.0), cpu(2, 0.5)], [16])
    for w in "ABC":
        planner.add_worker(w, NODE)
    see(planner, room=(4,))
    assert planner.pick("A", 0.0) == 1
    assert planner.pick("B", 0.0) == 2  # 0 fits no GPU of 4 bytes
    assert planner.pick("C", 0.0) is None
    see(planner, room=(16,))
    assert planner.pick("C", 0.0) == 0


def test_granted_leases_stay_on_their_gpus() -> None:
    # A and B run a 4 on GPU 0 and GPU 1 (as the broker granted them). Repacked, 4 + 4 would share
    # one GPU and leave the other to an 8; where they are, no GPU has 8 free: CPU work instead.
    jobs = [gpu(0, 10.0, 4), gpu(1, 10.0, 4), cpu(2, 10.0), cpu(3, 10.0), gpu(4, 5.0, 8), cpu(5, 1.0)]

    def third_pick(placed: dict[str, list[Grant]]) -> int | None:
        planner = one_node(jobs, [10, 10])
        for w in "ABC":
            planner.add_worker(w, NODE)
        assert [planner.pick(w, 0.0) for w in "ABAB"] == [0, 1, 2, 3]  # A and B hold two: 0 and 1 run
        see(planner, placed=placed)
        return planner.pick("C", 0.0)

    assert third_pick({}) == 4  # nothing known of the placement: packed freely, 4 + 4 and 8
    assert third_pick({"A": [Grant((0,), 4)], "B": [Grant((1,), 4)]}) == 5
    assert third_pick({"A": [Grant((0,), 4)], "B": [Grant((0,), 4)]}) == 4  # both on GPU 0: GPU 1 is free


def test_a_whole_gpu_needs_one_no_grant_is_on() -> None:
    jobs = [gpu(0, 10.0, 1), gpu(1, 10.0, 1), cpu(2, 10.0), cpu(3, 10.0), gpu(4, 5.0, EXCLUSIVE), cpu(5, 1.0)]
    planner = one_node(jobs, [10, 10])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "ABAB"] == [0, 1, 2, 3]
    see(planner, placed={"A": [Grant((0,), 1)], "B": [Grant((1,), 1)]})  # one small lease on each GPU
    assert planner.pick("C", 0.0) == 5  # repacked, both 1s would share a GPU and leave the other empty


def test_a_grant_is_only_where_its_worker_runs_a_test() -> None:
    # a worker that holds one test has not started it (xdist waits for its successor): a stale
    # grant under its name is not counted, its test's own need is
    jobs = [gpu(0, 10.0, 8), gpu(1, 5.0, 8), cpu(2, 1.0)]
    planner = one_node(jobs, [10, 10])
    for w in "AB":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 0
    see(planner, placed={"A": [Grant((0,), 8), Grant((1,), 8)]})
    assert planner.pick("B", 0.0) == 1  # A's 8 counts once (not started: packed), GPU 1 is free


def test_a_round_plans_each_test_beside_the_ones_planned_before_it() -> None:
    # the bench's case: three first tests of a round, none granted yet. Free packing says they fit
    # (the whole GPU on one, 12 + 1 on another); the plan says where, and the 1 is counted beside the
    # 12, never on the GPU the whole-GPU test was planned on
    jobs = [gpu(0, 3.0, EXCLUSIVE), gpu(1, 2.0, 12), gpu(2, 1.0, 1), cpu(3, 0.5)]
    planner = one_node(jobs, [16, 16, 16])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "ABC"] == [0, 1, 2]
    whole, twelve, one = (planner.planned(i) for i in range(3))
    assert whole == Grant((0,), EXCLUSIVE)
    assert twelve == Grant((1,), 12, (0,))
    assert one == Grant((2,), 1, (0,))  # an idle GPU: it shares no GPU's compute (never beside the whole GPU)
    planner.complete("A", 0, 1.0)
    assert planner.planned(0) is None  # done: its plan goes with it


def test_a_planned_test_is_held_where_it_was_planned_until_granted() -> None:
    # A's 4 is planned on GPU 0, B's 4 on GPU 1 where B has its context (the broker's affinity).
    # Repacked freely, 4 + 4 would share a GPU and leave the other to C's 8; where they are
    # planned (and will be granted: the broker is told), no GPU has 8 free: CPU work instead
    jobs = [gpu(0, 10.0, 4), gpu(1, 10.0, 4), cpu(2, 10.0), cpu(3, 10.0), gpu(4, 5.0, 8), cpu(5, 1.0)]
    planner = one_node(jobs, [10, 10])
    for w in "ABC":
        planner.add_worker(w, NODE)
    see(planner, contexts={"A": frozenset({0}), "B": frozenset({1}), "C": frozenset({0, 1})}, context_sizes=(1, 1))
    assert [planner.pick(w, 0.0) for w in "ABAB"] == [0, 1, 2, 3]
    assert (planner.planned(0), planner.planned(1)) == (Grant((0,), 4, (0,)), Grant((1,), 4, (0,)))
    assert planner.pick("C", 0.0) == 5
    see(planner, placed={"A": [Grant((0,), 4)], "B": [Grant((0,), 4)]})  # granted elsewhere: the grant wins
    assert planner.pick("C", 0.0) == 4


def test_a_test_handed_out_to_wait_is_planned_where_it_will_fit() -> None:
    # B's successor, a pair of 6s, fits nowhere when B is free (A's 8 holds GPU 0 till 10): rule 4
    # hands it out anyway, planned on the GPUs it fits once A's test ended
    jobs = [gpu(0, 10.0, 8), gpu(1, 4.0, 8), gpu(2, 3.0, 6, count=2)]
    planner = one_node(jobs, [10, 10])
    for w in "AB":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "ABB"] == [0, 1, 2]
    assert planner.planned(2) == Grant((0, 1), 6, (0, 0))


def test_a_worker_without_a_context_on_a_gpu_needs_room_for_one() -> None:
    # A runs an 8 on GPU 0 (room 15.5 beside A's context). B has no context there: a 7.25 would
    # open one (0.5), 15.75 in all: it waits for A (CPU work first); with a context there it fits
    jobs = [gpu(0, 10.0, 800), cpu(1, 10.0), gpu(2, 5.0, 725), cpu(3, 1.0)]

    def b_picks(contexts: dict[str, set[int]], sizes: list[int]) -> int | None:
        planner = one_node(jobs, [1550])
        for w in "AB":
            planner.add_worker(w, NODE)
        assert [planner.pick("A", 0.0) for _ in range(2)] == [0, 1]
        see(planner, placed={"A": [Grant((0,), 800)]})
        see(planner, contexts={w: frozenset(gpus) for w, gpus in contexts.items()}, context_sizes=tuple(sizes))
        return planner.pick("B", 0.0)

    assert b_picks({}, []) == 2  # contexts not counted (as before)
    assert b_picks({"A": {0}}, [50]) == 3
    assert b_picks({"A": {0}, "B": {0}}, [50]) == 2


# -- handing out ahead (Planner.fill) -------------------------------------------------------


def test_a_worker_running_short_tests_holds_the_one_after_its_next() -> None:
    # xdist starts a test once its worker holds the one after: with two held, every start
    # waits for the controller's answer to the last completion; a third held hides that wait
    planner = one_node([cpu(i, 0.1) for i in range(12)], [])
    for w in "AB":
        planner.add_worker(w, NODE)
    given = planner.fill(["A", "B"], 0.0)
    assert [w for w, _ in given] == ["A", "B", "A", "B", "A", "B"]  # one each, then two, then three
    assert planner.queue("A") == [0, 2, 4] and planner.queue("B") == [1, 3, 5]
    planner.complete("A", 0, 0.1)  # A starts 2 at once; 6 comes while it runs
    assert planner.fill(["A", "B"], 0.1) == [("A", 6)]


def test_nothing_goes_ahead_to_a_worker_busy_for_longer_than_the_window() -> None:
    planner = one_node([cpu(0, 10.0)] + [cpu(i, 0.1) for i in range(1, 12)], [])
    for w in "AB":
        planner.add_worker(w, NODE)
    planner.fill(["A", "B"], 0.0)
    assert planner.queue("A") == [0, 2]  # 10 s of held work: the next test waits for the controller
    assert len(planner.queue("B")) == 3
    assert AHEAD_WINDOW < 10.0


def test_nothing_goes_ahead_near_the_end_of_the_run() -> None:
    # four tests, two workers: two each, none a third, or one worker could end up with three
    # while the other runs dry
    planner = one_node([cpu(i, 0.1) for i in range(5)], [])
    for w in "AB":
        planner.add_worker(w, NODE)
    planner.fill(["A", "B"], 0.0)
    assert len(planner.queue("A")) == len(planner.queue("B")) == 2 and planner.pending == 1


def test_a_test_goes_ahead_only_where_it_fits_at_its_start() -> None:
    # 8-unit tests cannot share the GPU of 10: one after another on A; B runs the CPU tests,
    # and after those nothing fits it before A's are predicted done: no third test for B
    jobs = [gpu(i, 0.2, 8) for i in range(4)] + [cpu(4, 0.05), cpu(5, 0.05), gpu(6, 0.2, 8)]
    planner = one_node(jobs, [10])
    for w in "AB":
        planner.add_worker(w, NODE)
    planner.fill(["A", "B"], 0.0)
    assert planner.queue("A") == [0, 1, 2]  # each fits once the one before it is predicted done
    assert planner.queue("B") == [4, 5] and planner.pending == 2
    # as B's next test it would be given the soonest fit, to wait for it at the broker (rule 4)
    assert planner.pick("B", 0.0, wait=False) is None
    assert planner.pick("B", 0.0) == 3


# -- groups ----------------------------------------------------------------------------


def test_group_goes_to_one_worker_in_collection_order() -> None:
    jobs = [
        cpu(0, 2.0, group="g"),
        cpu(1, 1.0),
        cpu(2, 3.0, group="g"),
        cpu(3, 5.0),
        cpu(4, 1.0, group="g"),
        cpu(5, 4.0),
        cpu(6, 0.5, group="h"),
        cpu(7, 0.5, group="h"),
    ]
    got = drain(one_node(jobs, []), ["A", "B", "C"])
    assert sorted(itertools.chain(*got.values())) == list(range(8))
    owner = next(w for w, indices in got.items() if 0 in indices)
    assert [i for i in got[owner] if i in (0, 2, 4)] == [0, 2, 4]
    assert all(i not in (0, 2, 4) for w, indices in got.items() if w != owner for i in indices)
    owner_h = next(w for w, indices in got.items() if 6 in indices)
    assert [i for i in got[owner_h] if i in (6, 7)] == [6, 7]


def test_bound_group_is_not_eligible_elsewhere_until_its_worker_goes() -> None:
    planner = one_node([cpu(0, 5.0, group="g"), cpu(1, 5.0, group="g"), cpu(2, 1.0)], [])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0  # the group weighs 10
    assert planner.pick("B", 0.0) == 2
    assert not planner.eligible("B") and planner.eligible("A")
    assert planner.pick("B", 0.0) is None
    assert planner.remove_worker("A") == [0]
    assert planner.eligible("B")
    assert planner.pick("B", 0.0) == 1


def test_group_runs_back_to_back_on_its_worker() -> None:
    # after 0, the group weighs 2 against singles of 5: its worker still finishes it first
    jobs = [cpu(0, 10.0, group="g"), cpu(1, 1.0, group="g"), cpu(2, 1.0, group="g"), cpu(3, 5.0), cpu(4, 5.0)]
    planner = one_node(jobs, [])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("B", 0.0) == 3
    assert planner.pick("A", 0.0) == 1
    assert planner.pick("B", 0.0) == 4
    planner.complete("A", 0, 10.0)
    assert planner.pick("A", 10.0) == 2


def test_group_worker_takes_other_work_while_its_next_test_does_not_fit() -> None:
    jobs = [cpu(0, 10.0, group="g"), gpu(1, 1.0, 12, group="g"), gpu(2, 20.0, 12), cpu(3, 4.0), cpu(4, 3.0)]
    planner = one_node(jobs, [GPU_MEMORY])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 2  # GPU 0 until 20
    assert planner.pick("B", 0.0) == 0
    assert planner.pick("A", 0.0) == 3
    assert planner.pick("B", 0.0) == 4  # 1 would start at 10, next to 2
    planner.complete("B", 0, 10.0)
    assert planner.pick("B", 10.0) == 1  # held: nothing else is left


def test_fallback_tie_goes_by_priority_a_group_by_its_weight() -> None:
    # Regression: when nothing fits, candidates that fit equally soon go by the priority of
    # rule 3 (a group weighs its remaining duration), not by their own duration. Group g
    # (1 s + 20 s = 21 s) and the single 3 (10 s) both fit at 30: B must get g's head.
    # Ordering by own duration delayed a group's chain (2.57x the lower bound in the simulation).
    jobs = [gpu(0, 30.0, 8), gpu(1, 1.0, 8, group="g"), cpu(2, 20.0, group="g"), gpu(3, 10.0, 8), cpu(4, 0.5)]
    planner = one_node(jobs, [10])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0  # GPU 0 until 30
    assert planner.pick("B", 0.0) == 4
    assert planner.pick("B", 0.0) == 1  # actual: 3


# -- pool keys -------------------------------------------------------------------------


def test_pool_owner_prefers_its_pool_others_avoid_it_then_steal() -> None:
    jobs = [cpu(0, 20.0, pool="K"), cpu(1, 18.0), cpu(2, 15.0, pool="K"), cpu(3, 10.0), cpu(4, 12.0, pool="K")]
    jobs.append(cpu(5, 2.0))
    planner = one_node(jobs, [])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("A", 0.0) == 2  # its warm pool before the longer 1
    assert planner.pick("B", 0.0) == 1
    assert planner.pick("B", 0.0) == 3  # leaves the longer 4 to A
    planner.complete("B", 1, 18.0)
    assert planner.pick("B", 18.0) == 5  # still other work
    planner.complete("B", 3, 28.0)
    assert planner.pick("B", 28.0) == 4  # nothing else: steal rather than idle


def test_pool_preference_needs_a_fit() -> None:
    jobs = [gpu(0, 20.0, 8, pool="K"), gpu(1, 15.0, 8, pool="K"), cpu(2, 1.0)]
    planner = one_node(jobs, [10])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    planner.add_worker("C", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("B", 0.0) == 2  # 1 does not fit next to 0
    assert planner.pick("A", 0.0) == 1  # after 0, on A


# -- removal and requeue ---------------------------------------------------------------


def test_remove_worker_returns_held_running_first_and_requeues_in_priority_order() -> None:
    jobs = [cpu(0, 10.0, pool="K"), cpu(1, 8.0), cpu(2, 3.0, pool="K"), cpu(3, 5.0), cpu(4, 1.0)]
    planner = one_node(jobs, [])
    planner.add_worker("A", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("A", 0.0) == 2  # pool K: ahead of longer tests
    assert planner.remove_worker("A") == [0, 2]
    assert planner.workers == [] and planner.pending == 4
    assert planner.remove_worker("A") == []
    # 2 is back between 3 and 4, and K has no owner left to leave it to
    got = drain(planner, ["C"])
    assert got["C"] == [1, 3, 2, 4]


def test_remove_worker_keeps_group_order() -> None:
    planner = one_node([cpu(i, 1.0, group="g") for i in range(4)] + [cpu(4, 0.5)], [])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("A", 0.0) == 1
    assert planner.pick("B", 0.0) == 4
    assert planner.pick("B", 0.0) is None  # the group is A's
    assert planner.remove_worker("A") == [0, 1]
    assert planner.pending == 3
    assert planner.pick("B", 1.0) == 1
    planner.complete("B", 4, 1.0)
    assert planner.pick("B", 1.0) == 2
    planner.complete("B", 1, 2.0)
    assert planner.pick("B", 2.0) == 3


def test_requeue_puts_singles_back_by_priority() -> None:
    planner = one_node([cpu(0, 5.0), cpu(1, 3.0), cpu(2, 1.0), cpu(3, 4.0)], [])
    got = drain(planner, ["A"])
    assert got["A"] == [0, 3, 1, 2]
    for index in (1, 0, 3):  # reruns, in any order
        planner.requeue(index)
    assert planner.pending == 3 and planner.eligible("A")
    for index in list(planner.queue("A")):
        planner.complete("A", index, 20.0)
    assert [planner.pick("A", 20.0), planner.pick("A", 20.0)] == [0, 3]
    planner.complete("A", 0, 25.0)
    assert planner.pick("A", 25.0) == 1


# -- what goes first (--ff, --nf, -x) ---------------------------------------------------


def test_default_order_is_longest_first() -> None:
    jobs = [cpu(0, 1.0), cpu(1, 5.0), cpu(2, 3.0), cpu(3, 5.0, group="g"), cpu(4, 0.5, group="g")]
    assert drain(one_node(jobs, [], Order()), ["A"]) == drain(one_node(jobs, []), ["A"]) == {"A": [3, 4, 1, 2, 0]}


def test_last_failures_are_handed_out_first() -> None:
    # the quick test that failed last time (3) goes out first, then longest first as before
    jobs = [cpu(0, 1.0), cpu(1, 5.0), cpu(2, 3.0), cpu(3, 0.1), cpu(4, 4.0), cpu(5, 0.2)]
    assert drain(one_node(jobs, [], Order({3: 1, 5: 1})), ["A"]) == {"A": [5, 3, 1, 4, 2, 0]}
    assert drain(one_node(jobs, [], Order({3: 1, 5: 1})), ["A", "B"]) == {"A": [5, 3, 2], "B": [1, 4, 0]}


def test_stop_early_hands_out_shortest_first_after_the_failures() -> None:
    jobs = [cpu(0, 1.0), cpu(1, 5.0), cpu(2, 3.0), cpu(3, 4.0), cpu(4, 0.5), cpu(5, 0.2)]
    assert drain(one_node(jobs, [], Order(shortest_first=True)), ["A"]) == {"A": [5, 4, 0, 2, 3, 1]}
    assert drain(one_node(jobs, [], Order({3: 1}, shortest_first=True)), ["A"]) == {"A": [3, 5, 4, 0, 2, 1]}


def test_new_tests_go_before_last_failures() -> None:
    # --nf --ff: new (2), then failed (1), a new test that also failed (3) first
    jobs = [cpu(i, d) for i, d in enumerate([5.0, 1.0, 2.0, 3.0])]
    assert drain(one_node(jobs, [], Order({1: 1, 2: 2, 3: 3})), ["A"]) == {"A": [3, 2, 1, 0]}


def test_a_group_with_a_last_failure_goes_first_in_collection_order() -> None:
    jobs = [cpu(0, 9.0), cpu(1, 1.0, group="g"), cpu(2, 0.5, group="g"), cpu(3, 8.0)]
    planner = one_node(jobs, [], Order({2: 1}))
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 1  # the group's head, then the failure, on one worker
    assert planner.pick("B", 0.0) == 0
    assert planner.pick("A", 0.0) == 2
    assert planner.pick("B", 0.0) == 3


def test_a_last_failure_that_does_not_fit_waits_for_its_gpu() -> None:
    # the fit rules stand: 0 and 2 (both failed last time) each need 12 of the one GPU
    jobs = [gpu(0, 10.0, 12), cpu(1, 1.0), gpu(2, 0.5, 12), cpu(3, 2.0)]
    planner = one_node(jobs, [GPU_MEMORY], Order({0: 1, 2: 1}, shortest_first=True))
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 2
    assert planner.pick("B", 0.0) == 1  # 0 would overlap 2 on the GPU
    assert planner.pick("A", 0.0) == 0  # on A, after 2
    assert planner.pick("B", 0.0) == 3


def test_a_warm_pool_waits_for_a_last_failure() -> None:
    jobs = [cpu(0, 5.0, pool="K"), cpu(1, 4.0, pool="K"), cpu(2, 1.0), cpu(3, 0.5)]
    planner = one_node(jobs, [], Order({2: 1}))
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 2
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("B", 0.0) == 3  # leaves K's test to A
    planner.complete("A", 2, 1.0)
    assert planner.pick("A", 1.0) == 1  # pool K again, nothing ahead is pending


def test_requeued_failure_goes_first_again() -> None:
    planner = one_node([cpu(0, 5.0), cpu(1, 0.1), cpu(2, 3.0, pool="K"), cpu(3, 4.0, pool="K")], [], Order({1: 1}))
    planner.add_worker("A", NODE)
    assert [planner.pick("A", 0.0), planner.pick("A", 0.0)] == [1, 0]
    assert planner.remove_worker("A") == [1, 0]
    planner.add_worker("B", NODE)
    assert planner.pick("B", 1.0) == 0  # the running test was reported; 0 came back
    planner.requeue(1)  # a rerun of the failure
    planner.add_worker("C", NODE)
    assert planner.pick("C", 1.0) == 1


def test_shortest_first_reaches_a_quick_failure_sooner_in_simulation() -> None:
    # ten 2 s tests and a 0.1 s one (collected last) on 2 workers: when does the quick one end?
    jobs = [cpu(i, 2.0) for i in range(10)] + [cpu(10, 0.1)]
    longest = Sim(jobs, [], 2)
    longest.run()
    shortest = Sim(jobs, [], 2, order=Order(shortest_first=True))
    shortest.run()
    assert shortest.runs[10][2] <= 0.1 < 10.0 <= longest.runs[10][2]


# -- simulation ------------------------------------------------------------------------


class Sim:
    """A discrete-event run: xdist workers holding two tests each, and a broker granting GPUs.

    A worker runs its oldest held test once it holds a successor or is shut down (xdist).
    A started test that does not fit the GPUs now waits at the broker (arrival order,
    later ones may pass) and then runs for its ``actual`` duration.

    ``fixtures``: group -> the need of its module-scoped leasing fixture. The first test of
    the group that a worker starts sets it up (waiting at the broker for it, and only then
    for the test's own need); it lives, holding its GPUs, until the worker starts a test
    that is neither the group's nor one that goes before it (``Job.before``: a test of the
    module that does not use the fixture) or leaves; the planner learns it at its setup, as
    the scheduler does from ``held:`` entries. ``scopes``: test -> the group whose module it
    is in without being in the group (default: ``Job.before``). ``spread``: a shared need
    goes to the GPU with the fewest tenants first, as the broker places a worker's first
    context."""

    def __init__(
        self,
        jobs: Sequence[Job],
        capacities: Sequence[int],
        workers: int,
        actual: Mapping[int, float] | None = None,
        removals: Sequence[tuple[float, int]] = (),
        order: Order | None = None,
        fixtures: Mapping[str, Need] | None = None,
        scopes: Mapping[int, str] | None = None,
        spread: bool = False,
    ) -> None:
        self.jobs = {j.index: j for j in jobs}
        self.planner = one_node(jobs, capacities, order)
        self.fixtures = dict(fixtures or {})
        self.learned: dict[str, tuple[Need, ...]] = {}
        self.planner.held = self.learned
        self.alive: dict[str, tuple[str, list[int]]] = {}  # worker -> its live fixture's group, GPUs
        self.scopes = {j.index: set(j.before) for j in jobs}
        for index, group in (scopes or {}).items():
            self.scopes[index] = {group}
        self.spread = spread
        self.tenants = [0] * len(capacities)
        self.capacities = list(capacities)
        self.free = list(capacities)
        self.whole = [False] * len(capacities)
        self.actual = dict(actual) if actual is not None else {j.index: j.duration for j in jobs}
        self.removals = sorted(removals)
        self.now = 0.0
        self.shut: set[str] = set()
        self.gone: set[str] = set()
        self.running: dict[str, tuple[int, float, float, list[int]]] = {}  # worker -> index, start, end, GPUs
        self.waiting: dict[str, int] = {}  # worker -> its started test blocked at the broker
        self.runs: dict[int, tuple[str, float, float]] = {}
        self.completed: list[int] = []
        self.crashed: list[int] = []
        self.assigned: list[tuple[int, str, frozenset[str]]] = []  # index, worker, workers gone by then
        self._names = itertools.count()
        for _ in range(workers):
            self.planner.add_worker(f"gw{next(self._names)}", NODE)

    def run(self) -> float:
        self._fill()
        for _ in range(20 * len(self.jobs) + 100):
            self._start()
            if not self.running:
                assert not self.waiting, "a test waits for GPUs while nothing runs"
                break
            end, worker = min((r[2], w) for w, r in self.running.items())
            if self.removals and self.removals[0][0] <= end:
                at, choice = self.removals.pop(0)
                self.now = max(self.now, at)
                self._crash(choice)
            else:
                self.now = end
                self._finish(worker)
            self._fill()
        else:
            raise AssertionError("the run does not end")
        held = {w: self.planner.queue(w) for w in self.planner.workers}
        assert self.planner.pending == 0 and not any(held.values()), f"deadlock: {held}"
        return max((end for _, _, end in self.runs.values()), default=0.0)

    def _fill(self) -> None:
        """As GpuScheduling._fill_all: every live worker topped up (Planner.fill); then shutdowns."""
        live = [w for w in self.planner.workers if w not in self.shut]
        self.assigned += [(index, w, frozenset(self.gone)) for w, index in self.planner.fill(live, self.now)]
        for w in live:
            if not self.planner.pending or not self.planner.eligible(w):
                self.shut.add(w)
        for w in self.planner.workers:
            if w in self.shut and not self.planner.queue(w):  # it finished: xdist removes it
                assert self.planner.remove_worker(w) == []
                self.gone.add(w)
                self._teardown(w)

    def _start(self) -> None:
        for w in self.planner.workers:
            queue = self.planner.queue(w)
            if w not in self.running and w not in self.waiting and queue and (len(queue) > 1 or w in self.shut):
                self.waiting[w] = queue[0]
                job = self.jobs[queue[0]]
                if w in self.alive and self.alive[w][0] != job.group and self.alive[w][0] not in self.scopes[job.index]:
                    self._teardown(w)  # the test before was the last in the fixture's module
        for w, index in list(self.waiting.items()):
            job = self.jobs[index]
            if job.group in self.fixtures and w not in self.alive:  # the test's setup sets the fixture up
                need = self.fixtures[job.group]
                held = self._acquire(need)
                if held is None:
                    continue
                self.alive[w] = (job.group, held)
                self.learned[job.group] = (need,)
            gpus = self._acquire(job.need)
            if gpus is not None:
                del self.waiting[w]
                self.running[w] = (index, self.now, self.now + self.actual[index], gpus)

    def _teardown(self, worker: str) -> None:
        if worker in self.alive:
            group, gpus = self.alive.pop(worker)
            self._release(self.fixtures[group], gpus)

    def _finish(self, worker: str) -> None:
        index, start, end, gpus = self.running.pop(worker)
        self._release(self.jobs[index].need, gpus)
        self.planner.complete(worker, index, self.now)
        self.completed.append(index)
        self.runs[index] = (worker, start, end)

    def _crash(self, choice: int) -> None:
        workers = self.planner.workers
        if not workers:
            return
        worker = workers[choice % len(workers)]
        held = self.planner.remove_worker(worker)
        if worker in self.running:
            index, _, _, gpus = self.running.pop(worker)
            assert held[0] == index, "the running test comes first"
            self._release(self.jobs[index].need, gpus)
        if worker in self.waiting:
            assert held[0] == self.waiting.pop(worker)
        if held:
            self.crashed.append(held[0])  # xdist reports it; the rest went back to pending
        self._teardown(worker)
        self.shut.discard(worker)
        self.gone.add(worker)
        self.planner.add_worker(f"gw{next(self._names)}", NODE)  # xdist starts a replacement

    def _acquire(self, need: Need | None) -> list[int] | None:
        if need is None:
            return []
        if need.memory is None:
            empty = [i for i, free in enumerate(self.free) if not self.whole[i] and free == self.capacities[i]]
            if len(empty) < need.count:
                return None
            for i in empty[: need.count]:
                self.whole[i], self.free[i] = True, 0
            return empty[: need.count]
        usable = sorted(
            (self.tenants[i] if self.spread else 0, free, i)
            for i, free in enumerate(self.free)
            if not self.whole[i] and free >= need.memory
        )
        if len(usable) < need.count:
            return None
        chosen = [i for _, _, i in usable[: need.count]]
        for i in chosen:
            self.free[i] -= need.memory
            self.tenants[i] += 1
        return chosen

    def _release(self, need: Need | None, gpus: list[int]) -> None:
        for i in gpus:
            assert need is not None
            if need.memory is None:
                self.whole[i], self.free[i] = False, self.capacities[i]
            else:
                self.free[i] += need.memory
                self.tenants[i] -= 1
            assert 0 <= self.free[i] <= self.capacities[i]


def compatible(a: Need, b: Need, n_gpus: int) -> bool:
    """Whether two needs can hold GPUs of ``GPU_MEMORY`` at once (exact: every placement is tried)."""
    for mine in itertools.combinations(range(n_gpus), a.count):
        for theirs in itertools.combinations(range(n_gpus), b.count):
            if not set(mine) & set(theirs):
                return True
            if a.memory is not None and b.memory is not None and a.memory + b.memory <= GPU_MEMORY:
                return True
    return False


def lower_bound(jobs: Sequence[Job], n_gpus: int, workers: int) -> float:
    """No schedule beats this: the longest job or group, GPU memory-seconds over capacity, work over
    workers, and the total of jobs that cannot run two at once (e.g. 2-GPU 9 GiB jobs on 3 GPUs)."""
    groups: dict[str, float] = {}
    for j in jobs:
        if j.group is not None:
            groups[j.group] = groups.get(j.group, 0.0) + j.duration
    longest = max([j.duration for j in jobs] + list(groups.values()))
    memory = sum(j.duration * j.need.count * (j.need.memory or GPU_MEMORY) for j in jobs if j.need is not None)
    serial = 0.0  # greedy cliques of pairwise incompatible jobs: each must run one after the other
    gpu_jobs = sorted((j for j in jobs if j.need is not None), key=lambda j: -j.duration)
    for first in gpu_jobs:
        clique = [first]
        for j in gpu_jobs:
            if j is not first and not any(compatible(j.need, c.need, n_gpus) for c in clique):  # type: ignore[arg-type]
                clique.append(j)
        serial = max(serial, sum(j.duration for j in clique))
    gpu_bound = memory / (n_gpus * GPU_MEMORY) if memory else 0.0
    return max(longest, serial, gpu_bound, sum(j.duration for j in jobs) / workers)


def check_run(sim: Sim) -> None:
    """Every job once (completed or the crashed head of a removed worker); groups in order, on one worker."""
    assert sorted(sim.completed + sim.crashed) == sorted(sim.jobs)
    groups: dict[str, list[int]] = {}
    for j in sim.jobs.values():
        if j.group is not None:
            groups.setdefault(j.group, []).append(j.index)
    for members in groups.values():
        done = sorted((sim.runs[i][1], i) for i in members if i in sim.runs)
        assert [i for _, i in done] == sorted(i for _, i in done), "group members out of collection order"
        ends = [sim.runs[i][2] for _, i in done]
        assert all(start >= end for (start, _), end in zip(done[1:], ends, strict=False)), "group members overlap"
        owner: str | None = None
        for index, worker, gone in sim.assigned:
            if index in members:
                assert owner is None or worker == owner or owner in gone, "a bound group's test went elsewhere"
                owner = worker


@st.composite
def suites(draw: st.DrawFn, max_jobs: int = 24) -> tuple[list[Job], int, int]:
    """A random suite (CPU, 1- and 2-GPU, exclusive, grouped, pooled jobs), its GPU count and workers."""
    n_gpus = draw(st.integers(1, 4))
    workers = draw(st.integers(1, 5))
    jobs = []
    for index in range(draw(st.integers(1, max_jobs))):
        duration = draw(st.integers(1, 40)) / 4
        kind = draw(st.sampled_from(["cpu", "cpu", "gpu", "gpu", "gpu", "two", "exclusive", "exclusive2"]))
        count = 2 if kind in ("two", "exclusive2") and n_gpus >= 2 else 1
        need = None
        if kind in ("gpu", "two"):
            need = Need(count, draw(st.integers(1, GPU_MEMORY)))
        elif kind.startswith("exclusive"):
            need = Need(count, None)
        group = draw(st.sampled_from([None, None, None, "g1", "g2"]))
        pool = draw(st.sampled_from([None, None, "K", "L"]))
        jobs.append(Job(index, duration, need, group, pool))
    return jobs, n_gpus, workers


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    suites(),
    st.lists(st.tuples(st.integers(0, 60).map(lambda t: t / 4), st.integers(0, 9)), max_size=3),
    st.lists(st.integers(1, 40).map(lambda q: q / 4), min_size=24, max_size=24),
)
def test_simulated_runs_complete_every_job_once(
    suite: tuple[list[Job], int, int], removals: list[tuple[float, int]], actual: list[float]
) -> None:
    # durations as measured differ from the history the planner was given; workers crash
    jobs, n_gpus, workers = suite
    sim = Sim(jobs, [GPU_MEMORY] * n_gpus, workers, {j.index: actual[j.index] for j in jobs}, removals)
    sim.run()
    check_run(sim)
    assert len(sim.crashed) <= len(removals)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(suites(max_jobs=30))
def test_simulated_makespan_is_within_a_sane_factor_of_the_lower_bound(suite: tuple[list[Job], int, int]) -> None:
    jobs, n_gpus, workers = suite
    sim = Sim(jobs, [GPU_MEMORY] * n_gpus, workers)
    makespan = sim.run()
    check_run(sim)
    assert not sim.crashed
    bound = lower_bound(jobs, n_gpus, workers)
    assert bound <= makespan + 1e-9
    assert makespan <= 2.5 * bound + 1e-9, (makespan, bound)


def test_longest_first_beats_collection_order() -> None:
    # twelve 1 s tests, then one of 10 s, on 4 workers
    durations = [1.0] * 12 + [10.0]
    informed = [cpu(i, d) for i, d in enumerate(durations)]
    blind = [cpu(i, 1.0) for i in range(len(durations))]  # no history: all alike, collection order
    actual = dict(enumerate(durations))
    collection_order = Sim(blind, [], 4, actual).run()
    longest_first = Sim(informed, [], 4, actual).run()
    assert collection_order == 13.0  # the 10 s test starts last, at 3
    assert longest_first <= 11.0 < collection_order


def test_simulated_gpu_suite_keeps_to_capacity() -> None:
    # eight 12-of-16 jobs on two GPUs and CPU work: at most two at once, CPU work in the gaps
    jobs = [gpu(i, 4.0, 12) for i in range(8)] + [cpu(8 + i, 2.0) for i in range(8)]
    sim = Sim(jobs, [GPU_MEMORY, GPU_MEMORY], 4)
    makespan = sim.run()
    check_run(sim)
    gpu_runs = sorted(sim.runs[i][1:] for i in range(8))
    for t, _ in gpu_runs:
        assert sum(1 for s, e in gpu_runs if s <= t < e) <= 2
    assert makespan <= 1.5 * lower_bound(jobs, 2, 4)


def test_a_second_group_is_not_bound_to_a_worker_with_a_group_pending() -> None:
    # Regression: a worker whose own group still has tests pending must not start another
    # group. gw0 takes group x (pool K); x's next test waits for the GPU that gw1's blocker (5)
    # holds. Were gw0 to take y's head (pool preference), y would be bound to it too, gw1 would
    # have nothing eligible, be shut down and idle, and gw0 would interleave the two groups
    # (makespan 25 instead of 16 with gw1 running y after its blocker).
    x = [cpu(0, 1.0, group="x", pool="K"), gpu(1, 1.0, 12, group="x"), cpu(2, 6.0, group="x"), cpu(6, 6.0, group="x")]
    y = [cpu(3, 1.0, group="y", pool="K"), cpu(4, 5.0, group="y"), cpu(7, 5.0, group="y")]
    sim = Sim([*x, *y, gpu(5, 3.0, 12)], [GPU_MEMORY], 2)
    makespan = sim.run()
    check_run(sim)
    y_worker = sim.runs[3][0]
    ran = sorted((i for i, r in sim.runs.items() if r[0] == y_worker), key=lambda i: sim.runs[i][1])
    first = ran.index(3)
    assert ran[first : first + 3] == [3, 4, 7], f"y interleaved on {y_worker}: {ran}"
    assert makespan <= 20.0


# -- a module's fixture lives through the module's other tests (rule 1) --------------------------


def guide_suite(before: bool) -> list[Job]:
    """The migration guide's suite (docs/migration.md), twice (test_llm.py and a copy): per module a
    6-unit model fixture used by two tests (group "A"/"B"), and a test that uses no fixture
    but needs a whole GPU; ``before``: the catalog names the module's group it goes before."""
    jobs = []
    for base, group in ((0, "A"), (3, "B")):
        jobs += [cpu(base, 1.0, group=group), cpu(base + 1, 1.0, group=group)]
        jobs.append(Job(base + 2, 1.0, Need(1, EXCLUSIVE), before=(group,) if before else ()))
    return jobs


def test_the_guides_suite_deadlocked_and_no_longer_does() -> None:
    fixtures = {"A": Need(1, 6), "B": Need(1, 6)}
    scopes = {2: "A", 5: "B"}
    # before: the worker that finishes first is handed its own module's whole-GPU test, and
    # the other one its own: each model (placed apart from the other) lives on while that waits
    sim = Sim(guide_suite(before=False), [GPU_MEMORY] * 2, 2, fixtures=fixtures, scopes=scopes, spread=True)
    with pytest.raises(AssertionError, match="a test waits for GPUs while nothing runs"):
        sim.run()
    assert sorted(sim.waiting.items()) == [("gw0", 2), ("gw1", 5)]
    assert sorted((w, g) for w, (g, _) in sim.alive.items()) == [("gw0", "A"), ("gw1", "B")]
    # now: each is handed out before its module's model tests, so before its model is set up
    sim = Sim(guide_suite(before=True), [GPU_MEMORY] * 2, 2, fixtures=fixtures, scopes=scopes, spread=True)
    makespan = sim.run()
    check_run(sim)
    order = [index for index, _, _ in sim.assigned]
    assert order.index(2) < order.index(0) and order.index(5) < order.index(3), order
    assert order[:2] == [2, 5]  # ahead of a group as heavy as the one each holds back: the models load in parallel
    assert makespan == 3.0  # as the luckiest order before (a module's model tests, then the other's large test)


def test_tests_that_go_before_a_group_hold_it_back_and_take_its_rank() -> None:
    # 0-1: group "m" (8 s in all); 2-3: 1 s GPU tests of m's module that go before it; 4: a
    # 5 s GPU test elsewhere: by their own rank 2 and 3 would go last, by m's they go first
    before = [Job(i, 1.0, Need(1, 4), before=("m",)) for i in (2, 3)]
    jobs = [cpu(0, 4.0, group="m"), cpu(1, 4.0, group="m"), *before, gpu(4, 5.0, 4)]
    planner = one_node(jobs, [GPU_MEMORY])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert [planner.pick("A", 0.0), planner.pick("A", 0.0)] == [2, 3]
    planner.remove_worker("A")  # it crashed running 2: 3 goes back to pending, and holds m back again
    assert planner.pick("B", 0.0) == 3
    assert planner.pick("B", 0.0) == 0  # all handed out: m may start
    planner.add_worker("C", NODE)
    assert planner.pick("C", 0.0) == 4  # m is B's


@st.composite
def module_suites(draw: st.DrawFn) -> tuple[list[Job], dict[str, Need], int, int]:
    """Modules with a leasing fixture whose tests compute on its lease, GPU tests of those
    modules that do not use it (they go before its group), and tests of other modules."""
    n_gpus = draw(st.integers(1, 3))
    workers = draw(st.integers(1, 4))
    fixtures: dict[str, Need] = {}
    jobs: list[Job] = []
    for m in range(draw(st.integers(1, 4))):
        group = f"m{m}"
        fixtures[group] = Need(1, draw(st.sampled_from([4, 8, 12, EXCLUSIVE])))
        tests = [("user", None)] * draw(st.integers(1, 3))
        tests += [("other", draw(st.sampled_from([4, 10, EXCLUSIVE]))) for _ in range(draw(st.integers(0, 2)))]
        for kind, memory in draw(st.permutations(tests)):
            duration = draw(st.integers(1, 12)) / 4
            if kind == "user":
                jobs.append(cpu(len(jobs), duration, group=group))
            else:
                jobs.append(Job(len(jobs), duration, Need(1, memory), before=(group,)))
    for _ in range(draw(st.integers(0, 4))):
        need = draw(st.sampled_from([None, Need(1, 6), Need(1, EXCLUSIVE)]))
        jobs.append(Job(len(jobs), draw(st.integers(1, 12)) / 4, need))
    return jobs, fixtures, n_gpus, workers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(module_suites(), st.lists(st.integers(1, 12).map(lambda q: q / 4), min_size=24, max_size=24))
def test_simulated_runs_with_module_fixtures_never_wait_in_a_cycle(
    suite: tuple[list[Job], dict[str, Need], int, int], actual: list[float]
) -> None:
    """No worker waits for GPUs while its fixture holds some: the runs always end (the Sim
    asserts that nothing waits while nothing runs), however long the tests really take."""
    jobs, fixtures, n_gpus, workers = suite
    durations = {j.index: actual[j.index % len(actual)] for j in jobs}
    sim = Sim(jobs, [GPU_MEMORY] * n_gpus, workers, durations, fixtures=fixtures, spread=True)
    sim.run()
    check_run(sim)


# -- nodes (--gpu-nodes) ------------------------------------------------------------------


def test_workers_of_different_nodes_pack_onto_their_own_node_s_gpus() -> None:
    """Each node has one GPU: a whole-GPU test on node x's worker leaves node y's GPU free,
    so y's worker starts one at once; a second worker on x must wait for x's GPU."""
    whole = Need(1, None)
    jobs = [Job(i, 10.0, whole) for i in range(4)]
    planner = Planner(jobs)
    planner.nodes = {"x": NodeView((16,)), "y": NodeView((16,))}
    planner.add_worker("x1", "x")
    planner.add_worker("x2", "x")
    planner.add_worker("y1", "y")
    assert planner.pick("x1", 0.0) is not None
    assert planner.pick("y1", 0.0) is not None  # node x's test is not on y's GPU (one forecast for all would say so)
    assert planner.pick("x2", 0.0) is None  # x's one GPU is taken; x1 runs: x2 waits for its completion


def test_a_node_s_granted_leases_and_capacities_are_its_own() -> None:
    """What a running test on node x was granted is packed on x's GPUs only; a worker
    removed forgets its node."""
    half = Need(1, 8)
    jobs = [Job(i, 10.0, half) for i in range(3)]
    planner = Planner(jobs)
    planner.nodes = {"x": NodeView((8,)), "y": NodeView((8,))}
    planner.add_worker("x1", "x")
    planner.add_worker("y1", "y")
    first = planner.pick("x1", 0.0)
    assert first is not None
    see(planner, "x", placed={"x1": [Grant((0,), 8)]})
    assert planner.pick("y1", 0.0) is not None  # x1's grant is on x's GPU 0, not y's
    assert planner.remove_worker("x1") == [first]
    planner.add_worker("x1", "y")  # a worker of the same name on another node: packs with y
    assert planner.pick("x1", 0.0) is None  # y's GPU is y1's now


def test_a_test_that_can_never_fit_a_worker_s_node_is_left_to_other_nodes() -> None:
    """Node x's GPUs give 16 at most, y's 40: x's worker never picks the 30 test (not even as
    rule 4's soonest, where it would wait at x's broker forever), and once only such tests are
    left it is no longer eligible (it stops); y's worker takes them."""
    big, small = Need(1, 30), Need(1, 4)
    jobs = [Job(0, 10.0, big), Job(1, 10.0, big), Job(2, 1.0, small)]
    planner = Planner(jobs)
    planner.nodes = {"x": NodeView((16, 16), limits=(16, 16)), "y": NodeView((40,), limits=(40,))}
    planner.add_worker("x1", "x")
    planner.add_worker("y1", "y")
    assert planner.pick("x1", 0.0) == 2  # the small one: the big ones are longer, but never fit x
    assert planner.pick("x1", 0.0) is None  # holding one, nothing else fits x now or ever
    assert planner.pick("y1", 0.0) == 0
    planner.complete("x1", 2, 1.0)
    assert not planner.eligible("x1") and planner.eligible("y1")
    assert planner.pick("x1", 1.0) is None
    # two GPUs of x give a two-GPU need that y's one GPU never can
    pair = Planner([Job(0, 1.0, Need(2, 4))])
    pair.nodes = {"x": NodeView((16, 16), limits=(16, 16)), "y": NodeView((40,), limits=(40,))}
    pair.add_worker("y1", "y")
    pair.add_worker("x1", "x")
    assert pair.pick("y1", 0.0) is None and not pair.eligible("y1")
    assert pair.pick("x1", 0.0) == 0


def test_a_test_no_node_can_ever_hold_goes_to_a_worker_all_the_same() -> None:
    """A need beyond every node's limits is left to no one: any worker takes it (its broker
    then says why it can never be placed) and the run does not end with it pending. A run
    on one machine is such a run of one node: its limits leave every test to its workers."""
    huge = Need(1, 60)
    planner = Planner([Job(0, 1.0, huge), Job(1, 1.0, Need(1, 4))])
    planner.nodes = {"x": NodeView((16, 16), limits=(16, 16)), "y": NodeView((40,), limits=(40,))}
    planner.add_worker("x1", "x")
    planner.add_worker("y1", "y")
    assert planner.eligible("x1") and planner.eligible("y1")
    assert planner.pick("x1", 0.0) == 1
    assert planner.pick("x1", 0.0) == 0  # rule 4's successor, though it fits nowhere ever
    assert not planner.pending
    alone = one_node([Job(0, 1.0, Need(1, 12))], [16])
    see(alone, limits=(8,))
    alone.add_worker("A", NODE)
    assert alone.eligible("A") and alone.pick("A", 0.0) == 0


# -- spread compute, pack memory (the broker's rule, machine/placement.py) -----------------------


def test_plans_spread_tests_over_idle_gpus() -> None:
    # the case: -n 2, two 4 GiB tests, two idle GPUs: planned on different GPUs (the
    # broker honours a plan that fits, so a plan on one GPU would put both there)
    jobs = [gpu(0, 2.0, 4), gpu(1, 2.0, 4)]
    planner = one_node(jobs, [16, 16])
    for w in "AB":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "AB"] == [0, 1]
    assert {planner.planned(0).gpus, planner.planned(1).gpus} == {(0,), (1,)}  # type: ignore[union-attr]


def test_plans_pack_as_before_where_the_broker_does_not_spread() -> None:
    jobs = [gpu(0, 2.0, 4), gpu(1, 2.0, 4)]
    planner = one_node(jobs, [16, 16])
    see(planner, spread=False)
    for w in "AB":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "AB"] == [0, 1]
    assert planner.planned(0).gpus == planner.planned(1).gpus == (0,)  # type: ignore[union-attr]


def test_plans_pack_where_spreading_leaves_a_pending_test_no_gpu() -> None:
    # an 8 is pending: spreading the two 4s over both 10s would leave it no GPU; packing them pays
    jobs = [gpu(0, 10.0, 4), gpu(1, 10.0, 4), gpu(2, 5.0, 8), cpu(3, 10.0)]
    planner = one_node(jobs, [10, 10])
    for w in "AB":
        planner.add_worker(w, NODE)
    assert [planner.pick(w, 0.0) for w in "AB"] == [0, 1]
    assert planner.planned(0).gpus == planner.planned(1).gpus  # type: ignore[union-attr]
