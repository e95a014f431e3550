"""Stop strings applied in the frontend: text is held back while it could be the start of a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces; get back what is safe to emit and whether a stop string was hit."""

    __slots__ = ("_held", "_longest", "_stops", "stopped")

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Text to emit now; after a match, `stopped` is True and the stop string is not emitted."""
        if not self._stops:
            return text
        window = self._held + text
        cut = min((i for i in (window.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return window[:cut]
        keep = self._partial_suffix(window)
        self._held = window[len(window) - keep :] if keep else ""
        return window[: len(window) - keep]

    def flush(self) -> str:
        """The held-back tail at the end of the stream."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of some stop string."""
        for size in range(min(self._longest - 1, len(window)), 0, -1):
            tail = window[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0
