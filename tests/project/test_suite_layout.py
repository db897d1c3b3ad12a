"""The suite's own shape: a folder per subsystem, each named in CONTRIBUTING.md's map ("Where a
test goes"); test module names unique across the folders (pytest's default "prepend" import
mode imports each test module by its bare name, with its folder put on ``sys.path``); and every
path to one of the suite's test files written in the project (docs, CI scripts, benchmarks,
comments, the docs' ``SUITES``) names the file where it is, and the test it names is there."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from helpers import ROOT, TESTS

MAP_HEADING = "## Where a test goes"
# a folder's line in the map: "name/" then its description
MAP_LINE = re.compile(r"^([a-z0-9_]+)/ +\S", re.MULTILINE)
# a test file of this suite, as a path from the repository, and the test after "::" if any
TEST_PATH = re.compile(r"\btests/((?:[\w-]+/)*)(test_\w+\.py)(?:::(\w+))?")
# where such paths are written; CHANGELOG.md is history, and keeps the paths of its day
WRITTEN = ("README.md", "CONTRIBUTING.md", "pyproject.toml", "docs/**/*.md", "docs/**/*.py", "bench/**/*.py",
           "bench/README.md", ".ci/*", "src/**/*.py", "tests/**/*.py")  # fmt: skip


def folder_map(text: str) -> list[str]:
    """The folders CONTRIBUTING.md's map names, in its order (the first code block after its heading)."""
    section = text[text.index(MAP_HEADING) :]
    block = section.split("```")[1]
    return MAP_LINE.findall(block)


def test_the_map_names_every_folder_of_the_suite_and_no_other() -> None:
    named = folder_map((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"))
    assert len(named) == len(set(named)), named
    folders = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert sorted(named) == folders


def test_every_test_module_is_in_a_folder_and_its_name_is_the_suites_alone() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 80, "the scan found too few test files"
    assert [p.name for p in modules if p.parent == TESTS] == []  # tests/ holds the shared modules only
    twins = [name for name, count in Counter(p.name for p in modules).items() if count > 1]
    assert twins == [], "two test modules of one name: prepend mode imports only the first"
    assert not list(TESTS.rglob("__init__.py")), "the suite is rootdir-relative modules, not packages"


def written_test_paths(text: str, ours: dict[str, Path]) -> list[str]:
    """What is wrong with each path to one of ``ours`` (test files by name) written in ``text``."""
    wrong = []
    for folders, name, test in TEST_PATH.findall(text):
        if name not in ours:  # an example's file (tests/test_llm.py in a page), not the suite's
            continue
        where = ours[name].relative_to(ROOT).as_posix()
        if f"tests/{folders}{name}" != where:
            wrong.append(f"tests/{folders}{name} is {where}")
        elif test and not re.search(rf"^(?:async )?def {test}\(", ours[name].read_text(encoding="utf-8"), re.M):
            wrong.append(f"{where} has no test {test}")
    return wrong


def test_every_path_to_a_test_file_written_in_the_project_is_where_the_file_is() -> None:
    ours = {p.name: p for p in TESTS.rglob("test_*.py")}
    wrong = {}
    for pattern in WRITTEN:
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and (found := written_test_paths(path.read_text(encoding="utf-8"), ours)):
                wrong[path.relative_to(ROOT).as_posix()] = found
    assert wrong == {}


def test_the_path_check_sees_a_moved_file_and_a_missing_test() -> None:
    ours = {"test_broker.py": TESTS / "leasing" / "test_broker.py"}
    t = "tests"  # not spelled out: the check above reads this file too
    text = (
        f"see {t}/test_broker.py and {t}/leasing/test_broker.py::test_no_such_test; "
        f"{t}/leasing/test_broker.py::test_shared_grant is right, {t}/test_llm.py is a user's"
    )
    assert written_test_paths(text, ours) == [
        f"{t}/test_broker.py is {t}/leasing/test_broker.py",
        f"{t}/leasing/test_broker.py has no test test_no_such_test",
    ]
