"""Dependency groups (`pytest_gpu.scheduling.dependencies`): which collected tests must share a worker."""

from __future__ import annotations

import textwrap

import pytest

from conftest import INNER_ARGS, require
from helpers import by_group
from pytest_gpu.scheduling.dependencies import GROUP_PREFIX, automark_enabled, dependency_groups

# Registers the marker even where pytest-dependency is not installed (the lines add up).
INI = """
[pytest]
markers =
    dependency(name=None, depends=[], scope='module'): pytest-dependency
"""


def collect(pytester: pytest.Pytester, *args: str, **files: str) -> tuple[list[pytest.Item], pytest.Config]:
    """Write ``files`` (name, ``.py`` implied -> source) and collect them in-process."""
    if not (pytester.path / "tox.ini").exists():  # makeini writes tox.ini
        pytester.makeini(INI)
    for name, source in files.items():
        path = pytester.path / (name if name.endswith(".py") else f"{name}.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    items, reprec = pytester.inline_genitems(*INNER_ARGS, *args)
    assert not reprec.getfailedcollections()
    return items, items[0].config


def groups_of(pytester: pytest.Pytester, **files: str) -> dict[str, str]:
    items, _ = collect(pytester, **files)
    return dependency_groups(items)


@pytest.fixture
def tester(gpu_pytester: pytest.Pytester) -> pytest.Pytester:
    return gpu_pytester


def test_module_scope_chain(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_mod="""
            import pytest

            @pytest.mark.dependency()
            def test_a(): pass

            @pytest.mark.dependency(depends=["test_a"])
            def test_b(): pass

            @pytest.mark.dependency(depends=["test_b"])
            def test_c(): pass

            def test_unmarked(): pass

            @pytest.mark.dependency()
            def test_marked_no_edges(): pass
        """,
    )
    group = GROUP_PREFIX + "test_mod.py::test_a"
    assert groups == {f"test_mod.py::{name}": group for name in ("test_a", "test_b", "test_c")}


def test_class_and_module_names_differ(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_cls="""
            import pytest

            @pytest.mark.dependency()
            def test_a(): pass

            class TestX:
                @pytest.mark.dependency()
                def test_a(self): pass

                # class scope: "test_a" is this class's test_a, not the module's
                @pytest.mark.dependency(depends=["test_a"], scope="class")
                def test_b(self): pass

                # module scope (the default): "test_a" is the module-level function
                @pytest.mark.dependency(depends=["test_a"])
                def test_c(self): pass

                @pytest.mark.dependency(depends=["TestX::test_a"], scope="module")
                def test_d(self): pass

                # in class scope the class name is not part of the name: unknown
                @pytest.mark.dependency(depends=["TestX::test_a"], scope="class")
                def test_e(self): pass
        """,
    )
    assert by_group(groups) == {
        GROUP_PREFIX + "test_cls.py::test_a": {"test_cls.py::test_a", "test_cls.py::TestX::test_c"},
        GROUP_PREFIX + "test_cls.py::TestX::test_a": {
            "test_cls.py::TestX::test_a",
            "test_cls.py::TestX::test_b",
            "test_cls.py::TestX::test_d",
        },
    }


def test_class_scope_stays_in_its_class(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_two_classes="""
            import pytest

            class TestA:
                @pytest.mark.dependency()
                def test_x(self): pass

            class TestB:
                @pytest.mark.dependency(depends=["test_x"], scope="class")
                def test_y(self): pass

            # no class at all: pytest-dependency finds no class manager (setup error)
            @pytest.mark.dependency(depends=["test_x"], scope="class")
            def test_z(): pass
        """,
    )
    assert groups == {}


def test_nested_class_keeps_inner_class_name(tester: pytest.Pytester) -> None:
    # addResult's class-scope name is nodeid.split("::", 2)[2]: "Inner::test_a" here.
    groups = groups_of(
        tester,
        test_nested="""
            import pytest

            class TestOuter:
                class TestInner:
                    @pytest.mark.dependency()
                    def test_a(self): pass

                    @pytest.mark.dependency(depends=["TestInner::test_a"], scope="class")
                    def test_b(self): pass

                    @pytest.mark.dependency(depends=["test_a"], scope="class")
                    def test_c(self): pass
        """,
    )
    prefix = "test_nested.py::TestOuter::TestInner::"
    assert groups == {
        prefix + "test_a": GROUP_PREFIX + prefix + "test_a",
        prefix + "test_b": GROUP_PREFIX + prefix + "test_a",
    }


def test_session_scope_across_modules(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_one="""
            import pytest

            @pytest.mark.dependency()
            def test_a(): pass
        """,
        test_two="""
            import pytest

            @pytest.mark.dependency(depends=["test_one.py::test_a"], scope="session")
            def test_b(): pass

            # module scope only sees this module
            @pytest.mark.dependency(depends=["test_one.py::test_a"])
            def test_c(): pass
        """,
    )
    group = GROUP_PREFIX + "test_one.py::test_a"
    assert groups == {"test_one.py::test_a": group, "test_two.py::test_b": group}


def test_package_scope(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        **{
            "pkg/__init__.py": "",
            "pkg/test_p1.py": """
                import pytest

                @pytest.mark.dependency()
                def test_a(): pass
            """,
            "pkg/test_p2.py": """
                import pytest

                @pytest.mark.dependency(depends=["pkg/test_p1.py::test_a"], scope="package")
                def test_b(): pass
            """,
            # not in a package: no package manager (pytest-dependency errors at setup)
            "test_top.py": """
                import pytest

                @pytest.mark.dependency(depends=["pkg/test_p1.py::test_a"], scope="package")
                def test_c(): pass
            """,
        },
    )
    group = GROUP_PREFIX + "pkg/test_p1.py::test_a"
    assert groups == {"pkg/test_p1.py::test_a": group, "pkg/test_p2.py::test_b": group}


def test_custom_name_replaces_nodeid_name(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_named="""
            import pytest

            @pytest.mark.dependency(name="alpha")
            def test_a(): pass

            @pytest.mark.dependency(depends=["alpha"])
            def test_b(): pass

            @pytest.mark.dependency(depends=["test_a"])
            def test_c(): pass

            @pytest.mark.dependency(depends=["alpha"], scope="session")
            def test_d(): pass
        """,
    )
    group = GROUP_PREFIX + "test_named.py::test_a"
    assert groups == {"test_named.py::test_a": group, "test_named.py::test_b": group, "test_named.py::test_d": group}


def test_parametrized_ids(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_params="""
            import pytest

            @pytest.mark.dependency()
            @pytest.mark.parametrize("x", [1, 2])
            def test_p(x): pass

            @pytest.mark.dependency(depends=["test_p[1]"])
            def test_q(): pass

            @pytest.mark.parametrize("y", [
                pytest.param(1, marks=pytest.mark.dependency(name="first")),
                pytest.param(2, marks=pytest.mark.dependency(depends=["first"])),
                pytest.param(3, marks=pytest.mark.dependency(depends=["test_p"])),
            ])
            def test_r(y): pass
        """,
    )
    assert by_group(groups) == {
        GROUP_PREFIX + "test_params.py::test_p[1]": {"test_params.py::test_p[1]", "test_params.py::test_q"},
        GROUP_PREFIX + "test_params.py::test_r[1]": {"test_params.py::test_r[1]", "test_params.py::test_r[2]"},
    }


def test_unknown_name_links_nothing(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_unknown="""
            import pytest

            @pytest.mark.dependency()
            def test_a(): pass

            @pytest.mark.dependency(depends=["test_nope"])
            def test_b(): pass

            # test_c records nothing (no marker), so it is unknown too
            def test_c(): pass

            @pytest.mark.dependency(depends=["test_c"])
            def test_d(): pass

            # depends on itself: its own outcome is not known yet at setup
            @pytest.mark.dependency(depends=["test_self"])
            def test_self(): pass
        """,
    )
    assert groups == {}


def test_independent_chains_and_merges(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_chains="""
            import pytest

            @pytest.mark.dependency()
            def test_a1(): pass

            @pytest.mark.dependency()
            def test_b1(): pass

            @pytest.mark.dependency(depends=["test_a1"])
            def test_a2(): pass

            @pytest.mark.dependency(depends=["test_b1"])
            def test_b2(): pass

            # declared before what it depends on: still grouped, id from the first item
            @pytest.mark.dependency(depends=["test_late"])
            def test_early(): pass

            @pytest.mark.dependency()
            def test_late(): pass

            @pytest.mark.dependency()
            def test_m1(): pass

            @pytest.mark.dependency()
            def test_m2(): pass

            # joins two otherwise separate tests
            @pytest.mark.dependency(depends=["test_m1", "test_m2"])
            def test_m3(): pass
        """,
    )
    mod = "test_chains.py::"
    assert by_group(groups) == {
        GROUP_PREFIX + mod + "test_a1": {mod + "test_a1", mod + "test_a2"},
        GROUP_PREFIX + mod + "test_b1": {mod + "test_b1", mod + "test_b2"},
        GROUP_PREFIX + mod + "test_early": {mod + "test_early", mod + "test_late"},
        GROUP_PREFIX + mod + "test_m1": {mod + "test_m1", mod + "test_m2", mod + "test_m3"},
    }


def test_closest_marker_wins(tester: pytest.Pytester) -> None:
    groups = groups_of(
        tester,
        test_closest="""
            import pytest

            @pytest.mark.dependency()
            class TestC:
                def test_a(self): pass  # records through the class's marker

                @pytest.mark.dependency(depends=["TestC::test_a"])
                def test_b(self): pass

            @pytest.mark.dependency(depends=["TestC::test_a"])
            class TestD:
                def test_y(self): pass  # inherits the class's depends

                @pytest.mark.dependency()
                def test_z(self): pass  # its own marker replaces the class's
        """,
    )
    mod = "test_closest.py::"
    group = GROUP_PREFIX + mod + "TestC::test_a"
    assert groups == {mod + "TestC::test_a": group, mod + "TestC::test_b": group, mod + "TestD::test_y": group}


def test_automark(tester: pytest.Pytester) -> None:
    require("pytest-dependency", module="pytest_dependency")
    tester.makeini(INI + "automark_dependency = true\n")
    items, config = collect(
        tester,
        test_auto="""
            import pytest

            def test_a(): pass

            @pytest.mark.dependency(depends=["test_a"])
            def test_b(): pass
        """,
    )
    assert automark_enabled(config) is True
    group = GROUP_PREFIX + "test_auto.py::test_a"
    assert dependency_groups(items, automark=True) == {"test_auto.py::test_a": group, "test_auto.py::test_b": group}
    assert dependency_groups(items) == {}


def test_automark_enabled_is_false_by_default_and_without_the_plugin(tester: pytest.Pytester) -> None:
    require("pytest-dependency", module="pytest_dependency")
    _, config = collect(tester, test_m="def test_a(): pass\n")
    assert automark_enabled(config) is False
    _, config = collect(tester, "-p", "no:dependency")
    with pytest.raises(ValueError):
        config.getini("automark_dependency")
    assert automark_enabled(config) is False


# What pytest-dependency itself does: run a file with it, then run each dependent test's
# group alone (in collection order); a dependent test that passed must still pass.
CROSS_CHECK = """
    import pytest

    @pytest.mark.dependency()
    def test_a(): pass

    @pytest.mark.dependency(name="named")
    @pytest.mark.parametrize("x", [1, 2])
    def test_p(x): pass

    @pytest.mark.dependency(depends=["test_a", "named"])
    def test_uses_a_and_named(): pass

    @pytest.mark.dependency()
    @pytest.mark.parametrize("x", [1, 2])
    def test_q(x): pass

    @pytest.mark.dependency(depends=["test_q[1]"])
    def test_uses_param_id(): pass

    @pytest.mark.dependency(depends=["test_missing"])
    def test_uses_unknown(): pass

    class TestK:
        @pytest.mark.dependency()
        def test_a(self): pass

        @pytest.mark.dependency(depends=["test_a"], scope="class")
        def test_class_scope(self): pass

        @pytest.mark.dependency(depends=["TestK::test_a"])
        def test_module_scope(self): pass

        @pytest.mark.dependency(depends=["test_cross.py::TestK::test_a"], scope="session")
        def test_session_scope(self): pass

        class TestInner:
            @pytest.mark.dependency()
            def test_i(self): pass

            @pytest.mark.dependency(depends=["TestInner::test_i"], scope="class")
            def test_inner(self): pass
"""

KEEP_CONFTEST = """
    import os

    def pytest_collection_modifyitems(config, items):
        keep = os.environ.get("KEEP_NODEIDS")
        if keep is not None:
            wanted = set(keep.split("|"))
            items[:] = [item for item in items if item.nodeid in wanted]
"""


def test_groups_suffice_for_pytest_dependency(tester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    require("pytest-dependency", module="pytest_dependency")
    items, _ = collect(tester, **{"test_cross.py": CROSS_CHECK, "conftest.py": KEEP_CONFTEST})
    groups = dependency_groups(items)
    assert "test_cross.py::test_uses_unknown" not in groups
    # test_a + test_p (named) / test_q[1] / class TestK / class TestInner
    assert len(by_group(groups)) == 4

    # The names above are right: pytest-dependency skips only the unknown one.
    full = tester.runpytest_inprocess(*INNER_ARGS, "-rs")
    full.assert_outcomes(passed=len(items) - 1, skipped=1)
    full.stdout.fnmatch_lines(["*test_uses_unknown depends on test_missing*"])

    # Each group on its own, in collection order, is enough: nothing in it is skipped.
    for group in by_group(groups):
        members = [item.nodeid for item in items if groups.get(item.nodeid) == group]
        monkeypatch.setenv("KEEP_NODEIDS", "|".join(members))
        alone = tester.runpytest_inprocess(*INNER_ARGS)
        alone.assert_outcomes(passed=len(members))


def test_ten_thousand_items_in_a_hundred_chains(tester: pytest.Pytester) -> None:
    items, _ = collect(
        tester,
        test_big="""
            import pytest

            @pytest.mark.parametrize("i", [
                pytest.param(i, marks=pytest.mark.dependency(name=f"n{i}", depends=[f"n{i - 1}"] if i % 100 else []))
                for i in range(10_000)
            ])
            def test_chain(i): pass
        """,
    )
    assert len(items) == 10_000
    groups = dependency_groups(items, automark=True)
    assert len(groups) == 10_000
    assert len(set(groups.values())) == 100  # a chain of 100 per group
