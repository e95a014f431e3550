"""`dyn serve --router remote --routers 2`: two `dyn router` replicas between frontend and mocker workers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

from dynamo_cli.errors import RemoteError
from dynamo_cli.runtime.request_client import RequestClient, ResponseStream
from dynamo_cli.wire import GenerateChunk, GenerateRequest, SamplingParams
from tests.conftest import DynProcess, wait_until

FLAGS = ("--engine", "mocker", "--workers", "2", "--router", "remote", "--routers", "2", "--lease-ttl", "2")
BLOCK = 64
"""The mocker's default KV block size."""
PREFIX = [1000 + i for i in range(8 * BLOCK)]
"""A long shared prompt prefix: 8 full blocks."""
LOST = [3000 + i for i in range(8 * BLOCK)]
"""Another 8-block prefix, cached only on the worker the last-but-one test kills (the earlier tests cache
PREFIX on both workers)."""
CALL_TIMEOUT_S = 15.0
SECRET = bytes(range(32))
"""The deployment's cluster secret, given so that these tests can call the routers' request plane."""
ENV = {"DYN_CLUSTER_SECRET": SECRET.hex()}


def instances(d: DynProcess) -> list[dict[str, Any]]:
    dyn = [sys.executable, "-m", "dynamo_cli.cli.main"]
    out = subprocess.run(
        [*dyn, "ls", "--json", "--discovery", d.discovery], capture_output=True, text=True, timeout=30, check=True
    )
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def of(d: DynProcess, component: str) -> list[dict[str, Any]]:
    return [row for row in instances(d) if row["instance"].split("/")[1] == component]


def instance_id(row: dict[str, Any]) -> int:
    return int(row["instance"].rsplit("/", 1)[1], 16)


def ready(d: DynProcess) -> DynProcess:
    """Wait for both workers too: `dyn serve` is ready once its routers are, and they need one backend."""
    is_ready = wait_until(lambda: len(of(d, "backend")) == 2 and len(of(d, "router")) == 2, timeout=60, interval=0.5)
    assert is_ready, f"registered: {[row['instance'] for row in instances(d)]}\n" + "\n".join(d.lines[-30:])
    return d


@pytest.fixture(scope="module")
def deployment(dyn_serve_module, planes_module) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    """One deployment per planes, shared by the module's tests: each leaves it as it found it, except the
    last two, which damage it (a worker killed, then a router stopped) and run last in file order within
    each planes parameter. One deployment per planes, not three: about 20 s of CI saved."""
    discovery, events = planes_module
    d = ready(dyn_serve_module(*FLAGS, discovery=discovery, events=events, env=ENV))
    yield d
    d.stop()  # before its planes stop


def request(request_id: str, token_ids: list[int], max_tokens: int, pin: int | None = None) -> bytes:
    annotations = {"worker_instance_id": f"{pin:x}"} if pin is not None else {}
    body = GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(ignore_eos=True),
        annotations=annotations,
    )
    return msgspec.msgpack.encode(body)


async def generate(
    address: str, request_id: str, token_ids: list[int], max_tokens: int = 2, pin: int | None = None
) -> list[GenerateChunk]:
    """Every chunk of one request routed by the router at `address` (to worker `pin` if given)."""
    client = RequestClient(address, secret=SECRET)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream = await client.open_stream("generate", request(request_id, token_ids, max_tokens, pin))
            return [msgspec.msgpack.decode(raw, type=GenerateChunk) async for raw in stream]
    finally:
        await client.close()


async def best_worker(address: str, token_ids: list[int]) -> dict[str, Any]:
    """The router's `best_worker_id` answer (msgpack)."""
    client = RequestClient(address, secret=SECRET)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            stream = await client.open_stream("best_worker_id", msgspec.msgpack.encode({"token_ids": token_ids}))
            replies = [msgspec.msgpack.decode(raw) async for raw in stream]
    finally:
        await client.close()
    assert len(replies) == 1
    reply: dict[str, Any] = replies[0]
    return reply


