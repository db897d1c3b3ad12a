"""Data that crosses a process boundary or a report: each type's wire form round-trips, and
the writer and the reader agree on it (a field dropped on either side fails here)."""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from pytest_gpu.base.requests import DefaultMemory, GpuRequest
from pytest_gpu.base.spans import (
    GpuProperties,
    HeldRow,
    LeaseSpan,
    format_held,
    format_peaks,
    format_spans,
    gpu_properties,
    parse_held,
    parse_peaks,
    parse_spans,
)
from pytest_gpu.gpu.verification import Verdict
from pytest_gpu.leasing.broker import Broker, ClientInfo, scoped, unscoped
from pytest_gpu.leasing.client import Grant
from pytest_gpu.leasing.protocol import BROKER, CATALOG_ENTRY, FOREIGN, LEASE, ForeignNote, LeaseMessage
from pytest_gpu.machine.ports import PortOwner
from pytest_gpu.nodes.messages import RUN_WIRE
from pytest_gpu.report.timeline import Timeline
from pytest_gpu.run.lifecycle import TestState, report_properties
from pytest_gpu.run.options import Settings
from pytest_gpu.run.session import WIRE_KEY, GpuRun, RunWire
from pytest_gpu.scheduling.planner import Need
from pytest_gpu.sim.spec import parse
from pytest_gpu.vendors.devices import Inventory

GIB = 2**30
T0 = 1_700_000_000.0


def json_trip(value: Any) -> Any:
    """What arrives at the other end: JSON (the report, junitxml) or execnet (plain values)."""
    return json.loads(json.dumps(value))


# -- lease spans and the report's user properties -----------------------------------------

SPAN = LeaseSpan((0, 2), 3 * GIB, True, T0 + 0.25, T0 + 0.5, T0 + 2.75)
CHANGED = {"gpus": (1,), "memory": GIB, "exclusive": False, "asked": T0, "granted": T0 + 0.125, "released": T0 + 9}


def test_lease_span_round_trips_every_field() -> None:
    row = SPAN.to_wire()
    assert len(row) == len(fields(LeaseSpan))
    assert LeaseSpan.from_wire(json_trip(row)) == SPAN
    assert set(CHANGED) == {f.name for f in fields(LeaseSpan)}
    for name, value in CHANGED.items():  # each field reaches the reader: change one, the result changes
        other = replace(SPAN, **{name: value})
        assert LeaseSpan.from_wire(json_trip(other.to_wire())) == other != SPAN


def test_lease_span_row_is_in_field_order() -> None:
    # junitxml readers see the row: [gpus, memory, exclusive, asked, granted, released]
    assert SPAN.to_wire() == [[0, 2], 3 * GIB, True, T0 + 0.25, T0 + 0.5, T0 + 2.75]


def test_lease_span_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="a lease span has 6 fields"):
        LeaseSpan.from_wire(SPAN.to_wire()[:5])


def test_spans_and_peaks_round_trip() -> None:
    spans = [SPAN, LeaseSpan((1,), GIB, False, T0, T0, T0 + 1.0)]
    assert parse_spans(format_spans(spans)) == spans
    assert parse_spans(format_spans([])) == []
    peaks = {0: 5 * GIB, 3: 0}
    assert format_peaks(peaks) == f"0={5 * GIB},3=0"
    assert parse_peaks(format_peaks(peaks)) == peaks
    assert parse_peaks("") == {}


def test_held_rows_round_trip_and_refuse_unknown_keys() -> None:
    row = HeldRow("pool", "the rank pool of 2 ranks", (SPAN,), 1)
    assert parse_held(format_held([row])) == [row]
    assert HeldRow.from_wire(json_trip(row.to_wire())) == row
    with pytest.raises(ValueError, match="a held row has the keys"):
        HeldRow.from_wire({**row.to_wire(), "extra": 1})


