"""`dyn serve --frontends 2 --router kv`: two frontend processes on one port, one in-flight load, one /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DynProcess, descendants

FLAGS = ("--engine", "mocker", "--workers", "2", "--frontends", "2", "--router", "kv", "--lease-ttl", "2")
MODEL = "smollm2"
LONG = {"model": MODEL, "prompt": "a long stream " * 20, "max_tokens": 4000, "stream": True, "ignore_eos": True}
"""A stream of 4,000 tokens: about 25 s at the mocker's speed, cancelled by the tests long before."""
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def deployment(dyn_serve_module, planes_module) -> DynProcess:  # type: ignore[no-untyped-def]
    discovery, events = planes_module
    return dyn_serve_module(*FLAGS, discovery=discovery, events=events)


@contextlib.asynccontextmanager
async def on_frontends(d: DynProcess, per_frontend: int) -> AsyncIterator[dict[str, list[httpx.AsyncClient]]]:
    """Clients of one kept-alive connection each, `per_frontend` on each frontend (by its /health's id)."""
    found: dict[str, list[httpx.AsyncClient]] = {}
    spare: list[httpx.AsyncClient] = []
    try:
        for _ in range(200):
            if len(found) == 2 and all(len(c) >= per_frontend for c in found.values()):
                break
            client = httpx.AsyncClient(
                base_url=d.url, headers=d.auth, timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=1)
            )
            frontend = (await client.get("/health")).json()["frontend"]
            clients = found.setdefault(frontend, [])
            (clients if len(clients) < per_frontend else spare).append(client)
        assert len(found) == 2, f"200 connections all reached one frontend: {list(found)}"
        yield found
    finally:
        for client in [*spare, *(c for clients in found.values() for c in clients)]:
            await client.aclose()


async def in_flight(client: httpx.AsyncClient) -> int:
    """The requests in flight on every worker, as this connection's frontend counts them."""
    body = (await client.get("/health")).json()
    return sum(row["in_flight_requests"] for row in body["instances"])


async def eventually(check, expected: object, timeout: float = 10.0) -> object:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (got := await check()) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return got


async def first_chunk(client: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> AsyncIterator[str]:
    """Open a long stream on `client` and read up to its first token; the rest of its lines (left open)."""
    response = await stack.enter_async_context(client.stream("POST", "/v1/completions", json=LONG))
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {"):
            break
    return lines


def requests_total(d: DynProcess, client: httpx.Client) -> float:
    text = client.get(f"{d.url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "dynamo_frontend_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def test_connections_spread_over_both_frontends_and_the_openai_client_is_answered(deployment: DynProcess) -> None:
    seen = set()
    for _ in range(24):
        with httpx.Client(headers=deployment.auth, timeout=TIMEOUT_S) as client:  # a new connection each
            seen.add(client.get(f"{deployment.url}/health").json()["frontend"])
    assert len(seen) == 2
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.api_key, max_retries=0)
    reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert reply.usage is not None and reply.usage.completion_tokens == 5


async def test_each_frontend_counts_the_others_streams_and_nothing_stays_in_flight(deployment: DynProcess) -> None:
    async with on_frontends(deployment, per_frontend=4) as frontends:  # the last connection of each: its view
        (a, a_clients), (b, b_clients) = frontends.items()
        async with contextlib.AsyncExitStack() as streams:
            # three streams through frontend A, one through B (kept referenced: a dropped one is closed)
            opened = [await first_chunk(client, streams) for client in [*a_clients[:3], b_clients[0]]]
            assert await eventually(lambda: in_flight(b_clients[3]), 4) == 4, f"{b} does not count {a}'s 3 streams"
            assert await eventually(lambda: in_flight(a_clients[3]), 4) == 4, f"{a} does not count {b}'s stream"
            del opened
        # the streams closed (the clients went): both views back to nothing
        assert await eventually(lambda: in_flight(b_clients[3]), 0) == 0
        assert await eventually(lambda: in_flight(a_clients[3]), 0) == 0


def test_metrics_on_either_frontend_show_the_deployments_totals(deployment: DynProcess) -> None:
    time.sleep(1.5)  # every frontend's snapshot of the earlier tests' requests written
    with httpx.Client(headers=deployment.auth, timeout=TIMEOUT_S) as client:
        before = requests_total(deployment, client)
    for i in range(20):
        with httpx.Client(headers=deployment.auth, timeout=TIMEOUT_S) as client:  # spread by connection
            body = {"model": MODEL, "prompt": f"count me {i}", "max_tokens": 2}
            assert client.post(f"{deployment.url}/v1/completions", json=body).status_code == 200
    time.sleep(1.5)
    for _ in range(6):  # fresh connections: both frontends answer, each with the totals
        with httpx.Client(headers=deployment.auth, timeout=TIMEOUT_S) as client:
            assert requests_total(deployment, client) == before + 20


def test_a_second_group_on_the_same_port_is_refused_in_one_line(deployment: DynProcess) -> None:
    port = deployment.url.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "serve", "--workers", "0", "--frontends", "2"]
    done = subprocess.run([*argv, "--port", port], capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], done.stderr


def child_frontend(d: DynProcess) -> int:
    """The pid of the other frontend `dyn serve` started (a `dyn serve` process under it)."""
    pids = [
        pid for pid in descendants(d.proc.pid) if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]
    assert len(pids) == 1, pids
    return pids[0]


async def test_a_killed_frontend_loses_only_its_own_streams_and_comes_back(deployment: DynProcess) -> None:
    child = child_frontend(deployment)
    async with on_frontends(deployment, per_frontend=3) as frontends:  # the last connection of each: its view
        async with contextlib.AsyncExitStack() as streams:
            opened = {f: [await first_chunk(c, streams) for c in clients[:2]] for f, clients in frontends.items()}
            os.kill(child, signal.SIGKILL)
            survived, lost = set(), set()
            for frontend, streams_of in opened.items():
                for lines in streams_of:
                    try:
                        async with asyncio.timeout(1.0):
                            async for _ in lines:
                                pass
                    except TimeoutError:
                        survived.add(frontend)  # still streaming
                    except httpx.HTTPError:
                        lost.add(frontend)
            assert len(survived) == 1 and len(lost) == 1 and survived != lost, (survived, lost)
        (alive,) = survived
        # the survivor let go of its own streams and, once the dead one's lease is gone, of the dead one's
        assert await eventually(lambda: in_flight(frontends[alive][2]), 0, timeout=15) == 0
    restarted = await eventually(lambda: _frontend_ids(deployment), 2, timeout=30)
    assert restarted == 2, "the killed frontend was not started again"
    assert child_frontend(deployment) != child
    with httpx.Client(headers=deployment.auth, timeout=TIMEOUT_S) as client:
        text = client.get(f"{deployment.url}/metrics").text
    restarts = [line for line in text.splitlines() if line.startswith("dynamo_frontend_frontend_restarts_total")]
    # at least the kill; in 2 of about 60 runs the new frontend was restarted once more (issue 36's note)
    assert len(restarts) == 1 and float(restarts[0].split()[1]) >= 1, (restarts, deployment.lines[-20:])


async def _frontend_ids(d: DynProcess) -> int:
    seen = set()
    for _ in range(16):
        async with httpx.AsyncClient(headers=d.auth, timeout=TIMEOUT_S) as client:
            with contextlib.suppress(httpx.HTTPError):
                seen.add((await client.get(f"{d.url}/health")).json()["frontend"])
    return len(seen)
