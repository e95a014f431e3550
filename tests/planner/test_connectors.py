"""Connectors on real planes and real processes: the virtual decision/ack cycle on embedded discovery and
etcd; the workers and their ranks counted from discovery; the local connector starting a `dyn worker` and
draining it while a request streams."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest

from dynamo_cli.config import CLUSTER_SECRET_ENV, PlanesConfig, WorkerConfig, child_command
from dynamo_cli.model_card import ModelCard
from dynamo_cli.planner.connectors import (
    LocalConnector,
    ScaleTarget,
    VirtualAck,
    VirtualConnector,
    VirtualDecision,
    ack_key,
    decision_key,
)
from dynamo_cli.planner.observe import WorkerCount, count_workers
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import InstanceRecord
from dynamo_cli.runtime.names import EndpointName
from dynamo_cli.runtime.planes import open_discovery
from tests.conftest import API_KEY, DynProcess


@pytest.fixture(
    params=[pytest.param("embedded", id="embedded"), pytest.param("etcd", id="etcd", marks=pytest.mark.etcd)]
)
async def discovery(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Discovery]:
    url = f"file://{tmp_path / 'discovery'}" if request.param == "embedded" else request.getfixturevalue("etcd_server")
    store = open_discovery(url, ttl=5.0)
    async with asyncio.timeout(10):
        await store.start()
    yield store
    await store.close()


async def orchestrate(discovery: Discovery, namespace: str, seen: list[VirtualDecision]) -> None:
    """An external orchestrator: read each new decision, "scale", acknowledge it."""
    async for event in discovery.watch(decision_key(namespace)):
        decision = msgspec.json.decode(event.value, type=VirtualDecision)
        seen.append(decision)
        ack = VirtualAck(scaled_decision_id=decision.decision_id)
        await discovery.put(ack_key(namespace), msgspec.json.encode(ack), leased=False)


async def test_the_virtual_connector_writes_decisions_and_waits_for_their_ack(discovery: Discovery) -> None:
    connector = VirtualConnector(discovery, "ns1", ack_timeout_s=10.0, poll_s=0.05)
    seen: list[VirtualDecision] = []
    async with asyncio.TaskGroup() as group:
        orchestrator = group.create_task(orchestrate(discovery, "ns1", seen))
        assert await connector.next_decision_id() == 1
        assert await connector.apply(ScaleTarget(1, num_prefill=2, num_decode=3))
        assert await connector.apply(ScaleTarget(2, num_prefill=1, num_decode=5))
        orchestrator.cancel()
    assert seen == [
        VirtualDecision(decision_id=1, num_prefill_workers=2, num_decode_workers=3),
        VirtualDecision(decision_id=2, num_prefill_workers=1, num_decode_workers=5),
    ]
    # a planner started later continues the ids, so an orchestrator never sees an id twice
    assert await VirtualConnector(discovery, "ns1").next_decision_id() == 3


async def test_an_unacknowledged_decision_times_out_as_false(discovery: Discovery) -> None:
    connector = VirtualConnector(discovery, "ns2", ack_timeout_s=0.3, poll_s=0.05)
    started = time.monotonic()
    assert not await connector.apply(ScaleTarget(1, num_prefill=1, num_decode=1))
    assert 0.3 <= time.monotonic() - started < 3.0


async def register(
    discovery: Discovery, component: str, instance_id: int, role: str = "both", dp_size: int | None = 1
) -> None:
    """A worker's instance record and (unless `dp_size` is None) its model card, as a worker writes them."""
    name = EndpointName("dynamo", component, "generate")
    record = InstanceRecord(
        namespace="dynamo",
        component=component,
        endpoint="generate",
        instance_id=instance_id,
        transport={"tcp": "127.0.0.1:1"},
        role=role,
    )
    if dp_size is not None:
        card = ModelCard(display_name="m", tokenizer_source="", engine="mocker", role=role, dp_size=dp_size)
        await discovery.put(name.card_key(instance_id), msgspec.json.encode(card))
    await discovery.put(name.instance_key(instance_id), msgspec.json.encode(record))


