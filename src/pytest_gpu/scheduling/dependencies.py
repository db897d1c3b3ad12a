"""Dependency groups: tests linked by pytest-dependency or pytest-depends edges, kept on one worker.

pytest-dependency records outcomes per process (on the session, package, module and
class nodes of the process that ran the test), so under xdist a dependent test only sees
its dependency's outcome when both ran in the same worker, in order. The scheduler sends
each connected set of linked tests ("dependency group") to one worker in collection
order; this module computes those groups from collected items alone.

The naming and lookup rules mirror pytest-dependency 0.6.1 (``DependencyManager.addResult``,
``checkDepend``, ``pytest_runtest_makereport``, ``pytest_runtest_setup``). Where a rule
cannot be mirrored exactly the grouping errs towards linking more tests: an extra link
only costs parallelism, a missing one turns a passing dependent test into a skip.
pytest-dependency itself is never imported here: it is an optional dependency.

pytest-depends (``@pytest.mark.depends(on=[...])``) has the same problem: its
``DependencyManager`` keeps every outcome in the process that ran the test, and a
dependency that ran elsewhere counts as failed. Its chains join the same groups; its
name map and lookup are mirrored from pytest-depends 1.0.1 (``util.get_names``,
``util.get_absolute_nodeid``, ``main.TestDependencies``), not imported (none of it is a
public API). It sorts the collected items so that every test comes after what it depends
on; a group keeps that (collection) order.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import pytest

__all__ = ["GROUP_PREFIX", "automark_enabled", "dependency_groups", "depends_active"]

GROUP_PREFIX = "dependency:"
MARKER = "dependency"
AUTOMARK_INI = "automark_dependency"

# pytest-dependency's DependencyManager.ScopeCls: one results table per node of these types.
_SCOPE_TYPES: dict[str, type[pytest.Collector]] = {
    "session": pytest.Session,
    "package": pytest.Package,
    "module": pytest.Module,
    "class": pytest.Class,
}
_DEFAULT_SCOPE = "module"  # pytest_runtest_setup: marker.kwargs.get('scope', 'module')
_TRUE = frozenset({"y", "yes", "t", "true", "on", "1"})  # pytest's own bool ini spelling

# pytest-depends 1.0.1 (pytest_depends.constants and util.REGEX_PARAMETERS).
DEPENDS_MARKER = "depends"
_DEPENDS_NAME = "name"
_DEPENDS_ON = "on"
_DEPENDS_PLUGINS = ("depends", "pytest_depends")  # its entry point name; its module, as ``-p pytest_depends``
_PARAMETERS = re.compile(r"\[.+\]$")


def automark_enabled(config: pytest.Config) -> bool:
    """Whether pytest-dependency's ``automark_dependency`` ini option is on.

    False when pytest-dependency is not installed or not active (``-p no:dependency``):
    then the ini option is unknown to pytest and nothing records outcomes anyway.
    """
    try:
        value: Any = config.getini(AUTOMARK_INI)
    except (ValueError, KeyError):
        return False
    if isinstance(value, str):  # registered without type="bool" by some other version
        return value.strip().lower() in _TRUE
    return bool(value)


def depends_active(config: pytest.Config) -> bool:
    """Whether pytest-depends is registered in this session (not blocked with ``-p no:depends``).

    Without it a ``depends`` marker is someone else's or nobody's, and nothing is grouped for it.
    """
    manager = config.pluginmanager
    if any(manager.has_plugin(name) for name in _DEPENDS_PLUGINS):
        return True
    return any(getattr(plugin, "__name__", None) == "pytest_depends" for plugin in manager.get_plugins())


def dependency_groups(
    items: Sequence[pytest.Item], automark: bool = False, depends: bool | None = None
) -> dict[str, str]:
    """Map the nodeid of every test linked by a dependency edge to its group id.

    An edge joins a test whose ``dependency`` marker has ``depends=[...]`` to every test
    that pytest-dependency would record under one of those names in the marker's ``scope``
    (the same session / package / module / class node). Groups are the connected
    components; a group's id is ``"dependency:"`` + the nodeid of its first item in
    ``items`` order. Tests in no edge (unmarked, marked without ``depends``, or depending
    only on names nothing records) are absent from the result.

    ``automark`` is pytest-dependency's ``automark_dependency`` ini value (see
    `automark_enabled`): when true every test records its outcome, marked or not.

    ``depends``: whether pytest-depends' ``depends(on=...)`` edges link tests as well
    (None: when pytest-depends is active in the items' session, see `depends_active`).
    Such an edge joins a test to every test its ``on`` names resolve to, as pytest-depends
    resolves them (`_depends_edges`); both kinds of edge make one set of groups.
    Linear in the number of items and dependency names.
    """
    n = len(items)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    # (scope, scope node, recorded name) -> items recording that name there.
    recorded: dict[tuple[str, pytest.Collector, Hashable], list[int]] = {}
    # (item, scope, names it depends on), checked once every name is known.
    dependents: list[tuple[int, Any, list[Hashable]]] = []
    for index, item in enumerate(items):
        marker = item.get_closest_marker(MARKER)  # as pytest-dependency: closest marker wins
        if marker is None and not automark:
            continue
        custom = marker.kwargs.get("name") if marker is not None else None
        for scope, node_type in _SCOPE_TYPES.items():
            node = item.getparent(node_type)
            if node is None:  # e.g. no class: getManager() returns None, nothing is recorded
                continue
            name = custom if custom else _default_name(item.nodeid, scope)
            if _hashable(name):
                recorded.setdefault((scope, node, name), []).append(index)
        if marker is not None:
            depends = marker.kwargs.get("depends")
            if depends:  # pytest_runtest_setup checks only a non-empty `depends`
                scope = marker.kwargs.get("scope", _DEFAULT_SCOPE)
                dependents.append((index, scope, _depend_names(depends)))

    linked: list[int] = []
    joined: set[tuple[str, pytest.Collector, Hashable]] = set()  # keys whose recorders are one set already
    for index, scope, names in dependents:
        scope_type = _SCOPE_TYPES.get(scope) if isinstance(scope, str) else None
        node = items[index].getparent(scope_type) if scope_type is not None else None
        if node is None:  # pytest-dependency errors out at setup: no outcome to share
            continue
        for name in names:
            key = (scope, node, name)
            targets = recorded.get(key)
            if not targets:  # unknown name: pytest-dependency skips (or ignores) it on its own
                continue
            if key not in joined:
                # Every recorder of a name feeds the one status it is looked up under (each
                # run overwrites it): join them all, once, so repeats stay linear.
                joined.add(key)
                for other in targets[1:]:
                    union(targets[0], other)
                linked.extend(targets)
            union(index, targets[0])
            linked.append(index)

    if depends is None:
        depends = bool(items) and depends_active(items[0].config)
    if depends:
        for a, b in _depends_edges(items):
            union(a, b)
            linked.extend((a, b))

    # Items sharing a nodeid (--keep-duplicates) are one key in the result: keep them together.
    first_of: dict[str, int] = {}
    for index, item in enumerate(items):
        union(first_of.setdefault(item.nodeid, index), index)

    sizes: dict[int, int] = {}
    for index in range(n):
        root = find(index)
        sizes[root] = sizes.get(root, 0) + 1
    roots = {root for root in map(find, linked) if sizes[root] >= 2}  # not a test depending on itself
    groups: dict[str, str] = {}
    for index, item in enumerate(items):
        root = find(index)
        if root in roots:
            # The root is the component's smallest index, i.e. its first item in collection order.
            groups[item.nodeid] = GROUP_PREFIX + items[root].nodeid
    return groups


def _default_name(nodeid: str, scope: str) -> str | None:
    """The name pytest-dependency records a test under when ``name=`` is not given.

    DependencyManager.addResult: the full nodeid for session and package scope, the part
    after the module for module scope, the part after the first class for class scope
    (so a nested class keeps its inner class name). None where its split would fail.
    """
    nodeid = nodeid.replace("::()::", "::")  # pre-pytest-4 instance marker, stripped there too
    if scope in ("session", "package"):
        return nodeid
    parts = nodeid.split("::", 2 if scope == "class" else 1)
    want = 3 if scope == "class" else 2
    return parts[want - 1] if len(parts) >= want else None


def _depend_names(depends: Any) -> list[Hashable]:
    """The names ``checkDepend`` looks up: it iterates ``depends`` as given."""
    if isinstance(depends, str):
        # A bare string is iterated character by character there; take the whole string as
        # well, in case a later version treats it as one name (an extra link is harmless).
        return [depends, *depends]
    if not isinstance(depends, Iterable):
        return []
    return [name for name in depends if _hashable(name)]


def _hashable(value: object) -> bool:
    """Whether ``value`` can be a results key (pytest-dependency would crash on it otherwise)."""
    if value is None:
        return False
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _depends_edges(items: Sequence[pytest.Item]) -> list[tuple[int, int]]:
    """pytest-depends' resolved dependencies, as pairs of item indices to put in one group.

    Mirrors ``DependencyManager.items`` and ``TestDependencies``: every test is known by
    its (clean) node id, that node id without its ``[parameters]``, each ``::`` prefix of
    the latter (``file.py::Class``, ``file.py``) and every ``name=`` of its ``depends``
    markers (a string or a list; all markers, class and module ones included). An ``on=``
    name (a string or a list, from every ``depends`` marker) that is not such a name is
    made absolute from the dependent's own node id (``test_x`` -> ``file.py[::Class]::test_x``,
    ``Class::test_x`` -> ``file.py::Class::test_x``) and used if that is one. Names that
    resolve to nothing are left out: pytest-depends reports them missing wherever it runs.
    A dependent depends on every test its name resolves to: those are joined together
    once per name and the dependent to the first of them, so repeats stay linear.
    """
    by_name: dict[Hashable, list[int]] = {}
    clean_ids = [_clean_nodeid(item.nodeid) for item in items]
    for index, item in enumerate(items):
        for name in _depends_names(item, clean_ids[index]):
            by_name.setdefault(name, []).append(index)

    pairs: list[tuple[int, int]] = []
    joined: set[Hashable] = set()  # resolved names whose tests are one set already
    for index, item in enumerate(items):
        for marker in item.iter_markers(DEPENDS_MARKER):
            for name in _as_list(marker.kwargs.get(_DEPENDS_ON, [])):
                if not _hashable(name):
                    continue
                if name not in by_name and isinstance(name, str):
                    name = _absolute_nodeid(name, clean_ids[index])
                targets = by_name.get(name)
                if not targets:
                    continue
                if name not in joined:
                    joined.add(name)
                    pairs.extend((targets[0], other) for other in targets[1:])
                pairs.append((index, targets[0]))
    return pairs


def _depends_names(item: pytest.Item, nodeid: str) -> set[Hashable]:
    """``pytest_depends.util.get_names``: every name pytest-depends knows ``item`` by."""
    names: set[Hashable] = {nodeid}
    nodeid = _PARAMETERS.sub("", nodeid)
    names.add(nodeid)
    while "::" in nodeid:
        nodeid = nodeid.rsplit("::", 1)[0]
        names.add(nodeid)
    for marker in item.iter_markers(DEPENDS_MARKER):
        if _DEPENDS_NAME in marker.kwargs:
            names.update(name for name in _as_list(marker.kwargs[_DEPENDS_NAME]) if _hashable(name))
    return names


def _absolute_nodeid(name: str, scope: str) -> str:
    """``pytest_depends.util.get_absolute_nodeid``: ``name`` completed from the dependent's node id."""
    parts = name.split("::")
    if len(parts) == 1:  # a bare test name: the dependent's file[::Class]
        name = f"{scope.rsplit('::', 1)[0]}::{name}"
    elif "." not in parts[0]:  # Class::test: the dependent's file
        name = f"{scope.split('::', 1)[0]}::{name}"
    return _clean_nodeid(name)


def _clean_nodeid(nodeid: str) -> str:
    """``pytest_depends.util.clean_nodeid``: without the pre-pytest-4 ``::()`` instance part."""
    return nodeid.replace("::()::", "::")


def _as_list(value: Any) -> list[Any]:
    """``pytest_depends.util.as_list``: a string is one name, anything else is iterated (if it can be)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable):
        return []  # pytest-depends fails on it; nothing to group
    return list(value)
