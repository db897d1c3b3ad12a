"""What a test asks for: sizes and GPU requests, parsed and validated (pure, no I/O)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# Units as they are spelled: case matters, as "Gib" or "Gb" (bits) and "mB" are not sizes in
# bytes; a unit spelled in another case is refused with its right spelling (see _suggest).
_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "k": 2**10,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
# A number, then at most one space, then the unit: nothing before or after (a stray space in
# "8GB " is refused like a stray letter, naming the size without it).
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)(?: ?([a-zA-Z]+))?")
SIZE_FORM = 'an int of bytes or a string such as "512MiB", "8GiB" (binary) or "8GB" (SI)'
UNITS_FORM = "B, KiB, MiB, GiB, TiB (or K, M, G, T), kB, MB, GB, TB"
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4}


def _suggest(unit: str) -> str | None:
    """How to write ``unit`` spelled in the wrong case ("gib": "'GiB'"; "gb", which may mean
    either, names both: most who write it mean GiB); None when it is no unit in any case."""
    lowered = unit.lower()
    if len(lowered) == 2 and lowered[1] == "b" and lowered[0].upper() in _POWERS:
        prefix = lowered[0].upper()
        power = _POWERS[prefix]
        binary, si = f"{prefix}iB", "kB" if prefix == "K" else f"{prefix}B"
        exp = "" if power == 1 else f"^{power}"
        return f"{binary!r} (binary, 1024{exp} bytes) or {si!r} (SI, 1000{exp} bytes)"
    for known in ("B", "KiB", "MiB", "GiB", "TiB", "M", "G", "T"):
        if known.lower() == lowered:
            return repr(known)
    return None


class SizeError(ValueError):
    """A memory size that cannot be parsed."""


class GpuRequestError(ValueError):
    """A marker or fixture request with bad arguments; the message names what was expected."""


def parse_size(value: object) -> int:
    """Parse a memory size into bytes.

    Accepts non-negative ints, and strings with an optional unit: ``B``, SI units
    (``kB``/``KB``, ``MB``, ``GB``, ``TB``: powers of 1000) and binary units (``KiB``,
    ``MiB``, ``GiB``, ``TiB``, or the short ``K``/``k``, ``M``, ``G``, ``T``: powers of
    1024), after at most one space. Units are case-sensitive: ``Gib``, ``gb`` or ``mib`` are
    refused with the right spelling (a lowercase ``b`` reads as bits; ``gb`` names both ``GiB``
    and ``GB``), and so is a space before or after the size (``"8GB "``).
    """
    if isinstance(value, bool):
        raise SizeError(f"expected {SIZE_FORM}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"expected a non-negative size, got {value}")
        return value
    if not isinstance(value, str):
        raise SizeError(f"expected {SIZE_FORM}, got {value!r}")
    match = _SIZE_RE.fullmatch(value)
    if not match:
        if value.strip() != value and _readable(value.strip()):
            raise SizeError(f"space around the size in {value!r}: write {value.strip()!r} (expected {SIZE_FORM})")
        raise SizeError(f"expected {SIZE_FORM}, got {value!r}")
    number, unit = match.group(1), match.group(2) or ""
    factor = _UNITS.get(unit)
    if factor is None:
        right = _suggest(unit)
        if right is not None:
            raise SizeError(f"unit {unit!r} in {value!r}: write {right}; units are case-sensitive: {UNITS_FORM}")
        raise SizeError(f"unknown unit {unit!r} in {value!r}: expected {SIZE_FORM}")
    nbytes = float(number) * factor
    if not math.isfinite(nbytes):  # hundreds of digits: float() says inf, int() would raise OverflowError
        raise SizeError(f"expected a finite size, got {value!r}")
    return int(nbytes)


def _readable(text: str) -> bool:
    try:
        parse_size(text)
    except SizeError:
        return False
    return True


def format_size(nbytes: int) -> str:
    """Render bytes in binary units, short enough for a summary line."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)}B"
    text = f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{text}{unit}"


