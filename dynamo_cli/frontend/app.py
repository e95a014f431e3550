"""The ASGI app: OpenAI routes on a fast raw-ASGI path, the rest on Starlette.

`POST /v1/chat/completions` and `/v1/completions` are handled as raw ASGI (no Request object, no
per-request task group): they are the hot path. `/v1/models`, `/health`, `/live` and `/metrics` are
ordinary Starlette routes. With API keys configured, every path but the probes (and `/metrics`
unless `--metrics-require-key`) passes `auth.Gate` first, before any body is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dynamo_cli.config import FrontendConfig
from dynamo_cli.engine import Guided, check_token_ids
from dynamo_cli.errors import DynError, ModelNotFound, NoWorkers, RequestError
from dynamo_cli.frontend.auth import Gate
from dynamo_cli.frontend.choices import ChoicesResponse, fan_in
from dynamo_cli.frontend.dispatch import Dispatch, DispatchRules, Sampling, plan_request
from dynamo_cli.frontend.embeddings import embed, parse_embeddings
from dynamo_cli.frontend.features import check_features
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.models import ModelEntry, ModelRegistry
from dynamo_cli.frontend.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    logit_bias,
    parse_chat,
    parse_completion,
    requested_logprobs,
    stop_list,
)
from dynamo_cli.frontend.openapi import openapi_document
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.replies import SSE_HEADERS as _SSE
from dynamo_cli.frontend.replies import Write, reply_json, stream_sse
from dynamo_cli.frontend.replies import error_type as _error_type
from dynamo_cli.frontend.replies import internal as _internal
from dynamo_cli.frontend.replies import send_error as _send_error
from dynamo_cli.frontend.replies import watch_disconnect as _watch_disconnect
from dynamo_cli.frontend.streaming import DONE, ChunkFormatter
from dynamo_cli.frontend.tools.chat import prepare_chat
from dynamo_cli.frontend.translation import TRANSLATIONS, Translation
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.runtime.supervisor import cancel_and_wait

logger = logging.getLogger(__name__)



class ClientGone(Exception):
    """The HTTP client disconnected."""


class Frontend:
    """The OpenAI-compatible HTTP service over a model registry."""

    def __init__(self, config: FrontendConfig, registry: ModelRegistry, metrics: FrontendMetrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.standby: Callable[[str], float | None] | None = None
        """Set by `dyn serve`: for a model whose workers are restarting, seconds until one may serve
        again (requests then get 503 with Retry-After instead of 404); None when none is coming back."""
        self._openapi = msgspec.json.encode(openapi_document())
        self._gate = Gate(config.auth) if config.auth.api_keys else None
        self.rules = DispatchRules(config.migration_limit, registry.busy, is_remote=config.router == "remote",
                                   disagg=config.disagg, queue=config.queue)  # fmt: skip
        self._rest = Starlette(
            routes=[
                Route("/v1/models", self.list_models),
                Route("/health", self.health),
                Route("/live", self.live),
                Route("/metrics", self.prometheus),
                Route("/openapi.json", self.openapi),
            ],
            exception_handlers={404: self._not_found, 405: self._not_found, Exception: self._server_error},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._gate is not None and scope["type"] == "http" and not self._gate.is_open(scope["path"]):
            return await self._guarded(scope, receive, send, self._gate)
        await self._route(scope, receive, send)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, gate: Gate) -> None:
        try:
            admission = gate.admit(scope["headers"], time.monotonic())
        except RequestError as exc:
            logger.debug("refused %s %s from %s: %s", scope["method"], scope["path"], scope.get("client"), exc)
            self.metrics.refused.labels(exc.code).inc()
            return await _send_error(send, exc)
        try:
            await self._route(scope, receive, send)
        finally:
            admission.release()

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == "/v1/chat/completions":
                return await self._generate(scope, receive, send, is_chat=True)
            if path == "/v1/completions":
                return await self._generate(scope, receive, send, is_chat=False)
            if path in TRANSLATIONS:
                return await self._translated(scope, receive, send, TRANSLATIONS[path])
            if path == "/v1/embeddings":
                return await self._embeddings(scope, receive, send)
        await self._rest(scope, receive, send)

    ##### Hot path #####

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, is_chat: bool) -> None:
        endpoint = "chat_completions" if is_chat else "completions"
        try:
            body = await self._read_body(scope, receive)
            request = parse_chat(body) if is_chat else parse_completion(body)
            generations = await self._prepare(request, scope)
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        except Exception as exc:  # a bug, not the client's fault: a 500 in OpenAI's shape, findable in the log
            return await _send_error(send, _internal(exc, "preparing a request"))
        generation = generations[0]
        model = generation.dispatch.entry.name
        self.metrics.inflight.labels(model).inc()
        status = "success"
        try:
            if len(generations) > 1 or generation.dispatch.plan.sampling.logprobs is not None:
                status = await self._choices(generations, request, send, receive, is_chat)
            elif request.stream:
                status = await self._stream(generation, request, send, receive, is_chat)
            else:
                status = await self._complete(generation, send, is_chat)
        finally:
            for gen in generations:
                await gen.dispatch.aclose()  # idempotent: load and prefilled KV never leak
                self._observe(gen)
            self.metrics.inflight.labels(model).dec()
            self.metrics.requests.labels(model, endpoint, "stream" if request.stream else "unary", status).inc()

    async def _prepare(self, request: ChatCompletionRequest | CompletionRequest, scope: Scope) -> list[Generation]:
        """Check, template, tokenize, plan and start the request's `n` dispatches (one per choice)."""
        entry = self._entry(request.model)
        check_features(request, entry.card)
        tokenizer = await entry.tokenizer
        chat = None
        if isinstance(request, ChatCompletionRequest):
            chat = prepare_chat(request, entry.card, tokenizer, self.config.tool_call_parser,
                                self.config.reasoning_parser)  # fmt: skip
            if chat.output is not None and (request.n > 1 or request.logprobs):
                what = "n > 1" if request.n > 1 else "logprobs"
                raise RequestError(f"{what} together with tools, response_format or a reasoning parser is not "
                                   "supported yet; send them in separate requests", param="n" if request.n > 1
                                   else "logprobs")  # fmt: skip
        prompt_ids, max_tokens, echo = _prompt(request, tokenizer, chat.prompt if chat is not None else None)
        sampling = _sampling(request, max_tokens, chat.guided if chat is not None else None)
        check_token_ids(sampling.stop_token_ids, "stop_token_ids", tokenizer.vocab_size)
        check_token_ids([t for t, _ in sampling.logit_bias], "logit_bias", tokenizer.vocab_size)
        headers = dict(scope["headers"])
        prefix = "chatcmpl-" if isinstance(request, ChatCompletionRequest) else "cmpl-"
        # The id workers see is always ours: a client's x-request-id is echoed back, never reused inside.
        request_id = prefix + uuid.uuid4().hex
        client_id = _client_request_id(headers.get(b"x-request-id"))
        pinned, explain = _pinned(headers.get(b"x-worker-instance-id")), headers.get(b"x-dyn-explain-route")
        priority = _int_header(headers.get(b"x-dyn-priority"), "x-dyn-priority", -1000, 1000)
        deadline_ms = _int_header(headers.get(b"x-dyn-deadline-ms"), "x-dyn-deadline-ms", 1, 86_400_000)
        deadline = time.monotonic() + deadline_ms / 1000 if deadline_ms else None
        generations: list[Generation] = []
        try:
            for index in range(request.n):  # choice i: request id "-i", seed + i
                plan = plan_request(entry, request_id if index == 0 else f"{request_id}-{index}", prompt_ids,
                                    _nth_seed(sampling, index), pinned_worker=pinned, client_request_id=client_id,
                                    is_explained=explain in (b"1", b"true", b"yes"), priority=priority or 0,
                                    deadline=deadline)  # fmt: skip
                generations.append(Generation(Dispatch(entry, plan, self.rules, self.metrics), tokenizer, echo=echo))
                generations[-1].output = chat.output if chat is not None else None
                await generations[-1].dispatch.start()
        except BaseException:
            for gen in generations:
                await gen.dispatch.aclose()
            raise
        return generations

    def _entry(self, model: str) -> ModelEntry:
        try:
            return self.registry.get(model)
        except ModelNotFound:
            wait = self.standby(model) if self.standby is not None else None
            if wait is None:
                raise
            raise NoWorkers(f"model '{model}' (its workers are restarting)", retry_after=wait) from None

    async def _stream(self, gen: Generation, request: Any, send: Send, receive: Receive, is_chat: bool) -> str:
        d = gen.dispatch
        fmt = ChunkFormatter(d.plan.request_id, d.entry.name, is_chat=is_chat)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE, *_ids(gen)]})  # fmt: skip
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, d.abort))
        status = "success"
        head = fmt.role() if is_chat else b""  # rides with the first content chunk: one write fewer
        out = gen.output
        try:
            async for piece in gen.text():
                body = fmt.text(piece) if out is None else b"".join(fmt.delta(x) for x in out.push(piece))
                if body:
                    await send({"type": "http.response.body", "body": head + body, "more_body": True})
                    head = b""
            if d.is_aborted:
                status = "cancelled"
            reason = gen.finish_reason or "length"
            tail = b"" if out is None else b"".join(fmt.delta(x) for x in out.finish())
            tail = b"" if status == "cancelled" else tail + fmt.finish(out.finish_reason(reason) if out else reason)
            if include_usage and status != "cancelled":
                tail += fmt.usage(len(d.plan.prompt_ids), gen.completion_tokens, d.cached_tokens)
        except DynError as exc:
            status = "error"
            tail = fmt.error(str(exc), _error_type(exc), getattr(exc, "code", None))
        except Exception as exc:  # the stream still ends with an error event and [DONE]
            status = "error"
            error = _internal(exc, f"streaming request {d.plan.request_id}")
            tail = fmt.error(str(error), "internal_error", "internal_error")
        finally:
            await cancel_and_wait(watcher)
        if status == "cancelled":
            self.metrics.disconnected.labels(d.entry.name).inc()
            self.metrics.cancellations.labels(d.entry.name).inc()
        await send({"type": "http.response.body", "body": head + tail + DONE, "more_body": False})
        return status

    async def _complete(self, gen: Generation, send: Send, is_chat: bool) -> str:
        d = gen.dispatch
        fmt = ChunkFormatter(d.plan.request_id, d.entry.name, is_chat=is_chat)

        async def body() -> bytes:
            text = "".join([piece async for piece in gen.text()])
            reason, out = gen.finish_reason or "length", gen.output
            message = out.message(text) if out is not None else None
            reason = out.finish_reason(reason) if out is not None else reason
            return fmt.full(text, reason, len(d.plan.prompt_ids), gen.completion_tokens, d.cached_tokens, message)

        return await reply_json(send, body, lambda: _ids(gen), d.plan.request_id)

    async def _choices(self, gens: list[Generation], request: Any, send: Send, receive: Receive, is_chat: bool) -> str:
        """n choices and/or logprobs (choices.py): one body, or SSE events naming each choice's index."""
        d = gens[0].dispatch
        response = ChoicesResponse(d.plan.request_id, d.entry.name, gens, is_chat=is_chat,
                                   wants_logprobs=d.plan.sampling.logprobs is not None)  # fmt: skip
        if not request.stream:
            return await reply_json(send, response.body, lambda: _ids(gens[0]), d.plan.request_id)
        started: set[int] = set()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        async def produce(write: Write) -> bytes:
            async def on_piece(index: int, piece: str | None, items: list[Any]) -> None:
                await write(response.event(index, piece, items, is_first=index not in started))
                started.add(index)

            await fan_in(gens, on_piece)
            return response.usage_event() if include_usage and not d.is_aborted else b""

        def abort() -> None:
            for gen in gens:
                gen.dispatch.abort()

        def error_tail(exc: DynError) -> bytes:
            return ChunkFormatter("", "", is_chat=is_chat).error(str(exc), _error_type(exc), getattr(exc, "code", None))

        return await stream_sse(send, receive, _ids(gens[0]), produce, abort, error_tail, d.plan.request_id, done=DONE)

    async def _translated(self, scope: Scope, receive: Receive, send: Send, api: Translation) -> None:
        """/v1/responses and /v1/messages: a chat request underneath; the API's own object or events."""
        try:
            request = api.parse(await self._read_body(scope, receive))
            generation = (await self._prepare(api.to_chat(request), scope))[0]
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        except Exception as exc:
            return await _send_error(send, _internal(exc, "preparing a request"))
        writer, d = api.writer(request, generation), generation.dispatch
        self.metrics.inflight.labels(d.entry.name).inc()
        status = "error"
        try:
            if not request.stream:
                status = await reply_json(send, writer.body, lambda: _ids(generation), d.plan.request_id)
                return

            async def produce(write: Write) -> bytes:
                async for event in writer.events():
                    await write(event)
                return b""

            status = await stream_sse(send, receive, _ids(generation), produce, d.abort, writer.error_event,
                                      d.plan.request_id, done=b"")  # fmt: skip
        finally:
            await d.aclose()
            self._observe(generation)
            self.metrics.inflight.labels(d.entry.name).dec()
            stream = "stream" if request.stream else "unary"
            self.metrics.requests.labels(d.entry.name, api.name, stream, status).inc()

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/v1/embeddings (embeddings.py): on a worker of the model, over the request plane."""
        try:
            request = parse_embeddings(await self._read_body(scope, receive))
            entry = self._entry(request.model)
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        status = await reply_json(send, lambda: embed(entry, request), list, "embeddings")
        self.metrics.requests.labels(entry.name, "embeddings", "unary", status).inc()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _too_large(int(value), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _observe(self, gen: Generation) -> None:
        d = gen.dispatch
        m, model = self.metrics, d.entry.name
        end = time.perf_counter()
        m.isl.labels(model).observe(len(d.plan.prompt_ids))
        m.osl.labels(model).observe(gen.completion_tokens)
        m.output_tokens.labels(model).inc(gen.completion_tokens)
        m.duration.labels(model).observe(end - d.started_at)
        if d.cached_tokens is not None:
            m.cached.labels(model).observe(d.cached_tokens)
        if d.first_token_at is not None:
            m.ttft.labels(model).observe(d.first_token_at - d.started_at)
            if gen.completion_tokens > 1:
                m.itl.labels(model).observe((end - d.first_token_at) / (gen.completion_tokens - 1))

    ##### REST #####

    async def list_models(self, request: Request) -> Response:
        # servable(): a model only prefill workers serve has nothing to decode on, so it is not listed
        data = [
            {"id": e.name, "object": "model", "created": 0, "owned_by": "dyn",
             "max_model_len": e.card.context_length, "num_workers": len(e.workers) + len(e.prefill_workers)}
            for e in self.registry.servable()
        ]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        instances = [
            {"model": e.name, "instance_id": f"{wid:x}", "address": w.record.address, "role": w.card.role}
            for e in self.registry.servable() for wid, w in {**e.workers, **e.prefill_workers}.items()
        ]  # fmt: skip
        healthy = bool(instances)
        body = {"status": "healthy" if healthy else "unhealthy", "instances": instances}
        if not healthy:
            body["message"] = "No endpoints available"
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type="application/json")

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def prometheus(self, request: Request) -> Response:
        for name, entry in self.registry.models.items():
            self.metrics.workers.labels(name).set(len(entry.workers) + len(entry.prefill_workers))
            self.metrics.queued.labels(name).set(len(entry.queue))
            for worker in (*entry.workers.values(), *entry.prefill_workers.values()):
                if worker.load is not None and worker.load.kv_tiers is not None:
                    self.metrics.export_kv_tiers(name, worker.instance_id, worker.load.kv_tiers)
            counters = getattr(entry.policy, "counters", None)
            if counters is not None:
                self.metrics.export_router(name, counters.to_dict())
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        error = _internal(exc, f"serving {request.method} {request.url.path}")
        return Response(error_body(str(error), "internal_error", None, "internal_error"), status_code=500,
                        media_type="application/json")  # fmt: skip

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = f"no route {request.method} {request.url.path}" if status == 404 else f"{request.method} not allowed"
        return Response(error_body(message, "not_found_error" if status == 404 else "invalid_request_error"),
                        status_code=status, media_type="application/json")  # fmt: skip


MAX_REQUEST_ID = 128


def _prompt(
    request: ChatCompletionRequest | CompletionRequest, tokenizer: Tokenizer, chat_prompt: str | None
) -> tuple[list[int], int | None, str]:
    """The prompt's token ids, the max_tokens asked (None: as many as fit) and the text to echo; a chat
    request's prompt comes rendered (tools/chat.py)."""
    if isinstance(request, ChatCompletionRequest):
        assert chat_prompt is not None
        return tokenizer.encode(chat_prompt), request.max_completion_tokens or request.max_tokens, ""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        prompt_ids = list(prompt)  # the client's ids: only these can be outside the vocabulary
        check_token_ids(prompt_ids, "prompt", tokenizer.vocab_size)
    else:
        prompt_ids = tokenizer.encode(prompt if isinstance(prompt, str) else prompt[0])
    echo = "" if not request.echo else prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    return prompt_ids, request.max_tokens if request.max_tokens is not None else 16, echo


