"""The documentation is true: the README and the site under docs/ (MkDocs, mkdocs.yml).

- The options reference is generated from the options table in code (docs/hooks.py runs
  ``pytest_gpu.run.options.register`` against a recorder); these tests hold the generator to
  pytest's own parser and keep the hand-written text around it (the README's short table,
  the notes) to options that exist, with the defaults the code gives.
- A code block whose first line names a file (``# test_tour.py``, ``# conftest.py``) is part
  of a suite, and every such block is run by a test: the README's tour here, the migration
  guide in tests/project/test_migration_guide.py, the ``gpu_marker_map`` example in
  tests/run/test_conventions.py. A new one fails :func:`test_every_suite_in_the_docs_is_run`
  until it is given a test.
- ``mkdocs build --strict`` (in .ci/run) checks every link and anchor of the site, the
  README's included (it is the site's home page).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
import textwrap
from types import ModuleType

import pytest

from conftest import require
from helpers import ROOT
from pytest_gpu.run import options

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pytest_gpu_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _pages() -> dict[str, str]:
    """README.md and every page of the site, by path relative to the repository."""
    pages = {"README.md": README.read_text(encoding="utf-8")}
    for path in sorted(DOCS.rglob("*.md")):
        pages[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
    return pages


# -- the options reference ----------------------------------------------------------------


def _real_parser() -> tuple[set[str], set[str]]:
    """The option strings and ini keys ``register`` gives pytest's own parser."""
    from _pytest.config.argparsing import Parser

    parser = Parser(_ispytest=True)
    options.register(parser)
    names = {name for group in parser._groups for opt in group.options for name in opt.names()}
    names |= {name for opt in parser._anonymous.options for name in opt.names()}
    return names, set(parser._inidict)


def test_the_options_reference_is_the_code_s_table() -> None:
    hooks = _hooks()
    entries = hooks.option_entries()
    option_names, ini_keys = _real_parser()
    assert {e.option for e in entries if e.option} == option_names
    assert {e.ini for e in entries if e.ini} == ini_keys
    by_ini = {e.ini: e for e in entries if e.ini}
    for option, ini, default, help_text in options.OPTIONS:
        entry = by_ini[ini]
        assert (entry.option, entry.default, entry.help) == (option, default, help_text), entry
    table = hooks.options_table()
    rows = [line for line in table.splitlines() if line.startswith("| `") or line.startswith("| —")]
    assert len(rows) == len(entries)
    for e in entries:
        name = e.option or e.ini
        (row,) = [r for r in rows if r.startswith(f"| `{name}` ") or r.startswith(f"| — | `{name}` ")]
        assert e.help.replace("|", "\\|") in row, row
    # the launcher markers' built-in table is the code's, not "empty"
    (launchers,) = [r for r in rows if "`launcher_markers`" in r]
    assert "`torch_dist: torchrun srun mpirun`" in launchers, launchers


def test_the_options_page_is_generated_not_written() -> None:
    hooks = _hooks()
    page = (DOCS / "reference" / "options.md").read_text(encoding="utf-8")
    assert page.count(hooks.PLACEHOLDER) == 1
    assert not re.search(r"^\| `--", page, flags=re.MULTILINE), "an option row written by hand"
    rendered = hooks.on_page_markdown(page, None, {"config_file_path": str(ROOT / "mkdocs.yml")}, None)
    assert "| `--gpus` | `gpus` | `auto` |" in rendered
    # the notes name only options and ini keys that exist
    known = {e.option for e in hooks.option_entries()} | {e.ini for e in hooks.option_entries()}
    named = set(re.findall(r"`(--[a-z][a-z-]*)", page)) | set(re.findall(r"^- `([a-z_]+)`", page, flags=re.M))
    assert named and named <= known, named - known


def test_the_readme_options_table_has_the_code_s_defaults() -> None:
    readme = README.read_text(encoding="utf-8")
    section = readme[readme.index("### Options") :]
    section = section[: section.index("\n## ")]
    rows = re.findall(r"^\| `(--[a-z-]+)` \| ([^|]+) \|", section, flags=re.MULTILINE)
    assert len(rows) >= 5, rows
    defaults = {option: default for option, _, default, _ in options.OPTIONS}
    for option, shown in rows:
        expected = f"`{defaults[option]}`" if defaults[option] else "empty"
        assert shown.strip() == expected, (option, shown)


