"""The frontend's wait for a request to be prepared while its client may leave (replies.py `unless_gone`)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Awaitable, Callable

import pytest

from dynamo_cli.core.waits import interruptible
from dynamo_cli.frontend.replies import ClientGone, unless_gone


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


async def test_the_task_that_was_interrupted_goes_on_uncancelled_after_client_gone() -> None:
    left = asyncio.Event()
    left.set()  # gone before the wait begins: the watcher, started with the wait, sees it at once

    async def prepare() -> Prepared:
        with interruptible():
            await asyncio.sleep(3600)
        return Prepared()

    with pytest.raises(ClientGone):
        await asyncio.wait_for(unless_gone(prepare, _leaves_when(left)), 5)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending on the handler's task


async def test_a_client_gone_between_two_waits_ends_the_second_as_client_gone() -> None:
    left = asyncio.Event()
    second_began = asyncio.Event()

    async def prepare() -> Prepared:
        with interruptible():  # the watcher starts here, and sees the client leave after this wait
            await asyncio.sleep(0)
        left.set()
        await asyncio.sleep(0.05)  # not interruptible: the departure is only noted
        second_began.set()
        with interruptible():  # gone already: this wait does not begin
            await asyncio.sleep(3600)
        return Prepared()

    with pytest.raises(ClientGone):
        await asyncio.wait_for(unless_gone(prepare, _leaves_when(left)), 5)
    assert second_began.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_request_that_waits_for_nothing_is_prepared_without_yielding_the_event_loop() -> None:
    # Issue 47: every yield put a request behind the parsing and tokenizing of every other arrival of a burst.
    others: list[str] = []
    asyncio.get_running_loop().call_soon(others.append, "another arrival's turn")

    async def prepare() -> Prepared:
        return Prepared()

    result, is_gone = await unless_gone(prepare, _stays)
    assert isinstance(result, Prepared) and not is_gone
    assert others == []  # nothing else ran in between: no task, no watcher, no turn of the loop


async def test_a_client_that_leaves_outside_a_wait_is_not_cancelled_and_what_was_prepared_comes_back() -> None:
    # Outside a wait the client is not watched (the stream's own watcher notices the departure next and aborts
    # the work); what was prepared is returned whole, so it can be closed.
    left = asyncio.Event()

    async def prepare() -> Prepared:
        left.set()
        await asyncio.sleep(0.01)  # not an interruptible wait
        return Prepared()

    result, is_gone = await asyncio.wait_for(unless_gone(prepare, _leaves_when(left)), 5)
    assert isinstance(result, Prepared) and not is_gone