async def test_workers_are_counted_with_their_pools_most_common_ranks_from_their_cards(discovery: Discovery) -> None:
    # decode: three workers of 4 ranks and one of 2 (most common: 4); prefill: one whose card is not there yet
    # (a rank-blind worker: 1) and one of 1; a router replica is no worker
    for instance_id, dp_size in ((0x10, 4), (0x11, 4), (0x12, 2), (0x13, 4)):
        await register(discovery, "backend", instance_id, dp_size=dp_size)
    await register(discovery, "prefill", 0x20, role="prefill", dp_size=None)
    await register(discovery, "prefill", 0x21, role="prefill")
    await register(discovery, "router", 0x30, dp_size=8)
    count = await count_workers(discovery, "dynamo")
    assert count == WorkerCount(
        num_prefill=2, num_decode=4, prefill_ranks=1, decode_ranks=4, mixed="decode: 3 of 4 ranks, 1 of 2 ranks"
    )
    assert count.counts == (2, 4)
    assert await count_workers(discovery, "elsewhere") == WorkerCount()


async def test_a_tie_between_the_ranks_cards_say_sizes_for_the_fewer(discovery: Discovery) -> None:
    await register(discovery, "backend", 0x10, dp_size=8)
    await register(discovery, "backend", 0x11, dp_size=2)
    count = await count_workers(discovery, "dynamo")
    assert (count.decode_ranks, count.mixed) == (2, "decode: 1 of 2 ranks, 1 of 8 ranks")


def _serves_model(url: str) -> bool:
    """Whether the frontend lists smollm2 (it has a worker for it)."""
    response = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
    return response.status_code == 200 and any(m["id"] == "smollm2" for m in response.json()["data"])


def _stream(url: str, box: dict[str, object]) -> None:
    """One long streamed completion; records how many chunks came and how it ended."""
    body = {
        "model": "smollm2",
        "prompt": "hello",
        "max_tokens": 300,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    chunks = 0
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60, headers=auth) as response:
        box["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                box["chunks"] = chunks
                event = msgspec.json.decode(line.removeprefix("data: "))
                box["finish"] = box.get("finish") or next((c.get("finish_reason") for c in event["choices"]), None)
                if event.get("usage"):
                    box["tokens"] = event["usage"]["completion_tokens"]
            if line == "data: [DONE]":
                box["done"] = True


async def test_the_local_connector_starts_a_worker_and_drains_it_under_a_request(dyn_serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    secret = os.urandom(32).hex()
    frontend: DynProcess = dyn_serve("--engine", "mocker", "--workers", "0", env={CLUSTER_SECRET_ENV: secret})
    config = WorkerConfig(
        engine="mocker",
        model="smollm2",
        planes=PlanesConfig(discovery=frontend.discovery, cluster_secret=bytes.fromhex(secret)),
        extra={"speedup_ratio": 1.0},
        graceful_shutdown_s=20.0,
    )
    connector = LocalConnector(child_command(config), None, {}, grace_s=20.0)
    store = open_discovery(frontend.discovery)
    await store.start()
    try:
        await connector.apply(ScaleTarget(1, num_prefill=0, num_decode=1))
        async with asyncio.timeout(60):
            while (await count_workers(store, "dynamo")).counts != (0, 1):
                await asyncio.sleep(0.1)
        async with asyncio.timeout(30):  # the frontend sees the worker a little after discovery holds it
            while not await asyncio.to_thread(_serves_model, frontend.url):
                await asyncio.sleep(0.1)
        box: dict[str, object] = {}
        streaming = asyncio.get_running_loop().run_in_executor(None, _stream, frontend.url, box)
        async with asyncio.timeout(30):
            while int(box.get("chunks", 0)) < 5:  # type: ignore[call-overload]
                await asyncio.sleep(0.02)
        pid = connector.pids("decode")[0]
        await connector.apply(ScaleTarget(2, num_prefill=0, num_decode=0))  # returns once the worker exited
        assert connector.counts() == (0, 0) and not os.path.exists(f"/proc/{pid}")
        await asyncio.wait_for(streaming, 30)
        assert box["status"] == 200 and box.get("done") is True
        assert (box["finish"], box["tokens"]) == ("length", 300)  # every token came
        assert (await count_workers(store, "dynamo")).counts == (0, 0)
    finally:
        await connector.close()
        await store.close()
