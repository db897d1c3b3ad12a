"""Unit tests of the launched-session building blocks: launcher detection, the marker
mapping and its verdicts, the shard partition and the file-based gather."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpu.base.launch import LaunchContext, detect
from pytest_gpu.gpu.share import node_share, share
from pytest_gpu.launched import gather, torchenv
from pytest_gpu.launched.markers import DEFAULT_MAPPING, LauncherMarkerError, allowed, parse_mapping
from pytest_gpu.launched.session import outcome_table, rank_logs, rank_nodeid
from pytest_gpu.launched.shard import partition
from pytest_gpu.sim.spec import gpu_uuid as sim_uuid
from pytest_gpu.vendors.devices import Device, Inventory

# -- detect() ----------------------------------------------------------------------------

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "TORCHELASTIC_RUN_ID": "5abefca0-03c6-477c-8876-83bbebc26c9a",
    "MASTER_ADDR": "localhost",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_NAMESPACE": "prterun-host-1234@1",
    "PMIX_RANK": "3",
}
SRUN = {
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "3",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
}
PMI = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "PMI_JOBID": "job-7"}


def test_detect_torchrun() -> None:
    ctx = detect(TORCHRUN)
    assert ctx == LaunchContext("torchrun", 1, 4, 1, "5abefca0-03c6-477c-8876-83bbebc26c9a", local_size=2)
    assert not ctx.is_root
    assert detect({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"}).is_root


def test_detect_torchrun_restarts_are_new_runs() -> None:
    # torchrun --max-restarts starts every rank again under the same TORCHELASTIC_RUN_ID: the
    # new attempt must not read the documents the failed one left behind
    first = detect({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "0"})
    again = detect({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert first is not None and again is not None
    assert first.run_id == detect(TORCHRUN).run_id
    assert again.run_id != first.run_id
    assert (again.rank, again.world_size) == (first.rank, first.world_size)


def test_detect_torchrun_needs_its_run_id() -> None:
    # RANK/WORLD_SIZE alone are set by many tools (and by hand): not enough for torchrun
    assert detect({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}) is None


def test_detect_open_mpi() -> None:
    assert detect(OPEN_MPI) == LaunchContext("mpirun", 3, 4, 1, "prterun-host-1234_1", local_size=2)


def test_detect_open_mpi_without_pmix_namespace_uses_the_job_id() -> None:
    env = {k: v for k, v in OPEN_MPI.items() if k != "PMIX_NAMESPACE"} | {"OMPI_MCA_orte_ess_jobid": "770834433"}
    ctx = detect(env)
    assert ctx is not None
    assert (ctx.launcher, ctx.rank, ctx.world_size, ctx.run_id) == ("mpirun", 3, 4, "770834433")


def test_detect_srun_step() -> None:
    assert detect(SRUN) == LaunchContext("srun", 2, 3, 0, "42.0", local_size=1)
    assert detect({k: v for k, v in SRUN.items() if k != "SLURM_NTASKS"} | {"SLURM_NPROCS": "3"}) == detect(SRUN)


def test_detect_slurm_outside_an_srun_step_is_no_launch() -> None:
    # an sbatch script or an salloc shell: SLURM_PROCID/SLURM_NTASKS but no step yet
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert detect(batch) is None


def test_detect_pmi() -> None:
    assert detect(PMI) == LaunchContext("mpirun", 5, 8, 1, "job-7", local_size=4)
    pmix = {"PMIX_RANK": "2", "PMI_SIZE": "4", "PMIX_NAMESPACE": "ns"}
    assert detect(pmix) == LaunchContext("mpirun", 2, 4, 2, "ns", local_size=4)


def test_detect_pmi_local_rank_zero_is_kept() -> None:
    # the first rank on the second node: local rank 0, not its global rank
    ctx = detect({**PMI, "MPI_LOCALRANKID": "0"})
    assert ctx is not None
    assert (ctx.rank, ctx.local_rank) == (5, 0)


@pytest.mark.parametrize(
    ("env", "local"),
    [
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1"}, (0, 4)),
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}, (0, 3)),
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "2,1"}, (0, 3)),  # node 2 of a 2-node list: unknown
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "junk"}, (0, 3)),
        ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_TASKS_PER_NODE"}, (0, 3)),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1"}, (1, 4)),  # local rank 1 of 1 cannot be: the whole world
        ({k: v for k, v in OPEN_MPI.items() if not k.startswith("OMPI_COMM_WORLD_LOCAL")}, (3, 4)),
    ],
)
def test_detect_local_size_and_its_fallback(env: dict[str, str], local: tuple[int, int]) -> None:
    # unknown: the whole world, so that GPU shares (launched/share.py) can be too small but never overlap
    ctx = detect(env)
    assert ctx is not None
    assert (ctx.local_rank, ctx.local_size) == local


def test_detect_nested_launchers() -> None:
    # torchrun started inside an srun step: the ranks are torchrun's
    ctx = detect({**SRUN, **TORCHRUN})
    assert ctx is not None
    assert (ctx.launcher, ctx.rank, ctx.world_size) == ("torchrun", 1, 4)
    # mpirun inside an allocation's step: Open MPI's numbering wins over SLURM's
    ctx = detect({**SRUN, **OPEN_MPI})
    assert ctx is not None
    assert (ctx.launcher, ctx.rank, ctx.world_size) == ("mpirun", 3, 4)
    # Open MPI's own PMIx variables do not make it a generic PMI launch
    assert detect({**OPEN_MPI, **PMI}).rank == 3


@pytest.mark.parametrize("value", ["none", "None", "NONE"])
def test_detect_disabled(value: str) -> None:
    for env in (TORCHRUN, OPEN_MPI, SRUN, PMI):
        assert detect({**env, "PYTEST_GPU_LAUNCHER": value}) is None
    assert detect({**SRUN, "PYTEST_GPU_LAUNCHER": "srun"}) is not None


def test_detect_nothing() -> None:
    assert detect({}) is None
    assert detect({"RANK": "0", "WORLD_SIZE": "2", "PATH": "/usr/bin"}) is None
    assert detect({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}) is None
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "SLURM_STEP_ID": "0"}) is None


def test_detect_run_ids_are_path_safe() -> None:
    ctx = detect({**TORCHRUN, "TORCHELASTIC_RUN_ID": "../a b/c"})
    assert ctx is not None
    assert "/" not in ctx.run_id and " " not in ctx.run_id
    assert detect({**TORCHRUN, "TORCHELASTIC_RUN_ID": "x" * 500}).run_id == "x" * 80


# -- parse_mapping() and allowed() ---------------------------------------------------------

MAPPING = parse_mapping(DEFAULT_MAPPING)


def test_default_mapping() -> None:
    assert MAPPING == {
        "torch_dist": ("torchrun", "srun", "mpirun"),
        "deepspeed_dist": ("torchrun", "srun", "mpirun"),
        "horovod_dist": ("srun", "mpirun"),
        "ray_dist": ("ray",),
        "hpc": ("torchrun", "srun", "mpirun", "-m"),
    }


def test_parse_mapping_skips_blank_lines_and_comments() -> None:
    lines = ["", "  # a comment", "  my_dist :  srun   mpirun  ", "jax_dist: ray"]
    assert parse_mapping(lines) == {"my_dist": ("srun", "mpirun"), "jax_dist": ("ray",)}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("torch_dist torchrun", "cannot read 'torch_dist torchrun'; expected 'MARKER: LAUNCHER ...'"),
        ("torch_dist:", "cannot read 'torch_dist:'; expected 'MARKER: LAUNCHER ...'"),
        ("not a name: srun", "cannot read 'not a name: srun'"),
        ("torch_dist: torchrun slurm", "unknown launcher 'slurm' in 'torch_dist: torchrun slurm'"),
        ("x: pbs lsf", "unknown launcher 'pbs', 'lsf' in 'x: pbs lsf'; expected some of torchrun, srun, mpirun, ray"),
    ],
)
def test_parse_mapping_errors(line: str, expected: str) -> None:
    with pytest.raises(LauncherMarkerError) as info:
        parse_mapping(["ray_dist: ray", line])
    assert str(info.value).startswith("ini key 'launcher_markers': ")
    assert expected in str(info.value)


def verdict(names: list[str], current: str | None, *, launcher_args=(), hpc: bool = False, pool: bool = False):
    return allowed(names, list(launcher_args), MAPPING, current, selected_by_m=hpc, runs_on_pool=pool)


@pytest.mark.parametrize(
    ("marker", "runs_under"),
    [
        ("torch_dist", {"torchrun", "srun", "mpirun"}),
        ("deepspeed_dist", {"torchrun", "srun", "mpirun"}),
        ("horovod_dist", {"srun", "mpirun"}),
        ("ray_dist", {None}),
    ],
)
def test_default_markers_under_each_launcher(marker: str, runs_under: set[str | None]) -> None:
    allowed_names = " ".join(sorted(MAPPING[marker]))
    for current in ("torchrun", "srun", "mpirun", None):
        result = verdict([marker, "parametrize"], current)
        assert result.keep == (current in runs_under), (marker, current)
        if result.keep:
            assert result.reason == ""
        elif current is None:
            assert result.reason == f"{marker} needs a launcher ({' or '.join(sorted(MAPPING[marker]))})"
        else:
            assert result.reason == f"{marker} cannot run under {current} (allowed: {allowed_names})"


def test_horovod_under_torchrun_reason() -> None:
    result = verdict(["horovod_dist"], "torchrun")
    assert not result.keep
    assert result.reason == "horovod_dist cannot run under torchrun (allowed: mpirun srun)"


def test_strategy_marker_on_a_warm_pool_runs_without_launcher() -> None:
    assert verdict(["torch_dist", "distributed"], None, pool=True).keep
    assert verdict(["horovod_dist"], None, pool=True).keep
    # ... but a pool does not lift the restriction under a launcher
    assert not verdict(["horovod_dist"], "torchrun", pool=True).keep


def test_unmarked_tests_run_everywhere() -> None:
    for current in ("torchrun", "srun", "mpirun", None):
        assert verdict([], current).keep
        assert verdict(["gpu", "slow"], current).keep


def test_launcher_marker() -> None:
    only_srun = [("srun",)]
    assert verdict([], "srun", launcher_args=only_srun).keep
    result = verdict([], "torchrun", launcher_args=only_srun)
    assert (result.keep, result.reason) == (False, "launcher(srun) cannot run under torchrun (allowed: srun)")
    result = verdict([], None, launcher_args=[("torchrun", "mpirun")])
    assert (result.keep, result.reason) == (False, "launcher(torchrun, mpirun) needs a launcher (mpirun or torchrun)")
    assert verdict([], None, launcher_args=[("ray",)]).keep
    assert verdict([], None, launcher_args=[("srun",)], pool=True).keep


def test_launcher_marker_and_strategy_marker_must_both_allow() -> None:
    # horovod_dist allows srun and mpirun, the launcher marker only mpirun
    assert verdict(["horovod_dist"], "mpirun", launcher_args=[("mpirun", "torchrun")]).keep
    result = verdict(["horovod_dist"], "torchrun", launcher_args=[("mpirun", "torchrun")])
    assert result.reason == "horovod_dist cannot run under torchrun (allowed: mpirun srun)"
    result = verdict(["horovod_dist"], "srun", launcher_args=[("mpirun", "torchrun")])
    assert result.reason == "launcher(mpirun, torchrun) cannot run under srun (allowed: mpirun torchrun)"
    # two launcher markers: both must allow
    assert not verdict([], "srun", launcher_args=[("srun", "mpirun"), ("mpirun",)]).keep
    assert verdict([], "mpirun", launcher_args=[("srun", "mpirun"), ("mpirun",)]).keep


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "launcher marker needs at least one launcher; expected @pytest.mark.launcher("),
        (("torchrun", "slurm"), "launcher marker: unknown launcher 'slurm'; expected some of torchrun, srun, mpirun"),
        ((3,), "launcher marker: unknown launcher 3;"),
    ],
)
def test_bad_launcher_marker(args: tuple[object, ...], expected: str) -> None:
    with pytest.raises(LauncherMarkerError) as info:
        verdict([], "srun", launcher_args=[args])
    assert expected in str(info.value)


def test_hpc() -> None:
    for current in ("torchrun", "srun", "mpirun"):
        assert verdict(["hpc"], current).keep
    result = verdict(["hpc"], None)
    expected = "hpc needs a launcher (mpirun or srun or torchrun) or -m selecting it"
    assert (result.keep, result.reason) == (False, expected)
    assert verdict(["hpc"], None, hpc=True).keep
    # -m hpc does not override a strategy marker that needs a launcher
    result = verdict(["hpc", "horovod_dist"], None, hpc=True)
    assert (result.keep, result.reason) == (False, "horovod_dist needs a launcher (mpirun or srun)")
    # itwinai's ray tests carry hpc too: -m ray_dist selects them outside a launcher
    assert verdict(["hpc", "ray_dist"], None, hpc=True).keep
    assert not verdict(["hpc", "ray_dist"], "srun", hpc=True).keep


def test_hpc_is_a_launcher_markers_line() -> None:
    """The hpc rule is the default mapping's line, so an ini mapping can change or drop it."""
    assert "hpc: torchrun srun mpirun -m" in DEFAULT_MAPPING
    always = parse_mapping(["hpc: torchrun srun mpirun ray"])  # this suite's hpc tests also run on a laptop
    assert allowed(["hpc"], [], always, None, selected_by_m=False, runs_on_pool=False).keep
    only_m = parse_mapping(["nightly: -m"])
    result = allowed(["nightly"], [], only_m, None, selected_by_m=False, runs_on_pool=False)
    assert (result.keep, result.reason) == (False, "nightly needs -m selecting it")
    result = allowed(["nightly"], [], only_m, "srun", selected_by_m=True, runs_on_pool=False)
    assert (result.keep, result.reason) == (False, "nightly cannot run under srun (allowed: none)")
    assert allowed(["hpc"], [], parse_mapping(["jax_dist: srun"]), None, selected_by_m=False, runs_on_pool=False).keep


