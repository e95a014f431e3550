"""A ring of the engine's recent KV event batches, read in event-id order by any number of subscribers.

Like Dynamo's per-worker local indexer buffer, the ring keeps the last `capacity` batches: a subscriber
that joins late replays what is kept, and one that falls behind skips what was overwritten (the gap
shows in the event ids; the overflow is counted and logged once), so the step loop never blocks.
`EventPacer` moves the KV manager's events into the ring, a batch a pass (fewer at high speedup ratios). The
ranks of a data-parallel mocker (ranks.py) share one ring, each through a `RankEvents` that renumbers its batches
into the ring's one sequence and stamps them with the rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import msgspec

from dynamo_cli.kv.events import KvEventBatch

if TYPE_CHECKING:
    from .kv_manager import KvManager

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4096
EVENT_INTERVAL_S = 0.001
"""Passes shorter than this (high speedup ratios) publish their KV events together: at most once per interval
of wall time, and before the loop idles. A real engine's pass takes milliseconds, and so does the mocker's at
speedup 1; at speedup 1000 a pass takes microseconds, and one event batch per pass measured the event plane
(three publishes per request, a tenth of the CPU per request in benchmarks/mocker_live.py's cpu cells), not an
engine's behaviour. The router's view lags by at most the interval."""


class EventSink(Protocol):
    """Where an engine's KV event batches go, and where its `kv_events()` reads them."""

    def append(self, batch: KvEventBatch) -> None: ...

    def close(self) -> None: ...

    def subscribe(self) -> AsyncIterator[KvEventBatch]: ...


class EventRing:
    """Bounded history of `KvEventBatch`es with async readers; `close()` ends every reader."""

    __slots__ = ("_batches", "_waiter", "_is_closed", "num_skipped")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._batches: deque[KvEventBatch] = deque(maxlen=capacity)
        self._waiter: asyncio.Future[None] | None = None
        self._is_closed = False
        self.num_skipped = 0
        """Batches a slow subscriber never saw because the ring overwrote them."""

    def append(self, batch: KvEventBatch) -> None:
        """Keep a batch (ids must increase by 1) and wake the readers."""
        self._batches.append(batch)
        self._wake()

    def close(self) -> None:
        """Let readers drain what is kept, then end. Idempotent."""
        self._is_closed = True
        self._wake()

    @property
    def next_event_id(self) -> int:
        """The id the next batch appended must have (0 until the first)."""
        return self._batches[-1].event_id + 1 if self._batches else 0

    async def subscribe(self) -> AsyncIterator[KvEventBatch]:
        """Every batch kept now and appended later, in order, until `close()`."""
        next_id: int | None = None
        while True:
            batches = self._read_from(next_id)
            if batches:
                next_id = batches[-1].event_id + 1
                for batch in batches:
                    yield batch
                continue
            if self._is_closed:
                return
            if self._waiter is None:
                self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._waiter)

    def _read_from(self, next_id: int | None) -> list[KvEventBatch]:
        batches = self._batches
        if not batches:
            return []
        first = batches[0].event_id
        if next_id is None:
            next_id = first
        elif next_id < first:
            if self.num_skipped == 0:
                logger.warning("a KV event subscriber fell %d batches behind; events were lost", first - next_id)
            self.num_skipped += first - next_id
            next_id = first
        count = batches[-1].event_id + 1 - next_id  # the newest ones, read from the right end: O(count), not O(ring)
        return [batches[i] for i in range(-count, 0)] if count > 0 else []

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class RankEvents:
    """One data-parallel rank's way into its engine's one ring: each batch gets the ring's next event id, so the
    ranks' batches form one sequence from 0 with no gaps (as the worker's history and the router's gap repair
    count them), and the rank's `dp_rank`. The ring is the engine's: a rank that stops leaves it open."""

    __slots__ = ("_ring", "dp_rank")

    def __init__(self, ring: EventRing, dp_rank: int) -> None:
        self._ring = ring
        self.dp_rank = dp_rank

    def append(self, batch: KvEventBatch) -> None:
        ring = self._ring
        ring.append(msgspec.structs.replace(batch, event_id=ring.next_event_id, dp_rank=self.dp_rank))

    def close(self) -> None:
        """Nothing: the other ranks still publish; the engine closes the ring once every rank has stopped."""

    def subscribe(self) -> AsyncIterator[KvEventBatch]:
        """Every rank's batches (the engine's `kv_events()`)."""
        return self._ring.subscribe()


class EventPacer:
    """Takes a KV manager's events as one batch into a ring after each pass, a short pass's together with a later
    one's (EVENT_INTERVAL_S); `flush()` takes what is left (before idling, at stop)."""

    __slots__ = ("_kv", "_ring", "_taken_at")

    def __init__(self, kv: KvManager, ring: EventSink) -> None:
        self._kv = kv
        self._ring = ring
        self._taken_at = 0.0
        """When events were last taken (time.monotonic)."""

    def after_pass(self, pass_ms: float) -> None:
        if pass_ms < EVENT_INTERVAL_S * 1e3 and time.monotonic() - self._taken_at < EVENT_INTERVAL_S:
            return  # a short pass: its events go with a later pass's, or at the flush before the loop idles
        self.flush()

    def clear_cache(self) -> int:
        """Evict every cached block, pinned ones too (an operator's prefix-cache reset; the blocks running requests
        hold stay), their BlockRemoved events published at once: the number evicted."""
        count = self._kv.num_cached_blocks
        self._kv.evict(count)
        self.flush()
        return count

    def flush(self) -> None:
        batch = self._kv.take_events(timestamp=time.time())
        self._taken_at = time.monotonic()
        if batch is not None:
            self._ring.append(batch)
