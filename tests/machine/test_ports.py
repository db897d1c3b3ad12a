"""pytest_gpu.machine.ports: run-unique TCP ports, checked bindable when handed out."""

from __future__ import annotations

import socket

import pytest

from pytest_gpu.machine.ports import DEFAULT_RANGE, PortAllocator, bindable, parse_port_range


def always_free(port: int) -> bool:
    return True


# -- parse_port_range ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("20000-32767", (20000, 32767)), ("1024-65535", (1024, 65535)), ("5000-5000", (5000, 5000))],
)
def test_parse_port_range(text: str, expected: tuple[int, int]) -> None:
    assert parse_port_range(text) == expected


@pytest.mark.parametrize("text", ["20000", "20000-", "-20000", "a-b", "1-2-3", "20000:30000", "", "20000 - x"])
def test_parse_port_range_unreadable(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_port_range(text)
    assert str(info.value) == f"expected a port range LOW-HIGH such as 20000-32767, got {text!r}"


@pytest.mark.parametrize("text", ["80-2000", "1023-2000", "30000-20000", "20000-65536", "0-0"])
def test_parse_port_range_out_of_bounds(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_port_range(text)
    assert str(info.value) == f"expected 1024 <= LOW <= HIGH <= 65535, got {text!r}"


def test_default_range_is_below_the_ephemeral_ports() -> None:
    assert DEFAULT_RANGE == (20000, 32767)


# -- PortAllocator with an injected check ---------------------------------------------------


def test_take_returns_distinct_ports_in_range() -> None:
    pool = PortAllocator((30000, 30099), check=always_free, seed=1)
    got = pool.take(10, "a")
    assert len(got) == len(set(got)) == 10
    assert all(30000 <= p <= 30099 for p in got)
    assert {p: "a" for p in got} == pool.owners


def test_take_is_round_robin_and_wraps() -> None:
    pool = PortAllocator((30000, 30004), check=always_free, seed=0)
    start = pool._next[(30000, 30004)]
    first = pool.take(5, "a")
    assert first == [30000 + (start - 30000 + i) % 5 for i in range(5)]
    assert sorted(first) == [30000, 30001, 30002, 30003, 30004]


def test_a_port_given_back_is_not_reused_at_once() -> None:
    pool = PortAllocator((30000, 30009), check=always_free, seed=3)
    (first,) = pool.take(1, "a")
    pool.give_back("a")
    seen = [p for i in range(9) for p in pool.take(1, f"o{i}")]
    assert first not in seen  # the nine other ports come first
    assert pool.take(1, "last") == [first]


def test_ports_are_unique_across_owners() -> None:
    pool = PortAllocator((30000, 30019), check=always_free, seed=5)
    a = pool.take(7, "a")
    b = pool.take(7, "b")
    c = pool.take(6, "c")
    assert sorted(a + b + c) == list(range(30000, 30020))


def test_busy_ports_are_skipped() -> None:
    busy = {30001, 30003}
    checked: list[int] = []

    def check(port: int) -> bool:
        checked.append(port)
        return port not in busy

    pool = PortAllocator((30000, 30004), check=check, seed=0)
    assert sorted(pool.take(3, "a")) == [30000, 30002, 30004]
    assert set(checked) == {30000, 30001, 30002, 30003, 30004}


def test_leased_ports_are_not_checked_again() -> None:
    checked: list[int] = []

    def check(port: int) -> bool:
        checked.append(port)
        return True

    pool = PortAllocator((30000, 30003), check=check, seed=0)
    mine = pool.take(2, "a")
    checked.clear()
    others = pool.take(2, "b")
    assert set(checked) == set(others)
    assert not set(mine) & set(checked)


def test_exhaustion_error_and_nothing_kept() -> None:
    pool = PortAllocator((30000, 30004), check=always_free, seed=0)
    pool.take(3, "a")
    with pytest.raises(RuntimeError) as info:
        pool.take(3, "b")
    assert str(info.value) == "only 2 of 3 ports free in 30000-30004 (3 leased); widen --gpu-port-range"
    assert set(pool.owners.values()) == {"a"}  # b's partial take was rolled back
    assert len(pool.take(2, "b")) == 2


def test_exhaustion_counts_busy_ports() -> None:
    pool = PortAllocator((30000, 30009), check=lambda port: port % 2 == 0, seed=0)
    with pytest.raises(RuntimeError) as info:
        pool.take(6, "a")
    assert str(info.value) == "only 5 of 6 ports free in 30000-30009 (0 leased); widen --gpu-port-range"


def test_take_zero() -> None:
    pool = PortAllocator((30000, 30000), check=lambda port: False, seed=0)
    assert pool.take(0, "a") == []


def test_give_back() -> None:
    pool = PortAllocator((30000, 30009), check=always_free, seed=0)
    a = pool.take(3, "c1/test_a")
    b = pool.take(2, "c1/test_b")
    assert sorted(pool.give_back("c1/test_a")) == sorted(a)
    assert sorted(pool.owners) == sorted(b)
    assert pool.give_back("c1/test_a") == []
    assert pool.give_back("nobody") == []


def test_give_back_prefix_returns_one_clients_ports() -> None:
    pool = PortAllocator((30000, 30009), check=always_free, seed=0)
    a1 = pool.take(2, "c1/t1")
    a2 = pool.take(1, "c1/t2")
    other = pool.take(2, "c10/t1")  # "c1/" must not match "c10/"
    assert sorted(pool.give_back_prefix("c1/")) == sorted(a1 + a2)
    assert sorted(pool.owners) == sorted(other)
    assert {o for o in pool.owners.values()} == {"c10/t1"}


def test_same_seed_same_start() -> None:
    assert PortAllocator(seed=42)._next == PortAllocator(seed=42)._next
    assert DEFAULT_RANGE[0] <= PortAllocator(seed=42)._next[DEFAULT_RANGE] <= DEFAULT_RANGE[1]


def test_each_range_asked_for_is_its_own_round_robin() -> None:
    """The machine's arbiter serves runs with different --gpu-port-range: ports come from the range asked."""
    pool = PortAllocator((30000, 30999), check=always_free, seed=1)
    narrow = pool.take(3, "a", (40000, 40002))
    assert sorted(narrow) == [40000, 40001, 40002]
    assert all(30000 <= p <= 30999 for p in pool.take(3, "b"))
    with pytest.raises(RuntimeError, match=r"only 0 of 1 ports free in 40000-40002 \(3 leased\)"):
        pool.take(1, "c", (40000, 40002))


# -- the real check --------------------------------------------------------------------


@pytest.fixture
def listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_bindable_sees_a_listening_socket(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    assert bindable(port) is False
    listening.close()
    assert bindable(port) is True


def test_real_pool_skips_a_port_in_use(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    pool = PortAllocator((port, port), seed=0)  # the real bind check
    with pytest.raises(RuntimeError) as info:
        pool.take(1, "a")
    assert str(info.value) == f"only 0 of 1 ports free in {port}-{port} (0 leased); widen --gpu-port-range"
    listening.close()
    assert pool.take(1, "a") == [port]


def test_real_pool_hands_out_bindable_ports() -> None:
    pool = PortAllocator(seed=7)
    for port in pool.take(3, "a"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))  # raises if the pool handed out a busy port
