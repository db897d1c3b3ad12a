"""The package's shape: the map in ``pytest_gpu/__init__.py`` is true, pure modules are pure,
and imports run one way between the layers it states, with no circle between modules
(issue 19: "imports run one way between layers", instead of caps on sizes)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import pytest_gpu

PACKAGE = Path(pytest_gpu.__file__).parent
# what a pure module must not reach, directly or through the package's modules it imports
IMPURE = {
    "pytest", "_pytest", "pluggy", "xdist", "os", "sys", "io", "subprocess", "socket", "select", "selectors",
    "signal", "fcntl", "pathlib", "shutil", "tempfile", "glob", "time", "threading", "multiprocessing",
    "asyncio", "ctypes", "urllib", "http", "psutil", "pynvml", "filelock", "torch", "cupy", "ray", "mpi4py",
    "matplotlib", "importlib", "random", "secrets",
}  # fmt: skip


def _modules() -> dict[str, Path]:
    """Dotted name relative to the package (``leasing.broker``; ``plugin``) -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if rel.name == "__init__" and len(rel.parts) > 2:
            rel = rel.parent  # a package inside a folder (sim/nvml) is one of the folder's modules
        elif rel.name in ("__init__", "__main__"):
            continue
        found[".".join(rel.parts)] = path
    return found


def _map() -> tuple[dict[str, str], set[str]]:
    """The package docstring's map: dotted module -> description, and the modules it calls pure."""
    doc = pytest_gpu.__doc__ or ""
    names: dict[str, str] = {}
    folder = ""
    for line in doc.splitlines():
        if line.startswith("Layers"):
            break  # the layers follow the map
        top = re.match(r"^ {4}(\w+)(/?)\s+(.*)$", line)
        child = re.match(r"^ {8}(\w+)\s+(.*)$", line)
        if top:
            folder = top.group(1) if top.group(2) else ""
            if not top.group(2):
                names[top.group(1)] = top.group(3)
        elif child and folder:
            names[f"{folder}.{child.group(1)}"] = child.group(2)
    pure = {name for name, text in names.items() if "(pure)" in text}
    return names, pure


def test_the_package_map_names_every_module_and_only_those() -> None:
    names, _ = _map()
    modules = _modules()
    assert sorted(set(modules) - set(names)) == [], "modules missing from the map in pytest_gpu/__init__.py"
    assert sorted(set(names) - set(modules)) == [], "the map names modules that do not exist"


