"""Command-line options and ini keys, and their validation into :class:`Settings`."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pytest

from ..base.requests import DefaultMemory, SizeError, parse_size
from ..gpu.discovery import FORM as GPUS_FORM
from ..machine.domain import placement_spreads, user_memory_cap
from ..machine.ports import DEFAULT_RANGE, parse_port_range
from ..vendors.amd import PROCESS_LAG_S as AMD_PROCESS_LAG_S
from .conventions import MarkerMapError, marker_map
from .written import Margin, WrittenError, load, load_if_any

# (option, ini key, default, help)
OPTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("--gpus", "gpus", "auto", f"GPUs this run may use: {GPUS_FORM}. Default: auto (NVML, else amdsmi)."),
    (
        "--gpu-default-memory",
        "gpu_default_memory",
        "exclusive",
        "memory per GPU for a gpu test that gives none: 'exclusive' (a whole GPU) or a size such as 4GiB.",
    ),
    (
        "--gpu-oversize",
        "gpu_oversize",
        "skip",
        "a request this machine can never satisfy: 'skip' (with a reason) or 'fail'.",
    ),
    (
        "--gpu-required",
        "gpu_required",
        "false",
        "fail the run at start (after collection) when it has GPU tests and no GPUs, instead of skipping "
        "them: for a GPU CI job. A flag on the command line; 'true' or 'false' as an ini key.",
    ),
    (
        "--gpu-verify",
        "gpu_verify",
        "fail",
        "after each GPU test, check it stayed in its lease: 'fail', 'warn' or 'off'.",
    ),
    (
        "--gpu-wait-timeout",
        "gpu_wait_timeout",
        "1800",
        "seconds a test may wait for its GPUs before it fails, naming who held them.",
    ),
    (
        "--gpu-context-overhead",
        "gpu_context_overhead",
        "500MiB",
        "memory one process's CUDA context takes on a GPU, counted against capacity.",
    ),
    (
        "--gpu-amd-process-lag",
        "gpu_amd_process_lag",
        f"{AMD_PROCESS_LAG_S:g}",
        "Deprecated (amdsmi reads its per-process list live: 0 is right). AMD GPUs: seconds amdsmi's "
        "per-process list may be behind. A violation is judged again from a list read this long after the "
        "test ended; tests shorter than this are counted in the summary, or waited for with --gpu-amd-lag-wait.",
    ),
    (
        "--gpu-amd-lag-wait",
        "gpu_amd_lag_wait",
        "false",
        "AMD GPUs: verify a test shorter than --gpu-amd-process-lag only once the lag has passed since its "
        "lease began, so the list can show it (costs up to the lag per short GPU test). A flag on the "
        "command line; 'true' or 'false' as an ini key.",
    ),
    (
        "--gpu-workers-per-gpu",
        "gpu_workers_per_gpu",
        "none",
        "-n auto: at most this many workers per GPU (a positive whole number), or 'none' for no cap.",
    ),
    (
        "--gpu-host-cpus",
        "gpu_host_cpus",
        "auto",
        "CPUs the machine has for tests' cpus= leases: 'auto' (this process's CPU affinity) or a positive "
        "whole number; the run that is the machine's arbiter declares it for all.",
    ),
    (
        "--gpu-host-memory",
        "gpu_host_memory",
        "auto",
        "RAM the machine has for tests' host_memory= leases: 'auto' (total RAM less 10%, at least 1GiB, "
        "kept back) or a size such as 64GiB; the run that is the machine's arbiter declares it for all.",
    ),
    (
        "--gpu-port-range",
        "gpu_port_range",
        f"{DEFAULT_RANGE[0]}-{DEFAULT_RANGE[1]}",
        "TCP ports handed out by the ports/port fixtures, as LOW-HIGH.",
    ),
    ("--dist-timeout", "dist_timeout", "300", "seconds a distributed test may run (the marker's timeout= wins)."),
    (
        "--dist-pool",
        "dist_pool",
        "on",
        "'on': distributed tests reuse warm rank pools; 'off': fresh ranks for every test (for debugging).",
    ),
    ("--dist-pool-idle", "dist_pool_idle", "60", "seconds an idle rank pool lives before it is shut down."),
    (
        "--rank-log-dir",
        "rank_log_dir",
        "logs",
        "under a launcher: ranks other than 0 write their output to DIR/<launcher>/rank<N>.log.",
    ),
    (
        "--rank-gather-timeout",
        "rank_gather_timeout",
        "300",
        "under a launcher: seconds rank 0 waits for every rank's results before reporting the missing ones.",
    ),
    (
        "--ray-address",
        "ray_address",
        "",
        "Ray cluster for the ray_cluster fixture (host:port); empty: start a local head with the run's GPUs.",
    ),
    (
        "--gpu-schedule",
        "gpu_schedule",
        "on",
        "under -n without --dist: 'on' hands tests to workers by their GPU requests and past durations "
        "(longest first, what fits); 'off' leaves xdist's own load scheduling.",
    ),
    (
        "--gpu-trace",
        "gpu_trace",
        "",
        "write a Chrome/Perfetto trace (JSON) of the run to this path (in an existing directory): "
        "a track per GPU and per worker.",
    ),
    (
        "--ray-start-timeout",
        "ray_start_timeout",
        "60",
        "seconds the ray_cluster fixture waits for the Ray cluster to come up (or to be reached).",
    ),
    (
        "--gpu-retry-infra",
        "gpu_retry_infra",
        "false",
        "rerun once, on other GPUs and fresh ranks, a test whose failure pytest-gpu saw come from outside it "
        "(infrastructure: an OOM while memory outside the run grew, a port clash, a collective's start timing "
        "out, a lost worker); reported as passed on retry with the first failure kept. A flag on the command "
        "line; 'true' or 'false' as an ini key.",
    ),
    # written requests (pytest_gpu.run.written)
    (
        "--gpu-requests",
        "gpu_requests",
        "",
        "a file of written requests (memory per GPU for each test, measured): a test whose marker names "
        "no memory gets its line's; an ini key's path is relative to the ini file. Empty: none.",
    ),
    (
        "--gpu-requests-margin",
        "gpu_requests_margin",
        "25%,256MiB",
        "what --gpu-write-requests adds to a measured peak: a percentage and an optional floor (the least "
        "request), such as '25%' or '25%,256MiB'.",
    ),
    (
        "--gpu-write-requests",
        "gpu_write_requests",
        "false",
        "write (or update) the --gpu-requests file from this run's measured peaks, keeping the lines of "
        "tests not run; the file's requests are not applied in this run. A flag on the command line.",
    ),
    (
        "--gpu-check-requests",
        "gpu_check_requests",
        "false",
        "fail the run when a test's peak, with the file's margin, no longer fits its written request "
        "(or it ran out of memory under it), naming each test, its request and its new peak. A flag.",
    ),
    (
        "--dist-rerun-alone",
        "dist_rerun_alone",
        "on",
        "'on': a distributed test that fails on a warm pool after other tests is run once more alone on "
        "fresh ranks, to tell contamination by an earlier test from its own failure; 'off': never.",
    ),
    (
        "--dist-pool-ahead",
        "dist_pool_ahead",
        "4",
        "rank processes a test process may start ahead, for the rank pool of the next test it holds "
        "(0: pools start when their first test does).",
    ),
)

# ini keys of OPTIONS whose command-line option is a flag taking no value: given, it means "true"
FLAGS = frozenset({"gpu_required", "gpu_amd_lag_wait", "gpu_retry_infra", "gpu_write_requests", "gpu_check_requests"})
# ini keys of OPTIONS whose being given matters, not only their value: registered with the
# default None (pytest >= 8.0 returns an ini key's default as is when the file lacks it, and a
# file's value is never None), and read as OPTIONS' default when absent
GIVEN_MATTERS = frozenset({"gpu_context_overhead"})
_DEFAULTS = {ini: default for _, ini, default, _ in OPTIONS}


def _help_order(row: tuple[str, str, str, str]) -> tuple[bool, bool]:
    ini = row[1]
    return ini.startswith(("dist_", "rank_", "ray_")), ini.startswith("ray_")


def register(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu", "pytest-gpu: GPU-aware parallel test runs")
    # the GPU options first, in the order of OPTIONS less Ray's; Ray's in a group of their own
    ordered = sorted(OPTIONS, key=_help_order)
    ray = parser.getgroup("gpu-ray", "pytest-gpu: Ray clusters")
    for option, ini, default, help_text in ordered:
        target = ray if ini.startswith("ray_") else group
        # argparse %-formats help texts: a literal "%" must be doubled there
        shown = f"{help_text.replace('%', '%%')} (ini: {ini})"
        if ini in FLAGS:
            target.addoption(option, dest=ini, default=None, action="store_const", const="true", help=shown)
        else:
            target.addoption(option, dest=ini, default=None, help=shown)
        parser.addini(ini, help_text, default=None if ini in GIVEN_MATTERS else default)
    group.addoption(
        "--gpu-learn",
        action="store_true",
        default=False,
        help="record each GPU test's measured peak in pytest's cache; a test that names no memory "
        "then gets max(1.25 x peak, 256MiB) instead of --gpu-default-memory.",
    )
    group.addoption(
        "--gpu-rebuild-artifacts",
        action="store_true",
        default=False,
        help="build every shared_artifact anew (once in this run) even if its version is unchanged.",
    )
    group.addoption(
        "--gpu-nodes",
        dest="gpu_nodes",
        default=None,
        help="one run over several nodes, -n N workers on each, every node's GPUs leased there: 'slurm' "
        "(every node of the allocation, through srun), 'ssh:HOST,HOST' (through ssh) or 'local:N' (N nodes "
        "simulated on this machine, for tests); the nodes must share the filesystem.",
    )
    group.addoption(
        "--shard",
        action="store_true",
        default=False,
        help="under a launcher (srun/mpirun/torchrun): each rank runs its share of the suite, rank 0 reports all.",
    )
    group.addoption(
        "--gpu-bisect",
        dest="gpu_bisect",
        action="append",
        default=[],
        metavar="NODEID",
        help="after the run, find the smallest memory per GPU this test passes with, rerunning it alone "
        "under caps (bisecting, to 64MiB), and write that plus the margin as its --gpu-requests line. "
        "Repeatable.",
    )
    parser.addini(
        "launcher_markers",
        "strategy markers and the launchers they may run under, one 'MARKER: LAUNCHER ...' per line.",
        type="linelist",
        default=[],
    )
    parser.addini(
        "gpu_marker_map",
        "your own markers as GPU requests, one 'MARKER: count=N memory=SIZE exclusive' per line "
        "(each part optional; a gpu marker on the test wins).",
        type="linelist",
        default=[],
    )


CONTROLLER_ONLY = {"controller_only": True}  # metadata of a Settings field xdist workers are not sent


@dataclass(frozen=True)
class Settings:
    gpus: str
    default_memory: DefaultMemory
    oversize: str
    verify: str
    wait_timeout: float
    context_overhead: int
    port_range: tuple[int, int]
    dist_timeout: float = 300.0
    dist_pool: bool = True
    dist_pool_idle: float = 60.0
    rank_gather_timeout: float = 300.0
    ray_address: str = ""
    ray_start_timeout: float = 60.0
    learn: bool = False
    schedule: bool = True
    trace: str = field(default="", metadata=CONTROLLER_ONLY)  # the controller writes it
    workers_per_gpu: int | None = field(default=None, metadata=CONTROLLER_ONLY)  # -n auto's cap
    host_cpus: int | None = None  # the machine's CPUs for cpus= leases (None: measured, see pytest_gpu.leasing.host)
    host_memory: int | None = None  # the machine's RAM for host_memory= leases (None: measured)
    # --gpu-context-overhead was given (command line or ini): it wins over the measured context size
    context_overhead_given: bool = False
    required: bool = False  # --gpu-required: GPU tests and no GPUs fail the run (see pytest_gpu.run.required)
    amd_process_lag: float = AMD_PROCESS_LAG_S  # seconds amdsmi's process list may be old
    amd_lag_wait: bool = False  # --gpu-amd-lag-wait: verification of a test shorter than the lag waits it out
    retry_infra: bool = False  # --gpu-retry-infra: an infrastructure failure reruns once (pytest_gpu.run.infra)
    # written requests (pytest_gpu.run.written): the file (absolute), its margin, what this run does with it
    requests_path: str = ""
    requests_margin: float = 0.25
    requests_floor: int = 256 * 2**20
    write_requests: bool = False  # the file is written, not applied
    check_requests: bool = field(default=False, metadata=CONTROLLER_ONLY)
    bisect: tuple[str, ...] = field(default=(), metadata=CONTROLLER_ONLY)
    dist_rerun_alone: bool = True  # a failure on a warm pool after other tests: rerun alone (distributed.runner)
    dist_pool_ahead: int = 4  # --dist-pool-ahead: rank processes started ahead of their first test (0: none)

    def to_wire(self) -> dict[str, Any]:
        """The fields an xdist worker needs, by name, JSON-safe (``default_memory`` a dict,
        ``port_range`` a list); the controller's own fields stay home."""
        values = asdict(self)
        values["port_range"] = list(self.port_range)
        return {f.name: values[f.name] for f in fields(self) if not f.metadata.get("controller_only")}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Settings:
        """The inverse of :meth:`to_wire`: a field it lacks keeps its default."""
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["default_memory"] = DefaultMemory(**values["default_memory"])
        values["port_range"] = tuple(values["port_range"])
        return cls(**values)


