"""The wait queue on its own: who gets a freed worker first, and when a waiter gives up (core/queue.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from dynamo_cli.config import QueueConfig, QueuePolicy
from dynamo_cli.core.queue import QueuedRequest, WaitQueue
from dynamo_cli.errors import NoWorkers, Overloaded


class Slots:
    """`free` workers; `take` is the dispatcher's choose: one slot, or Overloaded."""

    def __init__(self) -> None:
        self.free = 0
        self.order: list[str] = []
        self.is_gone = False

    def taker(self, name: str):  # type: ignore[no-untyped-def]
        def take() -> str:
            if self.is_gone:
                raise NoWorkers("model 'm'")
            if self.free <= 0:
                raise Overloaded("all 1 workers of 'm' are busy")
            self.free -= 1
            self.order.append(name)
            return name

        return take


async def _queue_up(
    queue: WaitQueue, slots: Slots, requests: dict[str, QueuedRequest], config: QueueConfig
) -> list[asyncio.Task[str]]:
    tasks = []
    for name, request in requests.items():
        tasks.append(asyncio.create_task(queue.take(slots.taker(name), request, config)))
        await asyncio.sleep(0)  # arrive in this order
    await asyncio.sleep(0.01)
    assert len(queue) == len(requests)
    return tasks


async def _release_one_at_a_time(queue: WaitQueue, slots: Slots, tasks: list[asyncio.Task[str]]) -> None:
    for _ in tasks:
        slots.free += 1
        queue.notify()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (QueuePolicy.FCFS, ["a", "b", "c"]),  # arrival
        (QueuePolicy.SJF, ["c", "a", "b"]),  # job tokens 50 < 100 < 400
        (QueuePolicy.DEADLINE, ["b", "a", "c"]),  # deadline +5 s < +9 s < none
    ],
)
async def test_freed_workers_go_in_policy_order(policy: QueuePolicy, expected: list[str]) -> None:
    queue, slots, now = WaitQueue(), Slots(), time.monotonic()
    requests = {
        "a": QueuedRequest(job_tokens=100, deadline=now + 9),
        "b": QueuedRequest(job_tokens=400, deadline=now + 5),
        "c": QueuedRequest(job_tokens=50),
    }
    tasks = await _queue_up(queue, slots, requests, QueueConfig(policy=policy))
    await _release_one_at_a_time(queue, slots, tasks)
    assert slots.order == expected
    assert len(queue) == 0


async def test_priority_comes_before_the_policy() -> None:
    queue, slots = WaitQueue(), Slots()
    requests = {
        "early": QueuedRequest(),
        "urgent": QueuedRequest(priority=5),
        "low": QueuedRequest(priority=-1),
        "late": QueuedRequest(),
    }
    tasks = await _queue_up(queue, slots, requests, QueueConfig())
    await _release_one_at_a_time(queue, slots, tasks)
    assert slots.order == ["urgent", "early", "late", "low"]


async def test_a_full_queue_refuses_at_once_with_retry_after() -> None:
    queue, slots = WaitQueue(), Slots()
    config = QueueConfig(max_size=2)
    tasks = await _queue_up(queue, slots, {"a": QueuedRequest(), "b": QueuedRequest()}, config)
    started = time.monotonic()
    with pytest.raises(Overloaded, match=r"the wait queue is full \(2 requests\); retry in 1 s") as caught:
        await queue.take(slots.taker("c"), QueuedRequest(), config)
    assert time.monotonic() - started < 0.05 and caught.value.retry_after == 1.0
    await _release_one_at_a_time(queue, slots, tasks)
    assert slots.order == ["a", "b"]


async def test_a_waiter_gives_up_after_max_wait_and_at_its_deadline() -> None:
    queue, slots = WaitQueue(), Slots()
    started = time.monotonic()
    with pytest.raises(Overloaded, match="no worker freed up within 0.1 s"):
        await queue.take(slots.taker("a"), QueuedRequest(), QueueConfig(max_wait_s=0.1))
    assert 0.1 <= time.monotonic() - started < 0.5
    deadline = time.monotonic() + 0.05
    with pytest.raises(Overloaded, match="deadline passed"):
        await queue.take(slots.taker("b"), QueuedRequest(deadline=deadline), QueueConfig(max_wait_s=5))
    assert time.monotonic() - deadline < 0.3
    assert len(queue) == 0 and slots.order == []


async def test_a_client_that_leaves_frees_its_place_for_the_next() -> None:
    queue, slots = WaitQueue(), Slots()
    tasks = await _queue_up(queue, slots, {"gone": QueuedRequest(), "next": QueuedRequest()}, QueueConfig())
    tasks[0].cancel()
    await asyncio.sleep(0.01)
    assert len(queue) == 1
    slots.free = 1
    queue.notify()
    assert await asyncio.wait_for(tasks[1], 1) == "next"
    assert tasks[0].cancelled()


async def test_the_last_worker_leaving_fails_waiters_with_no_workers_not_a_hang() -> None:
    queue, slots = WaitQueue(), Slots()
    tasks = await _queue_up(queue, slots, {"a": QueuedRequest(), "b": QueuedRequest()}, QueueConfig())
    slots.is_gone = True
    queue.notify()
    for task in tasks:
        with pytest.raises(NoWorkers):
            await asyncio.wait_for(task, 1)
    assert len(queue) == 0


async def test_a_request_whose_expected_wait_is_too_long_is_refused_at_once() -> None:
    """Drain rate: 4 workers freed over the last second (0.25 s each), so position p waits about p * 0.25 s."""
    queue, slots, now = WaitQueue(), Slots(), time.monotonic()
    assert queue.expected_wait(1, now) is None  # no rate yet: nobody is refused for it
    queue._freed.extend([now - 1.0, now - 0.75, now - 0.5, now - 0.25])
    assert queue.expected_wait(2, now) == pytest.approx(0.5, abs=0.01)
    config = QueueConfig(max_wait_s=0.6)
    tasks = await _queue_up(queue, slots, {"first": QueuedRequest(), "second": QueuedRequest()}, config)
    started = time.monotonic()
    with pytest.raises(Overloaded, match=r"2 requests wait ahead of this one, about 0.8 s .* more than the 0.6 s"):
        await queue.take(slots.taker("third"), QueuedRequest(), config)
    assert time.monotonic() - started < 0.05  # at the door, not after waiting
    # a higher priority goes ahead of both, so its expected wait is one place's
    urgent = asyncio.create_task(queue.take(slots.taker("urgent"), QueuedRequest(priority=1), config))
    await asyncio.sleep(0.01)
    await _release_one_at_a_time(queue, slots, [urgent, *tasks])
    assert slots.order == ["urgent", "first", "second"]


def test_background_work_goes_only_to_workers_prefilling_nothing() -> None:
    """A batch line (priority below any client's) never joins a worker with a prompt in prefill: with every
    candidate prefilling it is Overloaded, so it waits in the queue behind the interactive requests."""
    from types import SimpleNamespace

    from dynamo_cli.core.registry import free_of_prefill

    workers: dict[int, Any] = {
        1: SimpleNamespace(pending_prefill_tokens=512),
        2: SimpleNamespace(pending_prefill_tokens=0),
    }
    assert free_of_prefill([1, 2], workers) == [2]
    workers[2].pending_prefill_tokens = 40
    with pytest.raises(Overloaded, match="prefilling"):
        free_of_prefill([1, 2], workers)
