"""Tenants and priority classes end to end, on mocker workers that take one request each
(`--max-inflight-per-worker 1`), keys mapped to tenants by a key file.

- Noisy neighbour: tenant A floods long prompts (8 clients retrying at once, its limit 2 in flight) while tenant
  B sends short interactive requests at a steady pace. A's limit keeps a worker for everyone else, so B's first
  tokens come as fast as when B is alone; A gets 429s naming the limit; every request ends, none is lost.
- Preemption: a bulk request running when an interactive one arrives is paused for it and resumed, and ends with
  the text and token count it has unpaused (a seeded mocker draws the same tokens); its tokens are counted once.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import DynProcess

KEYS = {"a": "sk-tenant-a-0123456789", "b": "sk-tenant-b-0123456789", "bulk": "sk-tenant-bulk-012345678"}
KEY_FILE = f"""
{KEYS["a"]} tenant=a max-inflight=2
{KEYS["b"]} tenant=b class=interactive
{KEYS["bulk"]} tenant=bulk class=bulk
"""
MOCKER = ("--engine", "mocker", "--speedup-ratio", "1", "--max-inflight-per-worker", "1", "--router", "kv")
CALL_TIMEOUT_S = 60.0
WORDS = [f"w{i}" for i in range(500)]


def serve(dyn_serve: Any, tmp_path: Path, workers: int) -> DynProcess:
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    d: DynProcess = dyn_serve(*MOCKER, "--workers", str(workers), "--api-key-file", str(key_file))
    return d


def body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, **extra}


def auth(tenant: str, priority_class: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if priority_class:
        headers["x-dyn-priority-class"] = priority_class
    return headers


async def streamed(
    client: httpx.AsyncClient, d: DynProcess, request: dict[str, Any], headers: dict[str, str]
) -> tuple[int, float, str, int]:
    """(status, TTFT in seconds, text, completion tokens) of one streamed chat completion."""
    started, ttft, text, tokens = time.perf_counter(), 0.0, [], 0
    request = {**request, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{d.url}/v1/chat/completions", json=request, headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code, 0.0, reply.text, 0
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    text.append(choice["delta"]["content"])
    return 200, ttft, "".join(text), tokens


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def tenant_b(client: httpx.AsyncClient, d: DynProcess, calls: int) -> list[float]:
    """B's steady pace: one short interactive request every 0.1 s; their TTFTs."""
    ttfts = []
    for i in range(calls):
        status, ttft, text, tokens = await streamed(client, d, body(f"b says hello {i}", 4), auth("b"))
        assert status == 200 and tokens == 4, (status, text)
        ttfts.append(ttft)
        await asyncio.sleep(0.1)
    return ttfts


async def tenant_a(client: httpx.AsyncClient, d: DynProcess, stop: asyncio.Event, seen: dict[str, int]) -> None:
    """One of A's clients: long prompts of fresh words back to back, again at once after a 429."""
    rng = random.Random()
    while not stop.is_set():
        prompt = " ".join(rng.choices(WORDS, k=1500))
        status, _, text, tokens = await streamed(client, d, body(prompt, 24), auth("a"))
        if status == 429:
            assert "max-inflight" in text and "tenant 'a'" in text, text
            seen["throttled"] += 1
            await asyncio.sleep(0.05)
        else:
            assert status == 200 and tokens == 24, (status, text)
            seen["served"] += 1


async def noisy_neighbour(d: DynProcess) -> tuple[float, float, dict[str, int]]:
    """B's TTFT p99 alone, then with A flooding; what A's requests got."""
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S, limits=limits) as client:
        await tenant_b(client, d, 5)  # warm: connections, the tokenizer
        alone = p99(await tenant_b(client, d, 40))
        stop, seen = asyncio.Event(), {"throttled": 0, "served": 0}
        flood = [asyncio.create_task(tenant_a(client, d, stop, seen)) for _ in range(8)]
        try:
            await asyncio.sleep(1.0)  # A holds its two workers
            crowded = p99(await tenant_b(client, d, 40))
        finally:
            stop.set()
            results = await asyncio.gather(*flood, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    return alone, crowded, seen


def test_a_noisy_neighbour_is_throttled_and_leaves_the_others_first_tokens_alone(
    dyn_serve: Any, tmp_path: Path
) -> None:
    d = serve(dyn_serve, tmp_path, workers=3)
    alone, crowded, seen = asyncio.run(noisy_neighbour(d))
    assert seen["served"] >= 2 and seen["throttled"] >= 10, seen
    assert crowded <= 1.5 * alone, f"B's TTFT p99: {crowded * 1e3:.1f} ms with A, {alone * 1e3:.1f} ms alone"
    metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
    assert re.search(r'dynamo_frontend_tenant_rejections_total\{limit="max_inflight",tenant="a"\} (\d+)', metrics)
    assert 'dynamo_frontend_tenant_requests_total{status="rejected",tenant="b"}' not in metrics


def counted(metrics: str, name: str, **labels: str) -> float:
    """The value of one series in a /metrics page (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def bulk_then_interactive(d: DynProcess, request: dict[str, Any]) -> tuple[tuple[int, float, str, int], float]:
    """The bulk request, with an interactive one sent once its first tokens came; the interactive one's end to
    end latency."""
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as client:
        bulk = asyncio.create_task(streamed(client, d, request, auth("bulk")))
        await asyncio.sleep(0.5)  # the bulk request holds the one worker, decoding
        started = time.perf_counter()
        status, _, text, tokens = await streamed(client, d, body("quick question", 4), auth("b"))
        interactive_s = time.perf_counter() - started
        assert status == 200 and tokens == 4, (status, text)
        assert not bulk.done(), "the bulk request ended before the interactive one: it was not preempted"
        return await bulk, interactive_s


def test_a_bulk_request_paused_for_an_interactive_one_ends_as_it_would_have(dyn_serve: Any, tmp_path: Path) -> None:
    d = serve(dyn_serve, tmp_path, workers=1)
    request = body("write a long essay about tenants", 400, seed=7, ignore_eos=True)
    with httpx.Client(timeout=CALL_TIMEOUT_S) as client:
        alone_s = time.perf_counter()
        alone = asyncio.run(_one(d, request))
        alone_s = time.perf_counter() - alone_s
        before = client.get(f"{d.url}/metrics").text
    assert alone[0] == 200 and alone[3] == 400, alone
    paused, interactive_s = asyncio.run(bulk_then_interactive(d, request))
    assert paused[0] == 200 and paused[2:] == alone[2:], "the resumed request's text or token count differs"
    assert interactive_s < alone_s / 2, f"interactive took {interactive_s:.2f} s; the bulk one {alone_s:.2f} s"
    after = httpx.get(f"{d.url}/metrics", timeout=10).text
    assert counted(after, "dynamo_frontend_preemptions_total", model="smollm2") >= 1
    tokens = {"tenant": "bulk", "kind": "output"}
    charged = counted(after, "dynamo_frontend_tenant_tokens_total", **tokens)
    assert charged - counted(before, "dynamo_frontend_tenant_tokens_total", **tokens) == 400


async def _one(d: DynProcess, request: dict[str, Any]) -> tuple[int, float, str, int]:
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as client:
        return await streamed(client, d, request, auth("bulk"))


pytestmark = pytest.mark.timeout(180)
