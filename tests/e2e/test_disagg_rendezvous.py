"""SGLang's rendezvous path of disaggregation end to end, on the mocker (`kv_transfer_mode=rendezvous`).

The prefill worker publishes a bootstrap address, so the frontend (or a `dyn router`) makes the SglangKv
up front and sends the bare prompt to the prefill and the decode worker at once: the prefill stream
carries no token and is drained beside the decode, whose stream carries every token. Nothing stays
running or held on either worker, whether the client reads to the end or leaves mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import openai
import pytest

from dynamo_cli.wire import LoadMetrics
from tests.conftest import DynProcess, wait_until
from tests.e2e.test_disagg import _loads, chat

RENDEZVOUS = (
    "--engine",
    "mocker",
    "--speedup-ratio",
    "5",
    "--lease-ttl",
    "2",
    "--max-restarts",
    "0",
    "--disagg",
    "--disagg-policy",
    "always",
    "--engine-arg",
    "kv_transfer_mode=rendezvous",
)
LONG = " ".join(["word"] * 1500)
COMPONENTS = ("backend", "prefill")


@pytest.fixture(scope="module")
def rendezvous(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    """1 prefill + 1 decode mocker meeting by rendezvous, KV-aware on both hops."""
    return with_prefill_pool(dyn_serve_module(*RENDEZVOUS, "--router", "kv"))


def with_prefill_pool(d: DynProcess) -> DynProcess:
    """`d` once its prefill worker is registered (it may come after `dyn serve ready`) and discovered."""
    assert wait_until(lambda: d.worker_pids("prefill"), timeout=60), d.lines[-20:]
    time.sleep(0.5)  # the frontend's or router's discovery watch takes it in
    return d


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=60)


def ask(c: openai.OpenAI, max_tokens: int, *, stream: bool) -> tuple[int, str | None]:
    """completion_tokens and the last finish_reason of one chat request on the long prompt."""
    kwargs: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True},
    }
    if not stream:
        answer = c.chat.completions.create(**kwargs)
        assert answer.usage is not None
        return answer.usage.completion_tokens, answer.choices[0].finish_reason
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None
    return usage.completion_tokens, [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]


def settled_loads(d: DynProcess, *, wait_s: float = 1.2, tries: int = 15) -> dict[str, LoadMetrics]:
    """The workers' published loads by role, once no request runs on either (or the last seen)."""
    roles = {r.instance_id: r.role for r in d.instance_records() if r.component in COMPONENTS}
    loads: dict[str, LoadMetrics] = {}
    for _ in range(tries):
        latest = asyncio.run(_loads(d, COMPONENTS, wait_s))
        loads = {roles[w]: m for w, m in latest.items() if w in roles}
        if len(loads) == 2 and all(m.num_running == m.num_waiting == m.active_blocks == 0 for m in loads.values()):
            break
    return loads


def test_a_rendezvous_prefill_is_remote_explained_and_its_stream_drained(rendezvous: DynProcess) -> None:
    raw = client(rendezvous).chat.completions.with_raw_response.create(
        model="smollm2",
        messages=[{"role": "user", "content": LONG}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
        extra_headers={"x-dyn-explain-route": "1"},
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    assert answer.choices[0].finish_reason == "length"
    route = json.loads(raw.headers["x-dyn-prefill-route"])
    assert (route["prefill"], route["outcome"]) == ("remote", "remote")
    [prefill_worker] = {r.instance_id for r in rendezvous.instance_records() if r.role == "prefill"}
    assert route["prefill_worker_id"] == raw.headers["x-dyn-prefill-instance-id"] == f"{prefill_worker:x}"
    assert raw.headers["x-worker-instance-id"] != raw.headers["x-dyn-prefill-instance-id"]
    loads = settled_loads(rendezvous)
    assert loads["prefill"].num_running == 0 and loads["prefill"].num_prefill_tokens_computed > 1000
    assert loads["decode"].num_prefill_tokens_computed == 0  # the decode worker met the prefill, computed none


def test_streaming_and_not_every_token_comes_from_the_decode_stream(rendezvous: DynProcess) -> None:
    c = client(rendezvous)
    assert ask(c, 12, stream=True) == (12, "length")
    assert ask(c, 1, stream=False) == (1, "length")  # the decode worker emits the first token too
    assert ask(c, 5, stream=False) == (5, "length")
    loads = settled_loads(rendezvous)
    assert loads["decode"].num_prefill_tokens_computed == 0


def test_a_finished_rendezvous_leaves_no_load_on_the_prefill_routers_books(rendezvous: DynProcess) -> None:
    """The prefill policy counted the rendezvous when it chose the prefill worker; it must hear the end."""
    headers = {"x-dyn-explain-route": "1"}
    with httpx.Client(base_url=rendezvous.url, headers=rendezvous.auth, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/chat/completions", json=chat(LONG), headers=headers)
            assert r.status_code == 200, r.text
        candidates = json.loads(r.headers["x-dyn-prefill-route"])["prefill_route"]["candidates"]
    assert [c["active_blocks"] for c in candidates] == [0]  # the first request's blocks were freed


async def test_clients_that_leave_mid_stream_leave_nothing_running_on_either_worker(rendezvous: DynProcess) -> None:
    c = openai.AsyncOpenAI(base_url=f"{rendezvous.url}/v1", api_key=rendezvous.api_key, max_retries=0, timeout=60)

    async def hang_up_after(seconds: float) -> None:  # during the prefill, the meeting or the decode
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                stream = await c.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": LONG}],
                    max_tokens=300,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                async for _ in stream:
                    pass

    await asyncio.gather(*(hang_up_after(0.003 + 0.02 * i) for i in range(12)))
    await c.close()
    loads = await asyncio.to_thread(settled_loads, rendezvous)
    assert sorted(loads) == ["decode", "prefill"]
    for metrics in loads.values():
        assert (metrics.num_running, metrics.num_waiting, metrics.active_blocks) == (0, 0, 0)


def test_dyn_router_replicas_run_the_rendezvous_too(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = with_prefill_pool(dyn_serve(*RENDEZVOUS, "--router", "remote", "--routers", "1"))
    c = client(d)
    assert ask(c, 6, stream=False) == (6, "length")
    assert ask(c, 9, stream=True) == (9, "length")
    loads = settled_loads(d)
    assert loads["prefill"].num_running == 0 and loads["prefill"].num_prefill_tokens_computed > 1000
    assert loads["decode"].num_prefill_tokens_computed == 0 and loads["decode"].active_blocks == 0
