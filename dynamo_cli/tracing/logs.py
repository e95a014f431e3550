"""Log lines that name the request and trace they were written for, as text or one JSON object per line.

A request's handler calls `enter_request` once (the frontend's HTTP handler, a worker's or router's `generate`);
a context variable then holds the request in scope for its task and the tasks it starts, and `RequestScope`, a
logging.Filter on the handler the CLI installs, copies it onto each record (`request_id`, `trace_id`).
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

import msgspec

from dynamo_cli.config import LOG_FORMATS
from dynamo_cli.errors import ConfigError

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(scope)s"

# NOTE: the one module-level mutable object besides `logger`s: a context variable is per task, not shared
# state, and it is how a log call deep in the request core learns the request without being passed it.
_SCOPE: ContextVar[tuple[str, str] | None] = ContextVar("dyn_request_scope", default=None)


def enter_request(request_id: str, trace_id: str = "") -> None:
    """Lines logged from now on in this task, and in the tasks it starts, name this request (and trace).

    Set once at the top of a handler that runs in a task of its own (an HTTP request, a request-plane stream):
    it ends with the task, so it is never reset."""
    _SCOPE.set((request_id, trace_id))


class RequestScope(logging.Filter):
    """Puts the request in scope on each record: `request_id`, `trace_id` (None outside a request) and `scope`,
    the text format's suffix."""

    def filter(self, record: logging.LogRecord) -> bool:
        scope = _SCOPE.get()
        if scope is None:
            record.request_id = record.trace_id = None
            record.scope = ""
            return True
        record.request_id, trace_id = scope
        record.trace_id = trace_id or None
        record.scope = f" [request_id={scope[0]}" + (f" trace_id={trace_id}]" if trace_id else "]")
        return True


class JsonLines(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, message, trace_id, request_id, and
    exc_info / stack_info when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line: dict[str, object] = {
            "ts": ts,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "trace_id": getattr(record, "trace_id", None),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return msgspec.json.encode(line).decode()


def configure_logging(level: str) -> None:
    """The process's log handler (stderr, text, RequestScope), unless logging is configured already."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestScope())
    handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def use_log_format(log_format: str) -> None:
    """Write `text` or `json` lines from now on, on the handlers `configure_logging` installed."""
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"--log-format '{log_format}' is invalid; use one of: {', '.join(LOG_FORMATS)}")
    formatter = JsonLines() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in logging.getLogger().handlers:
        if any(isinstance(f, RequestScope) for f in handler.filters):
            handler.setFormatter(formatter)
