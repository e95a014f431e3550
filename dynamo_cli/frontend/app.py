"""The ASGI app: OpenAI routes on a fast raw-ASGI path, the rest on Starlette.

`POST /v1/chat/completions` and `/v1/completions` are handled as raw ASGI (no Request object, no
per-request task group): they are the hot path. `/v1/models`, `/health`, `/live` and `/metrics` are
ordinary Starlette routes. With API keys configured, every path but the probes (and `/metrics`
unless `--metrics-require-key`) passes `auth.Gate` first, before any body is read.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dynamo_cli.config import FrontendConfig
from dynamo_cli.engine import check_token_ids
from dynamo_cli.errors import DynError, ModelNotFound, NoWorkers, RequestError
from dynamo_cli.frontend.auth import Gate
from dynamo_cli.frontend.choices import ChoicesResponse, fan_in
from dynamo_cli.frontend.embeddings import embed, parse_embeddings
from dynamo_cli.frontend.features import check_features
from dynamo_cli.frontend.headers import client_request_id, id_headers, int_header, pinned_header, too_large
from dynamo_cli.frontend.internal import INTERNAL_DEADLINE, INTERNAL_PRIORITY
from dynamo_cli.frontend.loras import LoraAdmin, adapter_rows
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.metrics_group import MetricsGroup
from dynamo_cli.frontend.models import FrontendRegistry, ServedModel
from dynamo_cli.frontend.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_chat,
    parse_completion,
)
from dynamo_cli.frontend.openapi import openapi_document
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.prompts import nth_seed, plan_request, prompt_of, sampling_of, stops_of
from dynamo_cli.frontend.replies import SSE_HEADERS as _SSE
from dynamo_cli.frontend.replies import ClientGone, Write, reply_json, stream_sse, unless_gone, watching
from dynamo_cli.frontend.replies import error_type as _error_type
from dynamo_cli.frontend.replies import internal as _internal
from dynamo_cli.frontend.replies import send_error as _send_error
from dynamo_cli.frontend.streaming import DONE, ChunkFormatter
from dynamo_cli.frontend.tools.chat import prepare_chat
from dynamo_cli.frontend.translation import TRANSLATIONS, Translation
from dynamo_cli.router.core import Dispatch, DispatchRules
from dynamo_cli.router.queue import LOWEST_CLIENT_PRIORITY
from dynamo_cli.router.sequences import ActiveSequences
from dynamo_cli.tracing.logs import enter_request
from dynamo_cli.tracing.traceparent import TRACE_SCOPE_KEY

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import RequestTrace, Tracing

logger = logging.getLogger(__name__)


def _priority(scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, float | None]:
    """The request's place in the router queue: a client's headers, or an internal request's class and deadline."""
    internal_deadline = scope.get(INTERNAL_DEADLINE)
    if internal_deadline is not None:
        return INTERNAL_PRIORITY, float(internal_deadline)
    priority = int_header(headers.get(b"x-dyn-priority"), "x-dyn-priority", LOWEST_CLIENT_PRIORITY, 1000)
    deadline_ms = int_header(headers.get(b"x-dyn-deadline-ms"), "x-dyn-deadline-ms", 1, 86_400_000)
    return priority or 0, time.monotonic() + deadline_ms / 1000 if deadline_ms else None


