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
from typing import Any, TypeVar

from dynamo_cli.config import QueueConfig, QueuePolicy
from dynamo_cli.config.tenants import PREEMPTIBLE, PREEMPTING, PriorityClass
from dynamo_cli.errors import Overloaded, RateLimited

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
MAX_COUNTERS = 4096
"""Tenants' work counters kept per queue (beyond it, those that lose nothing by it are forgotten)."""


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """What the policy knows of a request."""

    priority: int = 0
    """Higher is served sooner among its tenant's requests of its class (`x-dyn-priority`)."""
    job_tokens: int = 0
    """Prompt tokens + the most output tokens: the expected job size for `sjf`."""
    deadline: float | None = None
    """Monotonic time by which the request must have started; None: none."""
    tenant: str = ""
    """Whose share it is served from ("": the fair share is off, or a tenant-blind caller)."""
    weight: float = 1.0
    """Its tenant's share relative to others' (config/tenants.py)."""
    priority_class: PriorityClass = PriorityClass.DEFAULT
    """Served strictly by class, highest first (a background line's is BACKGROUND whatever this says)."""
    max_queued: int = 0
    """Its tenant's requests that may wait at once (0: no own limit); one more is a 429."""

    @property
    def lane_class(self) -> PriorityClass:
        return PriorityClass.BACKGROUND if self.priority < LOWEST_CLIENT_PRIORITY else self.priority_class


@dataclass(order=True, slots=True)
class _Ticket:
    key: tuple[float, ...]
    is_gone: bool = field(default=False, compare=False)
    has_preempted: bool = field(default=False, compare=False)


_Lane = tuple[int, str]
"""(priority class, tenant): the requests of one tenant in one class, a heap in policy order."""


