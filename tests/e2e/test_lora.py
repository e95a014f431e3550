"""Multi-LoRA through `dyn serve` (mocker workers): adapters as models, loaded and unloaded at run time through
the official `openai` client while streams run, refused when bad, and routed where they are loaded."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_cli.errors import RemoteError
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.wire import BEST_WORKER, BestWorkerQuery
from tests.conftest import DynProcess

MODEL = "smollm2"
SECRET = secrets.token_bytes(32)
"""The cluster secret of the `--router remote` deployment, so the test can ask its router directly."""
STREAMS = 16
STREAM_TOKENS = 600
"""~5 s a stream: the load, the listing, a completion on the adapter and the unload (~1.5 s, more on a loaded
machine) all happen while every stream runs (at 200 tokens the streams ended first one run in ten with -n 2)."""


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapter files (the mocker reads none: any file stands for an adapter), and one outside the folder."""
    folder = tmp_path_factory.mktemp("adapters")
    for name in ("a", "b", "c"):
        (folder / f"{name}.gguf").write_bytes(b"adapter " + name.encode())
    return folder


@pytest.fixture(scope="module")
def deployment(dyn_serve_module, planes_module, adapter_dir: Path) -> DynProcess:  # type: ignore[no-untyped-def]
    discovery, events = planes_module
    flags = ["--engine", "mocker", "--workers", "2", "--router", "kv", "--max-loras", "2"]
    flags += [
        "--lora",
        f"a={adapter_dir / 'a.gguf'}",
        "--lora",
        f"b={adapter_dir / 'b.gguf'}",
        "--lora-dir",
        str(adapter_dir),
    ]
    return dyn_serve_module(*flags, discovery=discovery, events=events)


def client_of(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=30)


def models(client: openai.OpenAI) -> dict[str, str | None]:
    """Model id -> its parent (None for a base model)."""
    return {m.id: (m.model_extra or {}).get("parent") for m in client.models.list().data}


def test_adapters_are_models_of_their_base_and_a_request_names_one_as_its_model(deployment: DynProcess) -> None:
    client = client_of(deployment)
    assert models(client) == {MODEL: None, "a": MODEL, "b": MODEL}
    reply = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.model == "a" and reply.usage is not None and reply.usage.completion_tokens == 4
    raw = httpx.post(
        f"{deployment.url}/v1/completions",
        json={"model": "b", "prompt": "hello there", "max_tokens": 2},
        headers={**deployment.auth, "x-dyn-explain-route": "1"},
        timeout=30,
    )
    assert raw.status_code == 200 and raw.json()["model"] == "b"
    route = json.loads(raw.headers["x-dyn-route"])
    assert route["lora"]["name"] == "b" and isinstance(route["lora"]["was_loaded"], bool)
    assert all("lora_load_s" in c for c in route["candidates"])  # the load term, per candidate
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="zzz", prompt="x", max_tokens=1)


async def test_load_and_unload_at_run_time_while_sixteen_streams_run_on_the_base(
    deployment: DynProcess, adapter_dir: Path
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.api_key, max_retries=0, timeout=60)

    async def stream() -> int:
        # Tokens, not chunks: a stream whose reader lags gets several tokens in one chunk (nothing is lost; counting
        # chunks read 197-199 of 200 on a loaded machine). The usage and the finish reason say what was generated.
        tokens, finish, chunks = 0, None, 0
        response = await client.completions.create(
            model=MODEL,
            prompt="a long story",
            max_tokens=STREAM_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in response:
            if chunk.choices:
                chunks += bool(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert finish == "length" and 0 < chunks <= tokens
        return tokens

    streams = [asyncio.create_task(stream()) for _ in range(STREAMS)]
    await asyncio.sleep(0.2)
    loaded = await client.post(
        "/load_lora_adapter", body={"lora_name": "c", "lora_path": str(adapter_dir / "c.gguf")}, cast_to=httpx.Response
    )
    assert loaded.status_code == 200 and loaded.json()["parent"] == MODEL and len(loaded.json()["workers"]) == 2
    listed = {m.id for m in (await client.models.list()).data}
    assert "c" in listed  # the reply came once this frontend saw the workers' cards
    reply = await client.completions.create(model="c", prompt="hello", max_tokens=3)
    assert reply.model == "c"
    unloaded = await client.post("/unload_lora_adapter", body={"lora_name": "c"}, cast_to=httpx.Response)
    assert unloaded.status_code == 200
    assert "c" not in {m.id for m in (await client.models.list()).data}
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="c", prompt="hello", max_tokens=3)
    assert all(not s.done() for s in streams)  # the loads happened while every stream ran
    counts = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert counts == [STREAM_TOKENS] * STREAMS  # none failed, none cut short
    await client.close()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"lora_name": "x", "lora_path": "/etc/passwd"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "MISSING"}, 400, "lora_path"),
        ({"lora_name": "a", "lora_path": "ANY"}, 400, "lora_name"),
        ({"lora_name": "../x", "lora_path": "ANY"}, 400, "lora_name"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "ANY", "base_model": "nope"}, 404, "model"),
    ],
)
def test_a_bad_load_is_a_client_error_naming_the_field_and_changes_nothing(
    deployment: DynProcess, adapter_dir: Path, body: dict[str, str], status: int, param: str
) -> None:
    body = {
        k: v.replace("MISSING", str(adapter_dir / "missing.gguf")).replace("ANY", str(adapter_dir / "a.gguf"))
        for k, v in body.items()
    }
    client = client_of(deployment)
    with pytest.raises(openai.APIStatusError) as refused:
        client.post("/load_lora_adapter", body=body, cast_to=httpx.Response)
    assert refused.value.status_code == status, refused.value.body
    assert refused.value.body["param"] == param  # type: ignore[index]
    assert models(client) == {MODEL: None, "a": MODEL, "b": MODEL}
    no_key = httpx.post(
        f"{deployment.url}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/x"}, timeout=10
    )
    assert no_key.status_code == 401  # behind the API key
    with pytest.raises(openai.NotFoundError) as gone:
        client.post("/unload_lora_adapter", body={"lora_name": "never"}, cast_to=httpx.Response)
    assert gone.value.body["param"] == "model"  # type: ignore[index]