async def eventually(check, timeout: float = 5.0) -> Any:  # type: ignore[no-untyped-def]
    """Await `check()` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.1)


def overlaps(reply: dict[str, Any]) -> dict[int, int]:
    return {c["worker_id"]: c["overlap_blocks"] for c in reply["explanation"]["candidates"]}


def test_serve_with_two_router_replicas_answers_the_openai_client(deployment: DynProcess) -> None:
    c = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.api_key, max_retries=0, timeout=30)
    routers = {f"{instance_id(row):x}" for row in of(deployment, "router")}
    backends = {f"{instance_id(row):x}" for row in of(deployment, "backend")}
    seen = set()
    for _ in range(4):
        raw = c.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        reply = raw.parse()
        assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens == 5
        seen.add(raw.headers["x-dyn-router-instance-id"])
        assert raw.headers["x-worker-instance-id"] in backends  # the backend that served, as the router reported
    assert seen == routers  # the frontend spreads over the replicas; they pick the workers


def test_rerank_and_score_reach_a_backend_through_the_routers(deployment: DynProcess) -> None:
    docs = ["Trains run on rails.", "The sky over the sea is blue."]
    body = {"model": "smollm2", "query": "What colour is the sky over the sea?", "documents": docs}
    for _ in range(4):  # over both replicas
        reply = httpx.post(f"{deployment.url}/v1/rerank", json=body, headers=deployment.auth, timeout=30)
        assert reply.status_code == 200, reply.text
        assert [r["index"] for r in reply.json()["results"]] == [1, 0]
    pairs = {"model": "smollm2", "text_1": body["query"], "text_2": docs}
    scored = httpx.post(f"{deployment.url}/v1/score", json=pairs, headers=deployment.auth, timeout=30).json()
    assert scored["data"][1]["score"] > scored["data"][0]["score"]


async def cached_blocks(address: str) -> int:
    """Blocks the router at `address` believes its workers cache, all workers together."""
    reply = await best_worker(address, [1])
    return sum(c["cached_blocks"] for c in reply["explanation"]["candidates"])


def test_a_repeated_long_prompt_hits_the_cache_through_either_replica(deployment: DynProcess) -> None:
    c = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.api_key, max_retries=0, timeout=30)
    routers = [row["address"] for row in of(deployment, "router")]
    for topic in ("rivers", "mountains", "deserts"):
        messages = [{"role": "user", "content": f"{topic}: " + "tell me everything you know " * 60}]
        before = [asyncio.run(cached_blocks(r)) for r in routers]
        first = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
        # the prompt's blocks are stored in one engine step: one KV event batch, seen by both replicas
        seen = dict(zip(routers, before, strict=True))
        assert wait_until(lambda: all(asyncio.run(cached_blocks(r)) > n for r, n in seen.items()), 5)  # noqa: B023
        second = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
        assert first.usage is not None and second.usage is not None
        prompt = second.usage.prompt_tokens
        assert second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // BLOCK * BLOCK, topic


async def test_a_shared_prefix_goes_to_the_worker_that_caches_it(deployment: DynProcess) -> None:
    replica_a, replica_b = (row["address"] for row in of(deployment, "router"))
    first = await generate(replica_a, "prefix-first", PREFIX + [7] * 40)
    assert first[0].num_cached_tokens is not None
    probe = PREFIX + [8] * 40

    async def holder_known() -> dict[str, Any] | None:
        # and that "prefix-first" ended: while a prompt is in flight a copy of it is free (time_cost.py point 4), and
        # its load, synced from replica A, may still count on the holder there: settled once B chooses the holder
        reply = await best_worker(replica_b, probe)
        chosen = reply["overlap_blocks"] == 8
        settled = chosen and max(overlaps(reply).values()) == 8 and reply["explanation"]["reason"] == "argmin"
        return reply if settled else None

    reply = await eventually(holder_known)
    assert reply, "replica B never learned which worker caches the prefix, or that nothing is in flight"
    assert sorted(overlaps(reply).values()) == [0, 8]
    assert reply["overlap_blocks"] == 8 and reply["explanation"]["reason"] == "argmin"
    chunks = await generate(replica_b, "prefix-second", probe)
    assert chunks[0].num_cached_tokens == 8 * BLOCK
    assert sum(len(ch.token_ids) for ch in chunks) == 2
    other = next(w for w, blocks in overlaps(reply).items() if blocks == 0)
    pinned = await generate(replica_a, "prefix-pinned", PREFIX + [6] * 40, pin=other)
    assert pinned[0].num_cached_tokens == 0  # the annotation wins over the cache


async def test_two_replicas_agree_on_the_in_flight_load(deployment: DynProcess) -> None:
    replica_a, replica_b = (row["address"] for row in of(deployment, "router"))
    client = RequestClient(replica_a, secret=SECRET)
    streams: list[ResponseStream] = []
    try:
        for n in range(3):
            prompt = [20_000 + 1000 * n + i for i in range(4 * BLOCK)]  # inside SmolLM2's 49152 ids
            streams.append(await client.open_stream("generate", request(f"long-{n}", prompt, 4000)))
        for stream in streams:  # every request has its first token: no prefill load left
            async with asyncio.timeout(CALL_TIMEOUT_S):
                assert await stream.next_batch()

        async def views_agree() -> list[Any] | None:
            view_a, view_b = [await best_worker(r, PREFIX) for r in (replica_a, replica_b)]
            in_flight = view_a["in_flight"]
            busy = sum(w["num_requests"] for w in in_flight) == 3 and all(
                w["active_prefill_tokens"] == 0 for w in in_flight
            )
            return in_flight if busy and view_b["in_flight"] == in_flight else None

        agreed = await eventually(views_agree)
        assert agreed, "replica B does not see replica A's three requests"
        assert sum(w["active_blocks"] for w in agreed) == 3 * 4  # 4 prompt blocks each, nothing shared
        for stream in streams:
            stream.cancel()

        async def both_idle() -> bool:
            views = [await best_worker(r, PREFIX) for r in (replica_a, replica_b)]
            return all(w["num_requests"] == 0 and w["active_blocks"] == 0 for v in views for w in v["in_flight"])

        assert await eventually(both_idle), "cancelled requests still count as load"
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [pytest.param(False, id="unary"), pytest.param(True, id="streaming")])
def test_a_pin_through_the_routers_reaches_that_backend_and_the_response_names_it(
    deployment: DynProcess, stream: bool
) -> None:
    routers = {f"{instance_id(row):x}" for row in of(deployment, "router")}
    body = {"model": "smollm2", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    with httpx.Client(base_url=deployment.url, headers=deployment.auth, timeout=30) as http:
        for row in of(deployment, "backend"):
            pin = f"{instance_id(row):x}"
            for _ in range(2):  # once through each replica (the frontend alternates)
                r = http.post("/v1/chat/completions", json=body, headers={"x-worker-instance-id": pin})
                assert (r.status_code, r.headers["x-worker-instance-id"]) == (200, pin)
                assert r.headers["x-dyn-router-instance-id"] in routers


@pytest.mark.parametrize("stream", [pytest.param(False, id="unary"), pytest.param(True, id="streaming")])
def test_a_pin_naming_no_backend_gets_a_400_through_the_routers(deployment: DynProcess, stream: bool) -> None:
    backends = [f"{instance_id(row):x}" for row in of(deployment, "backend")]
    body = {"model": "smollm2", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    with httpx.Client(base_url=deployment.url, headers=deployment.auth, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=body, headers={"x-worker-instance-id": "abc"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_instance")
    assert "'abc'" in error["message"] and all(b in error["message"] for b in backends)


async def test_a_router_asked_directly_refuses_a_pin_naming_no_backend(deployment: DynProcess) -> None:
    router = of(deployment, "router")[0]["address"]
    with pytest.raises(RemoteError) as raised:
        await generate(router, "pin-nowhere", [1, 2, 3], pin=0xABC)
    assert (raised.value.status, raised.value.code) == (400, "unknown_instance")
    assert all(f"{instance_id(row):x}" in str(raised.value) for row in of(deployment, "backend"))


def test_routers_without_the_remote_router_mode_is_refused_with_the_fix() -> None:
    dyn = [sys.executable, "-m", "dynamo_cli.cli.main"]
    out = subprocess.run(
        [*dyn, "serve", "--engine", "mocker", "--router", "kv", "--routers", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--routers 2 needs --router remote" in out.stderr


# The last two tests damage the shared deployment: keep every new test above them.


async def test_a_killed_workers_blocks_vanish_from_both_routers(deployment: DynProcess) -> None:
    d = deployment
    routers = [row["address"] for row in of(d, "router")]
    await generate(routers[0], "to-be-lost", LOST + [9] * 10)

    async def holder() -> int | None:
        reply = await best_worker(routers[1], LOST)
        return reply["worker_id"] if reply["overlap_blocks"] == 8 else None

    victim = await eventually(holder)
    assert victim is not None
    os.kill(next(row["pid"] for row in of(d, "backend") if instance_id(row) == victim), signal.SIGKILL)

    async def forgotten() -> bool:
        views = [await best_worker(r, LOST) for r in routers]
        return all(
            victim not in v["indexed_workers"] and victim not in overlaps(v) and v["overlap_blocks"] == 0 for v in views
        )

    assert await eventually(forgotten, timeout=2 + 4)
    chunks = await generate(routers[0], "after-the-loss", LOST + [9] * 10)
    assert chunks[0].num_cached_tokens == 0 and chunks[-1].finish_reason == "length"


def test_a_router_stopped_with_sigterm_leaves_discovery_and_the_other_replica_serves(
    deployment: DynProcess,
) -> None:
    d = deployment
    leaving, staying = of(d, "router")
    os.kill(leaving["pid"], signal.SIGTERM)
    assert wait_until(lambda: [row["instance"] for row in of(d, "router")] == [staying["instance"]], timeout=5)
    c = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=30)
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert raw.parse().usage.completion_tokens == 3  # type: ignore[union-attr]
        served = int(raw.headers["x-dyn-router-instance-id"], 16)
        # the other replica, or the stopped one's successor (dyn serve restarts a router that exits, in ~1 s)
        assert served != instance_id(leaving) and served in {instance_id(row) for row in of(d, "router")}
