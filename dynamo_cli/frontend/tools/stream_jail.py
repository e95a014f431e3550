"""The jailed stream: text that may be a tool call is held back until it is known, then released as
well-formed `tool_calls` (or, when it turns out not to be one, as the text it was).

NOTE: content flows through until a parser's call marker appears (`<tool_call>`, `[TOOL_CALLS]`, …, or
`{` / `[` as the first non-blank text for formats without a marker); a suffix that could be the start
of a marker is held, never emitted early. From the marker on everything is jailed to the end of the
output, then parsed whole: the client gets each call once, complete, as OpenAI's deltas (index, id,
type and name first, then the arguments), and text the parser could not read comes back as content.
"""

from __future__ import annotations

import uuid
from typing import Any

from dynamo_cli.frontend.tools.parsers import ParsedCall, ToolParser, partial_marker


class ToolCallJail:
    """Feed content pieces (`push`), then `finish`; one per request."""

    __slots__ = ("_held", "_jailed", "_parser", "_seen_text")

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._held = ""
        self._jailed: str | None = None
        """From the first call marker on, everything; None while free."""
        self._seen_text = False
        """Non-blank text went out: a leading-only marker can no longer open a call."""

    def push(self, text: str) -> str:
        """Content safe to emit now."""
        if self._jailed is not None:
            self._jailed += text
            return ""
        window, self._held = self._held + text, ""
        if not self._seen_text and self._parser.leading:
            stripped = window.lstrip()
            if not stripped or any(m.startswith(stripped) or stripped.startswith(m) for m in self._parser.leading):
                if stripped and any(stripped.startswith(m) for m in self._parser.leading):
                    self._jailed = window
                else:
                    self._held = window
                return ""
        start = min((i for i in (window.find(m) for m in self._parser.markers) if i >= 0), default=-1)
        if start >= 0:
            self._jailed = window[start:]
            window = window[:start]
        else:
            keep = partial_marker(window, self._parser.markers)
            self._held = window[len(window) - keep :] if keep else ""
            window = window[: len(window) - keep]
        self._seen_text = self._seen_text or bool(window.strip())
        return window

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content still to emit, calls) at the end of the output."""
        held, self._held = self._held, ""
        if self._jailed is None:
            return held, []
        jailed, self._jailed = self._jailed, None
        content, calls = self._parser.parse(jailed)
        return (content, calls) if calls else (held + jailed, [])


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_deltas(calls: list[ParsedCall], first_index: int = 0) -> list[dict[str, Any]]:
    """The streamed form of `calls`: per call a delta with index, id, type and name, then its arguments."""
    deltas: list[dict[str, Any]] = []
    for i, call in enumerate(calls, first_index):
        deltas.append(header_delta(i, call.name))
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return deltas


def header_delta(index: int, name: str) -> dict[str, Any]:
    """The first delta of a streamed call: who is called, with empty arguments so far."""
    call = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    return {"tool_calls": [call]}


def message_calls(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """`calls` as a response message's `tool_calls`."""
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]  # fmt: skip
