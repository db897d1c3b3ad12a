"""A whole pytest run alone, and beside keyless clients holding handshakes on its broker.

The run: ``pytest -n 4 --gpus sim:4x16GiB`` over 32 generated GPU tests (4 GiB each,
allocated and held 0.2 s). Beside it, the keyless clients of ``bench/broker.py --attack``
(:func:`broker._keyless_main`: 32 processes of this user, without the key, each holding
``--each`` connections to the run's broker socket stalled in the handshake and connecting
again as soon as one is dropped); they attack the socket the moment it appears. Alone and
attacked alternate, ``--runs`` times each; each run has a private ``TMPDIR`` (so its run
directory is found) and machine directory. Prints each run's wall time and the medians'
ratio, attacked over alone.

    python bench/keyless_run.py               # 3 runs a side
    python bench/keyless_run.py --runs 5 --each 4
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import broker  # bench/broker.py: the keyless clients

TESTS = """
import time, pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(memory="4GiB")
@pytest.mark.parametrize("i", range(32))
def test_gpu(gpu, i):
    block = sim.allocate(4 * 2**30, gpu.device)
    time.sleep(0.2)
    block.free()
"""


def _attack_when_up(pattern: str, clients: int, each: int, ready: Any) -> None:
    """Say it is up, wait for the run's broker socket, then hold handshakes on it (until killed)."""
    ready.put("armed")
    while not (found := glob.glob(pattern)):
        time.sleep(0.002)
    broker._keyless_main(found[0], clients, each, ready)


def one_run(suite: Path, attack: bool, each: int) -> float:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-keyless-") as tmp:
        env = {
            **os.environ,
            "TMPDIR": tmp,
            "PYTEST_GPU_MACHINE_DIR": str(Path(tmp) / "machines"),
            "PYTEST_GPU_SIM_MACHINE": f"keyless-{os.getpid()}-{time.monotonic_ns()}",
        }
        attacker = None
        if attack:  # started and waiting first (not timed), so that it is in before the first worker connects
            pattern = str(Path(tmp) / f"pytest-gpu-{os.getuid()}" / "*" / "broker.sock")
            ready = ctx.Queue()
            attacker = ctx.Process(
                target=_attack_when_up, args=(pattern, broker.KEYLESS_CLIENTS, each, ready), daemon=True
            )
            attacker.start()
            ready.get(timeout=120)  # armed: its own start-up is not the run's
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
        cmd += ["-n", "4", "--gpus", "sim:4x16GiB", str(suite)]
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        finally:
            if attacker is not None:
                attacker.kill()
                attacker.join()
        wall = time.monotonic() - started
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
        if done.returncode != 0:
            raise SystemExit(f"the run failed ({done.returncode}): {last}")
        print(f"  {'keyless' if attack else 'alone  '}  {wall:6.2f} s   {last}", flush=True)
        return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs a side, alternating (default 3)")
    parser.add_argument("--each", type=int, default=broker.KEYLESS_EACH, help="handshakes each keyless client holds")
    args = parser.parse_args(argv)
    print(
        f"pytest -n 4 --gpus sim:4x16GiB, 32 tests; beside {broker.KEYLESS_CLIENTS} keyless clients "
        f"x {args.each} handshakes · {os.cpu_count()} CPUs · load {os.getloadavg()[0]:.1f}"
    )
    walls: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-keyless-suite-") as tmp:
        suite = Path(tmp) / "test_keyless_suite.py"
        suite.write_text(TESTS)
        for i in range(args.runs):
            for attack in (False, True) if i % 2 == 0 else (True, False):
                walls[attack].append(one_run(suite, attack, args.each))
    alone, hit = statistics.median(walls[False]), statistics.median(walls[True])
    print(f"median wall: alone {alone:.2f} s, keyless {hit:.2f} s: x{hit / alone:.2f} (load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
