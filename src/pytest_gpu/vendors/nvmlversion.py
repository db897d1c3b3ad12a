"""Is the installed nvidia-ml-py new enough to read process lists correctly? (metadata only)"""

from __future__ import annotations

import importlib.metadata
import re

DISTRIBUTION = "nvidia-ml-py"
# 12.535.77 and older pack nvmlProcessInfo_t without the fields 550+ drivers send: the
# process lists NVML returns come back scrambled (wrong pids and memory).
MINIMUM = "12.535.108"


def _release(version: str) -> tuple[int, ...] | None:
    """The numeric release part of ``version`` ("12.535.77" -> (12, 535, 77)), None if there is none."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else None


def nvml_version_problem() -> str | None:
    """A sentence saying why the installed nvidia-ml-py is too old, or ``None`` (also when it is absent)."""
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None  # no bindings at all: discovery says so itself
    release, minimum = _release(installed), _release(MINIMUM)
    if release is None or minimum is None or release >= minimum:
        return None
    return (
        f"{DISTRIBUTION} {installed} is older than {MINIMUM}: its process records do not match drivers 550 "
        f"and later, so per-process GPU memory reads are scrambled; pip install '{DISTRIBUTION}>={MINIMUM}'"
    )
