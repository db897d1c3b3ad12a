"""The ``pytest-gpu`` command."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .base.requests import format_size
from .gpu.discovery import discover
from .machine.domain import REAL, Domain, machine_dir, private_root
from .machine.link import STATUS_TIMEOUT_S, status
from .machine.messages import PART, shown
from .sim import fake
from .sim.spec import gpu_of, mig_of
from .vendors import kinds
from .vendors import registry as vendors
from .vendors.devices import DeviceSpecError
from .vendors.kinds import Kind
from .vendors.sampling import Unavailable


def _inventory(args: argparse.Namespace) -> int:
    try:
        if fake.requested() and not args.gpus.strip().lower().startswith("sim:"):
            fake.activate()  # PYTEST_GPU_FAKE_GPUS: the GPUs as the fake NVML (libamd_smi.so, Sysman) reports them
        inventory = discover(args.gpus)
    except (DeviceSpecError, ValueError) as exc:
        print(f"pytest-gpu inventory: {exc}", file=sys.stderr)
        return 2
    print(f"--gpus {args.gpus}: {inventory.describe()}")
    for device in inventory.devices:
        where = f" (on GPU {device.parent})" if device.parent is not None else ""
        kept = f", {format_size(device.reserved)} reserved" if device.reserved else ""
        kind = "MIG" if device.parent is not None else "GPU"
        print(
            f"  {kind} {device.index}  {device.uuid}  {format_size(device.total_memory):>8}{kept}  {device.name}{where}"
        )
    if inventory.outer:
        print(f"  started with: {', '.join(f'{k}={v}' for k, v in inventory.outer)}")
    if inventory.note and inventory.devices:
        print(f"  note: {inventory.note}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import gantt  # local: slow (xml, urllib; matplotlib when drawing): only `report` draws

    trace = Path(args.trace)
    out = Path(args.output) if args.output else None
    if args.format is not None:
        fmt = args.format.lower()
        if fmt not in gantt.FORMATS:
            print(f"pytest-gpu report: --format {args.format!r}: expected png or svg", file=sys.stderr)
            return 2
    elif out is not None:
        fmt = out.suffix.lstrip(".").lower()
        if fmt not in gantt.FORMATS:
            print(
                f"pytest-gpu report: -o {str(out)!r}: cannot tell the format from its suffix; "
                "expected a name ending in .png or .svg, or --format png|svg",
                file=sys.stderr,
            )
            return 2
    else:
        fmt = "png"
    out = out or trace.with_suffix(f".{fmt}")
    if out.resolve() == trace.resolve():  # never draw over the trace itself
        print(f"pytest-gpu report: -o {str(out)!r} is the trace itself; expected another path", file=sys.stderr)
        return 2

    try:
        chart = gantt.build_chart(gantt.load_trace(trace), title=args.title)
    except gantt.TraceError as exc:
        print(f"pytest-gpu report: {trace}: {exc}", file=sys.stderr)
        return 2
    try:
        gantt.render(chart, out, fmt)
    except gantt.MissingMatplotlib as exc:
        print(f"pytest-gpu report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pytest-gpu report: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(out)
    print(chart.summary())
    return 0


def _ago(then: float | None, now: float) -> str:
    return "?" if then is None else f"{max(now - then, 0.0):.1f}s"


def gpu_labels(uuids: list[str], ask_nvml: bool) -> dict[str, str]:
    """The driver's name for each GPU of ``uuids`` that this process can tell: ``GPU 2`` (its index),
    ``GPU 0 MIG 1`` (a MIG instance), ``AMD GPU 2``, ``Intel GPU 2`` (:func:`identify`)."""
    return {uuid: label for uuid, (label, _) in identify(uuids, ask_nvml).items()}


def identify(uuids: list[str], ask_drivers: bool) -> dict[str, tuple[str, Kind]]:
    """Each GPU of ``uuids`` that this process can tell: its name (:func:`gpu_labels`) and vendor.
    Simulated and fake GPUs carry their vendor and index in their UUID; real ones are looked up
    once (``ask_drivers``) in each vendor's driver in turn (:data:`pytest_gpu.vendors.registry.VENDORS`:
    NVML, amdsmi, Level Zero Sysman) until every one is named, nothing where none answers. A
    launched rank's part of a GPU is named as its GPU."""
    found: dict[str, tuple[str, Kind]] = {}
    real: list[str] = []
    for uuid in uuids:
        base = uuid.partition(PART)[0]
        gpu, mig = gpu_of(base), mig_of(base)
        if gpu is not None:
            found[uuid] = gpu[0].gpu_label(gpu[1]), gpu[0]
        elif mig is not None:
            found[uuid] = f"GPU {mig[0]} MIG {mig[1]}", kinds.DEFAULT  # MIG: NVIDIA's
        else:
            real.append(uuid)
    for vendor in vendors.VENDORS.values() if ask_drivers else ():
        left = [uuid for uuid in real if uuid not in found]
        if not left:
            break
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints its load failures
                devices = vendor.devices()[0]
        except Unavailable:
            continue
        known = {d.uuid: vendor.gpu_label(d) for d in devices}
        for uuid in left:
            label = known.get(uuid.partition(PART)[0])
            if label is not None:
                found[uuid] = label, vendor.kind
    return found


