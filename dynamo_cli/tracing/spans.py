"""The spans of one process, exported with OTLP/HTTP: a frontend's request, tokenization, route decisions,
queue wait, prefill hop and migrations; a `dyn router`'s request and its decisions; a worker's stream and KV
pull. Imported only when `--otlp-endpoint` is set (tracing/__init__.py).

NOTE: every span is started with an explicit parent, never through OpenTelemetry's current-context stack: a
request-plane stream is an async generator that may be closed from another context than it started in, where
a detach would fail. The trace context crosses processes in `GenerateRequest.annotations` (W3C `traceparent`):
each hop stamps the request it sends with its own span, so the receiver's span is that span's child.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from dynamo_cli.config import TelemetryConfig
from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.tracing.traceparent import (
    TRACE_ID_HEADER,
    TRACE_SCOPE_KEY,
    TraceParent,
    parse_traceparent,
    parse_tracestate,
)
from dynamo_cli.wire import TRACEPARENT_ANNOTATION, TRACESTATE_ANNOTATION, GenerateChunk, GenerateRequest

EXPORT_DELAY_S = 1.0
"""A finished span waits at most this long in the batch before it is exported."""
EXPORT_TIMEOUT_S = 5.0
"""One export request's timeout, retries included: a collector that is gone delays shutdown by at most this."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class RouteChoice(Protocol):
    """What a route span reads of the policy's decision (routing/base.py `RouteDecision`)."""

    @property
    def overlap_blocks(self) -> int: ...

    @property
    def explanation(self) -> dict[str, Any]: ...


