"""The mocker's ring of KV event batches: readers see every kept batch in id order, a late reader replays what is
kept, a slow one skips what was overwritten (counted), and close() ends them."""

from __future__ import annotations

import asyncio

from dyn_engines.mocker.events import EventRing

from dynamo_cli.kv.events import BlockRemoved, KvEventBatch


def batch(event_id: int) -> KvEventBatch:
    return KvEventBatch(event_id=event_id, events=[BlockRemoved(block_hashes=[event_id])])


async def read(ring: EventRing, out: list[int]) -> None:
    async for b in ring.subscribe():
        out.append(b.event_id)


async def test_readers_see_every_batch_in_order_and_a_late_one_replays_what_is_kept() -> None:
    ring = EventRing(capacity=8)
    early: list[int] = []
    task = asyncio.create_task(read(ring, early))
    for i in range(5):
        ring.append(batch(i))
        await asyncio.sleep(0)
    late: list[int] = []
    late_task = asyncio.create_task(read(ring, late))
    await asyncio.sleep(0)
    for i in range(5, 7):
        ring.append(batch(i))
    ring.close()
    await asyncio.wait_for(asyncio.gather(task, late_task), 5)
    assert early == list(range(7))
    assert late == list(range(7))
    assert ring.num_skipped == 0


async def test_a_reader_that_falls_behind_skips_the_overwritten_batches_and_they_are_counted() -> None:
    ring = EventRing(capacity=4)
    ring.append(batch(0))
    seen: list[int] = []
    reader = ring.subscribe()
    seen.append((await anext(reader)).event_id)
    for i in range(1, 10):  # 1..5 are overwritten before the reader comes back
        ring.append(batch(i))
    ring.close()
    seen += [b.event_id async for b in reader]
    assert seen == [0, 6, 7, 8, 9]
    assert ring.num_skipped == 5


async def test_a_full_ring_gives_a_reader_only_the_batches_it_has_not_seen() -> None:
    ring = EventRing(capacity=64)
    for i in range(64):
        ring.append(batch(i))
    reader = ring.subscribe()
    assert [(await anext(reader)).event_id for _ in range(64)] == list(range(64))
    ring.append(batch(64))
    assert (await asyncio.wait_for(anext(reader), 5)).event_id == 64
    ring.close()
    assert [b async for b in reader] == []
