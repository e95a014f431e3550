"""KV-aware routing end to end on mocker workers, on both plane sets; late routers catch up."""

from __future__ import annotations

import json
import secrets
import time

import httpx

from tests.conftest import DynProcess, start_dyn

SYSTEM = "You are a meticulous assistant. " * 60  # ~400 tokens: several full 64-token blocks
FLAGS = ("--engine", "mocker", "--workers", "2", "--router", "kv", "--speedup-ratio", "20", "--lease-ttl", "2")


def ask(http: httpx.Client, question: str) -> tuple[str, dict]:  # type: ignore[type-arg]
    body = {
        "model": "smollm2",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    r = http.post("/v1/chat/completions", json=body, headers={"x-dyn-explain-route": "1"})
    assert r.status_code == 200, r.text
    return r.headers["x-worker-instance-id"], json.loads(r.headers["x-dyn-route"])


def test_requests_sharing_a_long_prefix_land_on_the_worker_that_holds_it(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(*FLAGS, discovery=planes[0], events=planes[1])
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=30) as http:
        first, _ = ask(http, "question zero")
        time.sleep(1.0)  # the first request's KV events, or the anti-entropy repair if ZMQ lost them
        for i in range(1, 6):
            worker, route = ask(http, f"question {i}")
            assert worker == first
            chosen = next(c for c in route["candidates"] if c["worker_id"] == worker)
            assert chosen["overlap_blocks"] >= 5
            assert chosen["hits"] == {"device": chosen["overlap_blocks"], "host": 0, "disk": 0}  # no tiers here
            assert route["reason"] in ("argmin", "only")


def test_a_router_that_starts_late_knows_what_the_workers_cached(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    shared = {"DYN_CLUSTER_SECRET": secrets.token_hex(32)}  # the late frontend joins this deployment
    d: DynProcess = dyn_serve(*FLAGS, discovery=planes[0], events=planes[1], env=shared)
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=30) as http:
        holder, _ = ask(http, "warm the cache")
    late = start_dyn(
        ["serve", "--workers", "0", "--router", "kv", "--port", "0", "--discovery", d.discovery, "--events", d.events],
        timeout=60,
        env=shared,
    )
    try:
        with httpx.Client(base_url=late.url, headers=late.auth, timeout=30) as http:
            for _ in range(50):  # the late frontend discovers the workers within a poll or two
                if http.get("/health").status_code == 200 and len(http.get("/health").json()["instances"]) == 2:
                    break
            time.sleep(1.0)  # catch-up replay / dump
            worker, route = ask(http, "another question")
        assert worker == holder
        assert next(c for c in route["candidates"] if c["worker_id"] == holder)["overlap_blocks"] >= 5
    finally:
        late.stop()
