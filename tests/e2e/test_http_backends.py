"""`dyn serve --backend URL --backend URL`: dyn's router in front of OpenAI-compatible servers it did not start.
The backends here are two other `dyn serve` deployments of the mocker, reached only by HTTP (their own discovery,
their own cluster secrets, the tests' API key): the official `openai` client through the front gets the backend's
own answer; a shared prefix stays on one backend, whose own cached-token count the client sees; a client that
leaves aborts the backend's request; a backend that dies is routed around with no client error and let back in
once it answers again."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.conftest import API_KEY, DynProcess, metric_sum, wait_until

MOCKER = ("--engine", "mocker", "--speedup-ratio", "10", "--served-model-name", "tiny")
PREFIX = "You are a careful assistant who answers in one short sentence. " * 12
BACKEND_KEY = {"DYN_BACKEND_API_KEY": API_KEY}  # the backends require the tests' key, as every test deployment


@pytest.fixture(scope="module")
def backends(dyn_serve_module) -> list[DynProcess]:  # type: ignore[no-untyped-def]
    return [dyn_serve_module(*MOCKER) for _ in range(2)]


@pytest.fixture(scope="module")
def front(dyn_serve_module, backends: list[DynProcess]) -> DynProcess:  # type: ignore[no-untyped-def]
    flags = [arg for b in backends for arg in ("--backend", b.url)]
    return dyn_serve_module(*flags, "--router", "kv", "--model", "smollm2", env=BACKEND_KEY)  # type: ignore[no-any-return]


def _client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=30)


def _metric(d: DynProcess, prefix: str) -> float:
    return metric_sum(d.url, prefix, d.auth)


def _served(d: DynProcess) -> float:
    return _metric(d, 'dynamo_frontend_requests_total{endpoint="completions"')


def test_the_client_gets_the_backends_own_answer_streamed(front: DynProcess, backends: list[DynProcess]) -> None:
    assert "2 workers, router kv" in "\n".join(front.lines)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12}
    ask |= {"temperature": 0.0, "seed": 11}
    direct = _client(backends[0]).chat.completions.create(**ask)  # type: ignore[call-overload]
    stream = _client(front).chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == direct.choices[0].message.content and len([p for p in pieces if p]) >= 1
    models = _client(front).models.list().data
    assert [m.id for m in models] == ["tiny"]  # the backends' own model name, served as it is


def test_a_shared_prefix_stays_on_one_backend_whose_cache_the_client_sees(
    front: DynProcess, backends: list[DynProcess]
) -> None:
    before = [_served(b) for b in backends]
    cached = []
    for i in range(6):
        reply = _client(front).completions.create(model="tiny", prompt=f"{PREFIX} Question {i}:", max_tokens=3)
        details = reply.usage.prompt_tokens_details if reply.usage is not None else None
        cached.append(details.cached_tokens if details is not None else None)
    moved = sorted(_served(b) - n for b, n in zip(backends, before, strict=True))
    assert moved == [0, 6]  # approximate KV routing: the router's own decisions stand in for the backends' caches
    assert all(n and n >= 64 for n in cached[1:])  # the backend's prefix cache, as the backend counted it
    assert _metric(front, "dynamo_frontend_worker_kv_events{") == 0  # both routed approximately, and it says so


def test_a_client_that_leaves_aborts_the_backends_request(front: DynProcess, backends: list[DynProcess]) -> None:
    cancelled = [_metric(b, "dynamo_frontend_model_cancellation_total{") for b in backends]
    body = {"model": "tiny", "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/completions", json=body, headers=front.auth, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # generating at the backend
    assert wait_until(lambda: sum(_metric(b, "dynamo_frontend_inflight_requests{") for b in backends) == 0, 20)
    after = [_metric(b, "dynamo_frontend_model_cancellation_total{") for b in backends]
    assert sum(after) == sum(cancelled) + 1


def test_a_backends_refusal_is_the_clients_error(front: DynProcess) -> None:
    with pytest.raises(openai.BadRequestError) as refused:  # the front takes penalties; the backend's mocker does not
        _client(front).completions.create(model="tiny", prompt="Hi", max_tokens=2, presence_penalty=0.5)
    assert "the backend refused the request" in str(refused.value) and "presence_penalty" in str(refused.value)
    assert _client(front).completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text  # serving on


def test_a_backend_that_dies_is_routed_around_and_let_back_in(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    a, b = dyn_serve(*MOCKER), dyn_serve(*MOCKER)
    front = dyn_serve("--backend", a.url, "--backend", b.url, "--router", "kv", "--model", "smollm2", env=BACKEND_KEY)
    prompt = f"{PREFIX} Which backend?"
    _client(front).completions.create(model="tiny", prompt=prompt, max_tokens=2)
    served, other = (a, b) if _served(a) > _served(b) else (b, a)
    port = int(served.url.rsplit(":", 1)[1])
    served.stop()
    for _ in range(4):  # each request goes on at the other backend: no client error
        assert _client(front).completions.create(model="tiny", prompt=prompt, max_tokens=2).choices[0].text
    assert _metric(front, "dynamo_frontend_worker_stalls_total{") == 1  # out of routing after the first failure
    assert _served(other) >= 4 + 1  # its dialect probe at start, and the four
    again = dyn_serve(*MOCKER, "--port", str(port))  # the same address: the canary gets through again
    assert again.url == served.url
    assert wait_until(lambda: _metric(front, "dynamo_frontend_worker_recoveries_total{") == 1, timeout=30)
    logs = "\n".join(front.lines)
    assert re.search(r"is hung: the backend at http://127\.0\.0\.1:\d+: ConnectError", logs)
    started = time.monotonic()
    assert _client(front).completions.create(model="tiny", prompt=prompt, max_tokens=2).choices[0].text
    assert time.monotonic() - started < 5


def test_a_backend_file_is_followed_as_lines_come_and_go(  # type: ignore[no-untyped-def]
    dyn_serve, backends: list[DynProcess], tmp_path
) -> None:
    listed = tmp_path / "backends.txt"
    listed.write_text(f"# the fleet\n{backends[0].url}\n")
    front = dyn_serve("--backend-file", str(listed), "--router", "kv", "--model", "smollm2", env=BACKEND_KEY)
    assert "1 workers, router kv" in "\n".join(front.lines)

    def workers() -> float:
        return _metric(front, "dynamo_frontend_workers{")

    listed.write_text(f"# the fleet\n{backends[0].url}\n{backends[1].url}  # added\n")
    assert wait_until(lambda: workers() == 2, timeout=30)
    listed.write_text(f"{backends[1].url}\n")  # the first taken away
    assert wait_until(lambda: workers() == 1, timeout=30)
    before = [_served(b) for b in backends]
    for _ in range(3):
        assert _client(front).completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text
    assert [_served(b) - n for b, n in zip(backends, before, strict=True)] == [0, 3]  # only the one listed
    listed.write_text(f"{backends[1].url}\nftp://nowhere\n")  # a bad line: the backends stay as they are
    assert wait_until(lambda: "line 2" in "\n".join(front.lines), timeout=10)
    assert workers() == 1


def test_logprobs_from_backends_that_do_not_name_them_by_id_are_a_400_naming_the_field(front: DynProcess) -> None:
    with pytest.raises(openai.BadRequestError) as refused:  # dyn's backends do not take return_tokens_as_token_ids
        _client(front).completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=1)
    assert "logprobs" in str(refused.value)
