"""pytest_gpu.base.requests: sizes, the default-memory setting and marker arguments."""

from __future__ import annotations

import re

import pytest

from pytest_gpu.base.requests import (
    GPU_MARKER_FORM,
    SIZE_FORM,
    UNITS_FORM,
    DefaultMemory,
    GpuRequest,
    GpuRequestError,
    SizeError,
    build_request,
    format_size,
    parse_size,
)
from pytest_gpu.gpu.discovery import discover
from pytest_gpu.vendors.devices import DeviceSpecError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
EXCLUSIVE = DefaultMemory(exclusive=True)
FOUR_GIB = DefaultMemory(exclusive=False, memory=4 * GiB)


# -- parse_size ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("1KiB", KiB),
        ("2TiB", 2 * TiB),
        ("8G", 8 * GiB),
        ("512M", 512 * MiB),
        ("4k", 4 * KiB),
        ("1T", TiB),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5G", GiB // 2),
    ],
)
def test_parse_size_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GB", 8 * 10**9),
        ("512MB", 512 * 10**6),
        ("3kB", 3000),
        ("3KB", 3000),
        ("1TB", 10**12),
        ("1.5GB", 1_500_000_000),
    ],
)
def test_parse_size_si_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10", 10),
        ("10B", 10),
        ("0", 0),
        ("3 GiB", 3 * GiB),
        ("3 G", 3 * GiB),
    ],
)
def test_parse_size_plain_bytes_and_one_space_before_the_unit(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", ["8GB ", " 8GB", " 3 GiB ", "8GiB\n", "\t512MiB", "10 "])
def test_parse_size_refuses_a_space_around_the_size_naming_it_without(value: str) -> None:
    """Strict as units are: "8GB " is not read as 8GB, the error says what to write."""
    with pytest.raises(SizeError) as info:
        parse_size(value)
    right = value.strip()
    assert str(info.value) == f"space around the size in {value!r}: write {right!r} (expected {SIZE_FORM})"
    assert parse_size(right) > 0  # as it says


@pytest.mark.parametrize(
    ("value", "right"),
    [("16Gib", "GiB"), ("16gib", "GiB"), ("8GIB", "GiB"), ("5b", "B"), ("2g", "G")],
)
def test_parse_size_refuses_units_in_the_wrong_case_naming_the_right_one(value: str, right: str) -> None:
    """Units are case-sensitive (a lowercase b reads as bits): the error says how to write it."""
    with pytest.raises(SizeError) as info:
        parse_size(value)
    unit = value.lstrip("0123456789")
    assert str(info.value) == f"unit {unit!r} in {value!r}: write {right!r}; units are case-sensitive: {UNITS_FORM}"
    assert parse_size(value.replace(unit, right)) > 0  # as it says


@pytest.mark.parametrize(
    ("value", "binary", "si", "power"),
    [
        ("16gb", "GiB", "GB", "^3"),
        ("2Gb", "GiB", "GB", "^3"),
        ("3kb", "KiB", "kB", ""),
        ("1Mb", "MiB", "MB", "^2"),
        ("1tB", "TiB", "TB", "^4"),
    ],
)
def test_parse_size_names_both_units_a_lowercase_b_may_mean(value: str, binary: str, si: str, power: str) -> None:
    """Who writes 16gb most often means 16GiB, not 16GB: the error names both and what each is."""
    with pytest.raises(SizeError) as info:
        parse_size(value)
    unit = value.lstrip("0123456789")
    assert str(info.value) == (
        f"unit {unit!r} in {value!r}: write {binary!r} (binary, 1024{power} bytes) or {si!r} "
        f"(SI, 1000{power} bytes); units are case-sensitive: {UNITS_FORM}"
    )
    assert parse_size(value.replace(unit, binary)) > parse_size(value.replace(unit, si)) > 0


def test_a_marker_size_and_a_sim_spec_size_follow_the_same_rule() -> None:
    with pytest.raises(GpuRequestError, match="write 'GiB'"):
        build_request((), {"memory": "16Gib"}, DefaultMemory.parse("exclusive"))
    with pytest.raises(DeviceSpecError, match="write 'GiB'"):
        discover("sim:4x16Gib")


@pytest.mark.parametrize("value", [0, 1, 4096, 80 * GiB])
def test_parse_size_ints_are_bytes(value: int) -> None:
    assert parse_size(value) == value


def test_si_and_binary_differ() -> None:
    assert parse_size("1GB") == 1_000_000_000
    assert parse_size("1GiB") == 1_073_741_824
    assert parse_size("1GB") < parse_size("1GiB")


@pytest.mark.parametrize(
    "value", ["lots", "", " ", "GiB", "1e3", "-1GiB", "1,5GiB", "8 Gi B", "1.GiB", "8  GiB", "8\tGiB", " 8gb "]
)
def test_parse_size_unreadable_strings(value: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert str(info.value) == f"expected {SIZE_FORM}, got {value!r}"


@pytest.mark.parametrize(("value", "unit"), [("8XB", "XB"), ("8gibibytes", "gibibytes"), ("3PiB", "PiB")])
def test_parse_size_unknown_unit(value: str, unit: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert str(info.value) == f"unknown unit {unit!r} in {value!r}: expected {SIZE_FORM}"


@pytest.mark.parametrize("value", [None, 1.5, True, False, [1], b"8GiB"])
def test_parse_size_wrong_types(value: object) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert str(info.value) == f"expected {SIZE_FORM}, got {value!r}"


def test_parse_size_too_many_digits_is_a_size_error() -> None:
    value = "9" * 400 + "GiB"  # float() of it is inf
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert str(info.value) == f"expected a finite size, got {value!r}"


def test_parse_size_negative_int() -> None:
    with pytest.raises(SizeError, match=r"^expected a non-negative size, got -1$"):
        parse_size(-1)


def test_size_error_is_a_value_error_and_names_the_forms() -> None:
    assert issubclass(SizeError, ValueError)
    assert '"512MiB"' in SIZE_FORM and '"8GiB"' in SIZE_FORM and '"8GB"' in SIZE_FORM and "int" in SIZE_FORM


# -- format_size -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (KiB, "1KiB"),
        (1536, "1.5KiB"),
        (MiB, "1MiB"),
        (500 * MiB, "500MiB"),
        (16 * GiB, "16GiB"),
        (3 * GiB // 2, "1.5GiB"),
        (10**9, "953.7MiB"),
        (2 * TiB, "2048GiB"),  # GiB is the largest unit
    ],
)
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


@pytest.mark.parametrize("text", ["1KiB", "512MiB", "16GiB", "80GiB", "1.5GiB", "2048GiB"])
def test_format_then_parse_round_trips_round_sizes(text: str) -> None:
    assert format_size(parse_size(text)) == text


# -- DefaultMemory ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["exclusive", "EXCLUSIVE", " Exclusive "])
def test_default_memory_exclusive(value: str) -> None:
    assert DefaultMemory.parse(value) == DefaultMemory(exclusive=True, memory=None)


@pytest.mark.parametrize(("value", "memory"), [("2GiB", 2 * GiB), ("8GB", 8 * 10**9), (4096, 4096)])
def test_default_memory_size(value: str | int, memory: int) -> None:
    assert DefaultMemory.parse(value) == DefaultMemory(exclusive=False, memory=memory)


@pytest.mark.parametrize("value", ["0", 0, "0GiB"])
def test_default_memory_zero_is_refused(value: str | int) -> None:
    with pytest.raises(SizeError) as info:
        DefaultMemory.parse(value)
    assert str(info.value) == f"expected a positive size, got {value!r}"


def test_default_memory_unparsable() -> None:
    with pytest.raises(SizeError) as info:
        DefaultMemory.parse("whole")
    assert str(info.value) == f"expected {SIZE_FORM}, got 'whole'"


# -- GpuRequest.describe ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "text"),
    [
        (GpuRequest(), "1 GPU (whole GPU)"),
        (GpuRequest(count=3), "3 GPUs (whole GPU each)"),
        (GpuRequest(count=1, memory=8 * GiB, exclusive=False), "1 GPU (8GiB)"),
        (GpuRequest(count=2, memory=512 * MiB, exclusive=False), "2 GPUs (512MiB each)"),
        (GpuRequest(min_memory=40 * GiB), "1 GPU (whole GPU of at least 40GiB)"),
        (GpuRequest(count=2, min_memory=40 * GiB), "2 GPUs (whole GPU of at least 40GiB each)"),
    ],
)
def test_request_describe(request_: GpuRequest, text: str) -> None:
    assert request_.describe() == text


# -- build_request: good arguments -----------------------------------------------------


def test_bare_marker_uses_the_exclusive_default() -> None:
    assert build_request((), {}, EXCLUSIVE) == GpuRequest(count=1, memory=None, exclusive=True)


def test_bare_marker_uses_a_size_default() -> None:
    assert build_request((), {}, FOUR_GIB) == GpuRequest(count=1, memory=4 * GiB, exclusive=False)


def test_count_positional() -> None:
    assert build_request((2,), {}, FOUR_GIB) == GpuRequest(count=2, memory=4 * GiB, exclusive=False)


def test_count_keyword() -> None:
    assert build_request((), {"count": 3}, EXCLUSIVE) == GpuRequest(count=3, memory=None, exclusive=True)


def test_memory_is_per_gpu_and_parsed() -> None:
    got = build_request((), {"count": 2, "memory": "8GiB", "exclusive": False}, EXCLUSIVE)
    assert got == GpuRequest(count=2, memory=8 * GiB, exclusive=False)


@pytest.mark.parametrize(("memory", "nbytes"), [("512MiB", 512 * MiB), ("8GB", 8 * 10**9), (12345, 12345)])
def test_memory_forms(memory: str | int, nbytes: int) -> None:
    assert build_request((1,), {"memory": memory}, EXCLUSIVE).memory == nbytes


def test_explicit_memory_overrides_an_exclusive_default() -> None:
    got = build_request((), {"memory": "1GiB"}, EXCLUSIVE)
    assert got == GpuRequest(count=1, memory=GiB, exclusive=False)


def test_exclusive_true_overrides_a_size_default() -> None:
    assert build_request((2,), {"exclusive": True}, FOUR_GIB) == GpuRequest(count=2, memory=None, exclusive=True)


def test_exclusive_true_with_memory_none_is_fine() -> None:
    assert build_request((), {"exclusive": True, "memory": None}, FOUR_GIB).exclusive is True


# -- build_request: bad arguments, exact messages --------------------------------------


def _error(args: tuple, kwargs: dict, default: DefaultMemory = EXCLUSIVE, **extra: str) -> str:
    with pytest.raises(GpuRequestError) as info:
        build_request(args, kwargs, default, **extra)
    return str(info.value)


@pytest.mark.parametrize("count", [0, -1])
def test_count_not_positive(count: int) -> None:
    assert _error((), {"count": count}) == (
        f"gpu marker: count must be a positive int, got {count}; expected {GPU_MARKER_FORM}"
    )
    assert _error((count,), {}) == f"gpu marker: count must be a positive int, got {count}; expected {GPU_MARKER_FORM}"


@pytest.mark.parametrize("count", [True, False])
def test_bool_count_is_refused(count: bool) -> None:
    assert _error((count,), {}) == f"gpu marker: count must be a positive int, got {count}; expected {GPU_MARKER_FORM}"


@pytest.mark.parametrize("count", [1.0, "2", None])
def test_non_int_count(count: object) -> None:
    assert _error((), {"count": count}) == (
        f"gpu marker: count must be a positive int, got {count!r}; expected {GPU_MARKER_FORM}"
    )


def test_unknown_keyword() -> None:
    assert _error((), {"gpus": 2}) == f"gpu marker: unknown keyword 'gpus'; expected {GPU_MARKER_FORM}"


def test_unknown_keywords_are_all_named_sorted() -> None:
    assert _error((), {"mem": "1GiB", "count": 1, "cnt": 2}) == (
        f"gpu marker: unknown keyword 'cnt', 'mem'; expected {GPU_MARKER_FORM}"
    )


def test_too_many_positionals() -> None:
    assert _error((1, "8GiB"), {}) == (
        f"gpu marker: too many positional arguments (1, '8GiB'); expected {GPU_MARKER_FORM}"
    )


def test_count_given_twice() -> None:
    assert _error((2,), {"count": 2}) == f"gpu marker: count given twice; expected {GPU_MARKER_FORM}"


@pytest.mark.parametrize("default", [EXCLUSIVE, FOUR_GIB])
def test_exclusive_with_memory_is_a_whole_gpu_of_at_least_that_size(default: DefaultMemory) -> None:
    # on a mixed machine the only way to say "a whole GPU with at least 40 GiB"
    got = build_request((2,), {"exclusive": True, "memory": "40GiB"}, default)
    assert got == GpuRequest(count=2, memory=None, exclusive=True, min_memory=40 * GiB)


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        (0, "gpu marker: memory must be positive, got 0"),
        ("lots", f"gpu marker: memory='lots' is not a size: expected {SIZE_FORM}, got 'lots'"),
    ],
)
def test_exclusive_with_a_bad_memory(memory: object, message: str) -> None:
    assert _error((), {"exclusive": True, "memory": memory}) == message