def _named(uuid: str, labels: dict[str, str]) -> str:
    label = labels.get(uuid)
    return f"{label} ({shown(uuid)})" if label else shown(uuid)


def _list(items: list[Any]) -> str:
    return ", ".join(shown(str(item)) for item in items)


def format_status(
    name: str,
    state: dict[str, Any],
    now: float,
    labels: dict[str, str] | None = None,
    runtimes: dict[str, str] | None = None,
) -> list[str]:
    """``pytest-gpu status`` lines for one machine domain; ``labels``: the driver's name of each GPU
    UUID known (:func:`gpu_labels`), shown beside it; ``runtimes``: whose contexts each GPU's are
    (``HIP``, ``Level Zero``; CUDA's where unknown). What an arbiter sent (labels, names,
    tests: maybe another user's words), and the domain's name (a directory anyone may have
    made), is shown with its control characters escaped."""
    labels = labels or {}
    runtimes = runtimes or {}
    runs = state["runs"]
    lines = [f"{shown(name)}: {len(runs)} run{'' if len(runs) == 1 else 's'} attached, {state['grants']} grants so far"]
    for run in runs:
        if "run" not in run:  # another user's: only that it exists, and what it holds
            held = f"{run['leases']} lease{'' if run['leases'] == 1 else 's'}"
            lines.append(
                f"  a run of user {shown(run['user'])}: {held}{' on ' + _list(run['gpus']) if run['gpus'] else ''}"
            )
            continue
        lines.append(
            f"  run {shown(run['run'])}  user {shown(run['user'])}  pid {run.get('pid', '?')}  "
            f"{shown(run.get('label', ''))}"
        )
    if state.get("pending"):
        lines.append(f"  a new arbiter waits for runs {_list(state['pending'])} to re-attach")
    for gpu in state["gpus"]:
        extra = f", {format_size(gpu['foreign'])} used outside pytest-gpu" if gpu["foreign"] else ""
        whole = ", held whole" if gpu["exclusive"] else ""
        lines.append(
            f"  {_named(gpu['uuid'], labels)}: {format_size(gpu['capacity'])}, {format_size(gpu['leased'])} promised "
            f"({gpu['contexts']} {runtimes.get(gpu['uuid'], kinds.DEFAULT.runtime)} "
            f"context{'' if gpu['contexts'] == 1 else 's'}){whole}{extra}"
        )
    lines.append(f"  leases ({len(state['leases'])}):")
    for row in sorted(state["leases"], key=lambda r: r.get("since") or 0):
        each = "whole GPU" if row["exclusive"] else format_size(row["memory"])
        gpus = ", ".join(_named(u, labels) for u in row["gpus"])
        lines.append(
            f"    run {shown(row['run'])} {shown(row['worker'])}  {shown(row['test'])}  {gpus}  {each}  "
            f"for {_ago(row.get('since'), now)}"
        )
    lines.append(f"  waiting ({len(state['waiting'])}):")
    for row in sorted(state["waiting"], key=lambda r: r.get("since") or 0):
        why = "  (held back by usage outside pytest-gpu)" if row.get("foreign") else ""
        lines.append(
            f"    run {shown(row['run'])} {shown(row['worker'])}  {shown(row['test'])}  {shown(row['request'])}  "
            f"for {_ago(row.get('since'), now)}, overtaken {row['bypassed']}x{why}"
        )
    return lines


