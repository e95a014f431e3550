"""`dyn serve --engine mocker --workers 2` answered by the official openai client (real processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from dynamo_cli.engine import LoadMetrics
from dynamo_cli.runtime.discovery import open_discovery
from dynamo_cli.runtime.events import open_event_bus
from tests.conftest import DynProcess, wait_until

FLAGS = ("--engine", "mocker", "--workers", "2", "--speedup-ratio", "50", "--lease-ttl", "2", "--body-limit-mb", "1")


@pytest.fixture(scope="module")
def deployment(dyn_serve_module, planes_module) -> DynProcess:  # type: ignore[no-untyped-def]
    """Shared by the tests that leave the deployment as they found it."""
    discovery, events = planes_module
    return dyn_serve_module(*FLAGS, discovery=discovery, events=events)


@pytest.fixture
def own_deployment(dyn_serve, planes) -> DynProcess:  # type: ignore[no-untyped-def]
    """A deployment a test may damage."""
    discovery, events = planes
    return dyn_serve(*FLAGS, discovery=discovery, events=events)


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=30)


def test_chat_and_completions_answer_streaming_and_not(deployment: DynProcess) -> None:
    c = client(deployment)
    chat = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=7)
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 5
    text = c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5)
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens == 5
    pieces = [ch for ch in c.completions.create(model="smollm2", prompt="Once", max_tokens=4, stream=True)]
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    assert pieces[-1].choices[0].finish_reason == "length"


def test_streamed_usage_counts_equal_the_tokens_streamed(deployment: DynProcess) -> None:
    stream = client(deployment).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "count"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert 1 <= len(content) <= 12  # a multi-byte character may hold a token back into the next chunk
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_requests_spread_over_both_workers(deployment: DynProcess) -> None:
    seen = set()
    with httpx.Client(base_url=deployment.url, timeout=30) as http:
        for _ in range(6):
            r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
            assert r.status_code == 200
            seen.add(r.headers["x-worker-instance-id"])
    assert len(seen) == 2


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        pytest.param(b'{"model": "smollm2", "messages": [', 400, "not valid JSON", id="malformed-json"),
        pytest.param(
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "nope", id="unknown-model"
        ),
        pytest.param(b'{"model": "smollm2", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}',
                     400, "max_tokens", id="negative-max-tokens"),
        pytest.param(b'{"model": "smollm2", "temperature": 9, "messages": [{"role": "user", "content": "x"}]}',
                     400, "temperature", id="temperature-out-of-range"),
        pytest.param(b'{"model": "smollm2", "max_tokens": 9000, "messages": [{"role": "user", "content": "x"}]}',
                     400, "context", id="context-overflow"),
        pytest.param(b'{"model": "smollm2", "messages": [{"role": "user", "content": "' + b"x" * 2_000_000 + b'"}]}',
                     413, "limit", id="oversize-body"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_4xx_naming_the_problem(
    deployment: DynProcess, body: bytes, status: int, needle: str
) -> None:
    r = httpx.post(f"{deployment.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["type"]


def test_openai_client_sees_typed_errors(deployment: DynProcess) -> None:
    c = client(deployment)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=-1)


async def _worker_running(d: DynProcess, seconds: float) -> dict[int, int]:
    """num_running per worker, from the load metrics the workers publish on the event plane."""
    discovery = open_discovery(d.discovery)
    await discovery.start()
    bus = open_event_bus(d.events, discovery)
    await bus.start()
    sub = await bus.subscribe("namespace.dynamo.component.backend.kv-metrics")
    seen: dict[int, int] = {}
    try:
        async with asyncio.timeout(seconds):
            async for _, payload in sub:
                metrics = msgspec.msgpack.decode(payload, type=LoadMetrics)
                seen[metrics.worker_id] = metrics.num_running
    except TimeoutError:
        pass
    finally:
        await bus.close()
        await discovery.close()
    return seen


async def test_a_client_that_disconnects_frees_the_worker_within_a_second(deployment: DynProcess) -> None:
    body = {"model": "smollm2", "max_tokens": 100000 // 50, "stream": True,
            "messages": [{"role": "user", "content": "long story"}]}  # fmt: skip
    async with httpx.AsyncClient(base_url=deployment.url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and "content" in line:
                    break
        # leaving the block closes the connection mid-stream
    disconnected_at = time.monotonic()
    running = await _worker_running(deployment, 1.0)
    assert running and all(n == 0 for n in running.values()), running
    assert time.monotonic() - disconnected_at < 2.0


def test_a_sigkilled_worker_leaves_discovery_and_the_other_serves(own_deployment: DynProcess) -> None:
    deployment = own_deployment
    pids = deployment.worker_pids()
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_until(lambda: len(deployment.worker_pids()) == 1, timeout=2 + 2)
    assert time.monotonic() - killed_at <= 4.0
    c = client(deployment)
    for _ in range(4):
        reply = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_sigterm_stops_serve_and_every_worker(own_deployment: DynProcess) -> None:
    deployment = own_deployment
    pids = deployment.worker_pids()
    assert deployment.stop() == 0 or deployment.proc.returncode in (0, -15)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")

    assert wait_until(lambda: all(gone(p) for p in pids), timeout=10)
