"""A process's spans, exported to a real loopback OTLP/HTTP receiver: the frontend's request span continues a
client's trace and names it in the response, a router's or worker's continues its request's, and `shutdown()`
exports what is left. Off, nothing of OpenTelemetry is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dynamo_cli.config import TelemetryConfig
from dynamo_cli.errors import ConfigError
from dynamo_cli.tracing import start_tracing
from dynamo_cli.tracing.spans import RequestTrace, Tracing
from dynamo_cli.tracing.traceparent import TRACE_SCOPE_KEY
from dynamo_cli.wire import GenerateChunk, GenerateRequest
from tests.otlp import OtlpReceiver, serve_otlp

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def call(tracing: Tracing, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict[str, Any]], RequestTrace]:
    """One POST through `serve_http` to an app that routes and answers 200; what it sent, and its trace."""
    sent: list[dict[str, Any]] = []
    seen: list[RequestTrace] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        trace = scope[TRACE_SCOPE_KEY]
        seen.append(trace)
        trace.describe("smollm2", "chatcmpl-1")
        trace.child("tokenize").end_tokenize(12)
        trace.routed(0.0, 0xAB, None, None)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    await tracing.serve_http(scope, receive, send, app)
    return sent, seen[0]


def tracing_to(receiver: OtlpReceiver, ratio: float = 1.0) -> Tracing:
    tracing = start_tracing(TelemetryConfig(otlp_endpoint=receiver.url, trace_sample_ratio=ratio), "dyn-frontend")
    assert tracing is not None
    return tracing


async def test_a_client_traceparent_is_continued_named_in_the_response_and_exported_on_shutdown() -> None:
    with serve_otlp() as receiver:
        tracing = tracing_to(receiver, ratio=0.0)  # the client's sampled flag decides, not the ratio
        sent, trace = await call(tracing, [(b"traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01".encode())])
        tracing.shutdown()
        spans = {s.name: s for s in receiver.of_trace(TRACE)}
    assert trace.trace_id == TRACE and trace.annotations["traceparent"].startswith(f"00-{TRACE}-")
    assert (b"x-dyn-trace-id", TRACE.encode()) in sent[0]["headers"]
    request = spans["http.request"]
    assert request.parent_span_id == CLIENT_SPAN and request.service == "dyn-frontend"
    assert request.attributes == {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "gen_ai.request.model": "smollm2",
        "dyn.request_id": "chatcmpl-1",
        "http.response.status_code": 200,
    }
    assert trace.annotations["traceparent"] == f"00-{TRACE}-{request.span_id}-01"  # what the workers get
    assert spans["tokenize"].parent_span_id == spans["route"].parent_span_id == request.span_id
    assert spans["tokenize"].attributes == {"gen_ai.usage.input_tokens": 12}
    assert spans["route"].attributes == {"dyn.worker_id": "ab"}


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([(b"traceparent", b"00-garbage")], id="malformed"),
        pytest.param([(b"traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01-x".encode())], id="version-00-too-long"),
        pytest.param([], id="none"),
    ],
)
async def test_without_a_valid_traceparent_a_new_trace_starts(headers: list[tuple[bytes, bytes]]) -> None:
    with serve_otlp() as receiver:
        tracing = tracing_to(receiver)
        sent, trace = await call(tracing, headers)
        tracing.shutdown()
        (request,) = [s for s in receiver.of_trace(trace.trace_id) if s.name == "http.request"]
    assert trace.trace_id != TRACE and request.parent_span_id == ""
    assert sent[0]["status"] == 200 and (b"x-dyn-trace-id", trace.trace_id.encode()) in sent[0]["headers"]


async def test_an_unsampled_request_is_neither_named_nor_exported() -> None:
    with serve_otlp() as receiver:
        tracing = tracing_to(receiver, ratio=1.0)
        sent, trace = await call(tracing, [(b"traceparent", f"00-{TRACE}-{CLIENT_SPAN}-00".encode())])
        tracing.shutdown()
        assert receiver.spans == []
    assert not trace.is_sampled and trace.annotations["traceparent"].endswith("-00")  # still carried on, unsampled
    assert all(name != b"x-dyn-trace-id" for name, _ in sent[0]["headers"])


def test_a_worker_continues_its_requests_trace_only() -> None:
    with serve_otlp() as receiver:
        tracing = start_tracing(TelemetryConfig(otlp_endpoint=receiver.url), "dyn-worker-decode")
        assert tracing is not None
        parent = f"00-{TRACE}-{CLIENT_SPAN}-01"
        request = GenerateRequest(
            request_id="r", token_ids=[1, 2, 3], max_tokens=4, annotations={"traceparent": parent}
        )
        stream = tracing.stream(request, 0xCAFE, "decode")
        assert stream is not None
        for chunk in (GenerateChunk(token_ids=[7]), GenerateChunk(token_ids=[8, 9], finish_reason="length")):
            stream.saw(chunk)
        stream.end()
        untraced = GenerateRequest(request_id="r", token_ids=[1], max_tokens=1)
        assert tracing.stream(untraced, 0xCAFE, "decode") is None  # only a frontend starts traces
        tracing.shutdown()
        (span,) = receiver.of_trace(TRACE)
    assert (span.name, span.service, span.parent_span_id) == ("worker.generate", "dyn-worker-decode", CLIENT_SPAN)
    assert span.attributes["gen_ai.usage.output_tokens"] == 3 and span.attributes["dyn.worker_id"] == "cafe"
    assert span.attributes["gen_ai.response.finish_reasons"] == ["length"] and "first_token" in span.events


@dataclass(frozen=True)
class KvDecision:
    """What a KV router's decision shows a route span (routing/cost.py `Selection.to_dict`)."""

    overlap_blocks: int = 3
    explanation: dict[str, Any] = field(
        default_factory=lambda: {
            "worker_id": 0xB,
            "reason": "argmin",
            "margin": 1.5,
            "num_candidates": 2,
            "candidates": [{"worker_id": 0xA, "logit": 9.0}, {"worker_id": 0xB, "logit": 7.5}],
        }
    )


