"""Requests from a suite's own conventions, without editing its tests.

Two sources, consulted by :func:`pytest_gpu.run.lifecycle.item_needs` after an explicit
``gpu`` marker and before the ``gpu`` fixture's default request:

1. the ``pytest_gpu_item_request(item)`` hook (see :mod:`pytest_gpu.hookspecs`), for
   requests derived in code (a decorator, a parametrization, a naming rule);
2. the ``gpu_marker_map`` ini key: the suite's own markers as requests, one
   ``MARKER: KEY=VALUE ...`` per line (grammar in :func:`parse_marker_map`).

Both give the keyword arguments of a ``gpu`` marker, validated as the marker's are.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from ..base.requests import (
    HOST_KWARGS,
    ISOLATE,
    DefaultMemory,
    GpuRequest,
    GpuRequestError,
    build_host_request,
    build_request,
    split_isolate,
)

MAP_INI = "gpu_marker_map"
MAP_FORM = (
    "one 'MARKER: KEY=VALUE ...' per line with keys count, memory, exclusive (or the bare word "
    "exclusive), cpus, host_memory, isolate (or the bare word isolate), such as "
    "'multi_gpu: count=2 memory=8GiB isolate', 'large: exclusive' or "
    "'loader: cpus=4 host_memory=16GiB' (only cpus/host_memory: no GPU); "
    "'MARKER:' alone means one GPU with the default memory"
)
HOOK = "pytest_gpu_item_request"
HOOK_FORM = (
    'None or a dict of gpu marker keywords such as {"count": 2, "memory": "8GiB", "exclusive": False, "cpus": 4, '
    '"isolate": True} '
    '(only "cpus"/"host_memory": no GPU, as the host_resources marker)'
)
_KEYS = ("count", "memory", "exclusive", "cpus", "host_memory", ISOLATE)
# markers pytest-gpu reads itself: mapping them would be a second meaning for the same name
_OWN_MARKERS = ("gpu", "distributed")
# structural checks only, before the run's --gpu-default-memory is known
_ANY_DEFAULT = DefaultMemory(exclusive=False, memory=1)

MAP_KEY = pytest.StashKey[dict[str, dict[str, Any]]]()


class MarkerMapError(ValueError):
    """A ``gpu_marker_map`` line that cannot be read; the message names the key, the line and the form."""


def parse_marker_map(lines: Sequence[str], default: DefaultMemory | None = None) -> dict[str, dict[str, Any]]:
    """``["multi_gpu: count=2 memory=8GiB", "large: exclusive"]`` → ``{"multi_gpu": {"count": 2,
    "memory": "8GiB"}, "large": {"exclusive": True}}``, in line order.

    Grammar, per line (blank lines and lines starting with ``#`` are skipped):
    ``MARKER: PART ...`` where MARKER is a Python identifier (not ``gpu`` nor ``distributed``)
    and each PART, separated by spaces or commas, is ``count=N`` (a positive int),
    ``memory=SIZE`` (as the marker's: ``8GiB``, ``512MiB``, ``8GB``, bytes), ``exclusive``
    (alone, or ``exclusive=true``/``false``), ``isolate`` (the same: the body runs in a
    process of its own that sees exactly its GPUs), ``cpus=N`` and ``host_memory=SIZE`` (host
    resources; with only these two, no GPU, as the ``host`` marker); a value may be quoted. No part at all is a
    bare ``@pytest.mark.gpu``. Each marker and each key at most once.

    ``default`` (the run's ``--gpu-default-memory``) also checks what depends on it
    (``exclusive=false`` without ``memory`` under the ``exclusive`` default).
    Raises :class:`MarkerMapError`.
    """
    mapping: dict[str, dict[str, Any]] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition(":")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise _error(raw, "no 'MARKER:' at its start")
        if name in _OWN_MARKERS:
            raise _error(raw, f"{name!r} is pytest-gpu's own marker, not one to map")
        if name in mapping:
            raise _error(raw, f"marker {name!r} is mapped twice")
        kwargs: dict[str, Any] = {}
        for part in (p for p in re.split(r"[\s,]+", rest.strip()) if p):
            key, value = _part(raw, part)
            if key in kwargs:
                raise _error(raw, f"{key} given twice")
            kwargs[key] = value
        try:
            lease_kwargs, _ = split_isolate(kwargs, f"marker {name!r}", MAP_FORM)
            convention_request(lease_kwargs, default or _ANY_DEFAULT, what=f"marker {name!r}", form=MAP_FORM)
        except GpuRequestError as exc:
            raise _error(raw, str(exc)) from None
        mapping[name] = kwargs
    return mapping


def convention_request(kwargs: Mapping[str, Any], default: DefaultMemory, *, what: str, form: str) -> GpuRequest:
    """The request of a map line's or the hook's keywords: a ``gpu`` marker's, except that
    host keywords alone (``cpus``, ``host_memory``) ask for no GPU, as the ``host`` marker."""
    if kwargs and set(kwargs) <= set(HOST_KWARGS):
        return build_host_request((), kwargs, what=what, form=form)
    return build_request((), kwargs, default, what=what, form=form)


def _part(raw: str, part: str) -> tuple[str, Any]:
    if part.lower() in ("exclusive", ISOLATE):
        return part.lower(), True
    key, eq, value = part.partition("=")
    key, value = key.strip().lower(), _unquote(value.strip())
    if not eq:
        raise _error(raw, f"{part!r} is neither KEY=VALUE nor exclusive")
    if key not in _KEYS:
        raise _error(raw, f"unknown key {key!r}")
    if key in ("count", "cpus"):
        if not re.fullmatch(r"[+-]?\d+", value):
            raise _error(raw, f"{key} must be a positive int, got {value!r}")
        return key, int(value)
    if key in ("exclusive", ISOLATE):
        if value.lower() not in ("true", "false"):
            raise _error(raw, f"{key} must be true or false, got {value!r}")
        return key, value.lower() == "true"
    return key, value  # memory: parsed (and checked) by build_request, as the marker's


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _error(raw: str, detail: str) -> MarkerMapError:
    expected = "" if "expected" in detail else f"; expected {MAP_FORM}"
    return MarkerMapError(f"ini key {MAP_INI!r}: line {raw.strip()!r}: {detail}{expected}")


def marker_map(config: pytest.Config, default: DefaultMemory) -> dict[str, dict[str, Any]]:
    """The run's ``gpu_marker_map``, read once per process (checked at start-up by
    :func:`pytest_gpu.run.options.read`; an xdist worker reads the same ini)."""
    found = config.stash.get(MAP_KEY, None)
    if found is None:
        found = parse_marker_map(config.getini(MAP_INI), default)
        config.stash[MAP_KEY] = found
    return found


def item_kwargs(item: pytest.Item, default: DefaultMemory) -> tuple[Mapping[str, Any], str, str] | None:
    """For a test without a ``gpu`` marker: ``(gpu marker keywords, what, form)`` from the hook,
    else from the first line of ``gpu_marker_map`` naming one of its markers; ``None``: neither.

    A ``distributed`` test gets its GPUs from its marker: neither applies to it.
    Raises :class:`GpuRequestError` (without the test's node id; the caller adds it).
    """
    if item.get_closest_marker("distributed") is not None:
        return None
    try:
        found = item.ihook.pytest_gpu_item_request(item=item)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise GpuRequestError(f"{HOOK} raised {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})") from None
    if found is not None:
        if not isinstance(found, Mapping) or not all(isinstance(key, str) for key in found):
            raise GpuRequestError(f"{HOOK} returned {found!r}; expected {HOOK_FORM}")
        return found, HOOK, HOOK_FORM
    try:
        mapping = marker_map(item.config, default)
    except MarkerMapError as exc:
        raise GpuRequestError(str(exc)) from None
    for name, kwargs in mapping.items():
        if item.get_closest_marker(name) is not None:
            return kwargs, f"{MAP_INI} {name!r}", MAP_FORM
    return None
