"""Log lines name the request and trace in scope, as text or one JSON object per line."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
from collections.abc import Iterator

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.tracing.logs import TEXT_FORMAT, JsonLines, RequestScope, enter_request, use_log_format

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """A handler as `configure_logging` installs it (RequestScope, text), on a logger of its own."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestScope())
    handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logger = logging.getLogger("tests.tracing.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield out
    logger.removeHandler(handler)


def log_in(context: contextvars.Context, message: str) -> None:
    context.run(logging.getLogger("tests.tracing.logs").warning, message)


def test_a_text_line_names_the_request_and_trace_in_scope_only(stream: io.StringIO) -> None:
    inside = contextvars.copy_context()
    inside.run(enter_request, "chatcmpl-1", TRACE)
    log_in(inside, "in a request")
    log_in(contextvars.copy_context(), "outside")
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(f"WARNING tests.tracing.logs: in a request [request_id=chatcmpl-1 trace_id={TRACE}]")
    assert lines[1].endswith("WARNING tests.tracing.logs: outside")


async def test_a_request_in_scope_reaches_the_tasks_its_handler_starts(stream: io.StringIO) -> None:
    async def handler() -> None:
        enter_request("cmpl-2")  # no trace: the request id alone
        await asyncio.create_task(_log("from a child task"))

    async def _log(message: str) -> None:
        logging.getLogger("tests.tracing.logs").warning(message)

    await asyncio.create_task(handler())
    await _log("after the handler's task")  # the scope ended with its task
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("from a child task [request_id=cmpl-2]") and lines[1].endswith("after the handler's task")


def test_json_lines_carry_the_scope_and_the_exception(stream: io.StringIO) -> None:
    handler = logging.getLogger("tests.tracing.logs").handlers[0]
    handler.setFormatter(JsonLines())
    context = contextvars.copy_context()
    context.run(enter_request, "chatcmpl-3", TRACE)

    def fail() -> None:
        try:
            raise ValueError("bad value")
        except ValueError:
            logging.getLogger("tests.tracing.logs").exception("it failed: %s", 42)

    context.run(fail)
    log_in(contextvars.copy_context(), "outside")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert {k: first[k] for k in ("level", "logger", "message", "trace_id", "request_id")} == {
        "level": "ERROR",
        "logger": "tests.tracing.logs",
        "message": "it failed: 42",
        "trace_id": TRACE,
        "request_id": "chatcmpl-3",
    }
    assert first["ts"].endswith("Z") and "ValueError: bad value" in first["exc_info"]
    assert second["trace_id"] is None and second["request_id"] is None and "exc_info" not in second


def test_the_log_format_switches_only_the_handlers_dyn_installed() -> None:
    ours, theirs = logging.StreamHandler(io.StringIO()), logging.StreamHandler(io.StringIO())
    ours.addFilter(RequestScope())
    root = logging.getLogger()
    root.addHandler(ours)
    root.addHandler(theirs)
    try:
        use_log_format("json")
        assert isinstance(ours.formatter, JsonLines) and theirs.formatter is None
        use_log_format("text")
        assert not isinstance(ours.formatter, JsonLines)
        with pytest.raises(ConfigError, match="--log-format 'xml' is invalid"):
            use_log_format("xml")
    finally:
        root.removeHandler(ours)
        root.removeHandler(theirs)