def test_the_writers_properties_are_the_typed_ones() -> None:
    state = TestState(indices={0, 2}, waited=0.25, leases=[SPAN], request=GpuRequest(count=2, exclusive=True))
    state.verdict = Verdict(peak={0: GIB, 2: 2 * GIB}, notes=["no NVML"], unseen_lag=1.0)
    state.held = [HeldRow("fixture", "fixture 'model' (module scope, t.py)", (SPAN,), 0)]
    props = report_properties(state, alone=False)
    # gpu_notes, gpu_held and gpu_unseen_lag included: there are some
    assert set(props) == set(GpuProperties.__annotations__)
    assert all(isinstance(value, (str, int, float)) for value in props.values())  # junitxml, execnet
    assert "gpu_notes" not in report_properties(replace(state, verdict=Verdict(peak={0: 1})), alone=False)
    assert "gpu_held" not in report_properties(replace(state, held=[]), alone=False)
    assert "gpu_unseen_lag" not in report_properties(replace(state, verdict=Verdict(peak={0: 1})), alone=False)
    # a holder's (a pool's) verdict judged during the test counts too
    judged = replace(state, verdict=Verdict(peak={0: 1}), unseen_lag=2.0)
    assert report_properties(judged, alone=False)["gpu_unseen_lag"] == 2.0


def test_what_the_test_writes_the_timeline_reads() -> None:
    state = TestState(indices={0, 2}, waited=0.25, leases=[SPAN], request=GpuRequest(count=2, memory=GIB))
    state.verdict = Verdict(peak={0: GIB, 2: 2 * GIB})
    user_properties = json_trip(list(report_properties(state, alone=False).items()))  # as the controller gets them
    tl = Timeline()
    tl.phase("t.py::a", "gw0", "teardown", "passed", T0, T0 + 3.0, 3.0, dict(user_properties))
    rec = tl.records["t.py::a"]
    assert rec.leases == [SPAN]
    assert state.request is not None
    assert (rec.request, rec.requested, rec.peak, rec.reported_wait) == (state.request.describe(), GIB, 2 * GIB, 0.25)
    read = gpu_properties(user_properties)
    assert (read["gpu_indices"], read["gpu_violations"]) == ("0,2", 0)


def test_unmeasured_peaks_and_a_serial_test_suggest_nothing() -> None:
    state = TestState(indices={1}, leases=[SPAN], verdict=Verdict(peak={1: GIB}, measured=False))
    props = report_properties(state, alone=True)
    assert (props["gpu_peak_bytes"], props["gpu_request_bytes"]) == ("", 0)
    tl = Timeline()
    tl.phase("t.py::a", "gw0", "teardown", "passed", T0, T0 + 3.0, 3.0, dict(props.items()))
    assert tl.records["t.py::a"].peak is None
    assert tl.records["t.py::a"].requested == 0


# -- port owners ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "owner",
    [
        PortOwner("tests/test_x.py::test_a", "1234"),
        PortOwner("tests/test_x.py::test_a[user@host]", "1234"),  # a node id with "@" of its own
        PortOwner("server#3", "pool0-99"),
        PortOwner("ray-head", "42"),
    ],
)
def test_port_owner_round_trips(owner: PortOwner) -> None:
    assert PortOwner.parse(str(owner)) == owner


def test_port_owner_of_this_process_and_without_a_tag() -> None:
    assert str(PortOwner.of_this_process("t::a")) == f"t::a@{os.getpid()}"
    assert PortOwner.parse("just-a-name") == PortOwner("just-a-name", "")


def test_scoped_keys_round_trip() -> None:
    assert unscoped(scoped("c3", "t::a@12")) == ("c3", "t::a@12")
    assert unscoped(scoped("c3", "k0/x")) == ("c3", "k0/x")  # only the client part is split off


# -- the broker's lease message --------------------------------------------------------------


def test_grant_reads_every_field_of_the_lease_message() -> None:
    assert {f.name for f in fields(Grant)} == set(LeaseMessage.__required_keys__)
    # the message's schema (checked where it arrives) and its type agree
    assert set(LEASE.required) == set(LeaseMessage.__required_keys__)
    assert set(LEASE.optional) == set(LeaseMessage.__optional_keys__)
    assert set(FOREIGN.required) == set(ForeignNote.__required_keys__)


