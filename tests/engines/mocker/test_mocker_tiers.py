"""The mocker's KV tiers: evicted blocks go to host or disk, a returning prefix is onboarded in simulated
time instead of computed, and a stream closed during the onboard leaves nothing behind."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from dyn_engines.mocker.engine import MockerEngine
from dyn_engines.mocker.kv_manager import KvManager
from dyn_engines.mocker.tiers import TierTiming

from dynamo_cli.engine import EngineArgs
from dynamo_cli.kv.events import DEVICE, DISK, HOST, BlockRemoved, BlockStored, KvEventBatch
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.kv.tiers import KvTierConfig
from dynamo_cli.wire import GenerateRequest

BS = 16
BLOCK_BYTES = 1024 * BS  # kv_bytes_per_token 1024
FAST = {"speedup_ratio": 1e6, "num_gpu_blocks": 8, "kv_bytes_per_token": 1024}


def prompt(n: int, blocks: int = 4) -> list[int]:
    """`blocks` full blocks of tokens unique to `n`."""
    return [1000 * (n + 1) + i for i in range(blocks * BS)]


def request(request_id: str, tokens: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, token_ids=tokens, max_tokens=1)


async def tiered(model_dir: str, tiers: KvTierConfig, **extra: float) -> MockerEngine:
    engine = MockerEngine(EngineArgs(model=model_dir, block_size=BS, extra={**FAST, **extra}, kv_tiers=tiers))
    await engine.start()
    return engine


async def run(engine: MockerEngine, req: GenerateRequest) -> None:
    async for _ in engine.generate(req):
        pass


async def events_of(engine: MockerEngine) -> list[object]:
    """Every event published so far (the ring replays from the oldest batch kept)."""
    seen: list[object] = []
    stream: AsyncIterator[KvEventBatch] = engine.kv_events()
    try:
        while True:
            batch = await asyncio.wait_for(anext(stream), 0.05)
            seen.extend(batch.events)
    except TimeoutError:
        return seen
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def test_evicted_blocks_are_kept_with_their_names_and_come_back_as_cached() -> None:
    kv = KvManager(num_blocks=4, block_size=BS)
    kv.collect_evicted = True
    a = prompt(0, blocks=3)
    seq, local = sequence_hashes(a, BS), block_hashes(a, BS)
    assert kv.allocate("a", len(a), seq, local)
    kv.free("a")
    b = prompt(1, blocks=3)
    assert kv.allocate("b", len(b), sequence_hashes(b, BS), block_hashes(b, BS))  # 1 free + 2 of a's evicted

    # a's blocks were freed tail-first, so its two deepest go first, each with its tokens hash and parent
    assert kv.evicted == [(seq[2], local[2], seq[1]), (seq[1], local[1], seq[0])]
    kv.free("b")
    kv.take_events()
    assert kv.insert_cached(seq, local, 1, 2) == 2  # a's blocks 1 and 2 back, evicting 2 of b's, not a's first

    assert kv.num_prefix_hits(seq) == 3
    stored = [e for e in kv.take_events().events if isinstance(e, BlockStored)]  # type: ignore[union-attr]
    assert [(e.parent_hash, [b.block_hash for b in e.blocks], e.tier) for e in stored] == [(seq[0], seq[1:3], DEVICE)]


def test_the_onboard_time_is_bytes_over_bandwidth_plus_latency_per_tier() -> None:
    timing = TierTiming(host_bandwidth_gbs=10, disk_bandwidth_gbs=2, host_latency_ms=1, disk_latency_ms=4)
    # 4 host blocks of 8 MB: 32e6 / 10e9 + 0.001; 2 disk blocks: 16e6 / 2e9 + 0.004
    expected = 0.0032 + 0.001 + 0.008 + 0.004
    assert timing.onboard_s([HOST] * 4 + [DISK] * 2, 8_000_000) == pytest.approx(expected)
    # the defaults are the router's (config.TIER_*): 20 GB/s and 20 us from host
    assert TierTiming(speedup_ratio=4).onboard_s([HOST], 20_000_000) == pytest.approx((0.001 + 0.00002) / 4)


async def test_an_evicted_prefix_is_onboarded_from_host_instead_of_recomputed(model_dir: str) -> None:
    engine = await tiered(model_dir, KvTierConfig(host_bytes=64 * BLOCK_BYTES))
    try:
        await run(engine, request("a", prompt(0)))
        await run(engine, request("b", prompt(1)))
        await run(engine, request("c", prompt(2)))  # 8 device blocks: a's 4 are evicted to host
        before = engine.load_metrics()
        await run(engine, request("a2", prompt(0)))
        after = engine.load_metrics()
        events = await events_of(engine)
    finally:
        await engine.stop()

    a = sequence_hashes(prompt(0), BS)
    host_stored = [h for e in events if isinstance(e, BlockStored) and e.tier == HOST for h in e.blocks]
    device_removed = [h for e in events if isinstance(e, BlockRemoved) and e.tier == DEVICE for h in e.block_hashes]
    assert set(a) <= {b.block_hash for b in host_stored} and set(a) <= set(device_removed)
    # the whole prompt but its last token (computed for its logits) was cached, none of it computed again
    assert after.num_prefill_tokens_cached - before.num_prefill_tokens_cached == 4 * BS - 1
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == 1
    assert after.kv_tiers is not None and after.kv_tiers.onboard_blocks_h2d == 4
    # the metrics record the simulated transfer time, not the store's bookkeeping time
    simulated = TierTiming(speedup_ratio=FAST["speedup_ratio"]).onboard_s([HOST] * 4, BLOCK_BYTES)
    assert after.kv_tiers.onboard_seconds_h2d == pytest.approx(simulated)


async def test_without_a_host_tier_evictions_go_to_disk_and_onboard_from_there(model_dir: str) -> None:
    engine = await tiered(model_dir, KvTierConfig(disk_bytes=1 << 30))
    try:
        for n, name in enumerate("abc"):
            await run(engine, request(name, prompt(n)))
        await run(engine, request("a2", prompt(0)))
        stats = engine.load_metrics().kv_tiers
        events = await events_of(engine)
    finally:
        await engine.stop()

    assert any(isinstance(e, BlockStored) and e.tier == DISK for e in events)
    assert stats is not None and (stats.onboard_blocks_d2d, stats.onboard_blocks_h2d) == (4, 0)


async def test_a_stream_closed_during_its_onboard_leaves_nothing_behind(model_dir: str) -> None:
    slow = {"kv_host_bandwidth": 1e-6, "speedup_ratio": 1.0}  # 64 KiB at 1 kB/s: about a minute
    engine = await tiered(model_dir, KvTierConfig(host_bytes=64 * BLOCK_BYTES), **slow)
    try:
        for n, name in enumerate("abc"):
            await run(engine, request(name, prompt(n)))
        held = engine.load_metrics()
        task = asyncio.create_task(run(engine, request("a2", prompt(0))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = engine.load_metrics()
    finally:
        await engine.stop()

    assert (after.num_running, after.num_waiting, after.active_blocks) == (0, 0, 0)
    assert after.num_prefill_tokens_cached == held.num_prefill_tokens_cached
    assert engine._kv.num_prefix_hits(sequence_hashes(prompt(0), BS)) == 0  # nothing was brought back