def _value(config: pytest.Config, ini: str) -> tuple[str, str]:
    """The value and where it came from (for error messages)."""
    option = "--" + ini.replace("_", "-")
    cli = config.getoption(ini)
    if cli is not None:
        return str(cli), option
    value = config.getini(ini)
    if value is None:  # a key of GIVEN_MATTERS that no ini file (nor -o) gives
        return _DEFAULTS[ini], option
    return str(value), f"ini key {ini!r}"


def _given(config: pytest.Config, ini: str) -> bool:
    """Was ``ini`` (a key of :data:`GIVEN_MATTERS`) given, on the command line, in an ini file or by ``-o``?"""
    return config.getoption(ini) is not None or config.getini(ini) is not None


def _choice(config: pytest.Config, ini: str, choices: tuple[str, ...]) -> str:
    value, where = _value(config, ini)
    if value.strip().lower() not in choices:
        raise pytest.UsageError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    return value.strip().lower()


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _flag(config: pytest.Config, ini: str) -> bool:
    value, where = _value(config, ini)
    word = value.strip().lower()
    if word not in _TRUE + _FALSE:
        raise pytest.UsageError(f"{where}: expected true or false, got {value!r}")
    return word in _TRUE


def foreseen(config: pytest.Config, ini: str) -> str:
    """An option's value before pytest has parsed the command line (``pytest_load_initial_conftests``,
    where ``known_args_namespace`` holds it), else its ini key's, else its default; unchecked
    (:func:`read` checks it): what the process's role foresees its features from."""
    cli = getattr(getattr(config, "known_args_namespace", None), ini, None)
    if cli is not None:
        return str(cli)
    value = config.getini(ini)
    return _DEFAULTS[ini] if value is None else str(value)


