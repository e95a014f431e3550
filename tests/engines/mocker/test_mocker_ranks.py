"""A data-parallel mocker (`data_parallel_size`): N whole mockers behind one Engine, a request on the rank it names
(else round-robin), one KV event stream numbered across ranks, the load per rank; one rank is the mocker of before."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from dyn_engines.mocker.engine import MockerEngine
from dyn_engines.mocker.ranks import RankedMocker, mocker_engine

from dynamo_cli.engine import EngineArgs, KvTierConfig, Role, ServesLoras
from dynamo_cli.errors import ConfigError, DynError, RequestError
from dynamo_cli.kv.events import BlockStored, KvEventBatch
from dynamo_cli.kv.handles import MockerKv
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.model_card import ModelCard
from dynamo_cli.wire import GenerateChunk, GenerateRequest, RankLoad

BLOCK = 64
RANKS = [4, 5, 6, 7]
"""The engine under test serves 4 ranks from global rank 4 (as the second of two 4-rank workers)."""


def ranked(model_dir: str, speedup: float = 1e6, role: Role = Role.BOTH, **extra: Any) -> RankedMocker:
    options = {"speedup_ratio": speedup, "num_gpu_blocks": 1000, "data_parallel_size": 4}
    engine = mocker_engine(
        EngineArgs(model=model_dir, role=role, extra={**options, "data_parallel_start_rank": 4, **extra})
    )
    assert isinstance(engine, RankedMocker)
    return engine


def prompt(n: int, length: int = 200) -> list[int]:
    """Token ids no other prompt of a test shares: each prompt's blocks hash apart."""
    return list(range(1000 * n, 1000 * n + length))


def request(request_id: str, token_ids: list[int], max_tokens: int = 5, **kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, token_ids=token_ids, max_tokens=max_tokens, **kw)


async def collect(engine: MockerEngine | RankedMocker, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(req)]


@contextlib.asynccontextmanager
async def recording(engine: MockerEngine | RankedMocker) -> AsyncIterator[list[KvEventBatch]]:
    """The engine's KV event batches, all of them once the block ends: it stops the engine, which ends the stream."""
    batches: list[KvEventBatch] = []

    async def read() -> None:
        async for batch in engine.kv_events():
            batches.append(batch)

    reader = asyncio.create_task(read())
    try:
        yield batches
    finally:
        await engine.stop()
        await asyncio.wait_for(reader, 1.0)


def rank_of_prompt(batches: list[KvEventBatch], token_ids: list[int]) -> set[int]:
    """The ranks whose events stored the prompt's first block."""
    first = sequence_hashes(token_ids, BLOCK)[0]
    return {
        batch.dp_rank
        for batch in batches
        for event in batch.events
        if isinstance(event, BlockStored) and first in [block.block_hash for block in event.blocks]
    }


async def test_start_reports_every_rank_and_their_summed_capacity(model_dir: str) -> None:
    engine = ranked(model_dir)
    info = await engine.start()
    await engine.stop()
    assert (info.total_kv_blocks, info.max_num_seqs) == (4000, 4 * 256)
    assert (info.extra["dp_start"], info.extra["dp_size"]) == (4, 4)
    card = ModelCard.from_engine(info, "mocker", Role.BOTH)
    assert card.ranks == range(4, 8) and card.is_ranked


async def test_requests_pinned_to_a_rank_run_there_and_its_events_and_load_say_so(model_dir: str) -> None:
    engine = ranked(model_dir, speedup=10.0)
    await engine.start()
    pins = {"a": 4, "b": 6, "c": 6, "d": 7}
    async with recording(engine) as batches:
        streams = {rid: engine.generate(request(rid, prompt(i), 1000, dp_rank=pins[rid])) for i, rid in enumerate(pins)}
        for stream in streams.values():
            await anext(stream)  # type: ignore[call-overload]
        load = engine.load_metrics()
        for stream in streams.values():
            await stream.aclose()  # type: ignore[attr-defined]
    assert [(rank.dp_rank, rank.num_running, rank.total_blocks) for rank in load.ranks] == [
        (4, 1, 1000),
        (5, 0, 1000),
        (6, 2, 1000),
        (7, 1, 1000),
    ]
    assert [rank.active_blocks > 0 for rank in load.ranks] == [True, False, True, True]
    assert (load.num_running, load.total_blocks) == (4, 4000)
    assert load.active_blocks == sum(rank.active_blocks for rank in load.ranks)
    assert [rank_of_prompt(batches, prompt(i)) for i in range(4)] == [{4}, {6}, {6}, {7}]


