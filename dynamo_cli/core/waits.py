"""Waits a departed caller interrupts: a request queued for a worker, or waiting for a router's report.

The frontend prepares each request in its own task (frontend/replies.py `unless_gone`) and marks it here; only the
waits inside an `interruptible()` block are cancelled when the client leaves, and the client is watched only from the
first such wait on (most requests never wait: they cost no watcher task and no extra turn of the event loop). The
request core (core/dispatch.py) marks its waits without knowing who the caller is: outside a marked request the
block is a no-op (`dyn router`'s requests end by the frontend cancelling their stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any


class Interruptible:
    """A request being prepared whose client may leave. Only the waits inside `interruptible()` blocks (in
    a queue for a worker, for a router's report) are cancelled when it does; anywhere else it is only noted
    (`is_gone`) and the caller closes what the preparation returned. A remote prefill cut off mid-transfer
    would leak its KV on the prefill worker (Dynamo's rule), and a task cancelled just before it returns
    loses its result, so nothing else is cancelled. The blocks find it in the `INTERRUPTIBLE` context var."""

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.is_gone = False
        """The client left."""
        self.has_cancelled = False
        """`interrupt` cancelled the task (the caller turns that cancellation into ClientGone)."""
        self._on_wait = on_wait
        """Called as each interruptible wait begins: the caller starts watching the client then."""
        self._depth = 0

    def interrupt(self) -> None:
        """The client left: cancel the task if it waits in an interruptible block. It is called from another task,
        so the task is suspended, and at an await inside the block if it is in one: the cancellation lands there."""
        self.is_gone = True
        if self._depth and self.task is not None and not self.has_cancelled:
            self.has_cancelled = True
            self.task.cancel()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        if self.is_gone:
            raise asyncio.CancelledError()  # it left before the wait began
        if self._on_wait is not None:
            self._on_wait()
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
