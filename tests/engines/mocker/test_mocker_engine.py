"""MockerEngine behind the Engine contract: streams, cancellation, KV events, roles, validation."""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from dyn_engines.mocker.config import MockerConfig
from dyn_engines.mocker.engine import MockerEngine
from dyn_engines.mocker.ranks import mocker_engine

from dynamo_cli.engine import Engine, EngineArgs, Role, load_engine
from dynamo_cli.errors import ConfigError, ContextOverflow, DynError, RequestError
from dynamo_cli.kv.events import BlockStored, KvEventBatch
from dynamo_cli.kv.handles import LlamaCppKv, MockerKv
from dynamo_cli.timing import decode_ms, prefill_ms
from dynamo_cli.wire import GenerateChunk, GenerateRequest, SamplingParams

FAST = {"speedup_ratio": 1e6}


@pytest.fixture
async def engine(model_dir: str) -> AsyncIterator[MockerEngine]:
    engine = MockerEngine(EngineArgs(model=model_dir, extra=dict(FAST)))
    await engine.start()
    yield engine
    await engine.stop()


def request(
    request_id: str, num_prompt: int = 100, max_tokens: int = 17, seed: int | None = None, **kw: Any
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        token_ids=list(range(num_prompt)),
        max_tokens=max_tokens,
        sampling=SamplingParams(seed=seed),
        **kw,
    )


async def collect(engine: MockerEngine, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(req)]


def tokens_of(chunks: list[GenerateChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


async def eventually(condition: Any, timeout: float = 1.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


def test_the_entry_point_resolves_to_the_mocker_and_it_satisfies_the_protocol(model_dir: str) -> None:
    assert load_engine("mocker") is mocker_engine
    engine: Engine = mocker_engine(EngineArgs(model=model_dir))
    assert isinstance(engine, MockerEngine)


async def test_start_reports_the_model_and_the_kv_capacity(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, context_length=4096, extra={"num_gpu_blocks": 100}))
    info = await engine.start()
    await engine.stop()
    assert (info.model_name, info.tokenizer_source) == ("mock-model", str(Path(model_dir).resolve()))
    assert (info.block_size, info.context_length, info.total_kv_blocks) == (64, 4096, 100)


async def test_a_request_gets_exactly_max_tokens_and_ends_with_length(engine: MockerEngine) -> None:
    chunks = await collect(engine, request("a", max_tokens=17))
    tokens = tokens_of(chunks)
    assert len(tokens) == 17 and all(1000 <= t < 2000 for t in tokens)
    assert chunks[-1].finish_reason == "length"
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[0].num_cached_tokens == 0


async def test_the_first_chunk_reports_prompt_tokens_served_from_the_prefix_cache(
    engine: MockerEngine,
) -> None:
    await collect(engine, request("a", num_prompt=200))
    chunks = await collect(engine, request("b", num_prompt=200))
    assert chunks[0].num_cached_tokens == 192  # 3 full blocks of 64
    assert engine.load_metrics().num_prefill_tokens_cached == 192


async def test_concurrent_requests_each_get_their_own_count_and_seeded_tokens(engine: MockerEngine) -> None:
    reqs = [request(str(i), num_prompt=50 + i, max_tokens=1 + i % 20, seed=i % 2) for i in range(60)]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for req, chunks in zip(reqs, results, strict=True):
        assert len(tokens_of(chunks)) == req.max_tokens
    assert tokens_of(results[2])[:3] == tokens_of(results[4])[:3]  # same seed, same tokens
    assert engine.load_metrics().active_blocks == 0


async def test_cancelling_a_stream_mid_way_frees_its_blocks_at_once(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"speedup_ratio": 10.0}))
    await engine.start()
    first_chunk = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request("a", num_prompt=300, max_tokens=1000)):
            first_chunk.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_chunk.wait(), 1.0)
    assert engine.load_metrics().active_blocks == 5
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.load_metrics().active_blocks, engine.load_metrics().num_running) == (0, 0)
    await engine.stop()


async def test_closing_the_iterator_aborts_the_request(engine: MockerEngine) -> None:
    stream = engine.generate(request("a", max_tokens=5000, num_prompt=1000))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.load_metrics().active_blocks == 0
    assert len(tokens_of(await collect(engine, request("a", max_tokens=3)))) == 3  # the id is free again