class Frontend:
    """The OpenAI-compatible HTTP service over a model registry."""

    def __init__(
        self,
        config: FrontendConfig,
        registry: FrontendRegistry,
        metrics: FrontendMetrics,
        rules: DispatchRules,
        tracing: Tracing | None = None,
        group: MetricsGroup | None = None,
        instance_id: int = 0,
    ) -> None:
        self.config = config
        self.tracing = tracing
        """Each OpenAI request's spans (`--otlp-endpoint`); None: tracing off."""
        self.group = group
        """`dyn serve --frontends N`: /metrics shows the group's totals."""
        self.instance_id = instance_id
        """This frontend's id on the planes (its lease), which `/health` names."""
        self.registry = registry
        self.metrics = metrics
        self.standby: Callable[[str], float | None] | None = None
        """Set by `dyn serve`: for a model whose workers are restarting, seconds until one may serve
        again (requests then get 503 with Retry-After instead of 404); None when none is coming back."""
        self._openapi = msgspec.json.encode(openapi_document())
        self._gate = Gate(config.auth) if config.auth.api_keys else None
        self.rules = rules
        loras = LoraAdmin(config, registry)
        self._rest = Starlette(
            routes=[
                Route("/v1/models", self.list_models),
                Route("/v1/load_lora_adapter", loras.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", loras.unload, methods=["POST"]),
                Route("/v1/loras", loras.listing),
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

    def add_routes(self, routes: list[Route]) -> None:
        """More routes on the ordinary (Starlette) path, behind the API-key gate: the Batch API's."""
        self._rest.router.routes.extend(routes)

    async def serve_internal(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request from this process itself (frontend/internal.py): past the API-key gate, which let its
        batch in."""
        await self._route(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            if self.tracing is not None and TRACE_SCOPE_KEY not in scope:  # in the request's span, once
                return await self.tracing.serve_http(scope, receive, send, self._route)
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
        request_id = self._enter(scope, "chatcmpl-" if is_chat else "cmpl-")
        try:
            body = await self._read_body(scope, receive)
            request = parse_chat(body) if is_chat else parse_completion(body)
            generations = await self._prepare_unless_gone(request, scope, receive, request_id)
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        except Exception as exc:  # a bug, not the client's fault: a 500 in OpenAI's shape, findable in the log
            return await _send_error(send, _internal(exc, "preparing a request"))
        generation = generations[0]
        model = generation.dispatch.model
        self.metrics.inflight.labels(model).inc()
        status = "success"
        try:
            if len(generations) > 1 or generation.dispatch.plan.request.sampling.logprobs is not None:
                status = await self._choices(generations, request, send, receive, is_chat)
            elif request.stream:
                status = await self._stream(generation, request, send, receive, is_chat)
            else:
                status = await self._complete(generation, send, receive, is_chat)
        finally:
            for gen in generations:
                await gen.dispatch.aclose()  # idempotent: load and prefilled KV never leak
                self._observe(gen)
            self.metrics.inflight.labels(model).dec()
            self.metrics.requests.labels(model, endpoint, "stream" if request.stream else "unary", status).inc()

    def _enter(self, scope: Scope, prefix: str) -> str:
        """A new request id (the workers only ever see ours), named from now on by this task's log lines."""
        request_id = prefix + uuid.uuid4().hex
        trace: RequestTrace | None = scope.get(TRACE_SCOPE_KEY) if self.tracing is not None else None
        enter_request(request_id, trace.trace_id if trace is not None else "")
        return request_id

    async def _prepare_unless_gone(
        self, request: ChatCompletionRequest | CompletionRequest, scope: Scope, receive: Receive, request_id: str
    ) -> list[Generation]:
        """`_prepare`, watching for the client to leave: its waits for a worker end then (see `Interruptible`),
        and what was prepared for a client gone by the end is closed: ClientGone."""
        generations, is_gone = await unless_gone(lambda: self._prepare(request, scope, request_id), receive)
        if is_gone:
            for gen in generations:
                await gen.dispatch.aclose()
            raise ClientGone()
        return generations

    async def _prepare(
        self, request: ChatCompletionRequest | CompletionRequest, scope: Scope, request_id: str
    ) -> list[Generation]:
        """Check, template, tokenize, plan and start the request's `n` dispatches (one per choice)."""
        entry, lora = self._entry(request.model)
        trace: RequestTrace | None = scope.get(TRACE_SCOPE_KEY) if self.tracing is not None else None
        if trace is not None:
            trace.describe(request.model, request_id)
        check_features(request, entry.card)
        tokenizer = await entry.tokenizer
        tokenize = trace.child("tokenize") if trace is not None else None
        chat = None
        if isinstance(request, ChatCompletionRequest):
            chat = prepare_chat(
                request, entry.card, tokenizer, self.config.tool_call_parser, self.config.reasoning_parser
            )
            if chat.output is not None and (request.n > 1 or request.logprobs):
                what = "n > 1" if request.n > 1 else "logprobs"
                raise RequestError(
                    f"{what} together with tools, response_format or a reasoning parser is not "
                    "supported yet; send them in separate requests",
                    param="n" if request.n > 1 else "logprobs",
                )
        prompt_ids, max_tokens, echo = await prompt_of(request, tokenizer, chat.prompt if chat is not None else None)
        if tokenize is not None:
            tokenize.end_tokenize(len(prompt_ids))
        sampling = sampling_of(request, chat.guided if chat is not None else None)
        check_token_ids(sampling.stop_token_ids, "stop_token_ids", tokenizer.vocab_size)
        check_token_ids(list(sampling.logit_bias), "logit_bias", tokenizer.vocab_size)
        stop = stops_of(request)
        headers = dict(scope["headers"])
        # The id workers see is always ours: a client's x-request-id is echoed back, never reused inside.
        client_id = client_request_id(headers.get(b"x-request-id"))
        pinned, explain = pinned_header(headers.get(b"x-worker-instance-id")), headers.get(b"x-dyn-explain-route")
        priority, deadline = _priority(scope, headers)
        generations: list[Generation] = []
        try:
            for index in range(request.n):  # choice i: request id "-i", seed + i
                plan = plan_request(
                    entry,
                    request_id if index == 0 else f"{request_id}-{index}",
                    prompt_ids,
                    max_tokens,
                    nth_seed(sampling, index),
                    pinned_worker=pinned,
                    client_request_id=client_id,
                    is_explained=explain in (b"1", b"true", b"yes"),
                    priority=priority,
                    deadline=deadline,
                    trace=trace,
                    lora=lora,
                )
                generations.append(Generation(Dispatch(entry, plan, self.rules), tokenizer, echo=echo, stop=stop))
                generations[-1].output = chat.output if chat is not None else None
                await generations[-1].dispatch.start()
        except BaseException:
            for gen in generations:
                await gen.dispatch.aclose()
            raise
        return generations

    def _entry(self, model: str) -> tuple[ServedModel, str]:
        """The entry serving `model` and its LoRA adapter ("": a base model)."""
        try:
            return self.registry.resolve(model)
        except ModelNotFound:
            wait = self.standby(model) if self.standby is not None else None
            if wait is None:
                raise
            raise NoWorkers(f"model '{model}' (its workers are restarting)", retry_after=wait) from None

    async def _stream(self, gen: Generation, request: Any, send: Send, receive: Receive, is_chat: bool) -> str:
        d = gen.dispatch
        fmt = ChunkFormatter(d.plan.request_id, d.model, is_chat=is_chat)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        await send({"type": "http.response.start", "status": 200, "headers": [*_SSE, *id_headers(gen)]})
        status = "success"
        head = fmt.role() if is_chat else b""  # rides with the first content chunk: one write fewer
        out = gen.output
        async with watching(receive, d.abort):
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
                    tail += fmt.usage(len(d.plan.prompt_ids), gen.completion_tokens, gen.cached_tokens)
            except DynError as exc:
                status = "error"
                tail = fmt.error(str(exc), _error_type(exc), exc.code)
            except Exception as exc:  # the stream still ends with an error event and [DONE]
                status = "error"
                error = _internal(exc, f"streaming request {d.plan.request_id}")
                tail = fmt.error(str(error), "internal_error", "internal_error")
        if status == "cancelled":
            self._count_gone(d)
        await send({"type": "http.response.body", "body": head + tail + DONE, "more_body": False})
        return status

    async def _complete(self, gen: Generation, send: Send, receive: Receive, is_chat: bool) -> str:
        """One JSON body; a client that leaves meanwhile aborts the work (the worker frees its KV at once)."""
        d = gen.dispatch
        fmt = ChunkFormatter(d.plan.request_id, d.model, is_chat=is_chat)

        async def body() -> bytes:
            text = "".join([piece async for piece in gen.text()])
            reason, out = gen.finish_reason or "length", gen.output
            message = out.message(text) if out is not None else None
            reason = out.finish_reason(reason) if out is not None else reason
            return fmt.full(text, reason, len(d.plan.prompt_ids), gen.completion_tokens, gen.cached_tokens, message)

        async with watching(receive, d.abort):
            status = await reply_json(send, body, lambda: id_headers(gen), d.plan.request_id)
        if d.is_aborted:
            self._count_gone(d)
            return "cancelled"
        return status

    def _count_gone(self, d: Dispatch) -> None:
        self.metrics.disconnected.labels(d.entry.name).inc()
        self.metrics.cancellations.labels(d.entry.name).inc()

    async def _choices(self, gens: list[Generation], request: Any, send: Send, receive: Receive, is_chat: bool) -> str:
        """n choices and/or logprobs (choices.py): one body, or SSE events naming each choice's index."""
        d = gens[0].dispatch
        response = ChoicesResponse(
            d.plan.request_id,
            d.model,
            gens,
            is_chat=is_chat,
            wants_logprobs=d.plan.request.sampling.logprobs is not None,
        )
        if not request.stream:
            return await reply_json(send, response.body, lambda: id_headers(gens[0]), d.plan.request_id)
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
            return ChunkFormatter("", "", is_chat=is_chat).error(str(exc), _error_type(exc), exc.code)

        return await stream_sse(
            send, receive, id_headers(gens[0]), produce, abort, error_tail, d.plan.request_id, done=DONE
        )

    async def _translated(self, scope: Scope, receive: Receive, send: Send, api: Translation) -> None:
        """/v1/responses and /v1/messages: a chat request underneath; the API's own object or events."""
        request_id = self._enter(scope, "chatcmpl-")  # a chat request underneath
        try:
            request = api.parse(await self._read_body(scope, receive))
            generation = (await self._prepare_unless_gone(api.to_chat(request), scope, receive, request_id))[0]
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        except Exception as exc:
            return await _send_error(send, _internal(exc, "preparing a request"))
        writer, d = api.writer(request, generation), generation.dispatch
        self.metrics.inflight.labels(d.model).inc()
        status = "error"
        try:
            if not request.stream:
                status = await reply_json(send, writer.body, lambda: id_headers(generation), d.plan.request_id)
                return

            async def produce(write: Write) -> bytes:
                async for event in writer.events():
                    await write(event)
                return b""

            status = await stream_sse(
                send, receive, id_headers(generation), produce, d.abort, writer.error_event, d.plan.request_id, done=b""
            )
        finally:
            await d.aclose()
            self._observe(generation)
            self.metrics.inflight.labels(d.model).dec()
            stream = "stream" if request.stream else "unary"
            self.metrics.requests.labels(d.model, api.name, stream, status).inc()

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/v1/embeddings (embeddings.py): on a worker of the model, over the request plane."""
        try:
            request = parse_embeddings(await self._read_body(scope, receive))
            entry, lora = self._entry(request.model)
            if lora:  # the base's vectors under the adapter's name would lie
                raise RequestError(f"'{lora}' is a LoRA adapter; adapters serve no embeddings", param="model")
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        status = await reply_json(send, lambda: embed(entry, request, self.rules), list, "embeddings")
        self.metrics.requests.labels(entry.name, "embeddings", "unary", status).inc()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise too_large(int(value), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _observe(self, gen: Generation) -> None:
        d = gen.dispatch
        m, model = self.metrics, d.model
        end = time.perf_counter()
        m.isl.labels(model).observe(len(d.plan.prompt_ids))
        m.osl.labels(model).observe(gen.completion_tokens)
        m.output_tokens.labels(model).inc(gen.completion_tokens)
        m.duration.labels(model).observe(end - d.started_at)
        if gen.cached_tokens is not None:
            m.cached.labels(model).observe(gen.cached_tokens)
        if (first := d.output.first_token_at) is not None:
            m.ttft.labels(model).observe(first - d.started_at)
            if gen.completion_tokens > 1:
                m.itl.labels(model).observe((end - first) / (gen.completion_tokens - 1))

    ##### REST #####

    async def list_models(self, request: Request) -> Response:
        # servable(): a model only prefill workers serve has nothing to decode on, so it is not listed
        data = [
            {
                "id": e.name,
                "object": "model",
                "created": 0,
                "owned_by": "dyn",
                "max_model_len": e.card.context_length,
                "num_workers": len(e.workers) + len(e.prefill_workers),
            }
            for e in self.registry.servable()
        ]
        return JSONResponse({"object": "list", "data": data + adapter_rows(self.registry)})

    async def health(self, request: Request) -> Response:
        instances = [
            {"model": e.name, "instance_id": f"{wid:x}", "address": w.record.address, "role": w.card.role}
            | ({"hung": w.hung} if w.hung is not None else {})
            | _in_flight(e.policy, wid)
            for e in self.registry.servable()
            for wid, w in {**e.workers, **e.prefill_workers}.items()
        ]
        healthy = bool(instances)
        body: dict[str, object] = {"status": "healthy" if healthy else "unhealthy", "frontend": f"{self.instance_id:x}"}
        body["instances"] = instances
        if not healthy:
            body["message"] = "No endpoints available"
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type="application/json")

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    def metrics_text(self) -> bytes:
        """What `/metrics` shows: this frontend's registry, or with `--frontends N` the group's totals."""
        if self.group is not None:
            return self.group.merged(self.refresh_metrics)
        self.refresh_metrics()
        return generate_latest(self.metrics.registry)

    def refresh_metrics(self) -> None:
        """Set the gauges read at scrape time: workers, queues, KV tiers, the router's counters."""
        for name, entry in self.registry.models.items():
            self.metrics.workers.labels(name).set(len(entry.workers) + len(entry.prefill_workers))
            self.metrics.queued.labels(name).set(len(entry.queue))
            for worker in (*entry.workers.values(), *entry.prefill_workers.values()):
                if worker.load is not None and worker.load.kv_tiers is not None:
                    self.metrics.export_kv_tiers(name, worker.instance_id, worker.load.kv_tiers)
            counters = getattr(entry.policy, "counters", None)
            if counters is not None:
                self.metrics.export_router(name, counters.to_dict())
        self.metrics.export_workers(
            (name, worker)
            for name, entry in self.registry.models.items()
            for worker in (*entry.workers.values(), *entry.prefill_workers.values())
        )

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        error = _internal(exc, f"serving {request.method} {request.url.path}")
        return Response(
            error_body(str(error), "internal_error", None, "internal_error"),
            status_code=500,
            media_type="application/json",
        )

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = f"no route {request.method} {request.url.path}" if status == 404 else f"{request.method} not allowed"
        return Response(
            error_body(message, "not_found_error" if status == 404 else "invalid_request_error"),
            status_code=status,
            media_type="application/json",
        )


def _in_flight(policy: object, worker_id: int) -> dict[str, int]:
    """The in-flight load the KV router counts on a worker (with `--router-replica-sync`, every frontend's and
    router's): requests and unique active blocks. Empty for the other routers, which count nothing."""
    sequences = getattr(policy, "sequences", None)
    if not isinstance(sequences, ActiveSequences):
        return {}
    return {
        "in_flight_requests": sequences.num_requests(worker_id),
        "active_blocks": sequences.active_blocks(worker_id),
    }
