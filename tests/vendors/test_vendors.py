"""The vendor interface (:class:`pytest_gpu.vendors.vendor.Vendor`, one object per vendor in
:mod:`pytest_gpu.vendors.registry`): NVIDIA's implementation is the code the NVIDIA path always
ran, AMD's is ROCm's model, Intel's Level Zero's; all answer the same questions."""

from __future__ import annotations

import os

import pytest

from conftest import Holder, run_fake_python, with_amdsmi
from pytest_gpu.sim.spec import amd_uuid, gpu_uuid, parse, xpu_uuid
from pytest_gpu.vendors import amd, kinds
from pytest_gpu.vendors import registry as vendors
from pytest_gpu.vendors.devices import Device, Inventory
from pytest_gpu.vendors.nvidia import cuda_view

GiB = 1 << 30
NV = tuple(Device(i, gpu_uuid(i), 16 * GiB) for i in range(4))  # as NVML reports a machine: not simulated
AMD = tuple(Device(i, amd_uuid(i), 192 * GiB) for i in range(4))
XPU = tuple(Device(i, xpu_uuid(i), 64 * GiB) for i in range(4))
MACHINES = {"nvidia": NV, "amd": AMD, "xpu": XPU}


def test_one_list_of_vendors_for_the_product_and_the_simulated_machines() -> None:
    assert tuple(vendors.VENDORS) == kinds.NAMES == ("nvidia", "amd", "xpu")
    assert [v.kind for v in vendors.VENDORS.values()] == list(kinds.ALL)
    assert vendors.DEFAULT is vendors.NVIDIA and parse("sim:1x1GiB").vendor == kinds.DEFAULT.name
    for kind in kinds.ALL:
        machine = parse(f"{kind.name}:sim:2x16GiB")
        assert [g.uuid for g in machine.gpus] == [kind.sim_uuid(i) for i in range(2)]
        assert [kind.sim_index(g.uuid) for g in machine.gpus] == [0, 1]
        assert all(other.sim_index(kind.sim_uuid(1)) is None for other in kinds.ALL if other is not kind)


@pytest.mark.parametrize("visible", [None, "", "2,0", "1,9,2", "GPU-51a00000-0000-4000-8000-000000000003"])
def test_nvidia_view_is_cudas(visible: str | None) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible, "ROCR_VISIBLE_DEVICES": "0"}
    outer = vendors.NVIDIA.outer(env)
    assert vendors.NVIDIA.view(NV, outer) == cuda_view(NV, visible)  # ROCm's variable means nothing to CUDA


