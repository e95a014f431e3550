"""`--engine http` against a real HTTP server on a loopback port that answers what each test scripts: the two
dialects (token ids, text), the request the backend is sent, and a backend that misbehaves (a refusal, an error
event, bytes that are no event, a line without end, token ids outside the vocabulary, a stream cut short, no
server at all): each is a clean error of the one request, the engine serves on."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from dyn_engines.http import HttpEngine
from dyn_engines.http.events import CHECK_EVENTS
from dyn_engines.http.upstream import MAX_LINE_BYTES

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import BackendUnavailable, ConfigError, DynError, RequestError
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.wire import GenerateChunk, GenerateRequest, SamplingParams
from tests.engines.kv_publisher import Publisher, first_blocks, payload, stored

Answer = Callable[[dict[str, Any]], bytes]


def sse(*events: dict[str, Any] | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return _http(200, "".join(lines).encode(), "text/event-stream")


def _http(status: int, body: bytes, kind: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


def piece(text: str = "", token_ids: list[int] | None = None, reason: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"choices": [choice]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 16}}}


def exact(body: dict[str, Any]) -> bytes:
    """A vLLM-like backend: token ids when asked for them."""
    ids = [[42], [43, 44]] if body.get("return_token_ids") else [None, None]
    return sse(piece(" a", ids[0]), piece(" b c", ids[1], "length"), USAGE, "[DONE]")


@dataclass
class Backend:
    """A loopback HTTP server: `/v1/models` lists one model, `/v1/completions` answers `answer(body)`."""

    answer: Answer = exact
    models: bytes = json.dumps({"data": [{"id": "up", "max_model_len": 2048}]}).encode()
    metrics: bytes | None = None
    """`/metrics` (None: 404)."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        size = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
        body = json.loads(await reader.readexactly(size)) if size else {}
        if head.startswith(b"GET /v1/models"):
            writer.write(_http(200, self.models))
        elif head.startswith(b"GET /metrics"):
            writer.write(_http(200, self.metrics, "text/plain") if self.metrics is not None else _http(404, b""))
        else:
            self.bodies.append(body)
            writer.write(self.answer(body))
        await writer.drain()
        if await reader.read(1) == b"":  # the client closed its side (at the end, or by aborting)
            self.hung_up.set()
        writer.close()


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    b = Backend()
    server = await asyncio.start_server(b.handle, "127.0.0.1", 0)
    b.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield b


def _engine(url: str, **extra: Any) -> HttpEngine:
    return HttpEngine(EngineArgs(model="smollm2", extra={"url": url, "start_timeout_s": 3, **extra}))


async def _run(engine: HttpEngine, request: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in engine.generate(request)]


def _request(rid: str = "r", **sampling: Any) -> GenerateRequest:
    return GenerateRequest(request_id=rid, token_ids=[1, 2, 3], max_tokens=3, sampling=SamplingParams(**sampling))


async def test_a_backend_that_returns_token_ids_is_relayed_exactly(backend: Backend) -> None:
    engine = _engine(backend.url)
    info = await engine.start()
    assert (info.model_name, info.context_length, info.extra["dialect"]) == ("up", 2048, "token_ids")
    chunks = await _run(engine, _request(temperature=0.0, seed=5, top_k=4))
    assert [c.token_ids for c in chunks] == [[42], [43, 44], []]
    assert (chunks[-1].finish_reason, chunks[-1].num_cached_tokens) == ("length", 16)
    sent = backend.bodies[-1]
    assert sent["prompt"] == [1, 2, 3] and sent["return_token_ids"] and sent["stream"]
    assert {k: sent[k] for k in ("temperature", "seed", "top_k", "max_tokens")} == {
        "temperature": 0.0, "seed": 5, "top_k": 4, "max_tokens": 3,
    }  # fmt: skip
    assert not {"top_p", "min_p", "presence_penalty", "logit_bias", "stop_token_ids"} & sent.keys()  # defaults
    await engine.stop()


