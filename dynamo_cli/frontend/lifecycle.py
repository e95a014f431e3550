"""The one lifecycle of a generation request at the edge, whatever its API (translation.py's `Api`):

    enter    a new request id (the workers only ever see ours), named by this task's log lines from now on
    read     the body, bounded by `--max-body-bytes` (413)
    parse    the API's request (400 naming the field)
    prepare  check, template, tokenize, plan and start the `n` dispatches, watching for the client to leave
    reply    the API writes its body or its events (the dispatches' tokens as they come)
    end      close every dispatch (load and prefilled KV never leak), observe, count

A client error is OpenAI's JSON error (4xx naming the field, 503/429 on overload), a bug a 500 findable in the log;
a client that leaves before the reply is counted as gone and its work closed. The APIs with one JSON reply
(unary.py: embeddings, rerank, score, tokenize) share the read, the entry and the error path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from dynamo_cli.config import FrontendConfig
from dynamo_cli.core.dispatch import Dispatch, DispatchRules
from dynamo_cli.core.queue import LOWEST_CLIENT_PRIORITY
from dynamo_cli.core.request_plan import RequestPlan
from dynamo_cli.engine import check_token_ids
from dynamo_cli.errors import DynError, ModelNotFound, NoWorkers, RateLimited, RequestError
from dynamo_cli.frontend.features import check_features
from dynamo_cli.frontend.headers import client_request_id, int_header, pinned_header, too_large
from dynamo_cli.frontend.internal import INTERNAL_DEADLINE, INTERNAL_PRIORITY
from dynamo_cli.frontend.media import LoadedImage
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.openai import ChatCompletionRequest, NvExt, OpenAiRequest
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.prompts import (
    chat_images,
    nth_seed,
    plan_request,
    prompt_of,
    sampling_of,
    stops_of,
)
from dynamo_cli.frontend.replies import ClientGone, reply_json, unless_gone
from dynamo_cli.frontend.replies import internal as _internal
from dynamo_cli.frontend.replies import send_error as _send_error
from dynamo_cli.frontend.served_models import FrontendRegistry, ServedModel
from dynamo_cli.frontend.tenants import Tenancy, Tenants
from dynamo_cli.frontend.tools.chat import ChatPlan, prepare_chat
from dynamo_cli.frontend.translation import Api
from dynamo_cli.frontend.unary import UnaryApi
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.routing.sessions import session_of
from dynamo_cli.tracing.logs import enter_request
from dynamo_cli.tracing.traceparent import TRACE_SCOPE_KEY
from dynamo_cli.wire import ImageInput, ImageSpec, SamplingParams

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import RequestTrace, Tracing


class Lifecycle:
    """Runs each generation request of every API through the same steps, against one registry and one set of
    dispatch rules."""

    def __init__(
        self,
        config: FrontendConfig,
        registry: FrontendRegistry,
        metrics: FrontendMetrics,
        rules: DispatchRules,
        tracing: Tracing | None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.rules = rules
        self.tracing = tracing
        self.tenants = Tenants(config.tenants, metrics.tenants, bool(config.auth.api_keys))
        """Who sends each request and what it may still use (frontend/tenants.py)."""
        self.standby: Callable[[str], float | None] | None = None
        """Set by `dyn serve`: for a model whose workers are restarting, seconds until one may serve
        again (requests then get 503 with Retry-After instead of 404); None when none is coming back."""

    async def serve(self, api: Api, scope: Scope, receive: Receive, send: Send) -> None:
        """One request of `api`, from its body to its end, within its tenant's limits."""
        request_id = self._enter(scope, api.id_prefix)
        try:
            request = api.parse(await self._read_body(scope, receive))
            tenancy = self.tenants.identify(scope, headers_of(scope), INTERNAL_DEADLINE in scope)
            self.tenants.admit(tenancy)
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        status, output_tokens = "error", 0
        try:
            status, output_tokens = await self._serve(api, request, tenancy, scope, receive, send, request_id)
        finally:
            self.tenants.release(tenancy, status, output_tokens)

    async def _serve(
        self, api: Api, request: Any, tenancy: Tenancy, scope: Scope, receive: Receive, send: Send, request_id: str
    ) -> tuple[str, int]:
        """Prepare, reply, end: the status (for the metrics) and the output tokens sent."""
        try:
            generations = await self._prepare_unless_gone(api.to_generate(request), scope, receive, request_id, tenancy)
        except ClientGone:
            return "cancelled", 0
        except DynError as exc:
            if isinstance(exc, RateLimited):
                self.tenants.refused(tenancy, exc)
            await _send_error(send, exc)
            return "rejected" if isinstance(exc, RateLimited) else "error", 0
        except Exception as exc:  # a bug, not the client's fault: a 500 in OpenAI's shape, findable in the log
            await _send_error(send, _internal(exc, "preparing a request"))
            return "error", 0
        d = generations[0].dispatch
        model, metrics = d.model, self.metrics
        metrics.inflight.labels(model).inc()
        status = "error"
        try:
            status = await api.reply(request, generations, send, receive)
        finally:
            for gen in generations:
                await gen.dispatch.aclose()  # idempotent: load and prefilled KV never leak
                self._observe(gen, tenancy)
            if status == "cancelled":
                metrics.disconnected.labels(d.entry.name).inc()
                metrics.cancellations.labels(d.entry.name).inc()
            metrics.inflight.labels(model).dec()
            metrics.requests.labels(model, api.name, "stream" if request.stream else "unary", status).inc()
        return status, sum(gen.completion_tokens for gen in generations)

    async def unary(self, api: UnaryApi, scope: Scope, receive: Receive, send: Send) -> None:
        """An API with one JSON reply (unary.py: embeddings, rerank, score, tokenize, detokenize)."""
        try:
            request = api.parse(await self._read_body(scope, receive))
            entry, lora = self._entry(request.model)
            if lora and not api.adapters:  # the base's answer under the adapter's name would lie
                raise RequestError(f"'{lora}' is a LoRA adapter; adapters serve no {api.name}", param="model")
        except ClientGone:
            return
        except DynError as exc:
            return await _send_error(send, exc)
        status = await reply_json(send, lambda: api.run(entry, request, self.rules, self.config), list, api.name)
        self.metrics.requests.labels(entry.name, api.name, "unary", status).inc()

    ##### Steps #####

    def _enter(self, scope: Scope, prefix: str) -> str:
        """A new request id (the workers only ever see ours), named from now on by this task's log lines."""
        request_id = prefix + uuid.uuid4().hex
        trace: RequestTrace | None = scope.get(TRACE_SCOPE_KEY) if self.tracing is not None else None
        enter_request(request_id, trace.trace_id if trace is not None else "")
        return request_id

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

    async def _prepare_unless_gone(
        self, request: OpenAiRequest, scope: Scope, receive: Receive, request_id: str, tenancy: Tenancy
    ) -> list[Generation]:
        """`_prepare`, watching for the client to leave: its waits for a worker end then (see `Interruptible`),
        and what was prepared for a client gone by the end is closed: ClientGone."""
        generations, is_gone = await unless_gone(lambda: self._prepare(request, scope, request_id, tenancy), receive)
        if is_gone:
            for gen in generations:
                await gen.dispatch.aclose()
            raise ClientGone()
        return generations

    async def _prepare(
        self, request: OpenAiRequest, scope: Scope, request_id: str, tenancy: Tenancy
    ) -> list[Generation]:
        """Check, template, tokenize, plan and start the request's `n` dispatches (one per choice)."""
        entry, lora = self._entry(request.model)
        trace: RequestTrace | None = scope.get(TRACE_SCOPE_KEY) if self.tracing is not None else None
        if trace is not None:
            trace.describe(request.model, request_id)
        check_features(request, entry.card)
        tokenizer = await entry.tokenizer
        tokenize = trace.child("tokenize") if trace is not None else None
        chat = self._chat(request, entry, tokenizer)
        loaded: list[LoadedImage] = []
        spec: ImageSpec | None = None
        if isinstance(request, ChatCompletionRequest):
            loaded, spec = await chat_images(request, entry.card, self.config.media)
        prompt_ids, max_tokens, echo, images = await prompt_of(
            request, tokenizer, chat.prompt if chat is not None else None, loaded, spec
        )
        if tokenize is not None:
            tokenize.end_tokenize(len(prompt_ids))
        self.tenants.spend_prompt(tenancy, len(prompt_ids))
        sampling = sampling_of(request, chat.guided if chat is not None else None)
        check_token_ids(sampling.stop_token_ids, "stop_token_ids", tokenizer.vocab_size)
        check_token_ids(list(sampling.logit_bias), "logit_bias", tokenizer.vocab_size)
        stop, headers = stops_of(request), headers_of(scope)
        plan_of = _planner(entry, scope, headers, prompt_ids, max_tokens, trace, lora, images, request.nvext, tenancy)
        generations: list[Generation] = []
        try:
            for index in range(request.n):  # choice i: request id "-i", seed + i
                plan = plan_of(request_id if index == 0 else f"{request_id}-{index}", nth_seed(sampling, index))
                generations.append(Generation(Dispatch(entry, plan, self.rules), tokenizer, echo=echo, stop=stop))
                generations[-1].output = chat.output if chat is not None else None
                await generations[-1].dispatch.start()
        except BaseException:
            for gen in generations:
                await gen.dispatch.aclose()
            raise
        return generations

    def _chat(self, request: OpenAiRequest, entry: ServedModel, tokenizer: Tokenizer) -> ChatPlan | None:
        """A chat request's prompt, tools, response format and reasoning (tools/chat.py); None for completions."""
        if not isinstance(request, ChatCompletionRequest):
            return None
        chat = prepare_chat(request, entry.card, tokenizer, self.config.tool_call_parser, self.config.reasoning_parser)
        if chat.output is not None and (request.n > 1 or request.logprobs):
            what = "n > 1" if request.n > 1 else "logprobs"
            raise RequestError(
                f"{what} together with tools, response_format or a reasoning parser is not "
                "supported yet; send them in separate requests",
                param="n" if request.n > 1 else "logprobs",
            )
        return chat

    def _entry(self, model: str) -> tuple[ServedModel, str]:
        """The entry serving `model` and its LoRA adapter ("": a base model)."""
        try:
            return self.registry.resolve(model)
        except ModelNotFound:
            wait = self.standby(model) if self.standby is not None else None
            if wait is None:
                raise
            raise NoWorkers(f"model '{model}' (its workers are restarting)", retry_after=wait) from None

    def _observe(self, gen: Generation, tenancy: Tenancy) -> None:
        d = gen.dispatch
        if d.queue_wait_s:
            self.tenants.waited(tenancy, d.queue_wait_s)
        m, model = self.metrics, d.model
        end = time.perf_counter()
        m.isl.labels(model).observe(len(d.plan.prompt_ids))
        m.osl.labels(model).observe(gen.completion_tokens)
        m.output_tokens.labels(model).inc(gen.completion_tokens)
        m.duration.labels(model).observe(end - d.started_at)
        if gen.cached_tokens is not None:
            m.cached.labels(model).observe(gen.cached_tokens)
        if (first := gen.first_shown_at or d.output.first_token_at) is not None:
            m.ttft.labels(model).observe(first - d.started_at)
            if gen.completion_tokens > 1:
                m.itl.labels(model).observe((end - first) / (gen.completion_tokens - 1))