async def test_kv_events_arrive_in_order_without_gaps(engine: MockerEngine) -> None:
    received: list[KvEventBatch] = []

    async def subscribe() -> None:
        async for batch in engine.kv_events():
            received.append(batch)

    reader = asyncio.create_task(subscribe())
    reqs = [request(str(i), num_prompt=64 * (1 + i % 4) + i, max_tokens=70) for i in range(40)]
    await asyncio.gather(*(collect(engine, r) for r in reqs))
    await engine.stop()
    await asyncio.wait_for(reader, 1.0)
    assert [b.event_id for b in received] == list(range(len(received)))
    assert len(received) > 1
    first = received[0].events[0]
    assert isinstance(first, BlockStored) and first.parent_hash is None


async def test_stop_ends_open_streams_as_cancelled_and_is_idempotent(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"speedup_ratio": 10.0}))
    await engine.start()
    stream = engine.generate(request("a", max_tokens=1000))
    await anext(stream)
    await engine.stop()
    await engine.stop()
    rest = [chunk async for chunk in stream]
    assert rest[-1].finish_reason == "cancelled"
    assert engine.load_metrics().active_blocks == 0


async def test_pass_times_follow_the_timing_model(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"speedup_ratio": 4.0}))
    await engine.start()
    start = time.perf_counter()
    arrivals = []
    async for _ in engine.generate(request("a", num_prompt=1024, max_tokens=4)):
        arrivals.append(time.perf_counter() - start)
    await engine.stop()
    ttft = prefill_ms(1024) / 4.0 / 1000  # the first token adds no decode term (Dynamo 1.6.1)
    assert ttft <= arrivals[0] < ttft + 0.1
    assert arrivals[-1] >= ttft + 3 * decode_ms(0.0) / 4.0 / 1000


async def test_the_work_counters_count_each_pass_and_its_modelled_time_after_the_speedup(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"speedup_ratio": 100.0}))
    await engine.start()
    await collect(engine, request("a", num_prompt=1000, max_tokens=3))
    counts = engine.work_counters()
    await engine.stop()
    decode_passes_ms = decode_ms(1001 / 16384 / 64) + decode_ms(1002 / 16384 / 64)
    modelled_s = (prefill_ms(1000) + decode_passes_ms) / 100.0 / 1000  # not divided by the speedup twice
    assert counts["pass_seconds"] == pytest.approx(modelled_s)
    assert counts["pass_wall_seconds"] >= modelled_s - 2 * 0.005  # at most the catch-up, per pass after the first
    assert {key: counts[key] for key in ("forward_passes", "decode_only_passes", "prefill_tokens", "first_tokens")} == {
        "forward_passes": 3,
        "decode_only_passes": 2,
        "prefill_tokens": 1000,
        "first_tokens": 1,
    }


@pytest.mark.parametrize("visibility", ["pass_start", "pass_end"])
async def test_kv_events_are_published_when_the_pass_starts_or_when_it_ends(model_dir: str, visibility: str) -> None:
    """A 3000-token prompt's pass lasts 66 ms at speedup 1: its events come before its token, or as it ends."""
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"kv_event_visibility": visibility}))
    await engine.start()
    events = engine.kv_events()
    start = time.perf_counter()
    stream = engine.generate(request("a", num_prompt=3000, max_tokens=1))
    first_chunk = asyncio.ensure_future(anext(stream))  # type: ignore[arg-type]
    batch = await anext(events)  # type: ignore[call-overload]
    if visibility == "pass_start":
        assert not first_chunk.done()
    else:
        assert time.perf_counter() - start >= prefill_ms(3000) / 1000
    assert isinstance(batch.events[0], BlockStored) and len(batch.events[0].blocks) == 3000 // 64
    await first_chunk
    await stream.aclose()  # type: ignore[attr-defined]
    await engine.stop()


async def test_a_prefill_worker_returns_one_token_and_a_kv_handle(model_dir: str) -> None:
    extra = {**FAST, "kv_bytes_per_token": 1000}
    engine = MockerEngine(EngineArgs(model=model_dir, role=Role.PREFILL, extra=extra))
    await engine.start()
    chunks = await collect(engine, request("a", num_prompt=300, max_tokens=50))
    await engine.stop()
    assert tokens_of(chunks) == [chunks[-1].token_ids[0]] and chunks[-1].finish_reason == "length"
    handle = chunks[-1].kv_transfer
    assert handle == MockerKv(num_tokens=300, first_token=tokens_of(chunks)[0], nbytes=300_000)
    assert handle.payload == b"" and engine.load_metrics().num_prefill_tokens_computed == 300