async def best_worker(address: str, query: BestWorkerQuery) -> dict[str, Any]:
    """A `dyn router`'s `best_worker_id` answer."""
    client = RequestClient(address, secret=SECRET)
    try:
        async with asyncio.timeout(10):
            stream = await client.open(BEST_WORKER, query)
            replies = [msgspec.msgpack.decode(raw) async for raw in stream]
    finally:
        await client.close()
    reply: dict[str, Any] = replies[0]
    return reply


##### Routing: where each adapter is loaded #####

NUM_ADAPTERS = 20
NUM_REQUESTS = 240
CONCURRENCY = 8


def zipf_mix(rng: random.Random, n: int) -> list[str]:
    weights = [1 / (i + 1) ** 1.1 for i in range(NUM_ADAPTERS)]
    return rng.choices([f"t{i}" for i in range(NUM_ADAPTERS)], weights, k=n)


async def drive(d: DynProcess, mix: list[str]) -> tuple[float, float]:
    """Send `mix` (adapter per request), CONCURRENCY at a time: (share routed where loaded, seconds)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for name in mix:
        queue.put_nowait(name)
    loaded: list[bool] = []
    headers = {**d.auth, "x-dyn-explain-route": "1"}

    async def one(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            name = queue.get_nowait()
            body = {"model": name, "prompt": f"tenant {name} asks {random.random()}", "max_tokens": 4}
            reply = await client.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            loaded.append(json.loads(reply.headers["x-dyn-route"])["lora"]["was_loaded"])

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=d.url, timeout=30) as client:
        await asyncio.gather(*(one(client) for _ in range(CONCURRENCY)))
    return sum(loaded) / len(loaded), time.monotonic() - started


def lora_loads(d: DynProcess) -> float:
    text = httpx.get(f"{d.url}/metrics", headers=d.auth, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "dynamo_frontend_worker_lora_loads"
        for s in family.samples
    )


async def test_kv_routing_sends_each_adapter_where_it_is_loaded_and_loads_less_than_round_robin(
    dyn_serve,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    folder = tmp_path / "adapters"
    folder.mkdir()
    flags = ["--engine", "mocker", "--workers", "4", "--max-loras", "4", "--engine-arg", "speedup_ratio=10"]
    for i in range(NUM_ADAPTERS):
        (folder / f"t{i}.gguf").write_bytes(b"x")
        flags += ["--lora", f"t{i}={folder / f't{i}.gguf'}"]
    mix = zipf_mix(random.Random(7), NUM_REQUESTS)
    found = {}
    for router in ("kv", "round-robin"):
        d = dyn_serve(*flags, "--router", router)
        deadline = time.monotonic() + 10
        while lora_loads(d) < 4 * NUM_ADAPTERS and time.monotonic() < deadline:  # each worker's start loads
            await asyncio.sleep(0.1)
        before = lora_loads(d)
        share, seconds = await drive(d, mix)
        await asyncio.sleep(0.7)  # the workers' last load reports (every 0.5 s at least)
        found[router] = (share, lora_loads(d) - before, seconds)
        d.stop()
    print(f"share where loaded, loads, seconds: {found}")
    (kv_share, kv_loads, _), (rr_share, rr_loads, _) = found["kv"], found["round-robin"]
    assert kv_share >= 0.75 and kv_share > rr_share + 0.25
    assert kv_loads < rr_loads / 2  # the same requests in the same order: loads, not loads per minute


def test_behind_dyn_routers_a_run_time_load_goes_through_a_router_and_its_card_lists_the_adapter(
    dyn_serve,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    for name in ("a", "c"):
        (tmp_path / f"{name}.gguf").write_bytes(b"x")
    flags = ["--engine", "mocker", "--workers", "2", "--router", "remote", "--routers", "1"]
    env = {"DYN_CLUSTER_SECRET": SECRET.hex()}
    d = dyn_serve(*flags, "--lora", f"a={tmp_path / 'a.gguf'}", "--lora-dir", str(tmp_path), env=env)
    client = client_of(d)
    assert models(client) == {MODEL: None, "a": MODEL}
    assert client.completions.create(model="a", prompt="hi", max_tokens=2).model == "a"
    loaded = client.post(
        "/load_lora_adapter", body={"lora_name": "c", "lora_path": str(tmp_path / "c.gguf")}, cast_to=httpx.Response
    )
    assert loaded.status_code == 200
    assert models(client) == {MODEL: None, "a": MODEL, "c": MODEL}
    assert client.completions.create(model="c", prompt="hi", max_tokens=2).model == "c"
    router = next(r.address for r in d.instance_records() if r.component == "router")
    explained = asyncio.run(best_worker(router, BestWorkerQuery(token_ids=list(range(1, 100)), lora="c")))
    assert {"lora_load_s"} <= explained["explanation"]["candidates"][0].keys()
    with pytest.raises(RemoteError, match="LoRA adapter 'zzz'"):
        asyncio.run(best_worker(router, BestWorkerQuery(token_ids=[1, 2], lora="zzz")))
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "/etc/passwd"}, cast_to=httpx.Response)
    assert refused.value.body["param"] == "lora_path"  # type: ignore[index]
    client.post("/unload_lora_adapter", body={"lora_name": "c"}, cast_to=httpx.Response)
    assert models(client) == {MODEL: None, "a": MODEL}