def test_nvidia_lease_sets_cuda_and_hip_alike() -> None:
    assert vendors.NVIDIA.lease_env(["GPU-a", "GPU-b"]) == {
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "HIP_VISIBLE_DEVICES": "GPU-a,GPU-b",
    }
    assert vendors.NVIDIA.lease_env([]) == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def test_amd_view_honours_rocr_before_cuda() -> None:
    outer = vendors.AMD.outer({"CUDA_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "2,3", "OTHER": "x"})
    assert outer == (("ROCR_VISIBLE_DEVICES", "2,3"), ("CUDA_VISIBLE_DEVICES", "1"))
    assert vendors.AMD.view(AMD, outer) == [3]


@pytest.mark.parametrize(("vendor", "expected"), [("nvidia", [2, 0]), ("amd", [2, 0]), ("xpu", [0, 2])])
def test_a_lease_env_is_the_view_of_its_names(vendor: str, expected: list[int]) -> None:
    """A subprocess under a lease's variables sees exactly the lease: in the lease's order, but on
    Intel GPUs, where Level Zero keeps the driver's order whatever the mask's."""
    implementation, machine = vendors.of(vendor), MACHINES[vendor]
    env = implementation.lease_env(implementation.lease_names([machine[2], machine[0]]))
    assert implementation.view(machine, implementation.outer(env)) == expected
    assert set(env) <= set(vendors.VISIBILITY)


def test_what_a_run_started_with() -> None:
    nv = Inventory(NV, "nvml", "", NV, "1,2")
    assert vendors.NVIDIA.started_with(nv) == (("CUDA_VISIBLE_DEVICES", "1,2"),)
    amd = Inventory(AMD, "amdsmi", "", AMD, None, "amd", (("ROCR_VISIBLE_DEVICES", "0"),))
    assert vendors.AMD.started_with(amd) == (("ROCR_VISIBLE_DEVICES", "0"),)
    with pytest.raises(KeyError):
        vendors.of("intel")


@pytest.mark.parametrize(
    ("spec", "runtime"),
    [
        ("sim:1x16GiB;context=700MiB", "CUDA"),
        ("amd:sim:1x16GiB;context=700MiB", "HIP"),
        ("xpu:sim:1x16GiB;context=700MiB", "Level Zero"),
    ],
)
def test_each_vendors_driver_measures_the_context(gpu_pytester, fake_run, monkeypatch, spec, runtime):
    """The calibration reads this process's line through the vendor's sampler: NVML's (fake
    libnvidia-ml.so.1), amdsmi's (fake libamd_smi.so) or Level Zero Sysman's (fake loader)."""
    if spec.startswith("amd:"):
        from conftest import amdsmi_site

        site = amdsmi_site()
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    gpu_pytester.makepyfile(
        test_ctx="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="1GiB")
        def test_gpu(gpu):
            sim.allocate("256MiB").free()
        """
    )
    result = fake_run(spec, "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    measured = f"pytest-gpu: {runtime} context measured: GPU 0: 700MiB (assumed 500MiB until measured)"
    result.stdout.fnmatch_lines([measured])


@pytest.mark.parametrize(("vendor", "lag"), [("nvidia", 0.0), ("amd", 2.0), ("xpu", 0.0)])
def test_only_amds_verification_waits_for_its_process_list(vendor: str, lag: float) -> None:
    """NVML's and Sysman's lists are read live: only amdsmi's may be old, --gpu-amd-process-lag's seconds."""
    from pytest_gpu.gpu.verification import NvmlRankVerifier, NvmlVerifier

    inventory = Inventory(devices=MACHINES[vendor], source="driver", vendor=vendor)
    assert NvmlVerifier(inventory, 0, lag=2.0).lag == NvmlRankVerifier(inventory, 0, lag=2.0).lag == lag


def test_nvidia_has_no_process_list_lag_to_say(gpu_pytester, fake_run):
    """NVML's lists are read live: short tests on NVIDIA GPUs are neither waited for nor counted
    in the summary's AMD blind-spot line, whatever --gpu-amd-process-lag says."""
    gpu_pytester.makepyfile(
        test_short="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.parametrize("n", range(2))
        @pytest.mark.gpu(memory="1GiB")
        def test_short(gpu, n):
            sim.allocate("256MiB").free()
        """
    )
    result = fake_run("sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", "--gpu-amd-process-lag=2")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 GPUs (2x16GiB) [[]nvml[]]*"])
    assert "process-list lag" not in result.stdout.str()


@pytest.mark.parametrize(
    ("vendor", "caveat"), [("nvidia", ""), ("amd", f" ({amd.caveat(0.0)})"), ("xpu", "")], ids=["nvidia", "amd", "xpu"]
)
def test_every_amd_verdict_says_how_coarse_its_list_is(monkeypatch, vendor: str, caveat: str) -> None:
    """A violation seen in amdsmi's list carries the caveat whichever verifier judged it: a test's
    or a rank pool's (whose own sampling overrides the test's); NVIDIA's and Intel's carry none."""
    from pytest_gpu.gpu.verification import NvmlRankVerifier, NvmlVerifier, Verdict

    def found(self, lease, others=()):
        return Verdict(violations=["GPU 1 outside the lease"])

    for cls in (NvmlVerifier, NvmlRankVerifier):
        monkeypatch.setattr(cls, "_end", found)
        verifier = cls(Inventory(devices=MACHINES[vendor], source="driver", vendor=vendor), 0, lag=0.0)
        assert verifier.end(None).violations == [f"GPU 1 outside the lease{caveat}"], cls  # type: ignore[arg-type]


INVENTORY = """
import contextlib, io
from pytest_gpu.cli import gpu_labels, main
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    main(["inventory", *{args!r}])
out["inventory"] = printed.getvalue().splitlines()
out["labels"] = gpu_labels([{uuid!r}, {unknown!r}], ask_nvml=True)
"""


@pytest.mark.parametrize(
    ("spec", "args", "narrow", "lines"),
    [
        (
            "amd:sim:2x192GiB",
            [],
            {"ROCR_VISIBLE_DEVICES": "1"},
            [
                "--gpus auto: 1 AMD GPU (1x192GiB)",
                f"  GPU 1  {amd_uuid(1)}    192GiB  Simulated AMD GPU 192GiB (0000:25:00.0)",
                "  started with: ROCR_VISIBLE_DEVICES=1",
            ],
        ),
        (
            "xpu:sim:2x64GiB",
            ["--gpus", "xpu:auto"],
            {"ZE_AFFINITY_MASK": "1"},
            [
                "--gpus xpu:auto: 1 Intel GPU (1x64GiB)",
                f"  GPU 1  {xpu_uuid(1)}     64GiB  Simulated Intel GPU 64GiB",
                "  started with: ZE_AFFINITY_MASK=1",
            ],
        ),
    ],
    ids=["amd", "xpu"],
)
def test_the_inventory_command_and_status_labels_name_the_vendors_gpus(
    tmp_path, spec: str, args: list[str], narrow: dict[str, str], lines: list[str]
) -> None:
    kind = kinds.of(parse(spec).vendor)
    unknown = kind.sim_uuid(1).replace("51a", "fff", 1)  # a UUID of its form that no GPU here has
    code = INVENTORY.format(args=args, uuid=kind.sim_uuid(1), unknown=unknown)
    out = run_fake_python(tmp_path, spec, code, amdsmi=kind is kinds.AMD, **narrow)
    assert out["inventory"] == lines
    assert out["labels"] == {kind.sim_uuid(1): kind.gpu_label(1)}


@pytest.mark.parametrize("vendor", ["amd", "xpu"])
def test_foreign_usage_through_the_vendors_driver_where_there_is_no_nvml(tmp_path, vendor: str) -> None:
    """The foreign sampler takes the first vendor's driver that opens (amdsmi, else Level Zero
    Sysman) where NVML answers "Driver Not Loaded", and names another process's memory there."""
    kind = kinds.of(vendor)
    spec = f"{vendor}:sim:2x64GiB;context=512MiB"
    env = {**os.environ, "PYTEST_GPU_FAKE_GPUS": spec, "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "ledger")}
    env["PYTEST_GPU_SIM"] = spec  # the ledger's spec, as a run's subprocess has it
    if kind is kinds.AMD:
        env = with_amdsmi(env)
    holder = Holder("--gpu", "1", "--memory", "2GiB", env=env)  # not a descendant of the sampling process
    uuids = [kind.sim_uuid(0), kind.sim_uuid(1)]
    try:
        out = run_fake_python(
            tmp_path,
            spec,
            f"""
            import os
            from pytest_gpu.sim.ledger import ledger
            from pytest_gpu.gpu.foreign import ForeignSampler
            ledger().allocate({GiB}, 0, None, None)  # ours
            sampler = ForeignSampler({uuids!r})
            found = sampler.sample({{os.getpid()}})
            out["nvml"] = sampler.unavailable
            out["found"] = {{u: [f.bytes, [[p.pid, p.bytes] for p in f.processes], f.note] for u, f in found.items()}}
            sampler.close()
            out["closed"] = sampler.sample({{os.getpid()}})[{uuids[0]!r}].note
            """,
            amdsmi=kind is kinds.AMD,
        )
    finally:
        holder.kill()
    held = 512 * 2**20 + 2 * GiB
    assert out["found"] == {uuids[0]: [0, [], None], uuids[1]: [held, [[holder.pid, held]], None]}
    assert out["nvml"].startswith("NVML unavailable (Driver Not Loaded)")
    assert out["closed"].endswith("foreign GPU usage is unknown")  # closed: no other driver is asked either


@pytest.mark.parametrize(
    ("vendor", "described", "words", "lacking"),
    [
        ("nvidia", "2 GPUs (2x16GiB)", "NCCL", "torch 2.3.0+cpu has no NCCL (a CPU build)"),
        (
            "amd",
            "2 AMD GPUs (2x192GiB)",
            "RCCL (its nccl backend on ROCm)",
            "torch 2.3.0+cpu has no NCCL (a CPU build)",
        ),
        ("xpu", "2 Intel GPUs (2x64GiB)", "XCCL", "torch 2.13.0+cpu has no XCCL (not an XPU build)"),
    ],
)
def test_auto_picks_the_vendors_collective_only_on_real_gpus_with_a_torch_that_has_it(
    monkeypatch, vendor: str, described: str, words: str, lacking: str
) -> None:
    """``backend="auto"``: the vendor's collective (NCCL, RCCL as torch's nccl, XCCL) where torch has
    it, gloo where it lacks it, where the run has no GPUs, and for more ranks than GPUs."""
    from pytest_gpu.distributed import backends

    implementation = vendors.of(vendor)
    inventory = Inventory(MACHINES[vendor][:2], "driver", machine=MACHINES[vendor], vendor=vendor)

    def lacks(said: str | None) -> None:
        if implementation.collective == "xccl":
            monkeypatch.setattr(backends, "xccl_missing", lambda inv: said)
        else:
            monkeypatch.setattr(backends, "torch_nccl_missing", lambda: said)

    lacks(None)
    choice = backends.auto_backend(inventory)
    assert choice == backends.AutoChoice(implementation.collective, f"{described} and a torch with {words}")
    assert choice.describe() == f"{implementation.collective}: {described} and a torch with {words}"
    assert backends.fit_ranks(choice, 2, inventory) is choice
    assert backends.fit_ranks(choice, 3, inventory) == backends.AutoChoice(
        "gloo", f"3 ranks would need 3 GPUs for {implementation.collective} and this run has {described}"
    )
    lacks(lacking)
    assert backends.auto_backend(inventory) == backends.AutoChoice("gloo", lacking)
    assert backends.fit_ranks(backends.AutoChoice("gloo", lacking), 3, inventory).backend == "gloo"
    monkeypatch.undo()  # torch as it is here: a run without GPUs has no use for it
    none = Inventory((), "auto", "NVML unavailable: NVML Shared Library Not Found", vendor=vendor)
    assert backends.auto_backend(none) == backends.AutoChoice(
        "gloo", "this run has no GPUs (NVML unavailable: NVML Shared Library Not Found)"
    )