@dataclass(frozen=True)
class GpuRequest:
    """GPUs a test needs: ``count`` GPUs with ``memory`` bytes each, or whole GPUs.

    ``memory`` is ``None`` exactly when ``exclusive`` is true: an exclusive lease gets
    everything the GPU can give (capacity less CUDA-context overheads) and no co-tenant.
    ``min_memory`` (exclusive only) is the least an exclusive lease must get per GPU: on
    a mixed machine, "a whole GPU with at least 40 GiB" (marker ``exclusive=True, memory=...``).
    """

    count: int = 1
    memory: int | None = None
    exclusive: bool = True
    min_memory: int | None = None
    # host resources leased with the GPUs (see :mod:`pytest_gpu.leasing.host`): CPUs and bytes of RAM;
    # a host-only request (a CPU test's ``host`` marker) has ``count=0``, ``memory=0``
    cpus: int = 0
    host_memory: int = 0

    def __post_init__(self) -> None:
        if self.min_memory is not None and not self.exclusive:
            raise ValueError("GpuRequest: min_memory is for exclusive requests; a shared one gives memory")
        if self.count == 0 and (self.exclusive or self.memory):
            raise ValueError("GpuRequest: a request for no GPU (count=0) is shared and has memory=0")

    @property
    def host(self) -> bool:
        """Whether the request leases host resources (CPUs or RAM) too."""
        return bool(self.cpus or self.host_memory)

    def describe_host(self) -> str:
        parts = []
        if self.cpus:
            parts.append(f"{self.cpus} CPU{'' if self.cpus == 1 else 's'}")
        if self.host_memory:
            parts.append(f"{format_size(self.host_memory)} of host memory")
        return " and ".join(parts)

    def describe(self) -> str:
        gpus = self._describe_gpus() if self.count else ""
        host = self.describe_host()
        return " with ".join(part for part in (gpus, host) if part) or "nothing"

    def _describe_gpus(self) -> str:
        if not self.exclusive:
            each = format_size(self.memory or 0)
        elif self.min_memory is not None:
            each = f"whole GPU of at least {format_size(self.min_memory)}"
        else:
            each = "whole GPU"
        if self.count == 1:
            return f"1 GPU ({each})"
        return f"{self.count} GPUs ({each} each)"


@dataclass(frozen=True)
class DefaultMemory:
    """The ``--gpu-default-memory`` setting: whole GPUs, or a size per GPU."""

    exclusive: bool
    memory: int | None = None

    @classmethod
    def parse(cls, value: str | int) -> DefaultMemory:
        if isinstance(value, str) and value.strip().lower() == "exclusive":
            return cls(exclusive=True)
        size = parse_size(value)
        if size <= 0:
            raise SizeError(f"expected a positive size, got {value!r}")
        return cls(exclusive=False, memory=size)


LEARN_FLOOR = 256 * 2**20
LEARN_FACTOR = 1.25


def learned(request: GpuRequest, peak: int, usable: int) -> GpuRequest:
    """``--gpu-learn``: a request that named no memory gets ``max(1.25 x peak, 256MiB)``
    per GPU (shared), at most what a GPU can give."""
    memory = min(max(int(LEARN_FACTOR * peak), LEARN_FLOOR), usable)
    return replace(request, memory=memory, exclusive=False, min_memory=None)


GPU_MARKER_FORM = (
    '@pytest.mark.gpu, @pytest.mark.gpu(2) or @pytest.mark.gpu(count=2, memory="8GiB", exclusive=False, '
    'cpus=4, host_memory="16GiB")'
)
# The ``gpu`` marker's keyword (and a convention's) that runs the test's body in a process of
# its own seeing exactly its lease (cuda:0..count-1): not part of the lease, read apart from it.
ISOLATE = "isolate"
ISOLATE_FORM = '@pytest.mark.gpu(2, memory="8GiB", isolate=True)'
HOST_KWARGS = ("cpus", "host_memory")
_GPU_KWARGS = ("count", "memory", "exclusive", *HOST_KWARGS)
HOST_MARKER_FORM = (
    '@pytest.mark.host_resources(cpus=2), @pytest.mark.host_resources(host_memory="8GiB") or '
    '@pytest.mark.host_resources(cpus=2, host_memory="8GiB")'
)


def host_part(kwargs: Mapping[str, Any], what: str, form: str) -> tuple[int, int]:
    """``(cpus, host_memory)`` from request keywords (0: not asked); raises :class:`GpuRequestError`."""
    cpus = kwargs.get("cpus", 0)
    if "cpus" in kwargs and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus <= 0):
        raise GpuRequestError(f"{what}: cpus must be a positive int (CPUs to lease), got {cpus!r}; expected {form}")
    host_memory = 0
    if "host_memory" in kwargs:
        host_memory = _positive_size(kwargs["host_memory"], what, "host_memory", f"; expected {form}")
    return cpus, host_memory