def test_a_catalog_entry_crosses_as_the_scheduler_wrote_it() -> None:
    from pytest_gpu.scheduling.catalog import Entry

    assert set(CATALOG_ENTRY.optional) == {f.name for f in fields(Entry)} | {"held"}
    entry = Entry(gpus=2, memory=None, pool="p", group="g", serial=True, before=("a",)).to_wire()
    arrived = BROKER.calls["catalog"].fields.check(json_trip({"tests": {"t::x": entry}}), "'catalog'")
    assert Entry.from_wire(arrived["tests"]["t::x"]) == Entry.from_wire(entry)


def test_what_the_broker_grants_the_client_reads(tmp_path: Path) -> None:
    broker = Broker({0: 16 * GIB, 1: 16 * GIB}, str(tmp_path / "b.sock"), b"key")
    try:
        info = ClientInfo("c0", "gw0", 1, None)  # type: ignore[arg-type]  # no connection: nothing is sent
        info.tests["c0/k0"] = "t.py::a"
        body = {
            "gpus": [broker.uuids[1]],
            "memory": 2 * GIB,
            "exclusive": False,
            "foreign": {"waited": True, "avoided": [broker.uuids[0]], "bytes": {broker.uuids[0]: GIB}},
        }
        message = broker._granted(info, "c0/k0", body, 1.5)
        arrived = BROKER.event("granted", json_trip(message))  # as the client checks it: the GPU keys integers again
        assert Grant.from_wire(arrived) == Grant("k0", (1,), 2 * GIB, False, 1.5)
        assert Grant.from_wire(arrived, 0.25).waited == 0.25  # the client's own measure
        assert arrived["foreign"] == message["foreign"] == {"waited": True, "avoided": [0], "bytes": {0: GIB}}
        assert broker.foreign == [
            {"test": "t.py::a", "seconds": 1.5, "waited": True, "avoided": [0], "bytes": {0: GIB}}
        ]
    finally:
        broker.close()


# -- settings and the run, controller to xdist worker -----------------------------------------


def every_field_set() -> Settings:
    """Settings with no field at its default: a field the wire drops would come back changed."""
    return Settings(
        gpus="sim:2x8GiB",
        default_memory=DefaultMemory(False, 3 * GIB),
        oversize="fail",
        verify="warn",
        wait_timeout=12.5,
        context_overhead=300 * 2**20,
        port_range=(21000, 21999),
        dist_timeout=30.0,
        dist_pool=False,
        dist_pool_idle=5.0,
        rank_gather_timeout=40.0,
        ray_address="10.0.0.1:6379",
        ray_start_timeout=7.5,
        learn=True,
        schedule=False,
        trace="trace.json",
        workers_per_gpu=3,
        host_cpus=6,
        host_memory=8 * GIB,
        context_overhead_given=True,
        required=True,
        amd_process_lag=2.5,
        amd_lag_wait=True,
        retry_infra=True,
        requests_path="/suite/gpu-requests.txt",
        requests_margin=0.5,
        requests_floor=2**30,
        write_requests=True,
        check_requests=True,
        bisect=("t.py::a",),
        dist_rerun_alone=False,
        dist_pool_ahead=2,
    )


def test_every_settings_field_differs_from_its_default() -> None:
    settings = every_field_set()
    for f in fields(Settings):
        assert getattr(settings, f.name) != f.default, f.name


def test_settings_round_trip_through_json() -> None:
    settings = every_field_set()
    wire = settings.to_wire()
    assert json_trip(wire) == wire  # JSON-safe as it is
    local = {"trace", "workers_per_gpu", "check_requests", "bisect"}  # the controller's alone
    assert set(wire) == {f.name for f in fields(Settings)} - local
    back = replace(settings, trace="", workers_per_gpu=None, check_requests=False, bisect=())
    assert Settings.from_wire(json_trip(wire)) == back


def test_settings_from_wire_fills_defaults_once() -> None:
    wire = every_field_set().to_wire()
    for name in ("learn", "schedule", "host_cpus", "ray_address"):
        del wire[name]
    back = Settings.from_wire(wire)
    assert (back.learn, back.schedule, back.host_cpus, back.ray_address) == (False, True, None, "")


