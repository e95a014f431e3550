"""Process lifecycle: the event loop, stop signals, and the one TaskGroup that owns background loops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop when installed (faster sockets), else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop` (the process then drains) instead of killing it."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel tasks and wait for them to finish, swallowing their cancellation."""
    live = [t for t in tasks if t is not None and not t.done()]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


PARENT_ENV = "DYN_PARENT_PID"
"""Set by `dyn serve` for its workers: the pid whose death must take the worker down."""


def die_with_parent() -> None:
    """If started by `dyn serve`, get SIGTERM when it dies, even by SIGKILL (Linux PR_SET_PDEATHSIG)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        sys.exit(1)