def foreseen_flag(config: pytest.Config, ini: str) -> bool:
    """:func:`foreseen` of a flag (a key of :data:`FLAGS`): whether it is true."""
    return foreseen(config, ini).strip().lower() in _TRUE


def read(config: pytest.Config) -> Settings:
    """Validate every option; a bad value is a UsageError naming the option."""
    gpus, _ = _value(config, "gpus")
    memory_text, where = _value(config, "gpu_default_memory")
    try:
        default_memory = DefaultMemory.parse(memory_text)
    except SizeError as exc:
        raise pytest.UsageError(f"{where}: expected 'exclusive' or a size; {exc}") from None
    wait_timeout = _seconds(config, "gpu_wait_timeout")
    overhead_text, where = _value(config, "gpu_context_overhead")
    try:
        overhead = parse_size(overhead_text)
    except SizeError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
    try:
        marker_map(config, default_memory)  # checked at start-up; kept for item_needs
    except MarkerMapError as exc:
        raise pytest.UsageError(str(exc)) from None
    range_text, where = _value(config, "gpu_port_range")
    try:
        port_range = parse_port_range(range_text)
    except ValueError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
    try:
        user_memory_cap()  # read by the machine's arbiter, which may live in this run: said at start
        placement_spreads()  # the bench's switch (GpuRun.start reads it): said at start too
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return Settings(
        gpus=gpus,
        default_memory=default_memory,
        oversize=_choice(config, "gpu_oversize", ("skip", "fail")),
        required=_flag(config, "gpu_required"),
        verify=_choice(config, "gpu_verify", ("fail", "warn", "off")),
        wait_timeout=wait_timeout,
        context_overhead=overhead,
        context_overhead_given=_given(config, "gpu_context_overhead"),
        port_range=port_range,
        dist_timeout=_seconds(config, "dist_timeout"),
        dist_pool=_choice(config, "dist_pool", ("on", "off")) == "on",
        dist_pool_idle=_seconds(config, "dist_pool_idle"),
        rank_gather_timeout=_seconds(config, "rank_gather_timeout"),
        ray_address=_value(config, "ray_address")[0].strip(),
        ray_start_timeout=_seconds(config, "ray_start_timeout"),
        learn=bool(config.getoption("gpu_learn", False)),
        schedule=_choice(config, "gpu_schedule", ("on", "off")) == "on",
        trace=_trace_path(config),
        workers_per_gpu=_workers_per_gpu(config),
        host_cpus=_host_cpus(config),
        host_memory=_host_memory(config),
        amd_process_lag=_lag(config),
        amd_lag_wait=_flag(config, "gpu_amd_lag_wait"),
        retry_infra=_flag(config, "gpu_retry_infra"),
        **_written(config),
        dist_rerun_alone=_choice(config, "dist_rerun_alone", ("on", "off")) == "on",
        dist_pool_ahead=_pool_ahead(config),
    )


