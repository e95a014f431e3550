"""The mocker's SGLang-style rendezvous (`kv_transfer_mode=rendezvous`): a prefill that returns no token,
a decode that emits every token, the first included, and computes none of the prompt."""

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dyn_engines.mocker.engine import MockerEngine
from dyn_engines.mocker.handoff import prefill_s

from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.errors import ConfigError, RequestError
from dynamo_cli.kv.handles import UNKNOWN_FIRST_TOKEN, MockerKv, SglangKv
from dynamo_cli.model_card import ModelCard
from dynamo_cli.timing import TimingModel
from dynamo_cli.wire import GenerateChunk, GenerateRequest

RENDEZVOUS = {"speedup_ratio": 1e6, "kv_transfer_mode": "rendezvous"}


@pytest.fixture
async def prefill(model_dir: str) -> AsyncIterator[MockerEngine]:
    engine = MockerEngine(EngineArgs(model=model_dir, role=Role.PREFILL, extra=dict(RENDEZVOUS), host="10.0.0.7"))
    await engine.start()
    yield engine
    await engine.stop()


def handle(num_tokens: int, first_token: int = UNKNOWN_FIRST_TOKEN) -> SglangKv:
    return SglangKv(
        num_tokens=num_tokens,
        first_token=first_token,
        bootstrap_host="10.0.0.7",
        bootstrap_port=8998,
        bootstrap_room=12345,
    )


def request(request_id: str, num_prompt: int, max_tokens: int, **kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, token_ids=list(range(num_prompt)), max_tokens=max_tokens, **kw)


async def collect(engine: MockerEngine, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(req)]


def tokens_of(chunks: list[GenerateChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


async def test_a_rendezvous_prefill_publishes_its_bootstrap_address_on_its_card(prefill: MockerEngine) -> None:
    info = await prefill.start()
    assert info.extra["bootstrap"] == "10.0.0.7:8998"
    assert ModelCard.from_engine(info, "mocker", Role.PREFILL).bootstrap == "10.0.0.7:8998"


@pytest.mark.parametrize(
    ("role", "mode"),
    [
        pytest.param(Role.PREFILL, "pull", id="pull-prefill"),
        pytest.param(Role.DECODE, "rendezvous", id="rendezvous-decode"),
        pytest.param(Role.BOTH, "rendezvous", id="rendezvous-both"),
    ],
)
async def test_only_a_rendezvous_prefill_publishes_a_bootstrap_address(model_dir: str, role: Role, mode: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, role=role, extra={"kv_transfer_mode": mode}))
    info = await engine.start()
    await engine.stop()
    assert "bootstrap" not in info.extra


@pytest.mark.parametrize(
    ("req", "words"),
    [
        pytest.param(request("a", 300, 1), "needs kv_transfer.*got none", id="no-handle"),
        pytest.param(
            request("a", 300, 1, kv_transfer=MockerKv(num_tokens=299, first_token=1, nbytes=0)),
            "got MockerKv",
            id="pulled-kind",
        ),
        pytest.param(request("a", 300, 1, kv_transfer=handle(300, first_token=7)), "first_token -1", id="first-token"),
        pytest.param(request("a", 300, 1, kv_transfer=handle(200)), "covers 200 tokens", id="num-tokens"),
    ],
)
async def test_a_rendezvous_prefill_without_its_handle_is_refused_naming_kv_transfer(
    prefill: MockerEngine, req: GenerateRequest, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as caught:
        await collect(prefill, req)
    assert caught.value.param == "kv_transfer"
    assert prefill.load_metrics().num_prefill_tokens_computed == 0


async def test_a_rendezvous_prefill_computes_the_prompt_and_ends_with_no_token_and_the_same_handle(
    prefill: MockerEngine,
) -> None:
    chunks = await collect(prefill, request("a", 300, 50, kv_transfer=handle(300)))
    assert tokens_of(chunks) == []
    assert [(c.finish_reason, c.kv_transfer) for c in chunks] == [("length", handle(300))]
    metrics = prefill.load_metrics()
    assert metrics.num_prefill_tokens_computed == 300
    assert (metrics.num_running, metrics.active_blocks) == (0, 0)


async def test_a_rendezvous_decode_emits_every_token_waits_the_meeting_and_computes_no_prompt(model_dir: str) -> None:
    # 1 GB/s and 1 MB a token: 0.2 s of transfer for 200 tokens, plus their modelled prefill at speedup 10
    extra = {"speedup_ratio": 10.0, "kv_transfer_bandwidth": 1.0, "kv_bytes_per_token": 1_000_000}
    engine = MockerEngine(EngineArgs(model=model_dir, role=Role.DECODE, extra=extra))
    await engine.start()
    try:
        start = time.perf_counter()
        chunks = await collect(engine, request("a", 200, 5, kv_transfer=handle(200)))
        elapsed = time.perf_counter() - start
        metrics = engine.load_metrics()
    finally:
        await engine.stop()
    tokens = tokens_of(chunks)
    assert len(tokens) == 5 and all(1000 <= t < 2000 for t in tokens)  # the first token is the decode's
    assert chunks[-1].finish_reason == "length" and all(c.kv_transfer is None for c in chunks)
    assert metrics.num_prefill_tokens_computed == 0 and metrics.active_blocks == 0
    meeting = 0.2 + prefill_s(engine.config, TimingModel(10.0), 200)
    assert meeting <= elapsed < meeting + 0.5


async def test_a_pull_mode_decode_worker_takes_a_rendezvous_handle_too(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"speedup_ratio": 1e6, "kv_transfer_bandwidth": 0}))
    await engine.start()
    try:
        chunks = await collect(engine, request("a", 100, 4, kv_transfer=handle(100)))
        assert len(tokens_of(chunks)) == 4
        assert engine.load_metrics().num_prefill_tokens_computed == 0
        with pytest.raises(RequestError, match="covers 99 tokens") as caught:  # prompt + [first_token] is pull's
            await collect(engine, request("b", 100, 4, kv_transfer=handle(99)))
        assert caught.value.param == "kv_transfer"
    finally:
        await engine.stop()


def test_prefill_time_is_the_timing_model_in_passes_of_the_token_budget(model_dir: str) -> None:
    engine = MockerEngine(EngineArgs(model=model_dir, extra={"max_num_batched_tokens": 1000}))
    timing = TimingModel(2.0)
    expected = (2 * timing.pass_ms(1000, 0, 0.0) + timing.pass_ms(500, 0, 0.0)) / 1000
    assert prefill_s(engine.config, timing, 2500) == pytest.approx(expected)


def test_an_unknown_kv_transfer_mode_is_refused_naming_the_choices(model_dir: str) -> None:
    with pytest.raises(ConfigError, match="kv_transfer_mode must be one of pull, rendezvous, got 'push'"):
        MockerEngine(EngineArgs(model=model_dir, extra={"kv_transfer_mode": "push"}))
