"""A loopback OTLP/HTTP trace receiver for tests: a real HTTP server on a free 127.0.0.1 port that decodes each
`ExportTraceServiceRequest` protobuf (opentelemetry-proto) into `ReceivedSpan`s, as a collector would."""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, with the resource of the process that exported it."""

    trace_id: str
    span_id: str
    parent_span_id: str
    """"" for a root span."""
    name: str
    service: str
    """The exporting process's `service.name`."""
    pid: int
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]]
    """Event name -> its attributes (the last event of a name)."""
    is_error: bool
    start_ns: int
    end_ns: int


@dataclass
class OtlpReceiver:
    """Collects what processes export to `url` (their `--otlp-endpoint`)."""

    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    num_requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, predicate: Any, timeout: float = 10.0) -> list[ReceivedSpan]:
        """The trace's spans once `predicate(spans)` holds (or, after `timeout`, as they are)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.of_trace(trace_id)
            if predicate(spans):
                return spans
            time.sleep(0.1)
        return self.of_trace(trace_id)

    def receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            service=str(resource.get("service.name", "")),
                            pid=int(resource.get("process.pid", 0)),
                            attributes=_attributes(span.attributes),
                            events={event.name: _attributes(event.attributes) for event in span.events},
                            is_error=span.status.code == span.status.STATUS_CODE_ERROR,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.spans += received
            self.num_requests += 1


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@contextlib.contextmanager
def serve_otlp() -> Iterator[OtlpReceiver]:
    """Run a receiver on a free loopback port; `receiver.url` is the `--otlp-endpoint`."""
    receiver = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            receiver.receive(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