def decode_request(request_id: str, num_prompt: int, max_tokens: int, nbytes: int) -> GenerateRequest:
    """What a decode worker gets: prompt + [first_token], the handle covering the prompt."""
    handle = MockerKv(num_tokens=num_prompt, first_token=num_prompt, nbytes=nbytes)  # request() counts up
    return request(request_id, num_prompt=num_prompt + 1, max_tokens=max_tokens, kv_transfer=handle)


async def test_a_decode_worker_waits_out_the_transfer_computes_no_prefill_and_streams_only_new_tokens(
    model_dir: str,
) -> None:
    extra = {**FAST, "kv_transfer_bandwidth": 1.0}  # 1 GB/s: 0.1 s for 100 MB
    engine = MockerEngine(EngineArgs(model=model_dir, role=Role.DECODE, extra=extra))
    await engine.start()
    start = time.perf_counter()
    chunks = await collect(engine, decode_request("a", num_prompt=50, max_tokens=3, nbytes=100_000_000))
    elapsed = time.perf_counter() - start
    local = await collect(engine, request("b", num_prompt=50, max_tokens=3))  # no handle: prefilled here
    metrics = engine.load_metrics()
    await engine.stop()
    assert len(tokens_of(chunks)) == 3 and chunks[0].num_cached_tokens == 0
    assert 0.1 <= elapsed < 0.6
    assert len(tokens_of(local)) == 3
    assert metrics.num_prefill_tokens_computed == 50  # request b's prompt alone
    assert MockerConfig.from_args(EngineArgs(model=model_dir)).kv_transfer_bandwidth == 0.0  # Dynamo's: no delay


async def test_by_default_a_transferred_request_waits_no_transfer_time(model_dir: str) -> None:
    """Dynamo 1.6.1 models no transfer unless its bandwidth is set: 10 GB at the old 64 GB/s default took 0.16 s."""
    engine = MockerEngine(EngineArgs(model=model_dir, role=Role.DECODE, extra=dict(FAST)))
    await engine.start()
    start = time.perf_counter()
    chunks = await collect(engine, decode_request("a", num_prompt=50, max_tokens=2, nbytes=10 * 10**9))
    elapsed = time.perf_counter() - start
    await engine.stop()
    assert len(tokens_of(chunks)) == 2 and elapsed < 0.1


async def test_closing_a_decode_stream_during_the_transfer_holds_no_blocks(model_dir: str) -> None:
    extra = {**FAST, "kv_transfer_bandwidth": 1.0}
    engine = MockerEngine(EngineArgs(model=model_dir, role=Role.DECODE, extra=extra))
    await engine.start()
    try:
        stream = engine.generate(decode_request("a", num_prompt=500, max_tokens=5, nbytes=10**9))  # 1 s
        pending = asyncio.ensure_future(anext(stream))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()  # type: ignore[attr-defined]
        metrics = engine.load_metrics()
        assert (metrics.num_running, metrics.num_waiting, metrics.active_blocks) == (0, 0, 0)
        assert len(tokens_of(await collect(engine, request("b", max_tokens=2)))) == 2
        assert engine.load_metrics().active_blocks == 0
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("role", "handle", "words"),
    [
        pytest.param(Role.DECODE, LlamaCppKv(num_tokens=50, first_token=1, payload=b"x"), "LlamaCppKv", id="kind"),
        pytest.param(Role.DECODE, MockerKv(num_tokens=20, first_token=50, nbytes=0), "covers 20", id="num-tokens"),
        pytest.param(Role.DECODE, MockerKv(num_tokens=50, first_token=9, nbytes=0), "first token 9", id="first-token"),
        pytest.param(Role.PREFILL, MockerKv(num_tokens=50, first_token=1, nbytes=0), "prefill-role", id="prefill"),
    ],
)
async def test_a_wrong_handle_is_refused_naming_kv_transfer(
    model_dir: str, role: Role, handle: Any, words: str
) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, role=role, extra=dict(FAST)))
    await engine.start()
    try:
        with pytest.raises(RequestError, match=words) as caught:
            await collect(engine, request("a", num_prompt=51, max_tokens=3, kv_transfer=handle))
        assert caught.value.param == "kv_transfer"
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "error", "words"),
    [
        pytest.param(10, 0, RequestError, "max_tokens must be at least 1, got 0", id="no-tokens"),
        pytest.param(8000, 500, ContextOverflow, "8000 and max_tokens is 500", id="over-context"),
        pytest.param(0, 5, RequestError, "no tokens", id="empty-prompt"),
    ],
)
async def test_bad_requests_are_refused_with_the_numbers(
    engine: MockerEngine, num_prompt: int, max_tokens: int, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        await collect(engine, request("a", num_prompt=num_prompt, max_tokens=max_tokens))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        pytest.param({"speedup_ratio": 0}, "speedup_ratio must be a number above 0", id="zero-speedup"),
        pytest.param({"num_gpu_blocks": -1}, "num_gpu_blocks must be a positive integer", id="negative-blocks"),
        pytest.param({"enable_prefix_caching": "yes"}, "must be true or false", id="string-bool"),
        pytest.param({"preemption_mode": "random"}, "preemption_mode must be one of lifo, fifo", id="preemption"),
        pytest.param({"decode_kv_input": "x"}, "decoding_tokens, active_blocks", id="decode-kv-input"),
        pytest.param({"prefilled_admission": 1}, "materialized, prompt", id="prefilled-admission"),
        pytest.param({"kv_event_visibility": "end"}, "pass_start, pass_end", id="kv-event-visibility"),
    ],
)
def test_bad_options_are_refused_naming_the_option(model_dir: str, extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        MockerEngine(EngineArgs(model=model_dir, extra=extra))


async def test_generate_before_start_says_to_call_start(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir))
    with pytest.raises(DynError, match="call start"):
        await collect(engine, request("a"))


