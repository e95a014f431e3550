"""The wait queue in `dyn router`: a frontend with `--router remote` in front of a router whose one backend is busy
(the priority, deadline and class of a request travel with it to the router).

`--max-inflight-per-worker 1` makes the backend busy while one stream holds it; the tests hold it with a
long stream sent straight to the router's request plane, then let it go by cancelling that stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from dynamo_cli.errors import RemoteError
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.wire import GenerateRequest
from tests.conftest import DynProcess, wait_until
from tests.e2e.test_router_service import CALL_TIMEOUT_S, ENV, SECRET, best_worker, of, request

QUEUE_SIZE = 3
FLAGS = (
    "--engine",
    "mocker",
    "--speedup-ratio",
    "1",
    "--workers",
    "1",
    "--router",
    "remote",
    "--routers",
    "1",
    "--lease-ttl",
    "2",
    "--max-inflight-per-worker",
    "1",
    "--router-queue-size",
    str(QUEUE_SIZE),
    "--router-queue-timeout",
    "30",
)
UNARY = {"model": "smollm2", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def deployment(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve_module(*FLAGS, env=ENV)
    assert wait_until(lambda: len(of(d, "backend")) == 1 and len(of(d, "router")) == 1, timeout=60, interval=0.5)
    return d


def router_of(d: DynProcess) -> str:
    address: str = of(d, "router")[0]["address"]
    return address


async def queued(router: str) -> int:
    """Requests waiting in the router's queue now."""
    n: int = (await best_worker(router, [1]))["queued"]
    return n


async def until_queued(router: str, n: int) -> None:
    deadline = asyncio.get_running_loop().time() + CALL_TIMEOUT_S
    while (now := await queued(router)) != n:
        assert asyncio.get_running_loop().time() < deadline, f"{now} queued in the router, not {n}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def busy_backend(router: str) -> AsyncIterator[None]:
    """The backend busy with one long stream of this test's until the block ends (the stream is cancelled)."""
    client = RequestClient(router, secret=SECRET)
    try:
        stream = await client.open_stream("generate", request("blocker", [5, 6, 7], 4000))
        async with asyncio.timeout(CALL_TIMEOUT_S):
            assert await stream.next_batch()
        yield
        stream.cancel()
    finally:
        await client.close()


async def ask(http: httpx.AsyncClient, name: str, finished: list[str], **headers: str) -> httpx.Response:
    reply = await http.post("/v1/chat/completions", json=UNARY, headers=headers)
    finished.append(name)
    return reply


async def queue_up(
    http: httpx.AsyncClient, router: str, finished: list[str], requests: list[tuple[str, int]]
) -> list[asyncio.Task[httpx.Response]]:
    """Send one request per (name, priority), each once the one before waits in the router's queue."""
    tasks = []
    for n, (name, priority) in enumerate(requests):
        tasks.append(asyncio.create_task(ask(http, name, finished, **{"x-dyn-priority": str(priority)})))
        await until_queued(router, n + 1)
    return tasks


def client(d: DynProcess) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=d.url, headers=d.auth, timeout=60)


async def test_a_burst_past_the_busy_backend_waits_in_the_router_and_is_served_in_arrival_order(
    deployment: DynProcess,
) -> None:
    router, finished = router_of(deployment), []
    async with client(deployment) as http:
        async with busy_backend(router):  # the frontend does not shed: every one reaches the router's queue
            burst = await queue_up(http, router, finished, [(f"r{n}", 0) for n in range(QUEUE_SIZE)])
            assert finished == []
        replies = await asyncio.gather(*burst)
    assert [r.status_code for r in replies] == [200] * QUEUE_SIZE
    assert all(r.json()["usage"]["completion_tokens"] == UNARY["max_tokens"] for r in replies)
    assert finished == ["r0", "r1", "r2"]  # one backend slot: first come, first served
    assert await queued(router) == 0


