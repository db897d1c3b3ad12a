"""What a test left behind on a rank of a warm pool, found after each test in the rank.

Each kind is compared with a snapshot, at a cost of microseconds (``bench/residue.py``):

- **torch's defaults** (default dtype and device, grad and anomaly mode, deterministic
  algorithms, float32 matmul precision, thread count, the ``torch.backends`` flags tests
  flip: cuDNN's benchmark/deterministic/TF32, cuBLAS's TF32 and reduced-precision
  reductions) and **the current CUDA device** (only where CUDA has started), against the
  rank's snapshot taken when the pool started (or when a body first imported torch): they
  are *kept* as the test left them, named on the test that left them, and every later test
  on that pool carries them (:attr:`Tracker.left`) until one puts them back;
- **process groups**: sub-groups a test left undestroyed (the rank destroys them), a
  default group the test set up (destroyed), or destroyed or replaced (the rank cannot run
  another test: its pool is replaced);
- **environment variables** added, changed or removed, and the working directory (put back);
- **seeding**: each test is promised the random state of its own seed whatever ran before
  it (the rank reseeds Python's, NumPy's and torch's generators from the test's id), so a
  test's own draws never reach the next; what would break that promise is a seed function
  or a global generator the test replaced (``random.seed``, ``numpy.random.seed``,
  ``torch.manual_seed``, ``torch.default_generator``, ...): compared by identity with the
  snapshot (the pool is replaced).

torch is read only when the rank has already imported it; nothing here imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..base import importhook
from ..base.wording import join, numbered

# variables a library sets on its own when a test first uses it, not the test: torch sets
# CUDA_MODULE_LOADING when CUDA starts (torch/cuda/__init__.py, _lazy_init)
SET_BY_LIBRARIES = frozenset({"CUDA_MODULE_LOADING"})
MAX_NAMES = 5  # variables named in one line; the rest counted

# what a setting is when torch did not report it at the snapshot (CUDA had not started then)
_UNSEEN = {"current CUDA device": "cuda:0"}
# one setting under two names: torch's matmul precision "high"/"medium" is cuBLAS's TF32 on
_SAME = {"float32 matmul precision": "torch.backends.cuda.matmul.allow_tf32"}


def _on_off(value: Any) -> str:
    return "on" if value else "off"


def _dtype(value: Any) -> str:
    return str(value).removeprefix("torch.")


# (name in the report, how to read it from torch, how to show it): cheap getters only
_TORCH: tuple[tuple[str, Callable[[Any], Any], Callable[[Any], str]], ...] = (
    ("default dtype", lambda t: t.get_default_dtype(), _dtype),
    ("default device", lambda t: t.get_default_device(), str),
    ("grad mode", lambda t: t.is_grad_enabled(), _on_off),
    ("anomaly detection", lambda t: t.is_anomaly_enabled(), _on_off),
    ("deterministic algorithms", lambda t: t.are_deterministic_algorithms_enabled(), _on_off),
    ("deterministic algorithms warn-only", lambda t: t.is_deterministic_algorithms_warn_only_enabled(), _on_off),
    ("float32 matmul precision", lambda t: t.get_float32_matmul_precision(), str),
    ("torch threads", lambda t: t.get_num_threads(), str),
    ("torch.backends.cudnn.enabled", lambda t: t.backends.cudnn.enabled, _on_off),
    ("torch.backends.cudnn.benchmark", lambda t: t.backends.cudnn.benchmark, _on_off),
    ("torch.backends.cudnn.deterministic", lambda t: t.backends.cudnn.deterministic, _on_off),
    ("torch.backends.cudnn.allow_tf32", lambda t: t.backends.cudnn.allow_tf32, _on_off),
    ("torch.backends.cuda.matmul.allow_tf32", lambda t: t.backends.cuda.matmul.allow_tf32, _on_off),
    (
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        lambda t: t.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        _on_off,
    ),
    (
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        lambda t: t.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        _on_off,
    ),
)


def torch_state(torch: Any) -> dict[str, str]:
    """torch's process-wide defaults, each as a report shows it (a setting this torch lacks is
    left out); the current CUDA device only where CUDA has started (reading it starts CUDA)."""
    state: dict[str, str] = {}
    for name, read, show in _TORCH:
        try:
            state[name] = show(read(torch))
        except Exception:  # an older or newer torch without it
            continue
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            state["current CUDA device"] = f"cuda:{cuda.current_device()}"
    except Exception:
        pass
    return state


def changed(pristine: Mapping[str, str], now: Mapping[str, str]) -> dict[str, str]:
    """The settings of ``now`` that differ from ``pristine``, each as "<name> <now> (was <then>)"."""
    out = {}
    for name, value in now.items():
        then = pristine.get(name, _UNSEEN.get(name))
        if then is not None and value != then:
            out[name] = f"{name} {value} (was {then})"
    for name, other in _SAME.items():
        if name in out and other in out:
            del out[name]  # said once, by its other name
    return out


def env_changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """What a test did to ``os.environ``, by variable name (values may be secrets: never shown)."""
    after = dict(after)  # os.environ decodes at each access: read once
    if after == before:
        return []
    added = sorted(k for k in after.keys() - before.keys() if k not in SET_BY_LIBRARIES)
    removed = sorted(k for k in before.keys() - after.keys() if k not in SET_BY_LIBRARIES)
    modified = sorted(k for k in after.keys() & before.keys() if after[k] != before[k] and k not in SET_BY_LIBRARIES)
    kinds = (("added", added), ("changed", modified), ("removed", removed))
    return [f"{_names(names)} {what}" for what, names in kinds if names]


def _names(names: list[str]) -> str:
    shown = names[:MAX_NAMES] + ([f"{len(names) - MAX_NAMES} more"] if len(names) > MAX_NAMES else [])
    return f"environment {'variable' if len(names) == 1 else 'variables'} {join(shown)}"


# what seeds each generator the rank reseeds, and the generator itself: replaced, the pool's
# reseeding no longer gives a test its seed's state (a module's attribute, by its dotted name)
SEEDING = {
    "random": ("seed", "random", "_inst"),
    "numpy": ("random.seed", "random.mtrand._rand"),
    "torch": ("manual_seed", "random.manual_seed", "default_generator"),
}


def seeding(module: Any, names: Iterable[str]) -> dict[str, int]:
    """The identity of each of ``names`` (dotted attributes of ``module``) now: a replaced one differs."""
    found = {}
    for name in names:
        value: Any = module
        try:
            for part in name.split("."):
                value = getattr(value, part)
        except AttributeError:
            continue
        found[f"{module.__name__}.{name}"] = id(value)
    return found


@dataclass
class Found:
    """What one test left on this rank, a line each for its report: ``lines``, what later tests
    would meet (kept) or what replaces the pool; ``put_back``, what the rank put back; and
    whether the rank can still run tests (a destroyed or replaced default process group)."""

    lines: list[str] = field(default_factory=list)
    put_back: list[str] = field(default_factory=list)
    unusable: bool = False


class Tracker:
    """One rank's snapshot of torch's defaults and what each test left of them.

    :meth:`begin` takes the snapshot (at once if torch is imported, else when a body first
    imports it); :meth:`torch_after` compares after each test and attributes what is new to
    that test: :attr:`left` maps each setting that differs from the snapshot now to the
    test that changed it and the report's line, so a later failure on this pool can name it.
    """

    def __init__(self) -> None:
        self.pristine: dict[str, str] | None = None
        self.left: dict[str, tuple[str, str]] = {}  # setting -> (node id, "default dtype float64 (was float32)")
        self.seeds: dict[str, int] = {}  # what seeds each generator, and the generator (SEEDING): identities

    def begin(self) -> None:
        for name in SEEDING:
            module = sys.modules.get(name)
            if module is not None:
                self._snapshot(module)
            else:  # the snapshot when a body first imports it, before it changes anything
                importhook.on_import(name, self._snapshot)

    def _snapshot(self, module: Any) -> None:
        self.seeds.update(seeding(module, SEEDING[module.__name__]))
        if module.__name__ == "torch" and self.pristine is None:
            self.pristine = torch_state(module)

    def reseeding_after(self) -> list[str]:
        """What a test replaced of what the rank reseeds each test with (``random.seed``, ...)."""
        now: dict[str, int] = {}
        for name, names in SEEDING.items():
            module = sys.modules.get(name)
            if module is not None:
                now.update(seeding(module, names))
        return [name for name, ident in now.items() if self.seeds.get(name, ident) != ident]

    def tainted(self) -> list[dict[str, str]]:
        """What earlier tests left and is still so, when a test starts: ``{"test", "what"}`` each."""
        return [{"test": test, "what": what} for test, what in self.left.values()]

    def torch_after(self, nodeid: str) -> list[str]:
        """What the test ``nodeid`` just left of torch's defaults (kept): lines for its report."""
        torch = sys.modules.get("torch")
        if torch is None or self.pristine is None:
            return []
        now = changed(self.pristine, torch_state(torch))
        new = [line for name, line in now.items() if self.left.get(name, ("", ""))[1] != line]
        # a setting put back is no one's any more; one changed again is the last changer's
        self.left = {name: self._owner(name, line, nodeid) for name, line in now.items()}
        return new

    def _owner(self, name: str, line: str, nodeid: str) -> tuple[str, str]:
        known = self.left.get(name)
        return known if known is not None and known[1] == line else (nodeid, line)


def merge(per_rank: Mapping[int, Iterable[str]], world_size: int) -> list[str]:
    """Each line once, with the ranks it came from ("on every rank" / "on rank 1"), in first-seen order."""
    ranks: dict[str, list[int]] = {}
    for rank in sorted(per_rank):
        for line in per_rank[rank]:
            ranks.setdefault(line, []).append(rank)
    out = []
    for line, where in ranks.items():
        on = "on every rank" if len(where) == world_size and world_size > 1 else f"on {numbered('rank', where)}"
        out.append(f"{line} ({on})" if world_size > 1 else line)
    return out
