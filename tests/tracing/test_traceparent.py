"""The W3C trace context a request carries: what is honoured, what is ignored (never an error)."""

from __future__ import annotations

import pytest

from dynamo_cli.tracing.traceparent import (
    TraceParent,
    parse_traceparent,
    parse_tracestate,
    trace_context,
    trace_id_of,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(VALID, TraceParent(TRACE, SPAN, 1), id="sampled"),
        pytest.param(f"00-{TRACE}-{SPAN}-00", TraceParent(TRACE, SPAN, 0), id="not-sampled"),
        pytest.param(VALID.encode(), TraceParent(TRACE, SPAN, 1), id="header-bytes"),
        pytest.param(f"  {VALID}\t", TraceParent(TRACE, SPAN, 1), id="surrounding-whitespace"),
        pytest.param(f"01-{TRACE}-{SPAN}-03-what-comes-later", TraceParent(TRACE, SPAN, 3), id="a-later-version"),
        pytest.param(f"01-{TRACE}-{SPAN}-01", TraceParent(TRACE, SPAN, 1), id="a-later-version-as-00"),
    ],
)
def test_a_valid_traceparent_is_read(value: str | bytes, expected: TraceParent) -> None:
    assert parse_traceparent(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(None, id="absent"),
        pytest.param("", id="empty"),
        pytest.param("garbage", id="garbage"),
        pytest.param(VALID.upper(), id="uppercase-hex"),
        pytest.param(f"00-{'0' * 32}-{SPAN}-01", id="all-zero-trace-id"),
        pytest.param(f"00-{TRACE}-{'0' * 16}-01", id="all-zero-parent-id"),
        pytest.param(f"ff-{TRACE}-{SPAN}-01", id="version-ff"),
        pytest.param(f"00-{TRACE}-{SPAN}-01-extra", id="version-00-with-more"),
        pytest.param(f"01-{TRACE}-{SPAN}-01extra", id="later-version-without-a-dash"),
        pytest.param(f"00-{TRACE[:-1]}-{SPAN}-01", id="short-trace-id"),
        pytest.param(f"00-{TRACE}x-{SPAN}-01", id="trace-id-not-hex"),
        pytest.param(f"00_{TRACE}_{SPAN}_01", id="wrong-separators"),
        pytest.param(f"00-{TRACE}-{SPAN}-0g", id="flags-not-hex"),
        pytest.param(b"\xff" * 55, id="not-ascii"),
    ],
)
def test_a_malformed_traceparent_is_ignored(value: str | bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_a_traceparent_is_written_as_version_00() -> None:
    parent = TraceParent(TRACE, SPAN, 1)
    assert parent.header == VALID and parent.is_sampled and not TraceParent(TRACE, SPAN, 2).is_sampled


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", id="kept"),
        pytest.param(b" a=1 ", "a=1", id="trimmed"),
        pytest.param("a=" + "x" * 600, None, id="too-long"),
        pytest.param("a=\x01", None, id="control-character"),
        pytest.param("", None, id="empty"),
    ],
)
def test_a_tracestate_is_carried_only_when_fit(value: str | bytes, expected: str | None) -> None:
    assert parse_tracestate(value) == expected


def test_only_the_trace_context_annotations_travel_on() -> None:
    annotations = {"traceparent": VALID, "tracestate": "a=1", "report_worker": "1", "priority": "3"}
    assert trace_context(annotations) == {"traceparent": VALID, "tracestate": "a=1"}
    assert trace_context({"tracestate": "a=1", "priority": "3"}) == {}  # a state without its parent is nothing


def test_the_trace_id_of_a_request_for_its_log_lines() -> None:
    assert trace_id_of({"traceparent": VALID}) == TRACE
    assert trace_id_of({"traceparent": "garbage"}) == trace_id_of({}) == ""
