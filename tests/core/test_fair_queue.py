"""The wait queue's shares between tenants and classes (core/queue.py): by work, weighted, work-conserving, with
a queue limit per tenant and the preemption of bulk work for interactive."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_cli.config import PriorityClass, QueueConfig
from dynamo_cli.core.queue import LOWEST_CLIENT_PRIORITY, MAX_COUNTERS, QueuedRequest, WaitQueue
from dynamo_cli.core.shares import tenant_annotations, tenant_of
from dynamo_cli.errors import Overloaded, RateLimited

CONFIG = QueueConfig(max_wait_s=5.0)


class Slots:
    """`free` workers; each take charges its tenant `work` tokens, as the dispatcher does."""

    def __init__(self, queue: WaitQueue, work: float = 1000.0) -> None:
        self.queue = queue
        self.free = 0
        self.work = work
        self.order: list[str] = []

    def taker(self, name: str, request: QueuedRequest):  # type: ignore[no-untyped-def]
        def take() -> str:
            if self.free <= 0:
                raise Overloaded("all 1 workers of 'm' are busy")
            self.free -= 1
            self.order.append(name)
            self.queue.charge(request.tenant, self.work, request.weight)
            return name

        return take


async def _run(
    queue: WaitQueue, slots: Slots, requests: list[tuple[str, QueuedRequest]], config: QueueConfig = CONFIG
) -> list[str]:
    """Queue `requests` in this order, then free one worker at a time; the order they were served in."""
    tasks = []
    for name, request in requests:
        tasks.append(asyncio.create_task(queue.take(slots.taker(name, request), request, config)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    for _ in tasks:
        slots.free += 1
        queue.notify()
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    return slots.order


def _of(tenant: str, n: int, **kwargs: object) -> list[tuple[str, QueuedRequest]]:
    return [(f"{tenant}{i}", QueuedRequest(tenant=tenant, **kwargs)) for i in range(1, n + 1)]  # type: ignore[arg-type]


async def test_the_tenant_that_had_the_least_work_goes_next_not_the_oldest_request() -> None:
    queue = WaitQueue()
    order = await _run(queue, Slots(queue), _of("a", 3) + _of("b", 1))
    assert order == ["a1", "b1", "a2", "a3"]


async def test_without_fair_shares_the_queue_is_one_line() -> None:
    queue = WaitQueue()
    order = await _run(queue, Slots(queue), _of("a", 3) + _of("b", 1), QueueConfig(max_wait_s=5.0, fair_share=False))
    assert order == ["a1", "a2", "a3", "b1"]


async def test_a_tenant_with_twice_the_weight_gets_twice_the_turns() -> None:
    queue = WaitQueue()
    order = await _run(queue, Slots(queue), _of("a", 8, weight=2.0) + _of("b", 8))
    assert sum(name.startswith("a") for name in order[:9]) == 6, order


async def test_an_idle_tenant_banks_no_credit() -> None:
    """b was idle while a was served ten times: when it comes, it does not get ten turns in a row."""
    queue = WaitQueue()
    for _ in range(10):
        queue.charge("a", 1000.0, 1.0)
    order = await _run(queue, Slots(queue), _of("a", 4) + _of("b", 4))
    runs = "".join(name[0] for name in order)
    assert "bbb" not in runs and "aaa" not in runs, runs


async def test_classes_come_before_shares_and_background_last() -> None:
    queue = WaitQueue()
    queue.charge("vip", 10**6, 1.0)  # a tenant with far more work done still goes first in a higher class
    requests = [
        ("background", QueuedRequest(priority=LOWEST_CLIENT_PRIORITY - 1, tenant="batch")),
        ("bulk", QueuedRequest(tenant="a", priority_class=PriorityClass.BULK)),
        ("default", QueuedRequest(tenant="b")),
        ("interactive", QueuedRequest(tenant="vip", priority_class=PriorityClass.INTERACTIVE)),
        ("system", QueuedRequest(tenant="vip", priority_class=PriorityClass.SYSTEM)),
    ]
    assert await _run(queue, Slots(queue), requests) == ["system", "interactive", "default", "bulk", "background"]


async def test_a_tenant_over_its_queue_limit_gets_429_naming_it_and_others_still_queue() -> None:
    queue = WaitQueue()
    slots = Slots(queue)
    waiting = [
        asyncio.create_task(queue.take(slots.taker(name, r), r, CONFIG)) for name, r in _of("a", 2, max_queued=2)
    ]
    await asyncio.sleep(0.01)
    third = QueuedRequest(tenant="a", max_queued=2)
    with pytest.raises(RateLimited, match=r"tenant 'a' already has 2 requests waiting \(max-queued\)") as refused:
        await queue.take(slots.taker("a3", third), third, CONFIG)
    assert refused.value.status == 429 and refused.value.limit == "max_queued" and refused.value.retry_after
    other = QueuedRequest(tenant="b", max_queued=2)
    waiting.append(asyncio.create_task(queue.take(slots.taker("b1", other), other, CONFIG)))
    await asyncio.sleep(0.01)
    assert len(queue) == 3
    slots.free = 3
    queue.notify()
    await asyncio.gather(*waiting)
    assert sorted(slots.order) == ["a1", "a2", "b1"]


async def test_a_waiting_interactive_request_preempts_the_newest_bulk_one_once() -> None:
    queue = WaitQueue()
    slots = Slots(queue)
    paused: list[str] = []

    def pausing(name: str, is_decoding: bool = True):  # type: ignore[no-untyped-def]
        def preempt(only_decoding: bool) -> bool:
            if only_decoding and not is_decoding:
                return False
            paused.append(name)
            slots.free += 1  # the paused request lets its worker go
            queue.freed()
            return True

        return preempt

    queue.running("old-bulk", PriorityClass.BULK, pausing("old-bulk"))
    queue.running("new-bulk", PriorityClass.BULK, pausing("new-bulk"))
    queue.running("default", PriorityClass.DEFAULT, pausing("default"))
    default = QueuedRequest(tenant="b")
    with pytest.raises(Overloaded):  # a default request waits its turn: it preempts nothing
        await queue.take(slots.taker("d", default), default, QueueConfig(max_wait_s=0.05))
    assert paused == []
    interactive = QueuedRequest(tenant="b", priority_class=PriorityClass.INTERACTIVE)
    assert await queue.take(slots.taker("i", interactive), interactive, CONFIG) == "i"
    assert paused == ["new-bulk"]
    queue.stopped("old-bulk")
    no_preemption = QueueConfig(max_wait_s=0.05, preemption=False)
    with pytest.raises(Overloaded):
        await queue.take(slots.taker("j", interactive), interactive, no_preemption)
    assert paused == ["new-bulk"]


def test_the_work_counters_stay_bounded_under_many_tenants() -> None:
    queue = WaitQueue()
    for i in range(3 * MAX_COUNTERS):
        queue.charge(f"t{i}", 1.0 + i % 7, 1.0)
    assert len(queue._work._counters) <= MAX_COUNTERS + 1  # noqa: SLF001


def test_a_tenant_and_its_class_travel_to_a_dyn_router_and_bad_values_fall_back() -> None:
    sent = QueuedRequest(3, 100, tenant="team-a", weight=2.5, priority_class=PriorityClass.BULK, max_queued=4)
    assert tenant_of(tenant_annotations(sent), QueuedRequest(3, 100)) == sent
    background = QueuedRequest(tenant="batch", priority_class=PriorityClass.BACKGROUND)
    assert tenant_of(tenant_annotations(background), QueuedRequest()) == background
    assert tenant_of({}, QueuedRequest(1)) == QueuedRequest(1)  # a frontend that sends no tenant
    hostile = {"tenant": "x" * 65, "priority_class": "system"}
    assert tenant_of(hostile, QueuedRequest()) == QueuedRequest()  # a name no frontend would send: no tenant
    odd = {"tenant": "b", "priority_class": "root", "tenant_weight": "nan", "tenant_max_queued": "-3"}
    assert tenant_of(odd, QueuedRequest()) == QueuedRequest(tenant="b")
    for weight in ("inf", "0", "-1", "1e9", "x"):
        assert tenant_of({"tenant": "b", "tenant_weight": weight}, QueuedRequest()).weight == 1.0


async def test_a_decoding_bulk_request_is_paused_before_a_newer_one_still_prefilling() -> None:
    queue, paused = WaitQueue(), []

    def pausing(name: str, is_decoding: bool):  # type: ignore[no-untyped-def]
        def preempt(only_decoding: bool) -> bool:
            if only_decoding and not is_decoding:
                return False
            paused.append(name)
            return True

        return preempt

    queue.running("decoding", PriorityClass.BULK, pausing("decoding", True))
    queue.running("prefilling", PriorityClass.BULK, pausing("prefilling", False))
    assert queue._preempt_for(PriorityClass.INTERACTIVE) and paused == ["decoding"]
    assert queue._preempt_for(PriorityClass.INTERACTIVE) and paused == ["decoding", "prefilling"]  # else any
    assert not queue._preempt_for(PriorityClass.INTERACTIVE)
