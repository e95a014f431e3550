"""Nothing lost: migration when a worker dies mid-stream, drain on SIGTERM, 503 on overload."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import DynProcess

SLOW = ("--engine", "mocker", "--speedup-ratio", "1", "--lease-ttl", "2")
CHAT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "tell me a story"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


def pid_of(d: DynProcess, instance_hex: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", "ls", "--json", "--discovery", d.discovery],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    rows = json.loads(out.stdout)
    return next(r["pid"] for r in rows if r["instance"].endswith("/" + instance_hex))


def read_stream(response: httpx.Response, on_content=None) -> dict:  # type: ignore[no-untyped-def]
    """Consume an SSE stream; return counts, usage and errors."""
    result = {"content": 0, "usage": None, "errors": [], "finish": None}
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            result["errors"].append(event["error"])
        if event.get("usage"):
            result["usage"] = event["usage"]
        for choice in event.get("choices", []):
            if choice["delta"].get("content"):
                result["content"] += 1
                if on_content:
                    on_content(result["content"])
            result["finish"] = choice.get("finish_reason") or result["finish"]
    return result


def test_a_worker_killed_mid_stream_is_survived_by_migration(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(*SLOW, "--workers", "2", discovery=planes[0], events=planes[1])
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 400}) as r:
            victim = pid_of(d, r.headers["x-worker-instance-id"])

            def kill_at(n: int) -> None:
                if n == 20:
                    os.kill(victim, signal.SIGKILL)

            result = read_stream(r, kill_at)
        metrics = http.get("/metrics").text
    assert result["errors"] == []
    assert result["usage"]["completion_tokens"] == 400
    assert result["finish"] == "length"
    assert 'dynamo_frontend_model_migration_total{migration_type="ongoing_request",model="smollm2"} 1.0' in metrics


def test_migration_limit_zero_turns_the_death_into_an_error_event(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(*SLOW, "--workers", "2", "--migration-limit", "0", discovery=planes[0], events=planes[1])
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 400}) as r:
            victim = pid_of(d, r.headers["x-worker-instance-id"])
            result = read_stream(r, lambda n: n == 10 and os.kill(victim, signal.SIGKILL))
    assert result["errors"] and result["usage"] is None


def test_sigterm_deregisters_first_then_finishes_in_flight_streams(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(*SLOW, "--workers", "2", discovery=planes[0], events=planes[1])
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 300}) as r:
            draining = r.headers["x-worker-instance-id"]
            os.kill(pid_of(d, draining), signal.SIGTERM)
            time.sleep(0.5)  # the worker deregisters at once; the frontend sees it at its next poll
            others = set()
            for _ in range(4):
                reply = http.post("/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2})
                assert reply.status_code == 200
                others.add(reply.headers["x-worker-instance-id"])
            result = read_stream(r)
        metrics = http.get("/metrics").text
    assert draining not in others
    assert result["errors"] == [] and result["usage"]["completion_tokens"] == 300
    assert "dynamo_frontend_model_migration_total{" not in metrics


def test_every_worker_busy_gets_a_503_with_a_reason_within_100_ms(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(
        *SLOW,
        "--workers",
        "1",
        "--max-inflight-per-worker",
        "1",
        "--router-queue-size",
        "0",
        discovery=planes[0],
        events=planes[1],
    )
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 200}) as r:
            assert r.status_code == 200
            start = time.perf_counter()
            reply = http.post("/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2})
            elapsed = time.perf_counter() - start
            read_stream(r)
        assert reply.status_code == 503 and "busy" in reply.json()["error"]["message"]
        assert elapsed < 0.1
        assert http.post("/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}).status_code == 200


def test_every_worker_busy_queues_then_serves_in_priority_order_and_a_full_queue_gets_a_503(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(
        *SLOW,
        "--workers",
        "1",
        "--max-inflight-per-worker",
        "1",
        "--router-queue-size",
        "2",
        "--router-queue-timeout",
        "30",
    )
    unary = {**CHAT, "stream": False, "max_tokens": 2}
    finished: list[str] = []

    def ask(name: str, priority: int) -> httpx.Response:
        reply = httpx.post(
            f"{d.url}/v1/chat/completions", json=unary, timeout=60, headers={**d.auth, "x-dyn-priority": str(priority)}
        )
        finished.append(name)
        return reply

    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 400}) as r:
            assert r.status_code == 200
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                low = pool.submit(ask, "low", 0)
                time.sleep(0.3)  # low queues first
                high = pool.submit(ask, "high", 5)
                time.sleep(0.3)
                full = http.post("/v1/chat/completions", json=unary, timeout=10)
                assert full.status_code == 503 and full.headers["retry-after"] == "1"
                assert "the wait queue is full (2 requests)" in full.json()["error"]["message"]
                assert read_stream(r)["usage"]["completion_tokens"] == 400
                assert low.result().status_code == 200 and high.result().status_code == 200
    assert finished == ["high", "low"]  # one worker slot: the higher priority went first
    bad = httpx.post(f"{d.url}/v1/chat/completions", json=unary, timeout=10, headers={**d.auth, "x-dyn-priority": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-dyn-priority"