# -- the README and the site ----------------------------------------------------------------


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"


def test_the_readme_links_resolve() -> None:
    """GitHub renders the README from the root: its relative links must name files there
    (the site checks them again, anchors included, as its home page)."""
    readme = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(((?!https?:|#)[^)#]+)(?:#[^)]*)?\)", readme)
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


def _table_problems(text: str) -> list[str]:
    """Tables of a Markdown page that do not render (GitHub's rules): a header without a
    separator row under it, or a row whose cell count (split on every unescaped ``|``, in
    code spans too) differs from the header's."""
    problems, table, fenced = [], [], False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("|"):
            table.append((number, line))
            continue
        if table:
            (first, header), *rows = table
            width = len(re.split(r"(?<!\\)\|", header.strip().strip("|")))
            if not rows or not re.fullmatch(r"\|( *:?-+:? *\|)+", rows[0][1].strip()):
                problems.append(f"line {first}: a header without a separator row")
            for row_number, row in rows:
                cells = len(re.split(r"(?<!\\)\|", row.strip().strip("|")))
                if cells != width:
                    problems.append(f"line {row_number}: {cells} cells, the header has {width}")
            table = []
    return problems


def test_every_table_renders() -> None:
    pages = _pages()
    for name in ("CONTRIBUTING.md", "bench/README.md"):  # included in the site's pages
        pages[name] = (ROOT / name).read_text(encoding="utf-8")
    broken = {name: problems for name, text in pages.items() if (problems := _table_problems(text))}
    assert not broken, broken


def test_the_table_check_sees_a_broken_table() -> None:
    text = "| a | b | c |\n| --- | --- | --- | --- |\n| 1 | 2 | 3 |\n\n| a | b |\n| 1 | 2 |\n"
    assert _table_problems(text) == ["line 2: 4 cells, the header has 3", "line 5: a header without a separator row"]


def test_the_readme_test_command_shows_failures_and_skips_and_is_ci_s() -> None:
    """Command 2: its short summary lists failures and errors (``-r`` f, E) and each skip's
    reason (s); ``.ci/run`` installs and runs exactly it (and adds its report options)."""
    (command,) = re.findall(r"^(pip install torch.* && python -m pytest .*)$", README.read_text(encoding="utf-8"), re.M)
    *installs, run = (part.strip() for part in command.split("&&"))
    chars = "".join(arg[2:] for arg in shlex.split(run) if arg.startswith("-r"))
    chars = chars.replace("A", "a").replace("a", "fEsxX")
    assert {"f", "E", "s"} <= set(chars), f"{run!r}: its -r must show failures, errors and skips"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for install in installs:
        assert "python -m " + install.replace("pip install ", "pip install -q ") in ci, install
    assert re.search(rf"^{re.escape(run)}( |$)", ci, re.M), f".ci/run does not run {run!r}"


def test_the_site_home_page_is_the_readme() -> None:
    hooks = _hooks()
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    rendered = hooks.on_page_markdown(home, None, {"config_file_path": str(ROOT / "mkdocs.yml")}, None)
    assert rendered.startswith("# pytest-gpu\n")
    assert "](docs/" not in rendered and "](reference/options.md)" in rendered


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert pages
    assert [p for p in pages if f": {p}\n" not in nav] == []


# -- code blocks that are suites ------------------------------------------------------------

FILE_BLOCK = re.compile(r"^```(?:python|ini)\n# ([\w.]+\.(?:py|ini))\n(.*?)^```$", re.MULTILINE | re.DOTALL)

# (page, file) -> the test that runs it
SUITES = {
    ("README.md", "test_tour.py"): "tests/project/test_docs.py::test_the_readme_tour_passes_on_simulated_gpus",
    ("docs/migration.md", "test_llm.py"): "tests/project/test_migration_guide.py",
    ("docs/migration.md", "conftest.py"): "tests/project/test_migration_guide.py",
    ("docs/migration.md", "pytest.ini"): "tests/project/test_migration_guide.py",
    ("docs/requests.md", "conftest.py"): "tests/run/test_conventions.py::test_the_readme_example",
    ("docs/real-gpus.md", "conftest.py"): (
        "tests/project/test_docs.py::test_the_confine_hook_example_confines_a_framework"
    ),
}


def file_blocks(text: str) -> dict[str, str]:
    """The code blocks of a page that name a file in their first line, by file name (the
    last one wins: a page's "after" follows its "before")."""
    return {name: f"# {name}\n{body}" for name, body in FILE_BLOCK.findall(text)}


def test_every_suite_in_the_docs_is_run() -> None:
    found = {(page, name) for page, text in _pages().items() for name in file_blocks(text)}
    assert found == set(SUITES), f"new: {found - set(SUITES)}, gone: {set(SUITES) - found}"


def _tour_command() -> list[str]:
    """The command the README's tour gives for a machine without GPUs."""
    readme = README.read_text(encoding="utf-8")
    intro = readme[readme.index("## A 2-minute tour") : readme.index("```python\n# test_tour.py")]
    (command,) = re.findall(r"without GPUs, `(pytest [^`]+)`", intro)
    return command.split()


def test_the_readme_tour_passes_on_simulated_gpus(gpu_pytester: pytest.Pytester) -> None:
    """The tour file as the README has it, with nothing beside it (no conftest), run with the
    command the README gives for a machine without GPUs, on torch's CPU build: every test
    passes, and what it puts on "cuda", ``gpu.device`` and ``lease.device`` was charged to the
    GPU the test leased (the run's trace, which only records: each such test peaked at one
    2 MiB segment of torch's small pool there; the others at nothing)."""
    require("torch", module="torch")
    tour = file_blocks(README.read_text(encoding="utf-8"))["test_tour.py"]
    gpu_pytester.makepyfile(test_tour=tour)
    command = _tour_command()
    assert command == ["pytest", "-n", "4", "--gpus", "sim:4x16GiB"]
    trace = gpu_pytester.path / "run.json"
    result = gpu_pytester.run(sys.executable, "-m", *command, f"--gpu-trace={trace}", timeout=300)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK, out + result.stderr.str()
    result.assert_outcomes(passed=6)
    assert sorted(p.name for p in gpu_pytester.path.glob("*.py")) == ["test_tour.py"]  # no conftest
    assert re.search(r"^pytest-gpu: 4 simulated GPUs .* · 0 violations$", out, flags=re.MULTILINE), out
    events = json.loads(trace.read_text())["traceEvents"]
    leased = {e["name"]: e["args"]["gpus"] for e in events if e.get("cat") == "test"}
    peaks: dict[str, list[tuple[int, int]]] = {}
    for event in events:
        if event.get("cat") == "lease":
            peaks.setdefault(event["name"], []).append((event["args"]["gpu"], event["args"]["peak"]))
    segment = 2 * 2**20  # torch's small pool: the tour's tensors (4 KiB and less) share one segment
    assert peaks["test_kernel"] == [(leased["test_kernel"][0], segment)], peaks
    assert peaks["test_compile_then_run"] == [(leased["test_compile_then_run"][0], segment)], peaks
    assert [peak for _, peak in peaks["TestSmall::test_a"] + peaks["test_sharded"]] == [0, 0, 0], peaks


CONFINE_TEST = """
import pytest


def test_imports_myfw_during_the_test(gpu):
    import myfw

    assert myfw.limit == (gpu.memory, [int(d.split(":")[1]) for d in gpu.devices])


@pytest.mark.gpu(memory="2GiB")
def test_myfw_already_imported(gpu):
    import myfw

    assert myfw.limit == (2 * 2**30, [int(gpu.device.split(":")[1])])


def test_and_restored_after_each_lease():
    import myfw

    assert myfw.limit == ("unlimited", None)
"""

MYFW = """
limit = ("unlimited", None)


def memory_limit():
    return limit[0]


def set_memory_limit(value, devices):
    global limit
    limit = (value, None if value == "unlimited" else list(devices))
"""


def test_the_confine_hook_example_confines_a_framework(gpu_pytester: pytest.Pytester, run_inner) -> None:
    """docs/real-gpus.md's ``pytest_gpu_confine`` conftest, verbatim, on a stand-in framework:
    applied when the test imports it and when it was imported before, undone after the lease."""
    conftest = file_blocks((DOCS / "real-gpus.md").read_text(encoding="utf-8"))["conftest.py"]
    gpu_pytester.makeconftest(conftest)
    gpu_pytester.makepyfile(myfw=MYFW, test_confine=textwrap.dedent(CONFINE_TEST))
    result = run_inner("--gpus", "sim:2x16GiB", "-p", "no:randomly")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=3)