def test_custom_mapping() -> None:
    mapping = parse_mapping(["jax_dist: srun"])
    result = allowed(["jax_dist"], [], mapping, "mpirun", selected_by_m=False, runs_on_pool=False)
    assert result.reason == "jax_dist cannot run under mpirun (allowed: srun)"
    # markers outside the mapping are not restricted
    assert allowed(["horovod_dist"], [], mapping, "torchrun", selected_by_m=False, runs_on_pool=False).keep


# -- partition() ---------------------------------------------------------------------------


def ids(n: int) -> list[str]:
    return [f"tests/test_s.py::test_{i:03d}" for i in range(n)]


def spread(parts: list[list[str]], durations: dict[str, float]) -> float:
    loads = [sum(durations[n] for n in part) for part in parts]
    return (max(loads) - min(loads)) / statistics.mean(loads)


def test_partition_covers_every_test_once() -> None:
    nodeids = ids(61)
    for shards in (1, 2, 3, 7, 80):
        parts = partition(nodeids, shards)
        assert len(parts) == shards
        assert sorted(n for part in parts for n in part) == sorted(nodeids)


def test_partition_without_history_is_count_balanced_and_deterministic() -> None:
    nodeids = ids(62)
    parts = partition(nodeids, 3)
    assert sorted(len(p) for p in parts) == [20, 21, 21]
    shuffled = nodeids[:]
    random.Random(1).shuffle(shuffled)
    assert partition(shuffled, 3) == parts  # every rank computes the same split, whatever its order
    assert partition(nodeids, 3, {}) == parts
    assert partition(nodeids, 3, {"some/other.py::test": 3.0}) == parts  # history of other tests only