def _pool_ahead(config: pytest.Config) -> int:
    text, where = _value(config, "dist_pool_ahead")
    value = text.strip()
    if not (value.isascii() and value.isdigit()):
        raise pytest.UsageError(f"{where}: expected a whole number of rank processes (0: none ahead), got {text!r}")
    return int(value)


def _lag(config: pytest.Config) -> float:
    text, where = _value(config, "gpu_amd_process_lag")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60:  # NaN fails too
        raise pytest.UsageError(f"{where}: expected seconds from 0 to 60 (0: the driver reads it live), got {text!r}")
    return value


def _host_cpus(config: pytest.Config) -> int | None:
    text, where = _value(config, "gpu_host_cpus")
    value = text.strip().lower()
    if value == "auto":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) <= 0:
        raise pytest.UsageError(f"{where}: expected 'auto' or a positive whole number of CPUs, got {text!r}")
    return int(value)


def _host_memory(config: pytest.Config) -> int | None:
    text, where = _value(config, "gpu_host_memory")
    if text.strip().lower() == "auto":
        return None
    try:
        size = parse_size(text)
    except SizeError as exc:
        raise pytest.UsageError(f"{where}: expected 'auto' or a size; {exc}") from None
    if size <= 0:
        raise pytest.UsageError(f"{where}: expected 'auto' or a positive size, got {text!r}")
    return size


