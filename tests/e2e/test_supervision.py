"""`dyn serve` heals: a worker that dies is started again; meanwhile its model answers 503 with Retry-After."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx

from tests.conftest import DynProcess, descendants, wait_until

CHAT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 300,
    "stream": True,
    "ignore_eos": True,
}


def _stream(d: DynProcess) -> str:
    try:
        return httpx.post(f"{d.url}/v1/chat/completions", json=CHAT, timeout=60, headers=d.auth).text
    except httpx.HTTPError as exc:  # a transport error is a lost request: the test counts it
        return f"transport error: {exc!r}"


def test_a_killed_single_worker_under_64_streams_is_restarted_and_serve_serves_again(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve("--engine", "mocker", "--workers", "1", "--speedup-ratio", "2", "--lease-ttl", "2")
    (worker,) = descendants(d.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        streams = [pool.submit(_stream, d) for _ in range(64)]
        time.sleep(1.0)
        os.kill(worker, signal.SIGKILL)
        texts = [f.result() for f in streams]
    # Every stream ended properly ([DONE] after its tokens or after an error event), or, not yet
    # started when the worker died, was refused with a 503 while it restarts.
    ended = [t for t in texts if t.rstrip().endswith("data: [DONE]") or '"service_unavailable"' in t]
    assert len(ended) == 64, [t[-200:] for t in texts if t not in ended][:3]
    assert d.proc.poll() is None, "dyn serve itself died"
    body = {**CHAT, "stream": False, "max_tokens": 4}
    answers: list[httpx.Response] = []

    def served() -> bool:
        answers.append(httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=30, headers=d.auth))
        return answers[-1].status_code == 200

    assert wait_until(served, timeout=30, interval=0.2), answers[-1].text
    waiting = [a for a in answers if a.status_code != 200]
    assert all(a.status_code == 503 and int(a.headers["retry-after"]) >= 1 for a in waiting), [
        (a.status_code, a.text[:200]) for a in waiting
    ]
    (replacement,) = descendants(d.proc.pid)
    assert replacement != worker
    metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
    assert "dynamo_frontend_worker_restarts_total 1.0" in metrics


def test_a_worker_that_keeps_dying_is_given_up_after_its_budget(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d = dyn_serve("--engine", "mocker", "--workers", "1", "--lease-ttl", "2", "--max-restarts", "1")
    for round_ in range(2):
        (worker,) = descendants(d.proc.pid)
        os.kill(worker, signal.SIGKILL)
        if round_ == 0:  # the one restart the budget allows
            assert wait_until(lambda w=worker: descendants(d.proc.pid) - {w}, timeout=10)
            assert wait_until(lambda: httpx.get(f"{d.url}/health", timeout=5).status_code == 200, timeout=20)
    time.sleep(3.0)  # longer than the backoff: nothing is started again
    assert descendants(d.proc.pid) == set() and d.proc.poll() is None
    reply = httpx.post(f"{d.url}/v1/chat/completions", json={**CHAT, "stream": False}, timeout=10, headers=d.auth)
    assert reply.status_code == 404  # nobody is coming back: the model is gone, as without supervision