def _sampling(request: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
              guided: Guided | None) -> Sampling:  # fmt: skip
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(0, request.top_k or 0),
        seed=request.seed,
        stop=tuple(stop_list(request.stop)),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=tuple(logit_bias(request.logit_bias).items()) if request.logit_bias else (),
        min_p=request.min_p or 0.0,
        logprobs=requested_logprobs(request),
        guided=guided,
    )


def _nth_seed(sampling: Sampling, index: int) -> Sampling:
    """Choice `index`'s sampling: seed + index (kept in int64), so seeded choices differ yet repeat."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index + 2**63) % 2**64 - 2**63)


def _client_request_id(header: bytes | None) -> str | None:
    """The caller's x-request-id, when it is printable ASCII of at most MAX_REQUEST_ID bytes."""
    if not header:
        return None
    if len(header) > MAX_REQUEST_ID or not all(0x20 < byte < 0x7F for byte in header):
        raise RequestError(f"header x-request-id must be 1-{MAX_REQUEST_ID} printable ASCII characters",
                           param="x-request-id")  # fmt: skip
    return header.decode("ascii")


def _int_header(header: bytes | None, name: str, low: int, high: int) -> int | None:
    """An integer header within [low, high], or None when absent; else a 400 naming the header."""
    if not header:
        return None
    try:
        value = int(header)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise RequestError(f"header {name} must be an integer in {low}..{high}", param=name)
    return value