def _trace_path(config: pytest.Config) -> str:
    text, where = _value(config, "gpu_trace")
    path = text.strip()
    if path and os.path.isdir(path):
        raise pytest.UsageError(f"{where}: expected the path of a file to write the trace to, got directory {path!r}")
    # checked now, not when the run is over; and never created: a typo would hide the trace
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        why = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise pytest.UsageError(
            f"{where}: {parent!r} {why}; expected the path of a file in an existing directory, got {path!r}"
        )
    return path


def _workers_per_gpu(config: pytest.Config) -> int | None:
    text, where = _value(config, "gpu_workers_per_gpu")
    value = text.strip().lower()
    if value in ("", "none"):
        return None
    if not (value.isascii() and value.isdigit()) or int(value) <= 0:
        raise pytest.UsageError(f"{where}: expected a positive whole number of workers per GPU or 'none', got {text!r}")
    return int(value)


def _seconds(config: pytest.Config, ini: str) -> float:
    text, where = _value(config, ini)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise pytest.UsageError(f"{where}: expected a positive number of seconds, got {text!r}")
    return value


def _written(config: pytest.Config) -> dict[str, Any]:
    """The written requests' settings: the file checked now (a bad line stops the run at start)."""
    margin_text, where = _value(config, "gpu_requests_margin")
    try:
        margin = Margin.parse(margin_text)
    except WrittenError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
    write, check = _flag(config, "gpu_write_requests"), _flag(config, "gpu_check_requests")
    bisect = tuple(str(n).strip() for n in config.getoption("gpu_bisect", None) or ())
    path = _requests_path(config)
    wants = [name for name, on in (("--gpu-write-requests", write), ("--gpu-check-requests", check)) if on]
    wants += ["--gpu-bisect"] if bisect else []
    if wants and not path:
        raise pytest.UsageError(
            f"{wants[0]}: expected --gpu-requests=PATH (or the ini key 'gpu_requests') naming the file of requests"
        )
    if write and check:
        raise pytest.UsageError(
            "--gpu-write-requests and --gpu-check-requests: expected one of the two (write the file, or check a run "
            "against it)"
        )
    if any(not node or "::" not in node for node in bisect):
        raise pytest.UsageError(
            f"--gpu-bisect: expected a test's node id such as 'tests/test_x.py::test_y', got {bisect}"
        )
    if path:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise pytest.UsageError(
                f"--gpu-requests: {parent!r} is not a directory; expected a file in an existing one"
            )
        try:
            load_if_any(path) if write or bisect else load(path)  # a file to update must be readable too
        except WrittenError as exc:
            raise pytest.UsageError(f"--gpu-requests: {exc}") from None
    return {
        "requests_path": path,
        "requests_margin": margin.fraction,
        "requests_floor": margin.floor,
        "write_requests": write,
        "check_requests": check,
        "bisect": bisect,
    }


def _requests_path(config: pytest.Config) -> str:
    """The file's absolute path: the option's from where pytest was started, the ini key's from the ini file."""
    cli = config.getoption("gpu_requests")
    if cli is not None:
        text, base = str(cli).strip(), config.invocation_params.dir
    else:
        text = str(config.getini("gpu_requests") or "").strip()
        base = config.inipath.parent if config.inipath is not None else config.rootpath
    return str((base / text).resolve()) if text else ""
