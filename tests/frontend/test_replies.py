"""The frontend's wait for a request to be prepared while its client may leave (replies.py `unless_gone`)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Awaitable, Callable

import pytest

from dynamo_cli.frontend.replies import ClientGone, unless_gone
from dynamo_cli.router.waits import interruptible


class Prepared:
    """Stands for what a request prepares (its dispatches, prompt and routing decision)."""


async def _stays(_: object = None) -> dict[str, str]:
    await asyncio.sleep(3600)  # a client that never leaves
    return {"type": "http.disconnect"}


def _leaves_when(left: asyncio.Event) -> Callable[[], Awaitable[dict[str, str]]]:
    """An ASGI `receive` whose client disconnects once `left` is set."""

    async def receive() -> dict[str, str]:
        await left.wait()
        return {"type": "http.disconnect"}

    return receive


async def test_a_prepared_request_is_freed_when_dropped_not_left_for_the_garbage_collector() -> None:
    # Issue 15: the guard <-> task cycle kept every request alive until a GC pass, whose 2-5 ms stalls
    # delayed the requests being dispatched meanwhile.
    async def prepare() -> Prepared:
        await asyncio.sleep(0)
        return Prepared()

    async def serve_one() -> weakref.ref[Prepared]:  # what the request's handler holds ends with it
        result, is_gone = await unless_gone(prepare, _stays)
        assert not is_gone
        return weakref.ref(result)

    gc.collect()
    gc.disable()
    try:
        freed = await serve_one()
        assert freed() is None
    finally:
        gc.enable()


async def test_a_client_that_leaves_while_the_request_waits_ends_the_wait() -> None:
    left = asyncio.Event()
    leaves = _leaves_when(left)

    async def prepare() -> Prepared:
        with interruptible():
            await asyncio.sleep(3600)  # waiting for a worker
        return Prepared()

    waiting = asyncio.ensure_future(unless_gone(prepare, leaves))
    await asyncio.sleep(0.01)
    left.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(waiting, 5)


async def test_a_client_that_leaves_outside_a_wait_is_reported_not_cancelled() -> None:
    left = asyncio.Event()
    leaves = _leaves_when(left)

    async def prepare() -> Prepared:
        left.set()
        await asyncio.sleep(0.01)  # not an interruptible wait: finishes, so what it made can be closed
        return Prepared()

    result, is_gone = await asyncio.wait_for(unless_gone(prepare, leaves), 5)
    assert is_gone and isinstance(result, Prepared)
