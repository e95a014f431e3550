"""Session affinity end to end: two frontends on one port (`--frontends 2`, their routing shared by the replica
sync) and 4 mocker workers. Every call of a session lands on one worker whichever frontend takes it; killing that
worker moves the session and the next call succeeds; the table stays bounded; `dyn router` replicas keep sessions
too (the frontend hands them the session as an annotation)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import DynProcess, wait_until

MOCKER = ("--engine", "mocker", "--speedup-ratio", "20", "--router", "kv")


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve_module(*MOCKER, "--workers", "4", "--frontends", "2", "--router-session-table-size", "30")
    yield d


def call(d: DynProcess, session: str, turn: int, header: str = "x-dyn-session-id") -> int:
    """One call of a session on a fresh connection; the worker that served. Each call's prompt is its own (no
    prefix shared with the session's other calls), so only the affinity keeps them together: KV routing alone
    spreads them over the idle workers."""
    context = " ".join(f"call {turn} of {session}, step {i}: file {turn * 31 + i}.py" for i in range(8))
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": f"{session} {context}"}]}
    with httpx.Client(timeout=30) as client:  # a new connection: either frontend may take it
        reply = client.post(f"{d.url}/v1/chat/completions", json=body, headers={**d.auth, header: session})
    assert reply.status_code == 200, reply.text
    return int(reply.headers["x-worker-instance-id"], 16)


def test_every_call_of_a_session_lands_on_one_worker_across_frontends(served: DynProcess) -> None:
    for name in ("alpha", "beta", "gamma"):
        seen = set()
        for turn in range(8):
            seen.add(call(served, name, turn))
            time.sleep(0.05)  # an agent's tool runs between calls (the replica sync's events arrive meanwhile)
        assert len(seen) == 1, (name, seen)
    # Dynamo's header name is an alias
    first = call(served, "delta", 0, "x-dynamo-session-id")
    assert all(call(served, "delta", t, "x-dynamo-session-id") == first for t in range(1, 4))


def test_the_session_table_stays_bounded(served: DynProcess) -> None:
    for i in range(70):
        call(served, f"short-{i}", 0)
    counts = []
    for _ in range(6):  # both frontends answer /health (connections spread over them)
        with httpx.Client(timeout=10) as client:
            counts.append(client.get(f"{served.url}/health").json()["sessions"]["smollm2"])
    assert max(counts) <= 30 and min(counts) > 0


def test_a_bad_session_id_is_a_400_naming_the_header(served: DynProcess) -> None:
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(
        f"{served.url}/v1/chat/completions", json=body, headers={**served.auth, "x-dyn-session-id": "x" * 300}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "x-dyn-session-id"


def test_killing_a_sessions_worker_moves_it_and_the_next_call_succeeds(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(*MOCKER, "--workers", "3")
    bound = call(d, "agent", 0)
    assert call(d, "agent", 1) == bound
    (pid,) = [r.pid for r in d.instance_records() if r.instance_id == bound]
    os.kill(pid, signal.SIGKILL)
    moved = call(d, "agent", 2)  # migrates off the dead worker, and the session with it
    assert moved != bound
    assert wait_until(lambda: bound not in {r.instance_id for r in d.instance_records()}, timeout=30)
    assert call(d, "agent", 3) == moved


def test_dyn_router_replicas_keep_sessions(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(*MOCKER[:4], "--router", "remote", "--routers", "2", "--workers", "3")
    first = call(d, "agent", 0)
    for turn in range(1, 8):
        time.sleep(0.05)
        assert call(d, "agent", turn) == first


def test_agent_hints_are_honoured_or_refused_naming_the_field(served: DynProcess, dyn_serve) -> None:  # type: ignore[no-untyped-def]
    hints = {"priority": 5, "osl": 16, "resume_after_s": 30.0}
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={**body, "nvext": {"agent_hints": hints}},
        headers={**served.auth, "x-dyn-session-id": "hinted"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text  # the mocker keeps the blocks (kv_retain)
    for bad, param in (({"resume_after_s": 0}, "nvext.agent_hints.resume_after_s"), ({"tier": 1}, "nvext.agent_hints")):
        refused = httpx.post(
            f"{served.url}/v1/chat/completions", json={**body, "nvext": {"agent_hints": bad}}, headers=served.auth
        )
        assert refused.status_code == 400 and param in refused.json()["error"]["message"], refused.text
    plain = dyn_serve(*MOCKER, "--engine-arg", "kv_retain_fraction=0")
    refused = httpx.post(
        f"{plain.url}/v1/chat/completions", json={**body, "nvext": {"agent_hints": hints}}, headers=plain.auth
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "nvext.agent_hints.resume_after_s"