def _imports(path: Path, module: str, source: str | None = None, *, typing: bool = False) -> tuple[set[str], set[str]]:
    """(outside top-level modules, package modules) ``path`` (or ``source``) imports at module
    level or in a function; under TYPE_CHECKING too with ``typing``."""
    tree = ast.parse(path.read_text() if source is None else source)
    package_parts = module.split(".")[:-1]
    outside: set[str] = set()
    inside: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == "pytest_gpu":
                    inside.add(alias.name.removeprefix("pytest_gpu").lstrip("."))
                else:
                    outside.add(top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
                for alias in node.names:
                    inside.add(f"{target}.{alias.name}".lstrip("."))
                inside.add(target)
            elif node.module and node.module.split(".")[0] == "pytest_gpu":
                target = node.module.removeprefix("pytest_gpu").lstrip(".")
                inside.update({target, *(f"{target}.{a.name}".lstrip(".") for a in node.names)})
            elif node.module and node.module != "__future__":
                outside.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return outside, inside


def _reach(module: str, modules: dict[str, Path]) -> dict[str, str]:
    """Every outside module ``module`` reaches through the package -> the package module that imports it."""
    seen: set[str] = set()
    reached: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = modules.get(name) or (PACKAGE / name.replace(".", "/") / "__init__.py")
        if not path.exists():
            continue  # a name imported from a module, not a module
        outside, inside = _imports(path, name if name in modules else f"{name}.__init__")
        for top in outside:
            reached.setdefault(top, name)
        todo.extend(inside)
    return reached


def test_the_map_calls_some_modules_pure() -> None:
    _, pure = _map()
    assert {"base.requests", "machine.placement", "scheduling.planner"} <= pure


@pytest.mark.parametrize("module", sorted(_map()[1]))
def test_pure_modules_import_neither_pytest_nor_io(module: str) -> None:
    reached = _reach(module, _modules())
    bad = {top: via for top, via in reached.items() if top in IMPURE}
    assert bad == {}, f"{module} is documented as pure but reaches {bad} (module -> through which module)"


def test_the_purity_check_sees_a_transitive_import() -> None:
    """The check itself: an I/O import two modules away is found (not only direct ones)."""
    assert "os" in _reach("vendors.amd", _modules())  # amd imports os
    assert "os" in _reach("vendors.registry", _modules())  # registry imports amd


def _layers() -> dict[str, int]:
    """The package docstring's layers: a folder (or a top-level module) -> its layer (1: lowest)."""
    doc = pytest_gpu.__doc__ or ""
    text = doc[doc.index("Layers") :]
    layers: dict[str, int] = {}
    for number, names in re.findall(r"^ {4}(\d+)\. \w+:((?:.|\n {7}\S)*)", text, flags=re.MULTILINE):
        for name in names.split():
            assert name not in layers, f"{name} is in two layers of pytest_gpu/__init__.py"
            layers[name] = int(number)
    return layers


def _folder(name: str) -> str:
    """The folder a dotted module (or a folder) is in: ``run.session`` -> ``run``; ``""`` for a
    top-level module (``plugin``: no dot, not a folder)."""
    return name.split(".")[0] if "." in name or (PACKAGE / name).is_dir() else ""


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of a dotted module (or a folder): its folder's, a top-level module's own."""
    return layers.get(_folder(module) or module)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module (or folder) an imported dotted name is in (``""``: the package itself)."""
    parts = name.split(".")
    while parts:
        dotted = ".".join(parts)
        if dotted in modules or (PACKAGE / dotted.replace(".", "/")).is_dir():
            return dotted
        parts.pop()
    return None


def upward_imports(module: str, path: Path, layers: dict[str, int], source: str | None = None) -> list[str]:
    """``module``'s imports of modules it must not import, as "module (layer) -> target (layer)":
    in a layer above its own, or in another folder of its own layer (the folders of one layer
    are peers: neither imports the other). Every kind of import counts: at module level, in a
    function, under ``TYPE_CHECKING``."""
    modules = _modules()
    mine = _layer_of(module, layers)
    assert mine is not None, f"{module} is in no layer of pytest_gpu/__init__.py"
    name = module if path.name != "__init__.py" else f"{module}.__init__"
    _, inside = _imports(path, name, source, typing=True)
    targets = {t for n in inside if (t := _resolve(n, modules)) not in (None, module)}
    # ``from ..scheduling import history`` names the folder too: its module is what is imported
    targets = {t for t in targets if not any(other.startswith(f"{t}.") for other in targets)}
    found = []
    for target in sorted(targets):
        theirs = _layer_of(target, layers)
        if theirs is not None and (theirs > mine or (theirs == mine and _folder(target) != _folder(module))):
            found.append(f"{module} ({mine}) -> {target} ({theirs})")
    return found


def test_every_module_is_in_a_layer() -> None:
    layers = _layers()
    modules = _modules()
    assert len(set(layers.values())) >= 5, layers
    assert [m for m in modules if _layer_of(m, layers) is None] == []
    # a layer names whole folders, and the top-level modules: no module is lifted out of its folder's layer
    assert [n for n in layers if not ((PACKAGE / n).is_dir() or (n in modules and "." not in n))] == []


def test_imports_run_one_way_between_layers() -> None:
    layers = _layers()
    upward = {line for module, path in _modules().items() for line in upward_imports(module, path, layers)}
    assert upward == set(), "imports from a higher layer or a peer folder (move the code down, or the module elsewhere)"


def test_no_two_folders_import_each_other() -> None:
    """What the layers come to: between folders, imports run one way."""
    pairs = {(_folder(a), _folder(b)) for a, targets in import_graph().items() for b in targets}
    both = sorted(f"{a or '.'} <-> {b or '.'}" for a, b in pairs if a < b and (b, a) in pairs)
    assert both == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from ..run.session import GpuRun\n", ["base.requests (1) -> run.session (8)"]),
        ("def f():\n    from ..plugin import gpu\n    return gpu\n", ["base.requests (1) -> plugin (13)"]),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..plugin import gpu\n",
            ["base.requests (1) -> plugin (13)"],
        ),
        ("import pytest_gpu.roles.owner\n", ["base.requests (1) -> roles.owner (12)"]),
        ("from ..scheduling import planner\n", ["base.requests (1) -> scheduling.planner (10)"]),
        ("from . import spans\nfrom ..base.wording import plural\n", []),
    ],
)
def test_the_layer_check_catches_an_upward_import(source: str, found: list[str]) -> None:
    """The check itself: a low module importing a high one, at module level, in a function or
    for types only."""
    layers = _layers()
    path = PACKAGE / "base" / "requests.py"
    assert upward_imports("base.requests", path, layers) == []
    assert upward_imports("base.requests", path, layers, source) == found