class WaitQueue:
    """One model's waiting requests (state only; the config comes with each call), and its running preemptible
    ones (`running`)."""

    def __init__(self) -> None:
        self._lanes: dict[_Lane, list[_Ticket]] = {}
        self._size = 0
        self._queued: collections.Counter[str] = collections.Counter()
        """Requests waiting per tenant."""
        self._work = TenantWork()
        self._head_cache: _Ticket | None = None
        """The head as last found; None once a push, a departure or a charge may have changed it."""
        self._preemptible: dict[object, tuple[PriorityClass, Callable[[bool], bool]]] = {}
        """Running requests a waiting higher class may pause, oldest first: key -> (class, preempt)."""
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

    def charge(self, tenant: str, work: float, weight: float) -> None:
        """`tenant` was served `work` (tokens: uncached prompt, output by their weight): its share moves back."""
        if work > 0:
            self._work.charge(tenant, work / weight, self._queued)
            self._head_cache = None

    def running(self, key: object, priority_class: PriorityClass, preempt: Callable[[bool], bool]) -> None:
        """A running request a waiting one of a higher class may pause (`preempt(only_decoding)`: True when it
        did; with `only_decoding`, not while its prompt is still being computed)."""
        self._preemptible[key] = (priority_class, preempt)

    def stopped(self, key: object) -> None:
        self._preemptible.pop(key, None)

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
        and it succeeds; Overloaded with a reason when the queue is full or the wait is too long, RateLimited
        when its tenant has as many waiting as it may."""
        if self._size >= config.max_size:
            raise Overloaded(f"the wait queue is full ({config.max_size} requests)", retry_after=RETRY_AFTER_S)
        tenant = request.tenant if config.fair_share else ""
        if request.max_queued and self._queued[request.tenant] >= request.max_queued:
            raise RateLimited(
                f"tenant '{request.tenant}' already has {request.max_queued} requests waiting (max-queued)",
                RETRY_AFTER_S,
                "max_queued",
            )
        ticket = _Ticket(self._key(request, config.policy))
        lane = (-int(request.lane_class), tenant)
        self._refuse_if_too_slow(ticket, lane, request, config)
        self._push(lane, ticket, request.tenant)
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
                        if config.preemption and not ticket.has_preempted and self._preempt_for(request.lane_class):
                            ticket.has_preempted = True  # once: then it waits for the worker that frees
                            continue
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    raise Overloaded(self._why(request, started, give_up), retry_after=RETRY_AFTER_S)
                if self._tick is None:
                    self._tick = asyncio.get_running_loop().create_future()
                await asyncio.wait((self._tick,), timeout=remaining)  # never cancels the shared future
        finally:
            self._left(ticket, request.tenant)

    ##### Internals #####

    def _push(self, lane: _Lane, ticket: _Ticket, tenant: str) -> None:
        if not self._queued[tenant]:
            self._work.backlogged(lane[1], self._queued)  # an idle tenant banks no credit
        heapq.heappush(self._lanes.setdefault(lane, []), ticket)
        self._size += 1
        self._queued[tenant] += 1
        self._head_cache = None

    def _left(self, ticket: _Ticket, tenant: str) -> None:
        ticket.is_gone = True
        self._size -= 1
        self._queued[tenant] -= 1
        if not self._queued[tenant]:
            del self._queued[tenant]
        self._head_cache = None
        self.notify()  # the next one may be the head now

    def _preempt_for(self, wanted: PriorityClass) -> bool:
        """Pause a running request of a preemptible class below `wanted`, if any: the most recently started of
        those decoding, else of those still prefilling. A decoding one frees its worker after one short step
        and loses no prefill; one mid-prefill holds the worker until its pass ends, and its pass is lost."""
        if wanted < PREEMPTING:
            return False
        candidates = [(k, p) for k, (c, p) in reversed(self._preemptible.items()) if c <= PREEMPTIBLE and c < wanted]
        for only_decoding in (True, False):
            for key, preempt in candidates:
                if preempt(only_decoding):
                    del self._preemptible[key]
                    return True
        return False

    def _refuse_if_too_slow(self, ticket: _Ticket, lane: _Lane, request: QueuedRequest, config: QueueConfig) -> None:
        now = time.monotonic()
        budget = config.max_wait_s if request.deadline is None else min(config.max_wait_s, request.deadline - now)
        position = 1 + self._ahead(ticket, lane)
        wait = self.expected_wait(position, now)
        if wait is not None and wait > budget:
            raise Overloaded(
                f"{position - 1} requests wait ahead of this one, about {wait:.1f} s at the rate workers"
                f" free up, more than the {max(budget, 0):.1f} s it may wait",
                retry_after=max(RETRY_AFTER_S, wait),
            )

    def _ahead(self, ticket: _Ticket, lane: _Lane) -> int:
        """About how many are served before `ticket`: every higher class, its own lane's earlier ones, and as
        many of each other tenant's in its class (the fair share alternates)."""
        own = sum(1 for t in self._lanes.get(lane, ()) if not t.is_gone and t < ticket)
        ahead = own
        for (rank, tenant), tickets in self._lanes.items():
            if rank < lane[0]:
                ahead += sum(1 for t in tickets if not t.is_gone)
            elif rank == lane[0] and tenant != lane[1]:
                ahead += min(own + 1, sum(1 for t in tickets if not t.is_gone))
        return ahead

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
        """The highest class's waiting request of the tenant that has had the least work (ties: arrival)."""
        head = self._head_cache
        if head is not None and not head.is_gone:
            return head
        best: tuple[Any, ...] | None = None
        for lane, tickets in list(self._lanes.items()):
            while tickets and tickets[0].is_gone:
                heapq.heappop(tickets)
            if not tickets:
                del self._lanes[lane]
                continue
            order = (lane[0], self._work.of(lane[1]), tickets[0].key[-1], tickets[0])
            if best is None or order[:3] < best[:3]:
                best = order
        self._head_cache = best[3] if best is not None else None
        return self._head_cache

    @staticmethod
    def _why(request: QueuedRequest, started: float, give_up: float) -> str:
        waited = time.monotonic() - started
        if request.deadline is not None and give_up >= request.deadline:
            return f"the request's deadline passed after {waited:.1f} s in the wait queue"
        return f"no worker freed up within {waited:.1f} s in the wait queue"


class TenantWork:
    """Each tenant's virtual work counter (VTC, Sheng et al., OSDI '24): the work it was served over its weight.
    The queue serves the backlogged tenant with the least; a tenant that starts waiting is lifted to the least of
    the others waiting (or to the last one served's), so idling banks no credit and the share is work-conserving."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._floor = 0.0
        """The counter of the tenant served last: where a tenant joins when nobody waits."""

    def of(self, tenant: str) -> float:
        return self._counters.get(tenant, self._floor)

    def charge(self, tenant: str, work: float, waiting: collections.Counter[str]) -> None:
        self._counters[tenant] = self._floor = self.of(tenant) + work
        if len(self._counters) > MAX_COUNTERS:  # forget the least served idle half (they come back at the floor)
            idle = sorted((c, t) for t, c in self._counters.items() if t not in waiting)
            for _, name in idle[: len(idle) // 2 + 1]:
                del self._counters[name]

    def backlogged(self, tenant: str, waiting: collections.Counter[str]) -> None:
        self._counters[tenant] = max(self.of(tenant), self._least(waiting, self._floor))

    def _least(self, waiting: collections.Counter[str], otherwise: float) -> float:
        return min((self.of(t) for t in waiting), default=otherwise)