async def test_a_backend_of_text_alone_has_its_text_tokenized_again(backend: Backend) -> None:
    backend.answer = lambda body: (
        _http(400, b'{"error": {"message": "unknown field return_token_ids"}}')
        if "return_token_ids" in body
        else sse(piece(" Paris is"), piece(" lovely.", reason="stop"), "[DONE]")
    )
    engine = _engine(backend.url)
    assert (await engine.start()).extra["dialect"] == "text"
    chunks = await _run(engine, _request())
    assert engine._tokenizer is not None
    assert engine._tokenizer.decode([t for c in chunks for t in c.token_ids]) == " Paris is lovely."
    assert chunks[-1].finish_reason == "stop" and "return_token_ids" not in backend.bodies[-1]
    await engine.stop()


async def test_a_backend_that_refuses_token_id_prompts_is_a_start_error(backend: Backend) -> None:
    backend.answer = lambda body: _http(401, b'{"error": {"message": "bad key"}}')
    with pytest.raises(ConfigError, match="refuses a completion of token ids.*bad key"):
        await _engine(backend.url).start()


@pytest.mark.parametrize(
    ("answer", "error", "words"),
    [
        (lambda b: _http(400, b'{"error": {"message": "top_k too big", "param": "top_k"}}'), RequestError, "top_k"),
        (lambda b: _http(503, b"overloaded"), BackendUnavailable, "answered 503: overloaded"),
        (lambda b: _http(429, b"{}"), BackendUnavailable, "answered 429"),
        (lambda b: sse(piece(" a", [42]), {"error": {"message": "engine died"}}), BackendUnavailable, "engine died"),
        (lambda b: sse("{not json"), BackendUnavailable, "no completion chunk"),
        (lambda b: sse({"choices": "no list"}), BackendUnavailable, "no completion chunk"),
        (lambda b: sse(piece(" a", [10**9], "stop"), "[DONE]"), BackendUnavailable, "outside this model's vocab"),
        (lambda b: sse(piece(" a", [42]), "[DONE]"), BackendUnavailable, "without a finish reason"),
        (lambda b: _http(200, b"data: " + b"x" * (MAX_LINE_BYTES + 10)), BackendUnavailable, "a line over"),
    ],
)
async def test_a_misbehaving_backend_fails_the_request_alone(
    backend: Backend, answer: Answer, error: type[DynError], words: str
) -> None:
    engine = _engine(backend.url)
    await engine.start()
    backend.answer = answer
    with pytest.raises(error, match=words):
        await _run(engine, _request())
    backend.answer = exact
    assert (await _run(engine, _request("next")))[-1].finish_reason == "length"  # serving on
    await engine.stop()


async def test_closing_the_stream_hangs_up_on_the_backend(backend: Backend) -> None:
    engine = _engine(backend.url)
    await engine.start()
    backend.hung_up.clear()
    backend.answer = lambda body: _http(200, b"data: " + json.dumps(piece(" a", [42])).encode() + b"\n\n" * 1000)[:-2]
    stream = engine.generate(_request())
    assert (await anext(stream)).token_ids == [42]
    await stream.aclose()
    await asyncio.wait_for(backend.hung_up.wait(), 5)
    assert not engine._in_flight
    await engine.stop()


