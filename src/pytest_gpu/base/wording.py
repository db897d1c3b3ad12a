"""Counts in messages that read right: "1 port", "2 ports", "GPU 1", "GPUs 1 and 2" (pure).

Every user-facing message that counts something goes through these, so that no
summary line says "its GPU 1 were reclaimed" or "ranks [1] did not answer".
"""

from __future__ import annotations

from collections.abc import Iterable


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1: ``1 port``, ``2 ports``, ``0 ports``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def join(items: Iterable[object]) -> str:
    """``a``, ``a and b``, ``a, b and c`` (``""`` for none)."""
    words = [str(item) for item in items]
    if len(words) <= 1:
        return "".join(words)
    return f"{', '.join(words[:-1])} and {words[-1]}"


def numbered(word: str, numbers: Iterable[object], many: str | None = None) -> str:
    """``word`` followed by its numbers: ``GPU 1``, ``GPUs 1 and 2``, ``ranks 0, 2 and 3``."""
    shown = list(numbers)
    return f"{word if len(shown) == 1 else (many or word + 's')} {join(shown)}"


def verb(n: int, one: str, many: str) -> str:
    """``one`` for a count of 1, else ``many``: ``verb(len(ports), "was", "were")``."""
    return one if n == 1 else many


def duration(seconds: float) -> str:
    """Seconds as a trace viewer shows them: ``0s``, ``46ms``, ``<1ms``, ``1.5s``, so that a
    short wait does not read as none ("0.0s" where the trace shows 46 ms)."""
    if seconds <= 0:
        return "0s"
    ms = round(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms" if ms else "<1ms"
    return f"{seconds:.1f}s"
