"""`POST /v1/admin/clear_kv_blocks` on a real `dyn serve --router kv` of two mocker workers: only a `role=admin` key
gets in (never open: no admin key configured is a 403 too); clearing empties the workers' prefix caches (the same
prompt is cached no more) and the router's index of them (its route explanation sees no overlap left)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import DynProcess, wait_until

MODEL = "alpha"
ADMIN, USER = "sk-admin-3f9c2d", "sk-user-81ab7e"
PROMPT = "word " * 300  # four full 64-token blocks


@pytest.fixture(scope="module")
def served(dyn_serve_module, tmp_path_factory: pytest.TempPathFactory) -> DynProcess:  # type: ignore[no-untyped-def]
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys"
    keys.write_text(f"{ADMIN} role=admin\n{USER} tenant=users\n")
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--workers", "2", "--served-model-name", MODEL, "--speedup-ratio", "100",
        "--router", "kv", "--api-key-file", str(keys),
    )  # fmt: skip
    assert wait_until(lambda: len(httpx.get(f"{d.url}/health", timeout=10).json().get("instances", [])) == 2, 60)
    return d


def _complete(d: DynProcess, prompt: str = PROMPT) -> tuple[int, dict[str, Any]]:
    """The prompt's cached tokens, and the router's explanation of its choice."""
    headers = {"Authorization": f"Bearer {USER}", "x-dyn-explain-route": "1"}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    reply = httpx.post(f"{d.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"], json.loads(reply.headers["x-dyn-route"])


def _indexed(d: DynProcess) -> dict[str, int]:
    """Each worker's blocks in the router's index, read off the explanation of a prompt shorter than a block (it
    stores none)."""
    _, route = _complete(d, "hi")
    return {c["worker_id"]: c["cached_blocks"] for c in route["candidates"]}


def _clear(d: DynProcess, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{d.url}/v1/admin/clear_kv_blocks", json=body, headers=headers, timeout=30)


def test_only_an_admin_key_gets_in(served: DynProcess) -> None:
    assert _clear(served, None, {}).status_code == 401
    refused = _clear(served, USER, {})
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]


def test_clearing_empties_the_workers_caches_and_the_routers_index(served: DynProcess) -> None:
    _complete(served)
    cached, route = _complete(served)  # the same prompt again: routed to its blocks, found there
    worker = route["worker_id"]
    assert cached >= 256 and _indexed(served)[worker] >= 4
    reply = _clear(served, ADMIN, {"model": MODEL})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    cleared = {row["worker_id"]: row["blocks_cleared"] for row in body["workers"]}
    assert len(cleared) == 2 and cleared[worker] >= 4 and body["blocks_cleared"] == sum(cleared.values())
    assert wait_until(lambda: set(_indexed(served).values()) == {0}, timeout=10)  # the BlockRemoved events came
    cached, route = _complete(served)
    assert cached == 0 and all(c["overlap_blocks"] == 0 for c in route["candidates"])


def test_one_worker_and_bad_fields_are_named(served: DynProcess) -> None:
    health = httpx.get(f"{served.url}/health", timeout=10).json()
    worker_id = health["instances"][0]["instance_id"]
    reply = _clear(served, ADMIN, {"worker_id": worker_id})
    assert reply.status_code == 200 and [r["worker_id"] for r in reply.json()["workers"]] == [worker_id]
    for body, param in (({"worker_id": "beef"}, "worker_id"), ({"model": "nope"}, "model"), ({"x": 1}, "x")):
        bad = _clear(served, ADMIN, body)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text


def test_without_an_admin_key_the_endpoint_is_off(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve("--engine", "mocker", "--speedup-ratio", "100")  # the tests' one ordinary key
    refused = _clear(d, d.key, {})
    assert refused.status_code == 403 and "role=admin" in refused.json()["error"]["message"]