def _domains(only: str | None) -> list[Any]:
    """The domains whose arbiter `status` asks: the real GPUs' (machine-wide), this user's own
    (private), and simulated machines shared with a group this user can enter."""
    found = [Domain.real()]
    try:
        for path in sorted(private_root().iterdir()):
            if not path.is_dir():
                continue
            if path.name.startswith(("run-", "launch-")):  # a run's own simulated machines
                machines = sorted(path.glob("sim-*"))
                found += [Domain(f"sim-{path.name}-{m.name[4:]}", m, ledger=m / "sim-ledger") for m in machines]
            else:
                found.append(Domain.private(path.name))
    except OSError:
        pass
    try:
        found += [
            Domain.machine_wide(p.name, p)
            for p in sorted(machine_dir().glob("sim-*"))
            if p.is_dir() and not p.is_symlink() and os.access(p, os.R_OK | os.X_OK)
        ]
    except OSError:
        pass
    if only is not None:
        return [d for d in found if d.name == only] or [Domain.machine_wide(only)]
    return found


STATUS_DEADLINE_S = 3.0  # the whole of `pytest-gpu status`, however many addresses answer slowly or never


def gather(domains: list[Domain], deadline_s: float = STATUS_DEADLINE_S) -> list[tuple[Domain, dict[str, Any]]]:
    """The state of each domain whose arbiter answers (:func:`~pytest_gpu.machine.link.status`),
    asked all at once: within ``deadline_s`` seconds in all, whatever listens at the addresses
    (a squatter that never answers costs its own domain only, and no more than that)."""
    found: dict[int, dict[str, Any] | None] = {}

    def ask(i: int, domain: Domain) -> None:
        found[i] = status(domain, timeout=min(STATUS_TIMEOUT_S, deadline_s))

    threads = [threading.Thread(target=ask, args=(i, d), daemon=True) for i, d in enumerate(domains)]
    end = time.monotonic() + deadline_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(end - time.monotonic(), 0.0))
    answered = dict(found)  # a thread still waiting may file its answer later: not shown
    return [(d, state) for i, d in enumerate(domains) if (state := answered.get(i)) is not None]


def _status(args: argparse.Namespace) -> int:
    import json

    try:
        domains = _domains(args.machine)
    except OSError as exc:
        print(f"pytest-gpu status: {exc}", file=sys.stderr)
        return 2
    found = {}
    labels: dict[str, dict[str, str]] = {}
    runtimes: dict[str, dict[str, str]] = {}
    for domain, state in gather(domains):
        private = not domain.wide and domain.name == REAL  # the fallback from a squatted address
        key = f"{REAL} (this user's runs only)" if private else domain.name
        found[key] = state
        uuids = [g["uuid"] for g in state.get("gpus", [])] + [u for r in state.get("leases", []) for u in r["gpus"]]
        known = identify(uuids, ask_drivers=domain.name == REAL)
        labels[key] = {uuid: label for uuid, (label, _) in known.items()}
        runtimes[key] = {uuid: kind.runtime for uuid, (_, kind) in known.items()}
        for gpu in state.get("gpus", []):
            gpu["name"] = labels[key].get(gpu["uuid"])  # NVML's index, as the text shows it
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    if not found:
        where = f"machine {args.machine!r}" if args.machine else "this machine"
        print(f"pytest-gpu status: no pytest-gpu run holds or waits for GPUs on {where} ({machine_dir()})")
        return 0
    now = time.time()
    for name, state in found.items():
        print("\n".join(format_status(name, state, now, labels[name], runtimes[name])))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pytest-gpu", description="pytest-gpu utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    inv = sub.add_parser("inventory", help="print the GPUs --gpus would give, with memory")
    inv.add_argument("--gpus", default="auto", help="as pytest's --gpus (default: auto)")
    inv.set_defaults(func=_inventory)
    rep = sub.add_parser("report", help="draw a --gpu-trace file as a Gantt chart picture (needs matplotlib)")
    rep.add_argument("trace", metavar="TRACE", help="trace JSON written by pytest --gpu-trace")
    rep.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="picture to write (default: TRACE with suffix .png, or .svg with --format svg)",
    )
    rep.add_argument("--format", help="png or svg (default: from OUT's suffix, else png)")
    rep.add_argument("--title", help="chart title (default: the run's inventory and makespan)")
    rep.set_defaults(func=_report)
    st = sub.add_parser(
        "status", help="the machine's leases now: runs, tests, GPUs, memory, since when, and who waits for what"
    )
    st.add_argument(
        "--machine",
        metavar="NAME",
        help="one domain: 'gpus' (the real GPUs) or 'sim-<name>' (a simulated machine); default: all",
    )
    st.add_argument("--json", action="store_true", help="print the arbiters' state as JSON")
    st.set_defaults(func=_status)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