class Tracing:
    """The process's tracer: requests sampled parent-based (a caller's sampled flag decides; a new trace is
    sampled at `trace_sample_ratio`), spans batched and exported to `{otlp_endpoint}/v1/traces` by one
    background thread this object owns; `shutdown()` exports what is left and stops it."""

    def __init__(self, config: TelemetryConfig, service_name: str) -> None:
        assert config.otlp_endpoint is not None, "tracing needs an OTLP endpoint"
        resource = Resource({"service.name": service_name, "process.pid": os.getpid()})
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio)),
            resource=resource,
            shutdown_on_exit=False,  # `shutdown()` is called on the way out; no atexit hook of its own
        )
        endpoint = config.otlp_endpoint.rstrip("/") + "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=EXPORT_DELAY_S * 1000,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
            )
        )
        self.tracer = self.provider.get_tracer("dynamo_cli")

    def shutdown(self) -> None:
        """Export the spans still batched, then stop the exporter's thread (idempotent)."""
        self.provider.shutdown()

    ##### Frontend #####

    async def serve_http(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        """Run `app` on one HTTP request inside its `http.request` span, which continues the client's
        `traceparent` if it sent a valid one; the response names a sampled trace (`x-dyn-trace-id`), and the
        handlers find the RequestTrace at `scope[TRACE_SCOPE_KEY]`."""
        headers = dict(scope["headers"])
        parent = remote_parent(parse_traceparent(headers.get(b"traceparent")), headers.get(b"tracestate"))
        span = self.tracer.start_span(
            "http.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "http.route": scope["path"]},
        )
        request = RequestTrace(self.tracer, span)

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                if request.is_sampled:
                    trace_id = (TRACE_ID_HEADER, request.trace_id.encode())
                    message = {**message, "headers": [*message.get("headers", ()), trace_id]}
            await send(message)

        try:
            await app({**scope, TRACE_SCOPE_KEY: request}, receive, traced_send)
        except BaseException as exc:
            _record_error(span, exc)
            raise
        finally:
            span.end()

    ##### dyn router and workers #####

    def continue_request(self, name: str, request: GenerateRequest) -> RequestTrace | None:
        """A span for `request` in this process, continuing the trace its annotations carry; None when it
        carries none (only a frontend starts traces)."""
        parent = parse_traceparent(request.annotations.get(TRACEPARENT_ANNOTATION))
        if parent is None:
            return None
        context = remote_parent(parent, request.annotations.get(TRACESTATE_ANNOTATION))
        attributes = {"dyn.request_id": request.request_id}
        span = self.tracer.start_span(name, context=context, kind=SpanKind.SERVER, attributes=attributes)
        return RequestTrace(self.tracer, span)

    def stream(self, request: GenerateRequest, worker_id: int, role: str) -> StreamTrace | None:
        """A worker's `worker.generate` span for `request` (None when it carries no trace, or it is not sampled)."""
        served = self.continue_request("worker.generate", request)
        if served is None or not served.is_sampled:
            return None
        served.span.set_attributes(
            {
                "dyn.worker_id": f"{worker_id:x}",
                "dyn.worker.role": role,
                "gen_ai.usage.input_tokens": len(request.token_ids),
                "gen_ai.request.max_tokens": request.max_tokens,
            }
        )
        return StreamTrace(served)


class ChildSpan:
    """A span under a request's span (the prefill hop's): stamp the request it sends, then `end()` it."""

    def __init__(self, span: Span) -> None:
        self.span = span

    def carried_by(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with this span as its receiver's parent."""
        return msgspec.structs.replace(request, annotations={**request.annotations, **_annotations(self.span)})

    def end_tokenize(self, num_tokens: int) -> None:
        """End the `tokenize` span: the prompt's length in tokens."""
        self.end({"gen_ai.usage.input_tokens": num_tokens})

    def end_prefill(self, worker_id: int | None, failed: list[int], error: BaseException | None = None) -> None:
        """End the prefill hop's span: the prefill worker that answered, those that failed before it."""
        attributes: dict[str, str | int | float] = {"dyn.prefill.num_failed": len(failed)}
        if worker_id is not None:
            attributes["dyn.prefill.worker_id"] = f"{worker_id:x}"
        if failed:
            attributes["dyn.prefill.failed_worker_ids"] = ",".join(f"{w:x}" for w in failed)
        self.end(attributes, error)

    def end(
        self, attributes: Mapping[str, str | int | float] | None = None, error: BaseException | None = None
    ) -> None:
        """End the span now; `error` marks it failed (or cancelled)."""
        if attributes:
            self.span.set_attributes(attributes)
        if error is not None:
            _record_error(self.span, error)
        self.span.end()


class RequestTrace:
    """One request's span in this process (a frontend's `http.request`, a router's `router.generate`) and its
    children, which the request core adds as it goes (core/dispatch.py); shared by a request's `n` choices."""

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        context = span.get_span_context()
        self.trace_id = f"{context.trace_id:032x}"
        self.is_sampled = context.trace_flags.sampled
        self.annotations = _annotations(span)
        """The trace context the requests this process sends carry: this span as their parent."""
        self._context = trace.set_span_in_context(span)

    def describe(self, model: str, request_id: str) -> None:
        """The request's model and id, once known."""
        self.span.set_attributes({"gen_ai.request.model": model, "dyn.request_id": request_id})

    def child(self, name: str) -> ChildSpan:
        """A span under this one, started now."""
        return ChildSpan(self.tracer.start_span(name, context=self._context))

    def routed(
        self, started_at: float, worker_id: int | None, decision: RouteChoice | None, router_id: int | None
    ) -> None:
        """A `route` span from `started_at` (perf_counter) to now: the chosen worker and, from a KV router's
        explanation, the cached prefix, the cost and how many candidates there were."""
        if not self.is_sampled:
            return
        attributes: dict[str, str | int | float] = {}
        if worker_id is not None:
            attributes["dyn.worker_id"] = f"{worker_id:x}"
        if router_id is not None:
            attributes["dyn.router_id"] = f"{router_id:x}"
        if decision is not None:
            attributes["dyn.route.overlap_blocks"] = decision.overlap_blocks
            attributes.update(_explained(decision.explanation))
        self.record("route", started_at, attributes)

    def queued(self, queued_at: float) -> None:
        """A `queue.wait` span from `queued_at` (perf_counter) to now: the request waited for a worker."""
        if self.is_sampled:
            self.record("queue.wait", queued_at, {})

    def migrated(self, from_worker: int, to_worker: int, reason: str, attempt: int) -> None:
        """A `migration` event on the request's span: its worker failed and another took the stream on."""
        attributes: dict[str, str | int] = {
            "dyn.migration.from_worker_id": f"{from_worker:x}",
            "dyn.migration.to_worker_id": f"{to_worker:x}",
            "dyn.migration.reason": reason,
            "dyn.migration.attempt": attempt,
        }
        self.span.add_event("migration", attributes)

    def end(self, finish_reason: str | None, status: str = "success", error: BaseException | None = None) -> None:
        """End the request's span (a router's or a worker's; a frontend's ends with its HTTP response): how the
        stream ended (`finish_reason`), and `status`, `success`, `cancelled` (the caller left) or `error`
        (`error` says which, when known)."""
        if finish_reason is not None:
            self.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        self.span.set_attribute("dyn.status", status)
        if error is not None:
            _record_error(self.span, error)
        elif status == "error":
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()

    def record(
        self, name: str, started_at: float, attributes: dict[str, str | int | float], error: str | None = None
    ) -> None:
        """A child span that began at `started_at` (perf_counter) and ends now; `error` marks it failed."""
        now = time.time_ns()
        started = now - int((time.perf_counter() - started_at) * 1e9)
        span = self.tracer.start_span(name, context=self._context, start_time=started, attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=now)


class StreamTrace:
    """A worker's `worker.generate` span: from the request to its last chunk, with the time of the first token
    (an event), the tokens out and the finish reason; a decode worker's KV pull is its child."""

    def __init__(self, served: RequestTrace) -> None:
        self.served = served
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def pulled(self, report: TransferReport) -> None:
        """A `kv.pull` span ending now: bytes, GB/s and backend ("local": the pull failed)."""
        attributes: dict[str, str | int | float] = {"dyn.kv.bytes": report.nbytes, "dyn.kv.backend": report.backend}
        if report.seconds > 0:
            attributes["dyn.kv.gbps"] = report.nbytes / report.seconds / 1e9
        failed = "the KV pull failed; the prompt was prefilled here" if report.backend == "local" else None
        self.served.record("kv.pull", time.perf_counter() - report.seconds, attributes, failed)

    def saw(self, chunk: GenerateChunk) -> None:
        """One chunk on its way out."""
        if chunk.token_ids:
            if not self.num_tokens:
                self.served.span.add_event("first_token")
            self.num_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    def end(self, error: BaseException | None = None) -> None:
        """The stream ended: done, or `error` (GeneratorExit, CancelledError: the caller closed it)."""
        self.served.span.set_attribute("gen_ai.usage.output_tokens", self.num_tokens)
        status = "success" if error is None else "cancelled" if _is_cancel(error) else "error"
        self.served.end(self.finish_reason, status, error)


def remote_parent(parent: TraceParent | None, tracestate: str | bytes | None) -> Context | None:
    """The context whose span is the caller's (None: a new trace)."""
    if parent is None:
        return None
    state = parse_tracestate(tracestate)
    span_context = trace.SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.parent_id, 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(parent.flags),
        trace_state=trace.TraceState.from_header([state]) if state else None,
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def _annotations(span: Span) -> dict[str, str]:
    context = span.get_span_context()
    annotations = {
        TRACEPARENT_ANNOTATION: f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    }
    state = context.trace_state.to_header() if context.trace_state else ""
    if state:
        annotations[TRACESTATE_ANNOTATION] = state
    return annotations


def _explained(explanation: dict[str, Any]) -> dict[str, str | int | float]:
    """A KV router's explanation, as span attributes: the reason, the chosen candidate's cost, the field."""
    if not explanation:
        return {}
    attributes: dict[str, str | int | float] = {"dyn.route.num_candidates": int(explanation.get("num_candidates", 0))}
    if explanation.get("reason") is not None:
        attributes["dyn.route.reason"] = str(explanation["reason"])
    if explanation.get("margin") is not None:
        attributes["dyn.route.margin"] = float(explanation["margin"])
    chosen = explanation.get("worker_id")
    row = next((r for r in explanation.get("candidates", ()) if r.get("worker_id") == chosen), None)
    if row is not None and row.get("logit") is not None:
        attributes["dyn.route.cost"] = float(row["logit"])
    return attributes


def _is_cancel(error: BaseException) -> bool:
    return isinstance(error, GeneratorExit | asyncio.CancelledError)


def _record_error(span: Span, error: BaseException) -> None:
    if _is_cancel(error):
        span.set_attribute("dyn.cancelled", True)  # the caller left: not the server's failure
        return
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