def test_partition_with_durations_is_balanced() -> None:
    for seed in range(5):
        rng = random.Random(seed)
        nodeids = ids(60)
        durations = {n: rng.uniform(0.05, 3.0) for n in nodeids}
        for shards in (2, 3, 4):
            parts = partition(nodeids, shards, durations)
            assert sorted(n for part in parts for n in part) == sorted(nodeids)
            assert spread(parts, durations) <= 0.25, (seed, shards)
            assert partition(list(reversed(nodeids)), shards, dict(reversed(durations.items()))) == parts
        # round-robin would not be: here the long tests sit at every third position
        skewed = {n: (3.0 if i % 3 == 0 else 0.05) for i, n in enumerate(nodeids)}
        assert spread(partition(nodeids, 3), skewed) > 1.0
        assert spread(partition(nodeids, 3, skewed), skewed) <= 0.25


def test_partition_keeps_collection_order_within_a_share() -> None:
    nodeids = ids(30)
    durations = {n: float(i % 7) + 0.1 for i, n in enumerate(nodeids)}
    for part in partition(nodeids, 4, durations):
        assert part == sorted(part)


def test_partition_unknown_tests_count_as_the_median() -> None:
    known = {"a": 1.0, "b": 2.0, "c": 9.0, "d": 9.5, "e": 0.5}  # median 2.0, mean 4.4
    nodeids = [*known, "new1", "new2"]
    filled = {**known, "new1": 2.0, "new2": 2.0}
    parts = partition(nodeids, 2, known)
    assert parts == partition(nodeids, 2, filled)
    # and that is a real difference: counted as nothing, or as the mean, they land elsewhere
    assert parts != partition(nodeids, 2, {**known, "new1": 0.0, "new2": 0.0})
    assert parts != partition(nodeids, 2, {**known, "new1": 4.4, "new2": 4.4})


