"""Fixtures of the bench tests: the rhythm server on 127.0.0.1, in this loop or in a thread (for the CLI)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from sse_server import Rhythm, start, stop  # noqa: E402


@asynccontextmanager
async def _serving(rhythm: Rhythm) -> AsyncIterator[str]:
    server, url = await start(rhythm)
    try:
        yield url
    finally:
        await stop(server, rhythm)


@pytest.fixture
def serve() -> Callable[[Rhythm], object]:
    """`async with serve(Rhythm(...)) as url:` runs the server in the test's own event loop."""
    return _serving


@contextmanager
def _threaded(rhythm: Rhythm) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready: list[str] = []
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        async with _serving(rhythm) as url:
            ready.append(url)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10), "the rhythm server did not start"
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@pytest.fixture
def serve_in_thread() -> Callable[[Rhythm], object]:
    """`with serve_in_thread(Rhythm(...)) as url:` for code that runs its own event loop (the CLI)."""
    return _threaded