def test_the_run_a_worker_joins_is_the_controllers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    inventory = Inventory(parse("sim:2x8GiB").devices()[0], "sim:2x8GiB", "a note")
    settings = every_field_set()
    run = GpuRun(settings, inventory, str(tmp_path / "b.sock"), b"\x00secret", "main", tmp_path)
    wire = run.to_wire()
    assert set(wire) == set(RunWire.__annotations__)
    assert json_trip(wire) == wire
    assert RUN_WIRE.check(json_trip(wire), "") == wire  # as a node's host hands it to the controller
    joined = GpuRun.join(json_trip({WIRE_KEY: wire})[WIRE_KEY], "gw1")
    try:
        local = {"trace": "", "workers_per_gpu": None, "check_requests": False, "bisect": ()}
        assert joined.settings == replace(settings, **local)
        assert joined.inventory == inventory
        assert (joined.address, joined.authkey, joined.run_dir) == (run.address, run.authkey, run.run_dir)
        assert joined.worker == "gw1"
        assert wire["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    finally:
        joined.close()


# -- the catalog: what a worker tells the scheduler of each test ---------------------------------


def test_catalog_entries_round_trip_with_full_word_keys() -> None:
    from pytest_gpu.scheduling.catalog import Entry

    entry = Entry(gpus=2, memory=GIB, pool="('gloo', 2)", group="fixture:t.py", serial=False, before=("g",))
    wire = json_trip(entry.to_wire())
    assert wire == {"gpus": 2, "memory": GIB, "pool": "('gloo', 2)", "group": "fixture:t.py", "before": ["g"]}
    assert Entry.from_wire(wire) == entry
    assert Entry(gpus=1).to_wire() == {"gpus": 1, "memory": None}  # None: an exclusive lease, said
    assert Entry.from_wire({}) == Entry() and Entry().need is None
    assert Entry(gpus=1, memory=GIB).need == Need(1, GIB)


@pytest.mark.parametrize(
    "wire",
    [{"n": 1, "m": None}, {"gpus": "1"}, {"gpus": True}, {"gpus": 1, "memory": -1}, {"serial": 1}, {"before": [1]}],
)
def test_a_bad_catalog_entry_is_refused(wire: dict[str, Any]) -> None:
    from pytest_gpu.scheduling.catalog import Entry

    with pytest.raises(ValueError, match="a catalog entry"):
        Entry.from_wire(wire)


# -- a test's record, built once at collection -------------------------------------------------

RECORDED = """
import pytest


@pytest.mark.gpu(memory="2GiB")
def test_gpu(gpu):
    pass


@pytest.mark.gpu_serial
def test_alone(gpu):
    pass


@pytest.mark.distributed(world_size=2, backend="gloo", gpus_per_rank=1)
def test_ranks(rank):
    pass


@pytest.mark.gpu(3)
def test_too_big(gpu):
    pass


def test_cpu():
    pass
"""


def test_collection_builds_each_tests_record_once_for_every_reader(gpu_pytester: pytest.Pytester) -> None:
    from pytest_gpu.run.record import needs

    gpu_pytester.makepyfile(test_recorded=RECORDED)
    items, _ = gpu_pytester.inline_genitems("--gpus", "sim:2x16GiB", "--gpu-oversize=fail", "-p", "no:cacheprovider")
    by_name = {item.name: needs(item) for item in items}
    assert by_name["test_gpu"].request == GpuRequest(count=1, memory=2 * GIB, exclusive=False)
    assert by_name["test_alone"].serial and by_name["test_alone"].request == GpuRequest(count=2, exclusive=True)
    ranks = by_name["test_ranks"]
    assert ranks.request is None and ranks.dist is not None and ranks.dist.world_size == 2
    assert ranks.scheduled_request(DefaultMemory.parse("1GiB")) == GpuRequest(count=2, memory=GIB, exclusive=False)
    assert by_name["test_too_big"].oversize is not None and "3 GPUs" in by_name["test_too_big"].oversize
    assert (by_name["test_cpu"].request, by_name["test_cpu"].dist, by_name["test_cpu"].serial) == (None, None, False)
