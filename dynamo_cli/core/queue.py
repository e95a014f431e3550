"""A bounded wait for a free worker instead of an instant 503, in policy order.

When every worker of a model is busy (core/registry.py `BusyThresholds`), a request waits in its
model's `WaitQueue` for a worker to free up instead of failing at once. Only the head of the queue
tries to take a worker: a freed slot goes to the request the policy puts first, not to whichever
coroutine wakes first. Order, highest first:

    1. priority (the `x-dyn-priority` header, an integer; default 0; higher is served sooner)
    2. the policy's key: fcfs = arrival; sjf = expected job size, prompt tokens + the most tokens the
       client may get (shortest first; Dynamo's WSPT with equal weights); deadline = the request's
       deadline (`x-dyn-deadline-ms` after arrival; none: last)
    3. arrival, for ties

A request is refused with 503 and `Retry-After` when the queue is full, when it has waited
`max_wait_s`, or when its deadline passes while it waits (it could no longer be met). It is refused at
once, without waiting, when the wait it can expect is already longer than it may wait: its place in
the queue divided by the rate at which workers have been freeing up lately (`expected_wait`). So a
burst is absorbed, while sustained overload is shed at the door instead of turning fast 503s into
answers that come too late to be useful (benchmarks/router_queue.py measured FIFO with a 30 s wait
and no such check at 0.44x the goodput of instant 503s at 120 % of capacity). A client that leaves
while queued simply leaves the queue. `max_size = 0` turns the queue off: every worker busy is
an immediate 503, as before.

NOTE: waiters sleep on one shared future, resolved (and replaced) by `notify()`: the dispatcher calls
it when a request lets go of a worker, the registry when a worker joins, leaves or publishes new load.
Each wake-up costs one check per waiter; the queue is bounded, so that is bounded too.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from dynamo_cli.config import QueueConfig, QueuePolicy
from dynamo_cli.errors import Overloaded

T = TypeVar("T")

LOWEST_CLIENT_PRIORITY = -1000
"""The lowest `x-dyn-priority` a client may send; below it is background work (a batch line, -1001), which goes
only to workers prefilling nothing (registry.free_of_prefill) and may wait `BACKGROUND_WAIT_S` here."""
BACKGROUND_WAIT_S = 60.0
"""How long background work waits in the queue for a worker before its 503 (it is retried then)."""
RETRY_AFTER_S = 1.0
"""What a refused request is told to wait before trying again (at least)."""
RATE_WINDOW_S = 10.0
"""Workers freed within this window give the drain rate `expected_wait` divides by."""
MIN_RATE_SAMPLES = 4
"""Fewer frees than this in the window: the rate is unknown and nobody is refused for it."""


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """What the policy knows of a request."""

    priority: int = 0
    """Higher is served sooner (`x-dyn-priority`)."""
    job_tokens: int = 0
    """Prompt tokens + the most output tokens: the expected job size for `sjf`."""
    deadline: float | None = None
    """Monotonic time by which the request must have started; None: none."""


@dataclass(order=True, slots=True)
class _Ticket:
    key: tuple[float, ...]
    is_gone: bool = field(default=False, compare=False)


class WaitQueue:
    """One model's waiting requests (state only; the config comes with each call)."""

    def __init__(self) -> None:
        self._heap: list[_Ticket] = []
        self._size = 0
        self._tick: asyncio.Future[None] | None = None
        """Resolved by the next `notify()`; every waiter sleeps on it."""
        self._arrivals = itertools.count()
        self._freed: collections.deque[float] = collections.deque(maxlen=1024)
        """When workers were freed lately (monotonic), for the drain rate."""

    def __len__(self) -> int:
        return self._size

    def freed(self) -> None:
        """A request let go of a worker: counts toward the drain rate, and lets the head try."""
        self._freed.append(time.monotonic())
        self.notify()

    def expected_wait(self, position: int, now: float) -> float | None:
        """Seconds until the request at `position` (1: next) gets a worker at the recent drain rate; None
        while the rate is unknown."""
        while self._freed and self._freed[0] < now - RATE_WINDOW_S:
            self._freed.popleft()
        if len(self._freed) < MIN_RATE_SAMPLES:
            return None
        span = max(now - self._freed[0], 1e-3)
        return position * span / len(self._freed)

    def notify(self) -> None:
        """Capacity may have changed: let the head try again. Synchronous; nothing when nobody waits."""
        tick, self._tick = self._tick, None
        if tick is not None and not tick.done():
            tick.set_result(None)

    async def take(self, try_take: Callable[[], T], request: QueuedRequest, config: QueueConfig) -> T:
        """`try_take()` (which raises Overloaded while every worker is busy) once this request is at the head
        and it succeeds; Overloaded with a reason when the queue is full or the wait is too long."""
        if self._size >= config.max_size:
            raise Overloaded(f"the wait queue is full ({config.max_size} requests)", retry_after=RETRY_AFTER_S)
        ticket = _Ticket(self._key(request, config.policy))
        self._refuse_if_too_slow(ticket, request, config)
        heapq.heappush(self._heap, ticket)
        self._size += 1
        started = time.monotonic()
        give_up = started + config.max_wait_s
        if request.deadline is not None:
            give_up = min(give_up, request.deadline)
        try:
            while True:
                if self._head() is ticket:
                    try:
                        return try_take()
                    except Overloaded:
                        pass
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    raise Overloaded(self._why(request, started, give_up), retry_after=RETRY_AFTER_S)
                if self._tick is None:
                    self._tick = asyncio.get_running_loop().create_future()
                await asyncio.wait((self._tick,), timeout=remaining)  # never cancels the shared future
        finally:
            ticket.is_gone = True
            self._size -= 1
            self.notify()  # the next one may be the head now

    ##### Internals #####

    def _refuse_if_too_slow(self, ticket: _Ticket, request: QueuedRequest, config: QueueConfig) -> None:
        now = time.monotonic()
        budget = config.max_wait_s if request.deadline is None else min(config.max_wait_s, request.deadline - now)
        position = 1 + sum(1 for t in self._heap if not t.is_gone and t < ticket)
        wait = self.expected_wait(position, now)
        if wait is not None and wait > budget:
            raise Overloaded(
                f"{position - 1} requests wait ahead of this one, about {wait:.1f} s at the rate workers"
                f" free up, more than the {max(budget, 0):.1f} s it may wait",
                retry_after=max(RETRY_AFTER_S, wait),
            )

    def _key(self, request: QueuedRequest, policy: QueuePolicy) -> tuple[float, ...]:
        arrival = float(next(self._arrivals))
        if policy is QueuePolicy.SJF:
            second = float(request.job_tokens)
        elif policy is QueuePolicy.DEADLINE:
            second = request.deadline if request.deadline is not None else float("inf")
        else:
            second = arrival
        return (-float(request.priority), second, arrival)

    def _head(self) -> _Ticket | None:
        while self._heap and self._heap[0].is_gone:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    @staticmethod
    def _why(request: QueuedRequest, started: float, give_up: float) -> str:
        waited = time.monotonic() - started
        if request.deadline is not None and give_up >= request.deadline:
            return f"the request's deadline passed after {waited:.1f} s in the wait queue"
        return f"no worker freed up within {waited:.1f} s in the wait queue"