async def test_a_full_router_queue_and_a_passed_deadline_are_503s_with_retry_after_through_the_frontend(
    deployment: DynProcess,
) -> None:
    router, finished = router_of(deployment), []
    async with client(deployment) as http:
        async with busy_backend(router):
            late = await http.post("/v1/chat/completions", json=UNARY, headers={"x-dyn-deadline-ms": "300"})
            assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
            reason = late.json()["error"]["message"]  # refused as it timed out, or at once at the drain rate
            assert "deadline passed" in reason or "than the 0.3 s it may wait" in reason, reason
            waiting = await queue_up(http, router, finished, [(f"r{n}", 0) for n in range(QUEUE_SIZE)])
            full = await http.post("/v1/chat/completions", json=UNARY)
            assert (full.status_code, full.headers["retry-after"]) == (503, "1")
            error = full.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "service_unavailable")
            assert f"the wait queue is full ({QUEUE_SIZE} requests)" in error["message"]
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * QUEUE_SIZE


async def test_a_higher_priority_queued_later_is_served_first(deployment: DynProcess) -> None:
    router, finished = router_of(deployment), []
    async with client(deployment) as http:
        async with busy_backend(router):
            waiting = await queue_up(http, router, finished, [("low-a", 0), ("low-b", -1), ("high", 5)])
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * 3
    assert finished == ["high", "low-a", "low-b"]


async def test_the_priority_classes_reach_the_router_queue_which_serves_them_highest_first(
    deployment: DynProcess,
) -> None:
    router, finished, waiting = router_of(deployment), [], []
    async with client(deployment) as http:
        async with busy_backend(router):
            for n, name in enumerate(("bulk", "default", "interactive")):
                headers = {"x-dyn-priority-class": name}
                waiting.append(asyncio.create_task(ask(http, name, finished, **headers)))
                await until_queued(router, n + 1)
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * 3
    assert finished == ["interactive", "default", "bulk"]


async def test_a_cancelled_queued_request_leaves_the_router_queue(deployment: DynProcess) -> None:
    router = router_of(deployment)
    caller = RequestClient(router, secret=SECRET)
    try:
        async with busy_backend(router):
            stream = await caller.open_stream("generate", request("waiter", [1, 2, 3], 2))
            await until_queued(router, 1)
            stream.cancel()
            await until_queued(router, 0)
            bad = GenerateRequest(request_id="bad", token_ids=[1], max_tokens=2, annotations={"priority": "soon"})
            with pytest.raises(RemoteError) as raised:  # refused at once, busy backend or not
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await (await caller.open_stream("generate", msgspec.msgpack.encode(bad))).next_batch()
            assert raised.value.status == 400 and "annotation priority 'soon'" in str(raised.value)
    finally:
        await caller.close()
    assert await queued(router) == 0


async def test_an_http_client_that_leaves_while_queued_leaves_the_router_queue(deployment: DynProcess) -> None:
    router = router_of(deployment)
    async with busy_backend(router):
        async with httpx.AsyncClient(base_url=deployment.url, headers=deployment.auth, timeout=60) as http:
            leaving = asyncio.create_task(http.post("/v1/chat/completions", json=UNARY))
            await until_queued(router, 1)
            leaving.cancel()  # closes its connection: the frontend sees the disconnect
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
        await until_queued(router, 0)  # while the backend is still busy: it left, it was not served


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(
            "/v1/responses", {"model": "smollm2", "input": "tell me a story", "max_output_tokens": 8}, id="responses"
        ),
        pytest.param(
            "/v1/messages", {"model": "smollm2", "max_tokens": 8, "messages": UNARY["messages"]}, id="messages"
        ),
    ],
)
async def test_a_client_of_the_translated_apis_that_leaves_while_queued_leaves_the_queue(
    deployment: DynProcess, path: str, body: dict[str, object]
) -> None:
    router = router_of(deployment)
    async with busy_backend(router):
        async with httpx.AsyncClient(base_url=deployment.url, headers=deployment.auth, timeout=60) as http:
            leaving = asyncio.create_task(http.post(path, json=body))
            await until_queued(router, 1)
            leaving.cancel()  # closes its connection: the frontend sees the disconnect
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
        await until_queued(router, 0)  # while the backend is still busy: it left, it was not served