async def test_no_backend_is_backend_unavailable_and_a_start_that_names_it() -> None:
    engine = _engine("http://127.0.0.1:9", start_timeout_s=1)
    with pytest.raises(DynError, match=r"127\.0\.0\.1:9 did not list a model within 1 s: .*ConnectError"):
        await engine.start()
    await engine.stop()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({}, "needs the backend's URL"),
        ({"url": "ftp://x"}, "give http"),
        ({"url": "http://x:1/?a=b"}, "no query"),
        ({"url": "http://x:1", "num_gpu_blocks": -1}, "must be > 0"),
        ({"url": "http://x:1", "speedup_ratio": 3}, "takes no option speedup_ratio"),
    ],
)
def test_options_are_checked_naming_the_one_that_is_wrong(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        HttpEngine(EngineArgs(model="smollm2", extra=extra))


def test_the_backend_serves_both_roles_itself() -> None:
    from dynamo_cli.engine import Role

    with pytest.raises(ConfigError, match="--role both"):
        HttpEngine(EngineArgs(model="smollm2", role=Role.PREFILL, extra={"url": "http://x:1"}))


async def test_what_a_backend_sends_after_done_is_read_only_so_far(backend: Backend) -> None:
    engine = _engine(backend.url)
    await engine.start()
    tail = b"data: " + b"y" * 1000 + b"\n"
    events = f"data: {json.dumps(piece(' a', [42], 'stop'))}\n\ndata: [DONE]\n\n".encode()
    # 200 kB after [DONE] of the 10 MB its length promises, then nothing: the request ends anyway, at once
    backend.answer = lambda body: _http(200, events + tail * 200, "text/event-stream").replace(
        b"content-length: ", b"content-length: 10000", 1
    )
    assert (await asyncio.wait_for(_run(engine, _request()), 5))[-1].finish_reason == "stop"
    await engine.stop()


VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="up"} 2.0
vllm:num_requests_running{engine="1",model_name="up"} 1.0
vllm:num_requests_waiting{engine="0",model_name="up"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="up"} 0.25
vllm:num_requests_waiting_by_reason{engine="0",model_name="up",reason="capacity"} 99.0
"""


async def test_the_backends_own_load_is_read_from_its_metrics(backend: Backend) -> None:
    backend.metrics = VLLM_METRICS
    engine = _engine(backend.url, num_gpu_blocks=1000)
    await engine.start()
    assert await _eventually(lambda: engine.load_metrics().num_waiting == 4)
    load = engine.load_metrics()  # summed over the engines (data-parallel ranks); other series left alone
    assert (load.num_running, load.active_blocks, load.total_blocks) == (3, 250, 1000)
    backend.metrics = b"nothing here 1.0\n"  # a backend that shows none of the series is not asked again
    assert await _eventually(lambda: engine._scraping is not None and engine._scraping.done())
    assert engine.load_metrics().num_waiting == 0
    await engine.stop()


async def test_a_backend_without_metrics_is_loaded_with_this_workers_requests(backend: Backend) -> None:
    engine = _engine(backend.url)
    await engine.start()
    assert engine._scraping is None  # a 404 at start: not asked again
    stream = engine.generate(_request())
    await anext(stream)
    assert engine.load_metrics().num_running == 1
    await stream.aclose()
    await engine.stop()


async def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


CACHE_INFO = (
    b'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    b'kv_cache_size_tokens="46592",num_cpu_blocks="None",num_gpu_blocks="364"} 1.0\n'
)
"""What vLLM 0.32 CPU says of its cache (labels trimmed)."""


async def test_the_backends_block_size_and_capacity_come_from_its_metrics(backend: Backend) -> None:
    backend.metrics = VLLM_METRICS + CACHE_INFO
    engine = _engine(backend.url)
    info = await engine.start()
    assert (info.block_size, info.total_kv_blocks, engine.load_metrics().total_blocks) == (128, 364, 364)
    await engine.stop()
    given = _engine(backend.url, num_gpu_blocks=99)  # the flags win where given
    given.args = replace(given.args, block_size=32)
    assert ((info := await given.start()).block_size, info.total_kv_blocks) == (32, 99)
    await given.stop()


async def test_a_block_size_unlike_the_backends_is_refused_when_its_kv_events_are_read(backend: Backend) -> None:
    backend.metrics = CACHE_INFO
    engine = _engine(backend.url, kv_events="tcp://127.0.0.1:1")
    engine.args = replace(engine.args, block_size=16)
    with pytest.raises(ConfigError, match="--block-size 16: .* caches 128-token blocks"):
        await engine.start()
    await engine.stop()


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "tcp://host", "tcp://:5557", "tcp://h:0", "ipc://", "x://h:1"])
def test_a_kv_events_endpoint_that_is_no_tcp_host_and_port_is_refused(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="kv_events=.*tcp://HOST:PORT"):
        _engine("http://127.0.0.1:1", kv_events=endpoint)


async def _events_engine(backend: Backend, publisher: Publisher) -> HttpEngine:
    engine = _engine(backend.url, kv_events=publisher.endpoint, kv_replay=publisher.replay, kv_topic="kv")
    engine.args = replace(engine.args, block_size=4)
    await engine.start()
    assert await asyncio.wait_for(publisher.pub.recv(), 10) == b"\x01kv"  # subscribed
    return engine


async def test_the_backends_kv_events_are_this_workers_with_our_hashes_and_match_its_prompts(
    backend: Backend, publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dyn_engines.http.events")
    engine = await _events_engine(backend, publisher)
    prompt = list(range(1, 9))
    await _run(engine, GenerateRequest(request_id="p", token_ids=prompt, max_tokens=3))
    for i in range(CHECK_EVENTS):  # the engine stores the prompt, then blocks of other clients' prompts
        await publisher.send(payload(stored(prompt if i == 0 else [100 + i] * 4)))
    batches = engine.kv_events()
    first = await asyncio.wait_for(anext(batches), 10)
    assert first_blocks(first) == sequence_hashes(prompt, 4)
    for _ in range(CHECK_EVENTS - 1):
        await asyncio.wait_for(anext(batches), 10)
    assert any("match the prompts sent" in r.getMessage() for r in caplog.records)
    await engine.stop()


async def test_kv_events_that_match_none_of_the_prompts_sent_are_named_in_a_warning(
    backend: Backend, publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await _events_engine(backend, publisher)
    await _run(engine, GenerateRequest(request_id="p", token_ids=list(range(1, 9)), max_tokens=3))
    for i in range(CHECK_EVENTS):  # another engine's, or tokens not ours
        await publisher.send(payload(stored([200 + i] * 4)))
    batches = engine.kv_events()
    for _ in range(CHECK_EVENTS):
        await asyncio.wait_for(anext(batches), 10)
    [warning] = [r.getMessage() for r in caplog.records if "match none of the prompts" in r.getMessage()]
    assert publisher.endpoint in warning and backend.url in warning
    await engine.stop()


def scored(names: str = "token_id:{}") -> Answer:
    """A vLLM-like backend that also gives logprobs, its tokens named as `names` says."""

    def answer(body: dict[str, Any]) -> bytes:
        ids = [[42], [43, 44]]
        pieces = [piece(" a", ids[0]), piece(" b c", ids[1], "length")]
        if body.get("logprobs") is not None:
            for p, tokens in zip(pieces, ids, strict=True):
                top = [
                    {names.format(t): -1.0, names.format(t + 100): -0.5, names.format(t + 200): -3.0} for t in tokens
                ]
                p["choices"][0]["logprobs"] = {
                    "token_logprobs": [-1.0] * len(tokens),
                    "tokens": [],
                    "top_logprobs": top,
                }
        return sse(*pieces, USAGE, "[DONE]")

    return answer


async def test_logprobs_named_by_token_id_are_forwarded_most_likely_first(backend: Backend) -> None:
    from dynamo_cli.engine import Feature

    backend.answer = scored()
    engine = _engine(backend.url)
    info = await engine.start()
    assert Feature.LOGPROBS in info.features and backend.bodies[-1]["return_tokens_as_token_ids"]  # probed
    chunks = await _run(engine, _request(logprobs=2))
    first = chunks[0].logprobs
    assert first is not None and first[0].logprob == -1.0 and first[0].top == [(142, -0.5), (42, -1.0)]
    assert chunks[1].logprobs is not None and len(chunks[1].logprobs) == 2 and chunks[-1].logprobs is None
    assert backend.bodies[-1]["logprobs"] == 2
    await _run(engine, _request())
    assert "logprobs" not in backend.bodies[-1]  # not asked: not sent
    await engine.stop()


async def test_a_backend_whose_logprobs_are_not_named_by_id_serves_without_them(backend: Backend) -> None:
    from dynamo_cli.engine import Feature

    backend.answer = scored("{}")  # tokens as text, not `token_id:N`
    engine = _engine(backend.url)
    info = await engine.start()
    assert Feature.LOGPROBS not in info.features and info.extra["dialect"] == "token_ids"
    await engine.stop()


async def test_logprobs_that_do_not_add_up_fail_the_request_alone(backend: Backend) -> None:
    engine = _engine(backend.url)
    backend.answer = scored()
    await engine.start()

    def short(body: dict[str, Any]) -> bytes:
        p = piece(" b c", [43, 44], "length")
        p["choices"][0]["logprobs"] = {"token_logprobs": [-1.0], "top_logprobs": [{"token_id:43": -1.0}]}
        return sse(p, "[DONE]")

    backend.answer = short
    with pytest.raises(BackendUnavailable, match="logprobs for 1 tokens in a piece of 2"):
        await _run(engine, _request(logprobs=1))
    backend.answer = scored()
    assert (await _run(engine, _request(logprobs=1)))[0].logprobs is not None  # serving on
    await engine.stop()