def test_partition_rejects_no_shards() -> None:
    with pytest.raises(ValueError, match="shards must be positive, got 0"):
        partition(ids(3), 0)


# -- gather ------------------------------------------------------------------------------


def test_gather_publish_and_collect(tmp_path: Path) -> None:
    where = tmp_path / "shared" / ".gather-run"
    for rank in range(3):
        gather.publish(where, "results", rank, {"rank": rank, "reports": [rank] * rank})
    assert gather.collect(where, "results", 3, timeout=5) == {
        0: {"rank": 0, "reports": []},
        1: {"rank": 1, "reports": [1]},
        2: {"rank": 2, "reports": [2, 2]},
    }
    assert json.loads((where / "results-rank2.json").read_text())["rank"] == 2
    assert [p.name for p in where.iterdir() if p.name.startswith(".")] == []  # no temporary files left
    assert gather.collect(where, "results", 3, timeout=5, ranks=[2]) == {2: {"rank": 2, "reports": [2, 2]}}
    assert gather.collect(where, "other", 3, timeout=0.2) == {}  # documents of another name are not mixed in


def test_gather_waits_for_late_ranks(tmp_path: Path) -> None:
    gather.publish(tmp_path, "collected", 0, {"ids": ["a"]})

    def late() -> None:
        time.sleep(0.5)
        gather.publish(tmp_path, "collected", 1, {"ids": ["b"]})

    thread = threading.Thread(target=late)
    thread.start()
    try:
        found = gather.collect(tmp_path, "collected", 2, timeout=30)
    finally:
        thread.join()
    assert found == {0: {"ids": ["a"]}, 1: {"ids": ["b"]}}