def test_the_layer_check_catches_a_peer_folder() -> None:
    """The check itself: two folders of one layer are peers, neither imports the other."""
    layers = _layers()
    assert layers["distributed"] == layers["raycluster"]
    path = PACKAGE / "raycluster" / "head.py"
    assert upward_imports("raycluster.head", path, layers, "from ..run import session\n") == []
    assert upward_imports("raycluster.head", path, layers, "from ..distributed import pool\n") == [
        "raycluster.head (9) -> distributed.pool (9)"
    ]
    path = PACKAGE / "plugin.py"
    assert upward_imports("plugin", path, layers, "from . import hookspecs, cli\n") == []  # the top level's modules


def import_circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = set()
            while True:
                other = stack.pop()
                part.add(other)
                if other == node:
                    break
            if len(part) > 1:
                found.append(part)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the package modules it imports, every kind of import counted: at module level,
    in a function, under TYPE_CHECKING (``sources``: module -> source instead of its file's)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        source = (sources or {}).get(module)
        name = module if path.name != "__init__.py" else f"{module}.__init__"
        _, inside = _imports(path, name, source, typing=True)
        graph[module] = {t for n in inside if (t := _resolve(n, modules)) in modules and t != module}
    return graph


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert import_circles(import_graph()) == []


def test_the_circle_check_catches_a_circle() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert import_circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    "source",
    [
        "from .session import GpuRun\n",
        "def f():\n    from .session import GpuRun\n    return GpuRun\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .session import GpuRun\n",
    ],
)
def test_the_circle_check_counts_every_kind_of_import(source: str) -> None:
    """The check itself: run.session imports run.leftovers, which importing it back closes a
    circle, whether at module level, in a function or for types only."""
    assert "run.leftovers" in import_graph()["run.session"]
    assert import_circles(import_graph({"run.leftovers": source})) == [{"run.leftovers", "run.session"}]


# -- function-local imports of the package -----------------------------------------------------

# What is left of them (issue 29: 107 before, 15 after), with a little room. A function-local
# import of the package is for a module that is slow to import and needed by few processes
# (the broker, the rank pool, the GPU scheduler): every pytest process, CPU-only suites
# included, pays for what the plugin imports. It says so on its line: ``# local: <why>``.
MAX_LOCAL_IMPORTS = 18
LOCAL_WHY = re.compile(r"#\s*local:\s*\S")


