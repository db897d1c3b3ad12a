"""Run a callback right after a module is imported, without importing it ourselves.

The plugin must never import torch or CuPy, but when a test imports one while it holds a
lease (or while fake GPUs are on), the framework has to be confined (or given its
simulated CUDA) before the test uses it. A ``sys.meta_path`` finder wraps the module's
loader so the callback runs once the module has executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        # the module keeps its own loader (importlib.resources and friends use its methods)
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        for callback in _callbacks.pop(self._name, []):
            try:
                callback(module)
            except Exception as exc:  # the test's import must never fail because of us
                warnings.warn(f"pytest-gpu: after importing {self._name}: {exc!r}", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name: str) -> object:
        # while the module executes, importlib may ask its loader for more (is_package, ...)
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)  # type: ignore[arg-type]
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def on_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def cancel(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Forget a callback that has not run yet."""
    pending = _callbacks.get(name, [])
    if callback in pending:
        pending.remove(callback)
    if not pending:
        _callbacks.pop(name, None)


def waiting(name: str) -> bool:
    """Whether a callback waits for ``name`` to be imported."""
    return bool(_callbacks.get(name))