async def test_without_prefix_caching_no_kv_events_are_published(model_dir: str) -> None:
    extra = {**FAST, "enable_prefix_caching": False}
    engine = MockerEngine(EngineArgs(model=model_dir, extra=extra))
    await engine.start()
    await collect(engine, request("a", num_prompt=300))
    chunks = await collect(engine, request("b", num_prompt=300))
    await engine.stop()
    assert chunks[0].num_cached_tokens == 0
    assert [batch async for batch in engine.kv_events()] == []


async def test_a_request_that_breaks_a_pass_fails_alone_and_the_engine_serves_on(model_dir: str) -> None:
    from dynamo_cli.errors import RequestFailed

    engine = MockerEngine(EngineArgs(model=model_dir, block_size=16))  # real time: ~6 ms a pass
    await engine.start()
    try:
        bad = engine.generate(request("bad", num_prompt=1, max_tokens=100))
        beside = asyncio.ensure_future(collect(engine, request("beside", max_tokens=40)))
        assert (await anext(bad)).token_ids  # type: ignore[call-overload]
        # As if check_request had let it through: hashing its first full block will raise.
        engine._streams["bad"].request.token_ids[0] = 2**40
        with pytest.raises(RequestFailed, match="'bad'"):
            async for _ in bad:  # type: ignore[attr-defined]
                pass
        chunks = await beside
        assert len(tokens_of(chunks)) == 40 and chunks[-1].finish_reason == "length"
        assert engine.state.value == "running"
    finally:
        await engine.stop()


def test_the_kv_bytes_per_token_are_the_models_own_unless_given(model_dir: str, tmp_path: Path) -> None:
    """As Dynamo's mocker: layers x 2 x KV heads x head dim x 2 bytes, from the GGUF's metadata or config.json."""
    assert MockerConfig.from_args(EngineArgs(model="smollm2")).kv_bytes_per_token == 30 * 2 * 3 * 64 * 2
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (hf / "config.json").write_text(json.dumps(config))
    assert MockerConfig.from_args(EngineArgs(model=str(hf))).kv_bytes_per_token == 24 * 2 * 8 * 128 * 2
    assert MockerConfig.from_args(EngineArgs(model=model_dir)).kv_bytes_per_token == 131072  # says nothing: the default
    given = EngineArgs(model="smollm2", extra={"kv_bytes_per_token": 1000})
    assert MockerConfig.from_args(given).kv_bytes_per_token == 1000
    with pytest.raises(ConfigError, match="kv_bytes_per_token"):
        MockerConfig.from_args(EngineArgs(model="smollm2", extra={"kv_bytes_per_token": 0}))