def build_host_request(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, what: str = "host_resources marker", form: str = HOST_MARKER_FORM
) -> GpuRequest:
    """A ``host`` marker's arguments as a request for no GPU, only CPUs and RAM (``count=0``)."""
    unknown = sorted(set(kwargs) - set(HOST_KWARGS))
    if unknown:
        raise GpuRequestError(f"{what}: unknown keyword {', '.join(map(repr, unknown))}; expected {form}")
    if args:
        raise GpuRequestError(f"{what}: takes keywords only, got positional {tuple(args)!r}; expected {form}")
    if not kwargs:
        raise GpuRequestError(f"{what}: asks for nothing; expected {form}")
    cpus, host_memory = host_part(kwargs, what, form)
    return GpuRequest(count=0, memory=0, exclusive=False, cpus=cpus, host_memory=host_memory)


def build_request(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    default: DefaultMemory,
    *,
    what: str = "gpu marker",
    form: str = GPU_MARKER_FORM,
) -> GpuRequest:
    """Validate marker/fixture arguments and turn them into a :class:`GpuRequest`.

    Raises :class:`GpuRequestError` naming the bad argument and the expected form.
    """
    unknown = sorted(set(kwargs) - set(_GPU_KWARGS))
    if unknown:
        raise GpuRequestError(f"{what}: unknown keyword {', '.join(map(repr, unknown))}; expected {form}")
    if len(args) > 1:
        raise GpuRequestError(f"{what}: too many positional arguments {tuple(args)!r}; expected {form}")
    if args and "count" in kwargs:
        raise GpuRequestError(f"{what}: count given twice; expected {form}")
    count = args[0] if args else kwargs.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise GpuRequestError(f"{what}: count must be a positive int, got {count!r}; expected {form}")
    exclusive = kwargs.get("exclusive", False)
    if not isinstance(exclusive, bool):
        raise GpuRequestError(f"{what}: exclusive must be True or False, got {exclusive!r}")
    memory_arg = kwargs.get("memory")
    memory = None if memory_arg is None else _positive_size(memory_arg, what)
    cpus, host_memory = host_part(kwargs, what, form)
    host = {"cpus": cpus, "host_memory": host_memory}
    if exclusive:  # with memory: only a GPU that can give at least that much, still whole
        return GpuRequest(count=count, memory=None, exclusive=True, min_memory=memory, **host)
    if memory is None:
        if default.exclusive:
            if "exclusive" in kwargs:  # exclusive=False said out loud, but no size to share with
                raise GpuRequestError(
                    f"{what}: exclusive=False needs memory= (the default memory is 'exclusive', "
                    'see --gpu-default-memory); expected e.g. memory="8GiB", exclusive=False'
                )
            return GpuRequest(count=count, memory=None, exclusive=True, **host)
        return GpuRequest(count=count, memory=default.memory, exclusive=False, **host)
    return GpuRequest(count=count, memory=memory, exclusive=False, **host)


def split_isolate(kwargs: Mapping[str, Any], what: str, form: str = ISOLATE_FORM) -> tuple[dict[str, Any], bool]:
    """``(the other keywords, whether isolate=True)``: ``isolate`` must be True or False.

    Raises :class:`GpuRequestError` naming ``what`` and the expected form."""
    rest = dict(kwargs)
    isolate = rest.pop(ISOLATE, False)
    if not isinstance(isolate, bool):
        raise GpuRequestError(f"{what}: {ISOLATE} must be True or False, got {isolate!r}; expected {form}")
    return rest, isolate


def with_host(request: GpuRequest | None, host: GpuRequest, what: str) -> GpuRequest:
    """``request`` (a GPU request, or none) with the host part of ``host`` (a ``host`` marker's).

    Raises :class:`GpuRequestError` when both name the same resource."""
    if request is None:
        return host
    twice = [k for k in HOST_KWARGS if getattr(request, k) and getattr(host, k)]
    if twice:
        raise GpuRequestError(
            f"{what}: {', '.join(twice)} given both in the GPU request and in the host_resources marker; give it once"
        )
    return replace(request, cpus=request.cpus or host.cpus, host_memory=request.host_memory or host.host_memory)


def _positive_size(value: Any, what: str, key: str = "memory", hint: str = "") -> int:
    """Bytes of the size ``value`` given as ``key`` (``what`` names the test or option; ``hint``
    ends the error); raises :class:`GpuRequestError` for what is not a positive size."""
    try:
        size = parse_size(value)
    except SizeError as exc:
        raise GpuRequestError(f"{what}: {key}={value!r} is not a size: {exc}{hint}") from None
    if size <= 0:
        raise GpuRequestError(f"{what}: {key} must be positive, got {value!r}{hint}")
    return size
