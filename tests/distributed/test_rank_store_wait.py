"""A rank other than 0 waits for rank 0's rendezvous store to listen before it connects
(``rankmain._await_store``): a connect refused first makes torch's client back off."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pytest_gpu.distributed import rankmain


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_returns_once_the_store_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    listening = threading.Event()
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()
        listening.set()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        rankmain._await_store(timeout=30)
        assert listening.is_set()  # it did not return while the port refused
        server.settimeout(5)
        accepted, _ = server.accept()  # its probe connected (and closed)
        accepted.close()
    finally:
        thread.join()
        server.close()


def test_gives_up_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nothing will listen there
    start = time.monotonic()
    rankmain._await_store(timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 5  # the rendezvous is left to fail and say why


@pytest.mark.parametrize("port", [None, "", "not-a-port"])
def test_without_a_store_address_nothing_waits(monkeypatch: pytest.MonkeyPatch, port: str | None) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    if port is None:
        monkeypatch.delenv("MASTER_PORT", raising=False)
    else:
        monkeypatch.setenv("MASTER_PORT", port)
    start = time.monotonic()
    rankmain._await_store(timeout=30)
    assert time.monotonic() - start < 1