def test_gather_reports_missing_ranks_after_the_timeout(tmp_path: Path) -> None:
    gather.publish(tmp_path, "results", 0, {"ok": True})
    gather.publish(tmp_path, "results", 2, {"ok": True})
    (tmp_path / "results-rank3.json").write_text('{"half": ')  # a rank that died while writing
    start = time.monotonic()
    found = gather.collect(tmp_path, "results", 4, timeout=0.5)
    waited = time.monotonic() - start
    assert sorted(found) == [0, 2]
    assert waited >= 0.5  # it did wait for ranks 1 and 3
    assert gather.collect(tmp_path / "nowhere", "results", 2, timeout=0.1) == {}


def test_gather_publish_replaces_a_document(tmp_path: Path) -> None:
    gather.publish(tmp_path, "left", 1, {"n": 1})
    gather.publish(tmp_path, "left", 1, {"n": 2})
    assert gather.collect(tmp_path, "left", 2, timeout=0.1, ranks=[1]) == {1: {"n": 2}}


# -- share(): the GPUs of one rank among the ranks of a node ------------------------------

GiB = 2**30


def sim_inventory(*sizes: int) -> Inventory:
    return Inventory(tuple(Device(i, sim_uuid(i), size, simulated=True) for i, size in enumerate(sizes)), "sim:test")


