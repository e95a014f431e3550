"""A ring of the engine's recent KV event batches, read in event-id order by any number of subscribers.

Like Dynamo's per-worker local indexer buffer, the ring keeps the last `capacity` batches: a subscriber
that joins late replays what is kept, and one that falls behind skips what was overwritten (the gap
shows in the event ids; the overflow is counted and logged once), so the step loop never blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

from dynamo_cli.kv.events import KvEventBatch

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4096


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
