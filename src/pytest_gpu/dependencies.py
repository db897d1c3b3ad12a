"""Dependency groups: tests linked by pytest-dependency edges, kept together on one worker.

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
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import pytest

__all__ = ["GROUP_PREFIX", "automark_enabled", "dependency_groups"]

GROUP_PREFIX = "dependency:"
MARKER = "dependency"
AUTOMARK_INI = "automark_dependency"

# pytest-dependency's DependencyManager.ScopeCls: one results table per node of these types.
_SCOPE_TYPES: dict[str, type[pytest.Node]] = {
    "session": pytest.Session,
    "package": pytest.Package,
    "module": pytest.Module,
    "class": pytest.Class,
}
_DEFAULT_SCOPE = "module"  # pytest_runtest_setup: marker.kwargs.get('scope', 'module')
_TRUE = frozenset({"y", "yes", "t", "true", "on", "1"})  # pytest's own bool ini spelling


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


def dependency_groups(items: Sequence[pytest.Item], automark: bool = False) -> dict[str, str]:
    """Map the nodeid of every test linked by a dependency edge to its group id.

    An edge joins a test whose ``dependency`` marker has ``depends=[...]`` to every test
    that pytest-dependency would record under one of those names in the marker's ``scope``
    (the same session / package / module / class node). Groups are the connected
    components; a group's id is ``"dependency:"`` + the nodeid of its first item in
    ``items`` order. Tests in no edge (unmarked, marked without ``depends``, or depending
    only on names nothing records) are absent from the result.

    ``automark`` is pytest-dependency's ``automark_dependency`` ini value (see
    `automark_enabled`): when true every test records its outcome, marked or not.
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
    recorded: dict[tuple[str, pytest.Node, Hashable], list[int]] = {}
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
    joined: set[tuple[str, pytest.Node, Hashable]] = set()  # keys whose recorders are one set already
    for index, scope, names in dependents:
        node_type = _SCOPE_TYPES.get(scope) if isinstance(scope, str) else None
        node = items[index].getparent(node_type) if node_type is not None else None
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
