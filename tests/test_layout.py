"""The package's shape: the map in ``pytest_gpu/__init__.py`` is true, pure modules are pure,
(issue: "A house that shows its architecture")."""

from __future__ import annotations

import ast
import re
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


def _imports(path: Path, module: str) -> tuple[set[str], set[str]]:
    """(outside top-level modules, package modules) ``path`` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package_parts = module.split(".")[:-1]
    outside: set[str] = set()
    inside: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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
    assert {"leasing.requests", "leasing.placement", "scheduling.planner"} <= pure


@pytest.mark.parametrize("module", sorted(_map()[1]))
def test_pure_modules_import_neither_pytest_nor_io(module: str) -> None:
    reached = _reach(module, _modules())
    bad = {top: via for top, via in reached.items() if top in IMPURE}
    assert bad == {}, f"{module} is documented as pure but reaches {bad} (module -> through which module)"


def test_the_purity_check_sees_a_transitive_import() -> None:
    """The check itself: an I/O import two modules away is found (not only direct ones)."""
    assert "os" in _reach("gpu.devices", _modules())  # devices imports os
    assert "os" in _reach("launched.share", _modules())  # share imports devices


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