_HEADERS = "dyn.headers"
"""Where a request's scope keeps its headers as a dict, once built."""


def headers_of(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by name, built once per request (the tenant and the plan both read them)."""
    headers: dict[bytes, bytes] | None = scope.get(_HEADERS)
    if headers is None:
        headers = scope[_HEADERS] = dict(scope["headers"])
    return headers


def _planner(
    entry: ServedModel,
    scope: Scope,
    headers: dict[bytes, bytes],
    prompt_ids: list[int],
    max_tokens: int | None,
    trace: RequestTrace | None,
    lora: str,
    images: list[ImageInput],
    request_hints: NvExt | None,
    tenancy: Tenancy,
) -> Callable[[str, SamplingParams], RequestPlan]:
    """The plan of each choice (its request id and sampling) by the headers (x-request-id: echoed, never used)."""
    client_id = client_request_id(headers.get(b"x-request-id"))
    pinned, explain = pinned_header(headers.get(b"x-worker-instance-id")), headers.get(b"x-dyn-explain-route")
    hints = request_hints.agent_hints if request_hints is not None else None
    priority, deadline = _priority(scope, headers, hints.priority if hints is not None else None)
    session = session_of(headers)

    def plan(request_id: str, sampling: SamplingParams) -> RequestPlan:
        return plan_request(
            entry,
            request_id,
            prompt_ids,
            max_tokens,
            sampling,
            pinned_worker=pinned,
            client_request_id=client_id,
            is_explained=explain in (b"1", b"true", b"yes"),
            priority=priority,
            deadline=deadline,
            trace=trace,
            lora=lora,
            images=images,
            session=session,
            hints=hints,
            tenancy=tenancy,
        )

    return plan


def _priority(scope: Scope, headers: dict[bytes, bytes], hinted: int | None) -> tuple[int, float | None]:
    """The request's place in the router queue: a client's headers (or its agent hint), or an internal request's
    class and deadline."""
    internal_deadline = scope.get(INTERNAL_DEADLINE)
    if internal_deadline is not None:
        return INTERNAL_PRIORITY, float(internal_deadline)
    priority = int_header(headers.get(b"x-dyn-priority"), "x-dyn-priority", LOWEST_CLIENT_PRIORITY, 1000)
    deadline_ms = int_header(headers.get(b"x-dyn-deadline-ms"), "x-dyn-deadline-ms", 1, 86_400_000)
    priority = priority if priority is not None else hinted
    return priority or 0, time.monotonic() + deadline_ms / 1000 if deadline_ms else None