def local_imports(source: str) -> list[tuple[int, bool]]:
    """``source``'s imports of the package inside a function (``from .x``, ``from pytest_gpu.x``,
    ``import pytest_gpu.x``): each one's line, and whether a ``# local: <why>`` comment is on it."""
    comments = {
        token.start[0]: token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    found: list[tuple[int, bool]] = []

    def package(node: ast.AST) -> bool:
        if isinstance(node, ast.ImportFrom):
            return bool(node.level) or (node.module or "").split(".")[0] == "pytest_gpu"
        return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pytest_gpu" for a in node.names)

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            local = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if local and package(child):
                end = child.end_lineno or child.lineno
                why = any(LOCAL_WHY.match(comments.get(line, "")) for line in range(child.lineno, end + 1))
                found.append((child.lineno, why))
            visit(child, local)

    visit(ast.parse(source), False)
    return found


def _package_local_imports() -> dict[str, bool]:
    """Every function-local import of the package: ``file:line`` -> whether it says why."""
    return {
        f"{path.relative_to(PACKAGE)}:{line}": why
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, why in local_imports(path.read_text())
    }


def test_every_function_local_import_says_why() -> None:
    unexplained = sorted(where for where, why in _package_local_imports().items() if not why)
    assert unexplained == [], (
        "import at module level; a function-local import of the package is for a slow module few "
        "processes need, with `# local: <why>` on its line"
    )


def test_function_local_imports_stay_few() -> None:
    found = _package_local_imports()
    assert len(found) <= MAX_LOCAL_IMPORTS, (
        f"{len(found)} function-local imports of the package (at most {MAX_LOCAL_IMPORTS}): "
        "import at module level, or make the slow module's import the one that stays local"
    )


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("def f():\n    from .session import GpuRun\n    return GpuRun\n", [(2, False)]),
        ("def f():\n    from .session import GpuRun  # local: slow\n    return GpuRun\n", [(2, True)]),
        ("def f():\n    from .session import GpuRun  # lazily\n    return GpuRun\n", [(2, False)]),
        ("def f():\n    from .session import GpuRun  # local:\n    return GpuRun\n", [(2, False)]),
        ("class C:\n    def f(self):\n        if x:\n            from .. import sim\n", [(4, False)]),
        (
            "async def f():\n    try:\n        import pytest_gpu.plugin\n    except ImportError:\n        pass\n",
            [(3, False)],
        ),
        ("def f():\n    from pytest_gpu.run import (  # local: slow\n        session,\n    )\n", [(2, True)]),
        ("def f():\n    def g():\n        from . import rundir\n", [(3, False)]),
        ("from .session import GpuRun\nif TYPE_CHECKING:\n    from .holding import Owner\n", []),
        ("def f():\n    import execnet\n    import json\n    from collections import abc\n", []),
    ],
)
def test_the_local_import_check_sees_every_spelling(source: str, found: list[tuple[int, bool]]) -> None:
    """The check itself: a package import in any function, method or nested block is found, with
    or without its reason; module-level, ``TYPE_CHECKING`` and other packages' imports are not."""
    assert local_imports(source) == found


def test_public_import_paths_keep_working() -> None:
    import importlib

    from pytest_gpu import GpuLease, GpuRequest, parse_size

    assert GpuLease.__name__ == "GpuLease" and GpuRequest.__name__ == "GpuRequest"
    assert parse_size("1GiB") == 1 << 30
    assert hasattr(importlib.import_module("pytest_gpu.sim"), "allocate")
    assert importlib.import_module("pytest_gpu.plugin").__name__ == "pytest_gpu.plugin"
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="pytest11") if ep.name == "gpu"]
    assert ep.value == "pytest_gpu.plugin"


# -- a vendor lives in one place -------------------------------------------------------------

VENDOR_NAMES = {"nvidia", "amd", "xpu", "intel", "rocm"}  # as --gpus spells them, and their other names
VENDOR_OBJECTS = {"NVIDIA", "AMD", "XPU", "INTEL"}  # the vendor objects and kinds, by their constants' names