def test_share_whole_gpus_when_there_are_enough() -> None:
    inventory = sim_inventory(*[16 * GiB] * 8)
    shares = [share(inventory, r, 3) for r in range(3)]
    assert [[d.index for d in s.devices] for s in shares] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert all(d.total_memory == 16 * GiB for s in shares for d in s.devices)
    assert shares[0].source == "sim:test"


def test_share_splits_a_gpu_between_the_ranks_on_it() -> None:
    inventory = sim_inventory(80 * GiB, 24 * GiB)
    shares = [share(inventory, r, 5) for r in range(5)]
    # GPU 0: ranks 0, 2, 4 (a third each); GPU 1: ranks 1, 3 (half each)
    assert [(s.devices[0].index, s.devices[0].total_memory) for s in shares] == [
        (0, 80 * GiB // 3),
        (1, 12 * GiB),
        (0, 80 * GiB // 3),
        (1, 12 * GiB),
        (0, 80 * GiB // 3),
    ]
    assert all(s.devices[0].uuid == sim_uuid(s.devices[0].index) for s in shares)


@pytest.mark.parametrize("where", [(0, 1), (0, 0), (3, 2), (-1, 2)])
def test_share_alone_or_out_of_range_is_everything(where: tuple[int, int]) -> None:
    inventory = sim_inventory(16 * GiB, 16 * GiB)
    assert share(inventory, *where) == inventory
    assert share(sim_inventory(), 1, 4) == sim_inventory()


def test_node_share_outside_a_launch_is_everything() -> None:
    inventory = sim_inventory(16 * GiB, 16 * GiB)
    assert node_share(inventory, None) == inventory
    assert node_share(inventory, detect({**TORCHRUN, "LOCAL_WORLD_SIZE": "2"})) == share(inventory, 1, 2)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 96), st.integers(0, 7)), min_size=1, max_size=9),
    local_size=st.integers(1, 12),
)
def test_property_no_gpu_memory_is_promised_twice(sizes: list[tuple[int, int]], local_size: int) -> None:
    # half-GiB sizes, and up to an eighth of each reserved by the driver
    gpus = tuple(
        Device(i, sim_uuid(i), h * GiB // 2, reserved=h * GiB // 2 * r // 56) for i, (h, r) in enumerate(sizes)
    )
    inventory = Inventory(gpus, "nvml")
    promised = [0] * len(gpus)
    for rank in range(local_size):
        mine = share(inventory, rank, local_size)
        assert mine.devices, f"rank {rank} of {local_size} got no GPU"
        assert len({d.index for d in mine.devices}) == len(mine.devices)
        for device in mine.devices:
            assert (device.uuid, device.reserved) == (gpus[device.index].uuid, gpus[device.index].reserved)
            promised[device.index] += device.capacity
    # every GPU in some share, none promised beyond what it can allocate, and little of it left idle
    for gpu in gpus:
        assert 0 < promised[gpu.index] <= gpu.capacity
        assert gpu.capacity - promised[gpu.index] < local_size


def test_share_splits_what_cuda_can_allocate() -> None:
    # the driver's reserve is not allocatable on any share: the capacities add up to the GPU's
    gpu = Device(0, sim_uuid(0), 80 * GiB, reserved=GiB)
    shares = [share(Inventory((gpu,), "nvml"), r, 3).devices[0] for r in range(3)]
    assert [d.capacity for d in shares] == [79 * GiB // 3] * 3
    assert sum(d.capacity for d in shares) <= gpu.capacity


def test_ranks_that_collected_the_same_tests_in_another_order_are_told_apart():
    """Lockstep needs the same order too: pytest-randomly with a seed per rank would hang collectives."""
    from pytest_gpu.launched.session import _differences

    same = ["t.py::a", "t.py::b", "t.py::c"]
    assert _differences({0: same, 1: list(same)}) == []
    lines = _differences({0: same, 1: ["t.py::a", "t.py::c", "t.py::b"]})
    assert len(lines) == 1
    assert "rank 1 runs them in another order than rank 0: test 2 is t.py::c there, t.py::b on rank 0" in lines[0]
    assert "--randomly-seed" in lines[0]
    missing = _differences({0: same, 1: same[:2]})
    assert missing == ["  only on rank 0 (not on every rank): t.py::c"]  # a missing test is named, not the order


# -- rank_nodeid() -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodeid", "expected"),
    [
        ("tests/test_a.py::test_x", "tests/test_a.py::test_x@rank1"),
        ("tests/test_a.py::TestT::test_x", "tests/test_a.py::TestT::test_x@rank1"),
        # pytest's terminal and junitxml split an id at its first "[": the "]" must stay last
        ("test_a.py::test_trainer[ddp_strategy]", "test_a.py::test_trainer[ddp_strategy@rank1]"),
        ("test_a.py::test_t[a[0]-b]", "test_a.py::test_t[a[0]-b@rank1]"),
        # a "[" in the module's path (not in the test's name) is no parametrization
        ("tests/[odd]/test_a.py::test_x", "tests/[odd]/test_a.py::test_x@rank1"),
    ],
)
def test_rank_nodeid_keeps_ids_well_formed(nodeid: str, expected: str) -> None:
    assert rank_nodeid(nodeid, 1) == expected


# -- torchenv.provide() ------------------------------------------------------------------------


# -- rank 0's report of every rank ----------------------------------------------------------------


def _report(nodeid: str, when: str, outcome: str) -> pytest.TestReport:
    return pytest.TestReport(nodeid, ("t.py", 1, nodeid), {}, outcome, None, when)  # type: ignore[arg-type]


def test_errors_at_setup_and_teardown_are_errors_apart_from_failures() -> None:
    by_rank = {
        rank: [
            _report("t.py::broken_fixture", "setup", "failed"),
            _report("t.py::broken_fixture", "teardown", "passed"),
            _report("t.py::fails", "setup", "passed"),
            _report("t.py::fails", "call", "failed" if rank else "passed"),
            _report("t.py::fails", "teardown", "failed" if rank else "passed"),
            _report("t.py::skips", "setup", "skipped"),
        ]
        for rank in (0, 1)
    }
    assert outcome_table(by_rank) == {
        "t.py::broken_fixture": {"error at setup": [0, 1]},
        "t.py::fails": {"passed": [0], "failed": [1], "error at teardown": [1]},
        "t.py::skips": {"skipped": [0, 1]},
    }


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([1], "/logs/torchrun/rank1.log"),
        ([1, 2], "/logs/torchrun/rank1.log, /logs/torchrun/rank2.log"),
        ([1, 2, 3], "/logs/torchrun/rank1.log to /logs/torchrun/rank3.log"),
        ([1, 3, 5], "/logs/torchrun/rank1.log, /logs/torchrun/rank3.log, /logs/torchrun/rank5.log"),
    ],
)
def test_the_other_ranks_logs_are_named(ranks: list[int], expected: str) -> None:
    assert rank_logs(Path("/logs/torchrun"), ranks) == expected