def test_the_cores_hops_become_spans_and_a_migration_an_event() -> None:
    with serve_otlp() as receiver:
        tracing = start_tracing(TelemetryConfig(otlp_endpoint=receiver.url), "dyn-router")
        assert tracing is not None
        parent = f"00-{TRACE}-{CLIENT_SPAN}-01"
        request = GenerateRequest(request_id="r", token_ids=[1], max_tokens=1, annotations={"traceparent": parent})
        trace = tracing.continue_request("router.generate", request)
        assert trace is not None
        now = time.perf_counter()
        trace.queued(now - 0.25)
        trace.routed(now - 0.5, 0xB, KvDecision(), None)
        trace.migrated(0xB, 0xA, "worker b disconnected", 1)
        trace.end("length")
        tracing.shutdown()
        spans = {s.name: s for s in receiver.of_trace(TRACE)}
    routed, queued, request_span = spans["route"], spans["queue.wait"], spans["router.generate"]
    assert routed.parent_span_id == queued.parent_span_id == request_span.span_id
    assert routed.attributes == {
        "dyn.worker_id": "b",
        "dyn.route.overlap_blocks": 3,
        "dyn.route.num_candidates": 2,
        "dyn.route.reason": "argmin",
        "dyn.route.margin": 1.5,
        "dyn.route.cost": 7.5,  # the chosen candidate's
    }
    assert 0.2e9 < queued.end_ns - queued.start_ns < 0.3e9 and routed.end_ns - routed.start_ns >= 0.5e9
    assert request_span.events["migration"] == {
        "dyn.migration.from_worker_id": "b",
        "dyn.migration.to_worker_id": "a",
        "dyn.migration.reason": "worker b disconnected",
        "dyn.migration.attempt": 1,
    }
    assert request_span.attributes["dyn.status"] == "success" and not request_span.is_error


def test_without_an_endpoint_there_is_no_tracer() -> None:
    assert start_tracing(TelemetryConfig(), "dyn-frontend") is None


def test_a_missing_sdk_is_one_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "dynamo_cli.tracing.spans")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)  # `import opentelemetry.sdk...` now fails
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError, match=r"pip install 'dynamo-cli\[tracing\]'"):
        start_tracing(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318"), "dyn-frontend")


def test_dyn_serve_without_the_sdk_says_what_to_install(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "opentelemetry"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'opentelemetry'\", name='opentelemetry')\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", "serve", "--engine", "mocker", "--port", "0"]
        + ["--discovery", f"file://{tmp_path}/d", "--otlp-endpoint", "http://127.0.0.1:4318"],
        env={**_env(), "PYTHONPATH": f"{shadow.parent}:{Path(__file__).resolve().parents[2]}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "pip install 'dynamo-cli[tracing]'" in lines[0] and "Traceback" not in result.stderr


def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    script = textwrap.dedent(
        """
        import sys
        from dynamo_cli.cli.main import _register
        import dynamo_cli.launcher, dynamo_cli.worker, dynamo_cli.router.service, dynamo_cli.frontend.app
        from dynamo_cli.config import TelemetryConfig
        from dynamo_cli.tracing import start_tracing
        _register()
        assert start_tracing(TelemetryConfig(), "dyn-frontend") is None
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
