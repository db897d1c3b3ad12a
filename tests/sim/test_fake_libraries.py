"""What every fake driver library of the simulated GPUs shares, each vendor's alike: the fake
NVML (:mod:`pytest_gpu.sim.nvml`), ``libamd_smi.so`` (:mod:`pytest_gpu.sim.amdsmi`),
``libamdhip64.so`` (:mod:`pytest_gpu.sim.hip`) and the Level Zero loader (:mod:`pytest_gpu.sim.zes`)
compile without a warning, and have room for every machine a spec may describe. What each one
answers is its own file's (``test_fake_nvml.py``, ``test_fake_amdsmi.py``, ``test_fake_hip.py``,
``test_xpu.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from conftest import amdsmi_site, require
from pytest_gpu.sim import amdsmi, hip, nvml, spec, zes

LIBRARIES = {"nvml": nvml, "amdsmi": amdsmi, "hip": hip, "zes": zes}
# (library, the defines of a variant it is built as)
VARIANTS = [("nvml", ()), ("nvml", ("-DFAKE_NVML_NO_V3",)), ("amdsmi", ()), ("hip", ()), ("zes", ())]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "defines"), VARIANTS, ids=["nvml", "nvml-nov3", "amdsmi", "hip", "zes"])
def test_the_source_compiles_without_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, defines: tuple[str, ...]
) -> None:
    require("C compiler", executable="cc")
    library: ModuleType = LIBRARIES[name]
    sources = [str(library.SOURCE)]
    if library is amdsmi:  # with the stubs it generates for what the installed package binds
        monkeypatch.syspath_prepend(amdsmi_site())
        generated = tmp_path / "unsupported.c"
        generated.write_text(amdsmi._unsupported())
        sources.append(str(generated))
        assert len(amdsmi.wrapper_symbols()) > 100  # the package was found: the stubs are there
    strict = ("-std=c11", "-Wall", "-Wextra", "-Werror")
    done = subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", *strict, *defines, "-o", str(tmp_path / "lib.so"), *sources],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", list(LIBRARIES))
def test_a_spec_within_its_bounds_fits_the_librarys_arrays(name: str) -> None:
    """A spec within :mod:`pytest_gpu.sim.spec`'s bounds must fit each library's fixed arrays."""
    source = LIBRARIES[name].SOURCE.read_text()
    assert f"#define MAX_GPUS {spec.MAX_GPUS}\n" in source
    if name == "nvml":  # MIG instances: NVIDIA's alone
        assert f"#define MAX_MIG {spec.MAX_MIG} " in source
