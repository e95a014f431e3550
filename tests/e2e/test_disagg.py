"""Disaggregated serving end to end on the mocker: `dyn serve --disagg` with real worker processes.

The decisions show in `x-dyn-prefill-route` and `/metrics`; the KV payload travels over the real KV
transfer plane; nothing stays held when clients leave; a prefill worker's death costs no request. The
aggregated end-to-end suite also runs disaggregated (tests/e2e/test_serve_skeleton.py), and the
token-for-token check on the real engine is tests/e2e/test_disagg_llamacpp.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest

from dynamo_cli.runtime.planes import open_discovery, open_event_bus
from dynamo_cli.wire import LoadMetrics
from tests.conftest import DynProcess, wait_until

MOCKER = ("--engine", "mocker", "--speedup-ratio", "5", "--lease-ttl", "2", "--max-restarts", "0")
LONG = " ".join(["word"] * 1500)  # ~1,500 tokens: over the default --max-local-prefill-length (512)


def chat(content: str, **extra: object) -> dict[str, object]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "ignore_eos": True,
        **extra,
    }


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def disagg(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    """1 prefill + 1 decode worker, the default (adaptive) policy, KV-aware on both hops."""
    return dyn_serve_module(*MOCKER, "--disagg", "--router", "kv")  # type: ignore[no-any-return]


def test_ls_shows_the_roles(disagg: DynProcess) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", "ls", "--json", "--discovery", disagg.discovery],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert sorted(row["role"] for row in json.loads(out.stdout)) == ["decode", "prefill"]


def test_a_long_prompt_is_prefilled_remotely_and_explained(disagg: DynProcess) -> None:
    with httpx.Client(base_url=disagg.url, headers=disagg.auth, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat(LONG), headers={"x-dyn-explain-route": "1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] > 1000
        route = json.loads(r.headers["x-dyn-prefill-route"])
        assert route["prefill"] == "remote" and route["outcome"] == "remote" and route["policy"] == "adaptive"
        assert route["effective_isl"] > 512 and route["prefill_worker_id"] == r.headers["x-dyn-prefill-instance-id"]
        assert "x-dyn-route" in r.headers  # the decode worker's decision, as aggregated
        assert r.headers["x-worker-instance-id"] != r.headers["x-dyn-prefill-instance-id"]
        page = http.get("/metrics").text
    assert metric(page, "dynamo_frontend_disagg_decisions_total", outcome="remote") >= 1
    assert metric(page, "dynamo_frontend_kv_transfer_seconds_count", backend="tcp") >= 1


def test_a_short_prompt_is_prefilled_on_its_decode_worker(disagg: DynProcess) -> None:
    with httpx.Client(base_url=disagg.url, headers=disagg.auth, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat("hi"), headers={"x-dyn-explain-route": "1"})
        assert r.status_code == 200, r.text
        route = json.loads(r.headers["x-dyn-prefill-route"])
        assert (route["prefill"], route["outcome"]) == ("local", "local_short")
        assert "x-dyn-prefill-instance-id" not in r.headers
        page = http.get("/metrics").text
    assert metric(page, "dynamo_frontend_disagg_decisions_total", outcome="local_short") >= 1


def test_streaming_a_remotely_prefilled_request_counts_every_token(disagg: DynProcess) -> None:
    import openai

    c = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key=disagg.api_key, max_retries=0, timeout=60)
    chunks = list(
        c.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": LONG}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # max_tokens 1: the prefill's token is the whole answer and the decode worker is never asked
    one = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": LONG}], max_tokens=1, extra_body={"ignore_eos": True}
    )
    assert one.usage is not None and one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"


async def _loads(d: DynProcess, components: tuple[str, ...], seconds: float) -> dict[int, LoadMetrics]:
    """The latest load each worker of `components` publishes within `seconds`."""
    discovery = open_discovery(d.discovery)
    await discovery.start()
    bus = open_event_bus(d.events, discovery)
    await bus.start()
    latest: dict[int, LoadMetrics] = {}
    try:
        subs = [await bus.subscribe(f"namespace.dynamo.component.{c}.kv-metrics") for c in components]

        async def pump(sub) -> None:  # type: ignore[no-untyped-def]
            async for _, payload in sub:
                metrics = msgspec.msgpack.decode(payload, type=LoadMetrics)
                latest[metrics.worker_id] = metrics

        tasks = [asyncio.get_running_loop().create_task(pump(s)) for s in subs]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await bus.close()
        await discovery.close()
    return latest


async def test_a_hundred_clients_that_leave_mid_request_leave_no_kv_held(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(*MOCKER, "--disagg", "--disagg-policy", "always")

    async def leave_after(http: httpx.AsyncClient, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                body = chat(LONG, stream=True, max_tokens=200)
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        except TimeoutError:
            pass  # the client hung up: during the prefill, the transfer or the decode

    async with httpx.AsyncClient(base_url=d.url, headers=d.auth, timeout=60) as http:
        for start in range(0, 100, 20):
            await asyncio.gather(*(leave_after(http, 0.01 * (i % 20) + 0.005) for i in range(start, start + 20)))

    def drained(loads: dict[int, LoadMetrics]) -> bool:
        return len(loads) == 2 and all(
            m.active_blocks == 0 and m.kv_transfer_held == 0 and m.num_running == 0 for m in loads.values()
        )

    loads: dict[int, LoadMetrics] = {}
    for _ in range(20):  # the frontend releases unused handles at once; the workers' loads follow
        loads = await _loads(d, ("backend", "prefill"), 1.2)
        if drained(loads):
            break
    assert drained(loads), loads


def test_a_prefill_worker_killed_mid_prefill_costs_no_request(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(
        "--engine",
        "mocker",
        "--speedup-ratio",
        "0.2",
        "--lease-ttl",
        "2",
        "--max-restarts",
        "0",
        "--disagg",
        "--disagg-policy",
        "always",
    )
    [victim] = d.worker_pids("prefill")
    results: list[httpx.Response] = []

    def ask() -> None:
        results.append(httpx.post(f"{d.url}/v1/chat/completions", json=chat(LONG), timeout=120, headers=d.auth))

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(0.3)  # the prompt is on the prefill worker now (a 1,500-token prefill at speedup 0.2)
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=120)
    [r] = results
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    # with no prefill worker left, the decode worker prefills (until the pool is back)
    assert wait_until(lambda: not d.worker_pids("prefill"), timeout=6)
    r = httpx.post(
        f"{d.url}/v1/chat/completions", json=chat(LONG), timeout=60, headers={**d.auth, "x-dyn-explain-route": "1"}
    )
    assert r.status_code == 200
    assert json.loads(r.headers["x-dyn-prefill-route"])["outcome"] == "local_no_prefill_worker"


def test_enforce_disagg_without_a_prefill_worker_is_a_503_naming_the_pool(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(*MOCKER, "--enforce-disagg")
    r = httpx.post(f"{d.url}/v1/chat/completions", json=chat("hi"), timeout=30, headers=d.auth)
    assert r.status_code == 503, r.text
    assert "prefill pool" in r.json()["error"]["message"]


def test_bad_disagg_flags_exit_2_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for flags in (
        ["--disagg", "--prefill-workers", "0"],
        ["--disagg-policy", "sometimes"],
        ["--max-prefill-queue", "0"],
        ["--kv-transfer", "carrier-pigeon"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "dynamo_cli.cli.main", "serve", "--engine", "mocker", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (flags, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_dyn_router_replicas_run_the_prefill_stage_too(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve(*MOCKER, "--disagg", "--router", "remote", "--routers", "1", "--disagg-policy", "always")
    import openai

    c = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=60)
    for stream in (False, True):
        if stream:
            chunks = list(
                c.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": LONG}],
                    max_tokens=6,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
            )
            usage = chunks[-1].usage
        else:
            usage = c.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": LONG}],
                max_tokens=6,
                extra_body={"ignore_eos": True},
            ).usage
        assert usage is not None and usage.completion_tokens == 6
    page = httpx.get(f"{d.url}/metrics", timeout=10).text
    # the decode workers' pulls reach the frontend's /metrics through the router
    why = [line for line in (*page.splitlines(), *d.lines) if "kv_transfer_seconds_count" in line or "WARNING" in line]
    assert (
        metric(page, "dynamo_frontend_kv_transfer_seconds_count", backend="tcp")
        + metric(page, "dynamo_frontend_kv_transfer_seconds_count", backend="nixl")
        >= 2
    ), why
