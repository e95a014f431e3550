"""The W3C trace context a request carries (`traceparent`, `tracestate`): read from a client's headers or a
request's annotations, checked, written back; and where the frontend keeps and names a request's trace. Pure: no
OpenTelemetry, no I/O.

A malformed value is ignored, never an error (W3C Trace Context: a receiver that cannot parse it starts a
new trace), so a client's bad header costs it its trace, never its request.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.wire import TRACEPARENT_ANNOTATION, TRACESTATE_ANNOTATION

_HEX = frozenset("0123456789abcdef")
_VERSION_00_LENGTH = 55
"""`00-` + 32 + `-` + 16 + `-` + 2."""
MAX_TRACESTATE = 512
"""Longest `tracestate` carried on (W3C: a vendor may drop a longer one)."""
SAMPLED = 0x01
"""The `sampled` bit of the trace flags."""
TRACE_ID_HEADER = b"x-dyn-trace-id"
"""The frontend's response header naming the trace of a sampled request."""
TRACE_SCOPE_KEY = "dyn.trace"
"""The ASGI scope key under which the frontend's handlers find the request's RequestTrace (tracing on)."""


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A caller's place in a trace: whose trace, which of its spans, and whether the trace is recorded."""

    trace_id: str
    """32 lowercase hex digits, not all zero."""
    parent_id: str
    """16 lowercase hex digits, not all zero: the caller's span."""
    flags: int
    """The trace flags; bit 0 (SAMPLED): the caller records this trace."""

    @property
    def is_sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    @property
    def header(self) -> str:
        """The value as version 00 writes it."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """The trace context in a `traceparent` value, or None when it is absent or malformed.

    Version 00 is exactly `00-{trace id}-{parent id}-{flags}`; a later version may append `-` and more,
    which is skipped (W3C: parse what version 00 defines); version `ff` is invalid."""
    if not value:
        return None
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    text = text.strip(" \t")
    if len(text) < _VERSION_00_LENGTH or text[2:3] != "-" or text[35:36] != "-" or text[52:53] != "-":
        return None
    version, trace_id, parent_id, flags = text[:2], text[3:35], text[36:52], text[53:55]
    if not _is_hex(version) or version == "ff" or (version == "00" and len(text) != _VERSION_00_LENGTH):
        return None
    if len(text) > _VERSION_00_LENGTH and text[55] != "-":
        return None
    if not (_is_hex(trace_id) and _is_hex(parent_id) and _is_hex(flags)):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def parse_tracestate(value: str | bytes | None) -> str | None:
    """A `tracestate` value fit to carry on (printable ASCII, at most MAX_TRACESTATE characters), else None."""
    if not value:
        return None
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    text = text.strip(" \t")
    if not text or len(text) > MAX_TRACESTATE or not all(" " <= c <= "~" for c in text):
        return None
    return text


def trace_context(annotations: dict[str, str]) -> dict[str, str]:
    """The trace-context annotations of a request (`traceparent`, `tracestate`), to carry to the next hop."""
    if TRACEPARENT_ANNOTATION not in annotations:
        return {}
    keys = (TRACEPARENT_ANNOTATION, TRACESTATE_ANNOTATION)
    return {key: annotations[key] for key in keys if key in annotations}


def trace_id_of(annotations: dict[str, str]) -> str:
    """The trace id a request's annotations carry, for its log lines; "" without a valid one."""
    parent = parse_traceparent(annotations.get(TRACEPARENT_ANNOTATION)) if annotations else None
    return parent.trace_id if parent is not None else ""


def _is_hex(text: str) -> bool:
    return all(c in _HEX for c in text)