async def test_requests_that_name_no_rank_go_to_the_ranks_in_turn(model_dir: str) -> None:
    engine = ranked(model_dir)
    await engine.start()
    async with recording(engine) as batches:
        for i in range(8):
            await collect(engine, request(f"r{i}", prompt(i)))
        first_tokens = [engine.ranks[rank].work_counters()["first_tokens"] for rank in RANKS]
    assert [rank_of_prompt(batches, prompt(i)) for i in range(8)] == [{RANKS[i % 4]} for i in range(8)]
    assert first_tokens == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "dp_rank", [pytest.param(3, id="below"), pytest.param(8, id="above"), pytest.param(-1, id="negative")]
)
async def test_a_rank_the_engine_does_not_serve_is_refused_naming_dp_rank(model_dir: str, dp_rank: int) -> None:
    engine = ranked(model_dir)
    await engine.start()
    try:
        with pytest.raises(
            RequestError, match=rf"dp_rank {dp_rank} is not served by this worker \(ranks 4..7\)"
        ) as refused:
            await collect(engine, request("a", prompt(0), dp_rank=dp_rank))
        assert refused.value.param == "dp_rank"
        assert len(await collect(engine, request("a", prompt(0), dp_rank=5))) > 0  # it serves on, the id is free
    finally:
        await engine.stop()


async def test_the_ranks_kv_events_are_numbered_from_0_without_gaps_in_one_stream(model_dir: str) -> None:
    engine = ranked(model_dir, speedup=1e3)
    await engine.start()
    async with recording(engine) as batches:
        reqs = [request(str(i), prompt(i, 64 * (1 + i % 4) + i), max_tokens=70) for i in range(40)]
        await asyncio.gather(*(collect(engine, r) for r in reqs))
    assert [batch.event_id for batch in batches] == list(range(len(batches)))
    assert {batch.dp_rank for batch in batches} == set(RANKS)


async def test_one_rank_0_is_the_rank_blind_mocker_of_before(model_dir: str) -> None:
    for extra in ({}, {"data_parallel_size": 1, "data_parallel_start_rank": 0}):
        engine = mocker_engine(EngineArgs(model=model_dir, extra={"speedup_ratio": 1e6, **extra}))
        assert type(engine) is MockerEngine
        info = await engine.start()
        async with recording(engine) as batches:
            await collect(engine, request("a", prompt(0)))
            load = engine.load_metrics()
        assert "dp_start" not in info.extra and "dp_size" not in info.extra
        assert not ModelCard.from_engine(info, "mocker", Role.BOTH).is_ranked
        assert load.ranks == [] and batches and {batch.dp_rank for batch in batches} == {0}


async def test_one_rank_that_is_not_rank_0_is_a_ranked_engine(model_dir: str) -> None:
    engine = mocker_engine(EngineArgs(model=model_dir, extra={"speedup_ratio": 1e6, "data_parallel_start_rank": 3}))
    assert isinstance(engine, RankedMocker)
    info = await engine.start()
    async with recording(engine) as batches:
        await collect(engine, request("a", prompt(0)))
        load = engine.load_metrics()
    assert ModelCard.from_engine(info, "mocker", Role.BOTH).ranks == range(3, 4)
    assert {batch.dp_rank for batch in batches} == {3}
    assert load.ranks == [RankLoad(dp_rank=3, total_blocks=16384)]


async def test_hidden_ranks_make_a_rank_blind_engine_that_sends_each_request_to_its_least_loaded_rank(
    model_dir: str,
) -> None:
    engine = ranked(model_dir, speedup=10.0, data_parallel_hidden=True)
    info = await engine.start()
    async with recording(engine) as batches:
        streams = [engine.generate(request(f"h{i}", prompt(i), 1000)) for i in range(4)]
        for stream in streams:
            await anext(stream)  # type: ignore[call-overload]
        queued = [engine.ranks[rank].load_metrics() for rank in RANKS]
        load = engine.load_metrics()
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
    card = ModelCard.from_engine(info, "mocker", Role.BOTH)
    assert not card.is_ranked and card.total_kv_blocks == 4000
    assert [rank.num_running + rank.num_waiting for rank in queued] == [1, 1, 1, 1]  # one each: the least loaded
    assert (load.num_running, load.total_blocks, load.ranks) == (4, 4000, [])
    assert {batch.dp_rank for batch in batches} == {0}
    assert [batch.event_id for batch in batches] == list(range(len(batches)))


