"""vLLM disaggregated for real: a prefill engine and a decode engine, the prompt's KV read over NIXL.

Runs wherever vLLM and the `nixl` package import (here: vLLM's CPU build, host KV buffers, UCX over TCP
on loopback; on a GPU machine the same test moves GPU KV). The built-in SmolLM2 is exported to an HF
directory as the other vLLM tests do. Greedy decoding: the client's view (the prefill's first token, then
the decode's stream) must equal what the decode engine produces alone for the same prompt.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import pytest
from dyn_engines.vllm.engine import VllmEngine

from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.kv.handles import VllmKv
from dynamo_cli.wire import GenerateChunk, GenerateRequest, SamplingParams
from tests.conftest import VLLM_TEST_EXTRA

_MISSING = [module for module in ("vllm", "nixl") if importlib.util.find_spec(module) is None]
pytestmark = [
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {_MISSING}: pip install 'dynamo-cli[vllm]' 'nixl>=1.5.1,<1.6'"),
    pytest.mark.timeout(600),
]

PROMPT = list(range(1000, 1070))
"""70 tokens: two full 32-token blocks and a partial one."""
MAX_TOKENS = 8


def engine(role: Role) -> VllmEngine:
    return VllmEngine(EngineArgs(model="smollm2", role=role, block_size=32, context_length=1024, extra=VLLM_TEST_EXTRA))


async def tokens(stream: AsyncIterator[GenerateChunk]) -> tuple[list[int], list[GenerateChunk]]:
    chunks = [chunk async for chunk in stream]
    return [token for chunk in chunks for token in chunk.token_ids], chunks


async def test_a_vllm_prefill_engine_hands_its_kv_to_a_vllm_decode_engine_over_nixl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    for variable in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.setenv(variable, "unset")  # restored after the test: each engine sets its own
    prefill, decode = engine(Role.PREFILL), engine(Role.DECODE)
    try:
        await prefill.start()
        await decode.start()
        alone, _ = await tokens(decode.generate(request("alone", PROMPT, temperature=0.0)))
        await decode._engine.reset_prefix_cache()  # the decode must read the whole prompt from the prefill
        first, prefill_chunks = await tokens(prefill.generate(request("p", PROMPT, temperature=0.0)))
        handle = prefill_chunks[-1].kv_transfer
        assert isinstance(handle, VllmKv) and handle.num_tokens == len(PROMPT) and first == [handle.first_token]
        assert prefill_chunks[-1].finish_reason == "length"
        computed = decode.load_metrics().num_prefill_tokens_computed
        rest, _ = await tokens(
            decode.generate(request("d", [*PROMPT, *first], temperature=0.0, max_tokens=MAX_TOKENS - 1, kv=handle))
        )
        assert first + rest == alone
        assert decode.num_first_token_mismatches == 0
        assert decode.load_metrics().num_prefill_tokens_computed == computed
    finally:
        await decode.stop()
        await prefill.stop()


def request(
    request_id: str, token_ids: list[int], *, temperature: float, max_tokens: int = MAX_TOKENS, kv: VllmKv | None = None
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature),
        kv_transfer=kv,
    )
