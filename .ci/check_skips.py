"""Fail when a test was skipped because a component CI is meant to provide is missing."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

MARK = "missing component"


def main(path: str) -> int:
    bad = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for skipped in case.iter("skipped"):
            text = f"{skipped.get('message', '')} {skipped.text or ''}"
            if MARK in text:
                bad.append(f"{case.get('classname')}::{case.get('name')}: {text.strip()}")
    if bad:
        print(f"CI: {len(bad)} test(s) skipped for a missing component:", file=sys.stderr)
        for line in bad:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("CI: no test skipped for a missing component")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