def _vendor_name(node: ast.AST) -> bool:
    """A vendor's name as a string, or a collection literal holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.strip().lower() in VENDOR_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_vendor_name(e) for e in node.elts)
    return False


def _vendor_ident(ident: str) -> bool:
    """A name for which vendor something is: ``vendor``, ``rank_vendor``, ``NVIDIA``."""
    return ident.lower() == "vendor" or ident.lower().endswith("_vendor") or ident in VENDOR_OBJECTS


def _names_a_vendor(node: ast.AST) -> bool:
    """An expression that is (or holds) which vendor something is: ``inventory.vendor``, ``vendor``,
    ``vendors.NVIDIA``, ``kinds.AMD.name``, ``lease.vendor.lower()``, a vendor's name."""
    for part in ast.walk(node):
        if _vendor_name(part):
            return True
        ident = part.id if isinstance(part, ast.Name) else part.attr if isinstance(part, ast.Attribute) else None
        if ident is not None and (
            ident.lower() == "vendor" or ident.lower().endswith("_vendor") or ident in VENDOR_OBJECTS
        ):
            return True
    return False


def vendor_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that decide something by which vendor it is: a comparison (``==``, ``!=``,
    ``is``, ``in``, in any order or spelling) whose side names a vendor, a ``match`` case on a
    vendor's name, a table keyed by vendors' names, or a vendor's name looked up in one."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_vendor_name(side) for side in sides) or any(_names_a_vendor(side) for side in sides):
                found.add(node.lineno)
        elif isinstance(node, ast.MatchValue) and _vendor_name(node.value):
            found.add(node.lineno)
        elif isinstance(node, ast.Dict) and sum(k is not None and _vendor_name(k) for k in node.keys) >= 2:
            found.add(node.lineno)
        elif isinstance(node, ast.Subscript) and _vendor_name(node.slice):
            found.add(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _names_a_vendor(node.func.value):
            if node.func.attr in ("startswith", "endswith", "__eq__", "__ne__", "__contains__", "find", "index"):
                found.add(node.lineno)
    return sorted(found)


def test_no_vendor_name_is_compared_outside_the_vendor_modules() -> None:
    """Issue 29: what differs by vendor is a member of its vendor object (pytest_gpu/vendors/);
    every other module asks the object. (The fake libraries' C sources model one vendor's library
    each: they are not Python, and not looked at.)"""
    found = {
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "vendors"
        for line in vendor_comparisons(path.read_text())
    }
    assert sorted(found) == [], "decide by vendor in its vendor object (pytest_gpu/vendors/), not here"


@pytest.mark.parametrize(
    "source",
    [
        'if inventory.vendor == "xpu":\n    pass\n',
        "if 'amd' != inventory.vendor:\n    pass\n",
        'x = "cuda" if (\n    lease.vendor\n    ==\n    "XPU"\n) else "cpu"\n',
        'ok = vendor in ("amd", "nvidia")\n',
        "ok = inventory.vendor is not vendors.NVIDIA.name\n",
        "ok = vendors.of(name) is vendors.AMD\n",
        "ok = kind == kinds.XPU\n",
        'ok = os.environ.get("RANK_VENDOR") == "xpu"\n',
        'ok = " Nvidia " == name\n',
        'match vendor:\n    case "amd":\n        pass\n',
        'where = {"nvidia": "a", "amd": "b"}.get(name)\n',
        'where = WORDS["amd"]\n',
        'ok = inventory.vendor.startswith("am")\n',
    ],
)
def test_the_vendor_check_sees_through_spelling(source: str) -> None:
    """The check itself: a comparison is found whatever its formatting, order, quotes or operator."""
    assert vendor_comparisons(source) != [], source


@pytest.mark.parametrize(
    "source",
    [
        "kind = vendors.of(inventory.vendor).device_kind\n",
        'ok = backend in ("nccl", "xccl")\n',
        'ok = device_kind == "cuda"\n',
        'found.get("xpu")\n',
    ],
)
def test_the_vendor_check_leaves_asking_the_vendor_alone(source: str) -> None:
    assert vendor_comparisons(source) == [], source