def _pinned(header: bytes | None) -> int | None:
    if not header:
        return None
    try:
        return int(header, 16)
    except ValueError:
        raise RequestError(
            f"x-worker-instance-id '{header.decode(errors='replace')}' is not a hex instance id"
        ) from None


def _ids(gen: Generation) -> list[tuple[bytes, bytes]]:
    """x-request-id, the backend that serves and, behind `dyn router`s, the router that routed."""
    d = gen.dispatch
    headers = [(b"x-request-id", (d.plan.client_request_id or d.plan.request_id).encode()),
               (b"x-worker-instance-id", f"{d.served_by or 0:x}".encode())]  # fmt: skip
    if d.rules.is_remote and d.worker is not None:
        headers.append((b"x-dyn-router-instance-id", f"{d.worker.instance_id:x}".encode()))
    if d.plan.is_explained and d.decision is not None:
        headers.append((b"x-dyn-route", msgspec.json.encode(_hex_ids(d.decision.explanation))))
    if d.plan.is_explained and d.prefill is not None:
        headers.append((b"x-dyn-prefill-route", msgspec.json.encode(_hex_ids(d.prefill))))
    if d.prefill is not None and "prefill_worker_id" in d.prefill:
        headers.append((b"x-dyn-prefill-instance-id", f"{d.prefill['prefill_worker_id']:x}".encode()))
    return headers


def _hex_ids(explanation: dict[str, Any]) -> dict[str, Any]:
    """Worker ids as the hex strings every other place shows."""

    def fix(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: fix(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v, key) for v in value]
        return f"{value:x}" if key.endswith("worker_id") and isinstance(value, int) else value

    return fix(explanation)  # type: ignore[no-any-return]


def _too_large(size: int, limit: int) -> RequestError:
    error = RequestError(f"request body of {size} bytes exceeds the {limit}-byte limit", code="payload_too_large")
    error.status = 413
    return error
