"""Text helpers the streaming parsers share: how much of a stream's tail to hold back."""

from __future__ import annotations


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (held back)."""
    longest = max((len(m) for m in markers), default=0)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0
