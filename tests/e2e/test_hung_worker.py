"""A hung worker (alive, registered, producing nothing) is found, taken out of routing, its streams migrate and
complete, and it is routed to again once it answers: SIGSTOP one of three workers under 32 streams, then SIGCONT.
Embeddings and LoRA commands leave a stopped worker out too."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai

from tests.conftest import DynProcess, wait_until

MAX_TOKENS = 600


def _stream(client: openai.OpenAI) -> tuple[int, str | None]:
    """(completion tokens, finish reason) of one streamed chat request."""
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens, finish = 0, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, finish


def _served_by(d: DynProcess) -> str:
    reply = httpx.post(
        f"{d.url}/v1/completions",
        json={"model": "smollm2", "prompt": "hi", "max_tokens": 2},
        headers=d.auth,
        timeout=10,
    )
    assert reply.status_code == 200, reply.text
    return reply.headers["x-worker-instance-id"]


def _metric(d: DynProcess, name: str, worker: str) -> float:
    text = httpx.get(f"{d.url}/metrics", timeout=5, headers=d.auth).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'worker_id="{worker}"' in line
    )


def test_a_stopped_worker_is_routed_around_its_streams_complete_and_it_comes_back(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--workers", "3", "--speedup-ratio", "1", "--stall-timeout", "2",
        "--lease-ttl", "60", "--migration-limit", "3",
    )  # fmt: skip
    records = [r for r in d.instance_records() if r.component != "router"]
    stopped = records[0]
    stopped_id = f"{stopped.instance_id:x}"
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, timeout=60, max_retries=0)
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            streams = [pool.submit(_stream, client) for _ in range(32)]
            time.sleep(1.0)  # every stream is running
            os.kill(stopped.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            results = [f.result(timeout=60) for f in streams]
        assert results == [(MAX_TOKENS, "length")] * 32  # every stream complete, the stopped worker's migrated
        assert time.monotonic() - stopped_at < 20
        assert _metric(d, "dynamo_frontend_worker_stalls_total", stopped_id) == 1
        text = httpx.get(f"{d.url}/metrics", timeout=5, headers=d.auth).text
        moved = [line for line in text.splitlines() if "migration" in line or "stall" in line]
        assert 'migration_type="ongoing_request"' in text, moved  # its streams moved on mid-stream
        # While it is stopped, no request goes to it (round-robin would send every third there).
        assert stopped_id not in {_served_by(d) for _ in range(6)}
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert wait_until(lambda: _metric(d, "dynamo_frontend_worker_recoveries_total", stopped_id) == 1, timeout=15)
    assert stopped_id in {_served_by(d) for _ in range(6)}  # routed to again


def test_with_canaries_an_idle_stopped_worker_is_found_without_traffic_and_comes_back(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--workers", "2", "--health-check", "--canary-wait", "1",
        "--health-check-timeout", "1", "--lease-ttl", "60",
    )  # fmt: skip
    stopped = next(r for r in d.instance_records() if r.component != "router")
    stopped_id = f"{stopped.instance_id:x}"
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: _metric(d, "dynamo_frontend_worker_stalls_total", stopped_id) == 1, timeout=10)
        assert 'reason="canary"' in httpx.get(f"{d.url}/metrics", timeout=5, headers=d.auth).text
        assert stopped_id not in {_served_by(d) for _ in range(4)}
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert wait_until(lambda: _metric(d, "dynamo_frontend_worker_recoveries_total", stopped_id) == 1, timeout=10)
    assert stopped_id in {_served_by(d) for _ in range(4)}


def _stop_one(d: DynProcess) -> tuple[int, str]:
    """SIGSTOP one worker: its pid and instance id (hex)."""
    stopped = next(r for r in d.instance_records() if r.component != "router")
    os.kill(stopped.pid, signal.SIGSTOP)
    return stopped.pid, f"{stopped.instance_id:x}"


def test_embeddings_leave_a_stopped_worker_for_another_and_then_avoid_it(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(
        "--workers", "2", "--engine-arg", "embeddings=true", "--stall-timeout", "2", "--lease-ttl", "60",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, timeout=20, max_retries=0)

    def embedding(n: int) -> list[float]:
        return client.embeddings.create(model="smollm2", input=f"text {n}").data[0].embedding

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert len(list(pool.map(embedding, range(2)))) == 2  # both workers have served: it stops while connected
    pid, stopped_id = _stop_one(d)
    try:
        started = time.monotonic()
        # Four at once go two to each worker (the fewest in flight): the stopped one's are left for the other after
        # the stall timeout, and it is out of routing for the rest.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            vectors = list(pool.map(embedding, range(4)))
        assert time.monotonic() - started < 12
        assert all(len(v) == len(vectors[0]) > 0 for v in vectors)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert len(list(pool.map(embedding, range(4, 8)))) == 4
        assert time.monotonic() - started < 1.5  # no wait on the stopped worker (its stall timeout is 2 s)
        assert _metric(d, "dynamo_frontend_worker_stalls_total", stopped_id) == 1
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_lora_load_leaves_out_a_stopped_worker_that_the_canary_found(dyn_serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    adapter = tmp_path / "c.gguf"
    adapter.write_bytes(b"adapter c")  # the mocker reads no adapter file
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--workers", "2", "--max-loras", "2", "--lora-dir", str(tmp_path),
        "--health-check", "--canary-wait", "1", "--health-check-timeout", "1", "--lease-ttl", "60",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, timeout=20, max_retries=0)
    pid, stopped_id = _stop_one(d)
    try:
        assert wait_until(lambda: _metric(d, "dynamo_frontend_worker_stalls_total", stopped_id) == 1, timeout=10)
        body = {"lora_name": "c", "lora_path": str(adapter)}
        loaded = client.post("/load_lora_adapter", body=body, cast_to=httpx.Response)
        assert loaded.status_code == 200, loaded.text
        taken = loaded.json()["workers"]
        assert len(taken) == 1 and stopped_id not in taken  # the other worker only, at once
        assert client.completions.create(model="c", prompt="hello", max_tokens=3).model == "c"
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_worker_stopped_before_any_request_reached_it_is_left_within_the_stall_timeout(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--workers", "2", "--router", "round-robin", "--stall-timeout", "2",
        "--lease-ttl", "60",
    )  # fmt: skip
    pid, stopped_id = _stop_one(d)  # the frontend has no connection to it yet: its kernel accepts, nothing answers
    try:
        started = time.monotonic()
        served = {_served_by(d) for _ in range(4)}  # round-robin sends the first or second there
        assert stopped_id not in served and time.monotonic() - started < 8  # not a 10 s handshake wait per request
        assert _metric(d, "dynamo_frontend_worker_stalls_total", stopped_id) == 1
    finally:
        os.kill(pid, signal.SIGCONT)