def test_torch_variables_under_mpirun(tmp_path: Path) -> None:
    """Rank 0 chooses the master and publishes it; rank 1 reads the same."""
    rank0 = LaunchContext("mpirun", 0, 2, 0, "job7", local_size=2)
    rank1 = LaunchContext("mpirun", 1, 2, 1, "job7", local_size=2)
    env0: dict[str, str] = {"OMPI_COMM_WORLD_RANK": "0"}
    env1: dict[str, str] = {"OMPI_COMM_WORLD_RANK": "1", "MASTER_PORT": "29555"}  # the user's own stays
    set0 = torchenv.provide(rank0, tmp_path, 5.0, env0)
    set1 = torchenv.provide(rank1, tmp_path, 5.0, env1)
    assert set0 == {k: env0[k] for k in torchenv.VARIABLES}
    assert (env0["RANK"], env0["WORLD_SIZE"], env0["LOCAL_RANK"], env0["LOCAL_WORLD_SIZE"]) == ("0", "2", "0", "2")
    assert (env1["RANK"], env1["WORLD_SIZE"], env1["LOCAL_RANK"]) == ("1", "2", "1")
    assert env1["MASTER_ADDR"] == env0["MASTER_ADDR"]
    assert 0 < int(env0["MASTER_PORT"]) < 65536
    assert env1["MASTER_PORT"] == "29555" and "MASTER_PORT" not in set1