def test_min_memory_only_with_exclusive() -> None:
    with pytest.raises(ValueError, match="min_memory"):
        GpuRequest(count=1, memory=GiB, exclusive=False, min_memory=GiB)


@pytest.mark.parametrize("exclusive", ["yes", 1, None])
def test_exclusive_must_be_bool(exclusive: object) -> None:
    assert _error((), {"exclusive": exclusive}) == f"gpu marker: exclusive must be True or False, got {exclusive!r}"


def test_unparsable_memory() -> None:
    assert _error((), {"memory": "lots"}) == (
        f"gpu marker: memory='lots' is not a size: expected {SIZE_FORM}, got 'lots'"
    )


def test_memory_with_unknown_unit() -> None:
    assert _error((), {"memory": "8GiBs"}) == (
        f"gpu marker: memory='8GiBs' is not a size: unknown unit 'GiBs' in '8GiBs': expected {SIZE_FORM}"
    )


@pytest.mark.parametrize("memory", [0, "0GiB"])
def test_zero_memory(memory: object) -> None:
    assert _error((), {"memory": memory}) == f"gpu marker: memory must be positive, got {memory!r}"


def test_negative_memory() -> None:
    assert _error((), {"memory": -5}) == "gpu marker: memory=-5 is not a size: expected a non-negative size, got -5"


