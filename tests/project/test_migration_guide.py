"""The migration guide (docs/migration.md, "Adopting pytest-gpu in an existing suite") is real:
its "after" code blocks, taken from the page verbatim, pass as an inner run on simulated GPUs.

The guide's ``mylib.load_model`` is the suite's own code; here it is a stand-in whose
models are simulated GPU memory (``pytest_gpu.sim``), freed when the model is.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from helpers import ROOT

GUIDE = ROOT / "docs" / "migration.md"
TITLE = "# Adopting pytest-gpu in an existing suite"

MYLIB = '''
"""A stand-in for the suite's own model code: models are simulated GPU memory."""

import os

from pytest_gpu import sim

GiB = 2**30
WEIGHTS = {"small": 4 * GiB, "full": 12 * GiB}


class Model:
    def __init__(self, size, device):
        self.size = size
        # "cuda": the current device, as torch's .to("cuda"); "cuda:K": that device
        self.weights = sim.allocate(WEIGHTS[size], device=None if device == "cuda" else device)
        loads = os.environ.get("MYLIB_LOADS")
        if loads:
            with open(loads, "a") as fh:
                fh.write(f"{size} {os.getpid()} {self.weights.physical}\\n")

    def generate(self, prompt):
        with sim.allocate(GiB, device=self.weights.device):  # activations, on the model's GPU
            return prompt[::-1] or "."

    def __del__(self):  # like a tensor: the memory goes back with the last reference
        self.weights.free()


def load_model(size, device):
    return Model(size, device)
'''


def guide_files(text: str) -> dict[str, dict[str, str]]:
    """The guide's code blocks that name a file in their first line (``# conftest.py``),
    by subsection (``## Before``, ``## After``, ...) and file name."""
    assert text.startswith(TITLE + "\n"), text[:200]
    files: dict[str, dict[str, str]] = {}
    heading = ""
    for part in re.split(r"^(## .*)$", text, flags=re.MULTILINE):
        if part.startswith("## "):
            heading = part[3:].strip()
            continue
        for body in re.findall(r"^```(?:python|ini)\n(.*?)^```$", part, flags=re.MULTILINE | re.DOTALL):
            first = body.splitlines()[0]
            if match := re.fullmatch(r"# ([\w.]+\.(?:py|ini))", first):
                files.setdefault(heading, {})[match.group(1)] = body
    return files


def test_the_guide_has_the_blocks_this_test_runs() -> None:
    files = guide_files(GUIDE.read_text())
    assert set(files) == {"The suite", "Before", "After"}, files.keys()
    assert set(files["The suite"]) == {"test_llm.py"}
    assert set(files["Before"]) == {"conftest.py", "pytest.ini"}
    assert set(files["After"]) == {"conftest.py", "pytest.ini"}
    before, after = files["Before"]["conftest.py"], files["After"]["conftest.py"]
    assert "PYTEST_XDIST_WORKER" in before and "CUDA_VISIBLE_DEVICES" in before
    assert "CUDA_VISIBLE_DEVICES" not in after and "gpu_lease_factory" in after
    assert "large: exclusive" in files["After"]["pytest.ini"]


def test_the_guides_after_passes_on_simulated_gpus(gpu_pytester, run_inner, monkeypatch) -> None:
    """Two modules (the guide's test file and a copy) on 2 simulated GPUs and 2 workers: every
    test passes, no lease is broken, each module loads its model once, and the ``large`` tests
    get a whole GPU through the marker map."""
    files = guide_files(GUIDE.read_text())
    after = {**files["The suite"], **files["After"]}
    for name, body in after.items():
        (gpu_pytester.path / name).write_text(body)
    (gpu_pytester.path / "test_llm_copy.py").write_text(after["test_llm.py"])
    (gpu_pytester.path / "mylib.py").write_text(MYLIB)
    loads = gpu_pytester.path / "loads.txt"
    monkeypatch.setenv("MYLIB_LOADS", str(loads))
    junit = gpu_pytester.path / "junit.xml"
    result = run_inner(
        "--gpus", "sim:2x16GiB", "-n", "2", "--strict-markers", f"--junitxml={junit}", "-rA", subprocess=True
    )
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK, out
    result.assert_outcomes(passed=6)
    assert "broke its GPU lease" not in out, out
    assert re.search(r"^pytest-gpu: 2 simulated GPUs .* · 0 violations$", out, flags=re.MULTILINE), out

    records = [line.split() for line in loads.read_text().splitlines()]
    assert sorted(size for size, _, _ in records) == ["full", "full", "small", "small"], records  # once per module

    requests = {}
    held = {}
    for case in ET.parse(junit).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        requests[f"{case.get('classname')}::{case.get('name')}"] = props.get("gpu_request")
        held[f"{case.get('classname')}::{case.get('name')}"] = "model" in (props.get("gpu_held") or "")
    assert requests == {
        f"{module}::{name}": request
        for module in ("test_llm", "test_llm_copy")
        for name, request in [
            ("test_generate", None),  # no lease of its own: on the model's GPU, within the model's lease
            # none of its own either; the model's lease, judged in its teardown (where the module's
            # fixture ends), is reported through it: the report's only GPU properties are that holding's
            ("test_batch", ""),
            ("test_full_size", "1 GPU (whole GPU)"),  # large: exclusive
        ]
    }
    assert held == {
        f"{m}::{n}": n == "test_batch"
        for m in ("test_llm", "test_llm_copy")
        for n in ("test_generate", "test_batch", "test_full_size")
    }
