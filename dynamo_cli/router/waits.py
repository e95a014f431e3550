"""Waits a departed caller interrupts: a request queued for a worker, or waiting for a router's report.

The frontend prepares each request in a task of its own (frontend/replies.py `unless_gone`) and marks it
here; only the waits inside an `interruptible()` block are cancelled when the client leaves. The request
core (router/core.py) marks its waits without knowing who the caller is: outside a marked request the
block is a no-op (`dyn router`'s requests end by the frontend cancelling their stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any


class Interruptible:
    """A request being prepared whose client may leave. Only the waits inside `interruptible()` blocks (in
    a queue for a worker, for a router's report) are cancelled when it does; anywhere else it is only noted
    (`is_gone`) and the caller closes what the preparation returned. A remote prefill cut off mid-transfer
    would leak its KV on the prefill worker (Dynamo's rule), and a task cancelled just before it returns
    loses its result, so nothing else is cancelled. The blocks find it in the `INTERRUPTIBLE` context var."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.is_gone = False
        """The client left."""
        self._depth = 0

    def interrupt(self) -> None:
        """The client left: cancel the task if it waits in an interruptible block."""
        self.is_gone = True
        if self._depth and self.task is not None:
            self.task.cancel()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        if self.is_gone:
            raise asyncio.CancelledError()  # it left before the wait began
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


INTERRUPTIBLE: contextvars.ContextVar[Interruptible | None] = contextvars.ContextVar("interruptible", default=None)
"""The Interruptible of the request being prepared in this task, if any."""


def interruptible() -> contextlib.AbstractContextManager[None]:
    """The current request's `Interruptible.interruptible()`, or nothing outside one."""
    guard = INTERRUPTIBLE.get()
    return guard.interruptible() if guard is not None else contextlib.nullcontext()