def test_torch_variables_kept_and_not_for_torchrun(tmp_path: Path) -> None:
    given_env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    given_env |= {"MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    env = dict(given_env)
    assert torchenv.provide(LaunchContext("srun", 5, 8, 1, "9.0", local_size=4), tmp_path, 1.0, env) == {}
    assert env == given_env
    assert not list(tmp_path.iterdir())  # nothing to agree on: no exchange
    env = {}
    assert torchenv.provide(LaunchContext("torchrun", 0, 2, 0, "x", local_size=2), tmp_path, 1.0, env) == {}


def test_torch_master_missing_from_rank_0(tmp_path: Path) -> None:
    """Rank 0 never published (it died at start): the place is set, the master is not."""
    env: dict[str, str] = {}
    started = time.monotonic()
    torchenv.provide(LaunchContext("srun", 1, 2, 1, "9.0", local_size=2), tmp_path, 0.3, env)
    assert time.monotonic() - started < 5
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    "document",
    [
        {"addr": "node1", "port": "not-a-port"},
        {"addr": "node1", "port": "70000"},
        {"addr": "node1", "port": 29500},
        {"addr": "node 1", "port": "29500"},
        {"addr": "", "port": "29500"},
        {"addr": "node1\nMASTER_PORT=1", "port": "29500"},
        {"port": "29500"},
    ],
)
def test_a_master_document_that_does_not_read_as_host_and_port_is_not_used(tmp_path: Path, document: dict) -> None:
    """What rank 0 published crossed a file: a torn or foreign one sets no master."""
    gather.publish(tmp_path, torchenv.DOCUMENT, 0, {"run": "job7", **document})
    env: dict[str, str] = {}
    torchenv.provide(LaunchContext("mpirun", 1, 2, 1, "job7", local_size=2), tmp_path, 0.3, env)
    assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env
    assert env["RANK"] == "1"
