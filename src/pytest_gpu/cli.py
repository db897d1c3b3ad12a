"""The ``pytest-gpu`` command."""

from __future__ import annotations

import argparse
import sys

from .devices import DeviceSpecError, discover
from .requests import format_size


def _inventory(args: argparse.Namespace) -> int:
    try:
        inventory = discover(args.gpus)
    except DeviceSpecError as exc:
        print(f"pytest-gpu inventory: {exc}", file=sys.stderr)
        return 2
    print(f"--gpus {args.gpus}: {inventory.describe()}")
    for device in inventory.devices:
        print(f"  GPU {device.index}  {device.uuid}  {format_size(device.total_memory):>8}  {device.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pytest-gpu", description="pytest-gpu utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    inv = sub.add_parser("inventory", help="print the GPUs --gpus would give, with memory")
    inv.add_argument("--gpus", default="auto", help="as pytest's --gpus (default: auto)")
    inv.set_defaults(func=_inventory)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