async def test_an_adapter_loaded_on_the_engine_reaches_every_rank(model_dir: str, tmp_path: Path) -> None:
    engine = ranked(model_dir)
    assert isinstance(engine, ServesLoras)
    (tmp_path / "sql.bin").write_bytes(b"adapter")
    await engine.start()
    try:
        await engine.load_lora("sql", str(tmp_path / "sql.bin"))
        for rank in RANKS:
            assert len(await collect(engine, request(f"l{rank}", prompt(rank), lora="sql", dp_rank=rank))) > 0
        assert engine.work_counters()["lora_loads"] == 4  # once per rank
        assert engine.work_counters()["first_tokens"] == 4
        await engine.unload_lora("sql")
        with pytest.raises(RequestError, match="'sql' is not loaded") as refused:
            await collect(engine, request("after", prompt(9), lora="sql", dp_rank=7))
        assert refused.value.param == "model"
    finally:
        await engine.stop()


async def test_stop_ends_the_streams_of_every_rank_and_the_kv_event_stream(model_dir: str) -> None:
    engine = ranked(model_dir, speedup=10.0)
    await engine.start()
    events = engine.kv_events()
    streams = [engine.generate(request(f"s{rank}", prompt(rank), 1000, dp_rank=rank)) for rank in RANKS]
    for stream in streams:
        await anext(stream)  # type: ignore[call-overload]
    await engine.stop()
    await engine.stop()  # idempotent
    for stream in streams:
        assert [chunk async for chunk in stream][-1].finish_reason == "cancelled"  # type: ignore[attr-defined]
    batches = await asyncio.wait_for(_drain(events), 1.0)
    assert {batch.dp_rank for batch in batches} == set(RANKS)  # the last ones kept, then the stream ended
    assert engine.load_metrics().active_blocks == 0
    with pytest.raises(DynError, match="stopped"):
        await collect(engine, request("late", prompt(0)))


async def _drain(events: AsyncIterator[KvEventBatch]) -> list[KvEventBatch]:
    return [batch async for batch in events]


async def test_a_prefill_rank_hands_on_kv_that_a_decode_rank_takes(model_dir: str) -> None:
    prefill = ranked(model_dir, role=Role.PREFILL, kv_bytes_per_token=1000)
    decode = ranked(model_dir, role=Role.DECODE)
    await prefill.start()
    await decode.start()
    try:
        async with recording(prefill) as batches:
            chunks = await collect(prefill, request("p", prompt(0, 300), max_tokens=50, dp_rank=5))
        handle = chunks[-1].kv_transfer
        first_token = chunks[-1].token_ids[0]
        assert handle == MockerKv(num_tokens=300, first_token=first_token, nbytes=300_000)
        assert rank_of_prompt(batches, prompt(0, 300)) == {5}
        decoded = await collect(decode, request("d", [*prompt(0, 300), first_token], 3, kv_transfer=handle, dp_rank=7))
        assert sum(len(chunk.token_ids) for chunk in decoded) == 3
        assert [rank.num_running for rank in decode.load_metrics().ranks] == [0, 0, 0, 0]
        assert decode.load_metrics().num_prefill_tokens_computed == 0  # taken, not computed
    finally:
        await decode.stop()


@pytest.mark.parametrize(
    ("extra", "tiers", "words"),
    [
        pytest.param({}, KvTierConfig(host_bytes=1 << 20), "data_parallel_size=4: .* KV tiers", id="tiers"),
        pytest.param({"data_parallel_size": 0}, None, "data_parallel_size must be a positive integer", id="size-0"),
        pytest.param(
            {"data_parallel_start_rank": -1}, None, r"data_parallel_start_rank must be an integer >= 0", id="start"
        ),
        pytest.param({"data_parallel_size": "2"}, None, "data_parallel_size must be a positive integer", id="string"),
        pytest.param({"data_parallel_hidden": "yes"}, None, "data_parallel_hidden must be true or false", id="hidden"),
    ],
)
def test_what_ranks_cannot_do_is_refused_naming_the_option(
    model_dir: str, extra: dict[str, Any], tiers: KvTierConfig | None, words: str
) -> None:
    options = {"data_parallel_size": 4, **extra}
    args = EngineArgs(model=model_dir, extra=options, kv_tiers=tiers or KvTierConfig())
    with pytest.raises(ConfigError, match=words):
        mocker_engine(args)


def test_a_mocker_engine_built_by_hand_is_one_rank_and_says_to_use_the_entry_point(model_dir: str) -> None:
    with pytest.raises(ConfigError, match=r"one rank, not data_parallel_size=4 .*entry point \(load_engine"):
        MockerEngine(EngineArgs(model=model_dir, extra={"data_parallel_size": 4}))
