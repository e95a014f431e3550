"""Session affinity: a session's calls go to the target that served its last one (an agent's growing context is
there), as Dynamo's `x-dynamo-session-id` does.

A session is named by the client (`x-dyn-session-id`, or Dynamo's `x-dynamo-session-id`); a sub-agent may name its
parent (`x-dyn-parent-session-id` / `x-dynamo-parent-session-id`), whose target places its first call, where the
parent's prefix is. The table maps a session id to the target of its last call and when that was: an entry older
than the TTL is gone, the table holds at most `max_entries` (the least recently used go first), and an entry whose
worker left is dropped when next read, so the session moves. `hard` sends every call to the bound worker (waiting
for it when busy); `soft` (the default) keeps it unless it is busy or its cache no longer holds the context (another
target has more of the prompt cached): the KV cost then moves the session, and the table follows.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from dynamo_cli.errors import RequestError
from dynamo_cli.routing.target import Target

MAX_SESSION_ID_BYTES = 256
"""Longest session id (Dynamo's cap)."""
SESSION_HEADERS = (b"x-dyn-session-id", b"x-dynamo-session-id")
PARENT_HEADERS = (b"x-dyn-parent-session-id", b"x-dynamo-parent-session-id")


@dataclass(frozen=True, slots=True)
class Session:
    """The session a request belongs to."""

    id: str
    parent: str | None = None
    """A sub-agent's parent session: its target places the first call."""


def session_of(headers: dict[bytes, bytes]) -> Session | None:
    """The request's session from its headers (ours or Dynamo's); a malformed id is a 400 naming the header."""
    session = _header(headers, SESSION_HEADERS)
    if session is None:
        return None
    return Session(session, _header(headers, PARENT_HEADERS))


def session_from(session: str | None, parent: str | None, names: tuple[str, str]) -> Session | None:
    """A session from annotations (a frontend's, to `dyn router`), checked as headers are (`names` in errors)."""
    if not session:
        return None
    checked = _checked(session.encode(), names[0])
    return Session(checked, _checked(parent.encode(), names[1]) if parent else None)


def _header(headers: dict[bytes, bytes], names: tuple[bytes, ...]) -> str | None:
    for name in names:
        raw = headers.get(name)
        if raw is not None:
            return _checked(raw, name.decode())
    return None


def _checked(raw: bytes, name: str) -> str:
    if not 0 < len(raw) <= MAX_SESSION_ID_BYTES or any(b < 0x21 or b > 0x7E for b in raw):
        raise RequestError(f"{name} must be 1 to {MAX_SESSION_ID_BYTES} visible ASCII characters", param=name)
    return raw.decode()


class SessionTable:
    """Session id -> (target, when it was last used); bounded and least recently used first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: OrderedDict[str, tuple[Target, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str, ttl_s: float, workers: Collection[int]) -> Target | None:
        """The target bound to `session_id`: None when there is none, it is older than `ttl_s`, or its worker is
        not among `workers` any more (the entry is then dropped)."""
        found = self._entries.get(session_id)
        if found is None:
            return None
        target, used_at = found
        if self._clock() - used_at > ttl_s or target.worker not in workers:
            del self._entries[session_id]
            return None
        return target

    def bind(self, session_id: str, target: Target, max_entries: int) -> None:
        """`session_id`'s last call went to `target` now; the oldest entries go beyond `max_entries`."""
        entries = self._entries
        entries[session_id] = (target, self._clock())
        entries.move_to_end(session_id)
        while len(entries) > max_entries:
            entries.popitem(last=False)
