"""Ports, subprocesses, and leasing only the GPU-heavy section of a test."""

from __future__ import annotations

import hashlib
import os
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from pytest_gpu import GpuLease, sim


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(self.request.recv(1024).upper())


def _serve_once(port: int) -> str:
    server = socketserver.TCPServer(("127.0.0.1", port), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"ping")
            return conn.recv(1024).decode()
    finally:
        server.shutdown()
        server.server_close()


def test_rendezvous_server_on_a_run_unique_port(port: int) -> None:
    # no more "everyone uses 29500": the port is unique across all workers of the run
    assert _serve_once(port) == "PING"


def test_several_services(ports: Callable[[int], list[int]]) -> None:
    master, metrics = ports(2)
    assert master != metrics
    assert _serve_once(master) == "PING"
    assert _serve_once(metrics) == "PING"


CHILD = """
import os
from pytest_gpu import sim
with sim.allocate("2GiB") as block:  # device 0 of what this process can see
    print(os.environ.get("CUDA_VISIBLE_DEVICES"), block.physical)
"""


@pytest.mark.gpu(memory="4GiB")
def test_subprocess_inherits_the_lease(gpu: GpuLease) -> None:
    # CUDA_VISIBLE_DEVICES is set in os.environ for the test (indices on simulated GPUs,
    # UUIDs on real ones), so a child process (a launcher, a CLI under test) lands on the
    # leased GPU too
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    visible, physical = out.split()
    assert visible == os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices
    assert int(physical) == gpu.indices[0]
    sim.hold("1GiB", 0.2)


def _compile_kernels() -> str:
    # host-side work (compilation, data preparation): needs no GPU, runs in parallel
    digest = b""
    for i in range(20000):
        digest = hashlib.sha256(digest + i.to_bytes(4, "little")).digest()
    return digest.hex()


def test_lease_only_the_gpu_section(gpu_request: Callable[..., object]) -> None:
    kernel = _compile_kernels()
    with gpu_request(memory="6GiB") as lease:  # waits for a GPU only here
        assert os.environ["CUDA_VISIBLE_DEVICES"] == lease.visible_devices
        sim.hold("5GiB", 0.5)
    assert len(kernel) == 64
