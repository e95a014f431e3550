"""Process lifecycle: the event loop, stop signals, and the task owner of each service.

NOTE: every background task has an owner that cancels and awaits it. A service (worker, router service,
frontend server) spawns its long-lived loops on one `ServiceTasks` and closes it on the way out;
`wait_stop` returns when the process is told to stop and re-raises the first loop that died, as
itself (an `asyncio.TaskGroup` would wrap it in an ExceptionGroup, which the CLI's one `DynError`
handler would not recognise). Below the services, objects that must run a task of their own
(etcd's lease keep-alive, a ZMQ subscription's pumps, the request server's streams, the connection
pool's closers) own it themselves and cancel it in their idempotent `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
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


GC_THRESHOLDS = (50_000, 10, 10)
"""The collector's thresholds in a service (Python's are 700, 10, 10): a young collection once 50,000 more
container objects are alive than at the last one."""


def freeze_heap() -> None:
    """Put what a service built at startup (modules, tokenizer, config, clients) out of the collector's reach,
    and collect young objects 70 times less often.

    NOTE: a full collection walks every tracked object; in a frontend with its tokenizer loaded one took
    48-58 ms, stalling every request in flight (benchmarks/RESULTS.md). vLLM and SGLang freeze after
    startup for the same reason. Objects made later are collected as usual, but not at Python's default
    pace: a request's work briefly holds hundreds of containers (its decoded body, its prompt, its stream),
    so a collection every 700 came several times a second and walked every request in flight, each time
    (a kv frontend at 165 req/s: 393 young collections of ~1 ms and 35 middle ones of ~11 ms in a minute,
    on the event loop). Almost all of those objects are freed by reference counting, so at 50,000 the same
    minute had one collection. Only objects in reference cycles wait longer to be freed."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def ready_line(process: str, what: str) -> str:
    """The one line each dyn process prints once it serves, `dyn PROCESS ready: WHAT`: `dyn serve`, the tests and
    the benchmarks wait for it (`dyn serve ready: URL`), and an operator reads where each part listens."""
    return f"dyn {process} ready: {what}"


def announce(line: str) -> None:
    """Print a ready line (or any line a supervisor waits for) at once."""
    print(line, flush=True)


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


class ServiceTasks:
    """The background tasks of one service: spawned here, cancelled and awaited by `close()`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as a task owned by this service; a finished one that did not fail is forgotten."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._forget_if_clean)
        return task

    def _forget_if_clean(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            self._tasks.discard(task)

    def raise_if_died(self) -> None:
        """Re-raise the exception of a task that failed."""
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def wait_stop(self, stop: asyncio.Event) -> None:
        """Return when `stop` is set; re-raise if a task died first."""
        stopper = asyncio.get_running_loop().create_task(stop.wait())
        try:
            while not stopper.done():
                self.raise_if_died()
                running = [t for t in self._tasks if not t.done()]
                await asyncio.wait([stopper, *running], return_when=asyncio.FIRST_COMPLETED)
            self.raise_if_died()
        finally:
            await cancel_and_wait(stopper)

    async def close(self) -> None:
        """Cancel every task and wait for them. Idempotent."""
        tasks, self._tasks = list(self._tasks), set()
        await cancel_and_wait(*tasks)

    async def __aenter__(self) -> ServiceTasks:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a SIGKILLed child not yet reaped is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return True