def test_bad_arguments_with_a_size_default_still_fail() -> None:
    assert _error((0,), {}, FOUR_GIB).startswith("gpu marker: count must be a positive int, got 0")


def test_what_and_form_are_used_in_messages() -> None:
    message = _error((), {"colour": 1}, what="gpu_request()", form="gpu_request(count=1, memory=...)")
    assert message == "gpu_request(): unknown keyword 'colour'; expected gpu_request(count=1, memory=...)"


def test_every_message_names_the_marker_form() -> None:
    # the collection error must tell the user what to write instead
    for args, kwargs in [((0,), {}), ((), {"x": 1}), ((1, 2), {}), ((1,), {"count": 1})]:
        assert re.search(re.escape(GPU_MARKER_FORM) + "$", _error(args, kwargs))


def test_gpu_request_error_is_a_value_error() -> None:
    assert issubclass(GpuRequestError, ValueError)


def test_shared_without_a_size_under_an_exclusive_default_is_an_error() -> None:
    with pytest.raises(GpuRequestError) as info:
        build_request((), {"exclusive": False}, DefaultMemory(exclusive=True))
    assert str(info.value) == (
        "gpu marker: exclusive=False needs memory= (the default memory is 'exclusive', see "
        '--gpu-default-memory); expected e.g. memory="8GiB", exclusive=False'
    )
    # with a size as the default, exclusive=False alone takes that size
    assert build_request((), {"exclusive": False}, DefaultMemory(exclusive=False, memory=GiB)) == GpuRequest(
        count=1, memory=GiB, exclusive=False
    )
