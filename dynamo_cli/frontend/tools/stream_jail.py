"""The jailed stream: text that may be a tool call is held back until it is known, then released as
well-formed `tool_calls` (or, when it turns out not to be one, as the text it was).

NOTE: content flows through until a parser's call marker appears (`<tool_call>`, `[TOOL_CALLS]`, …, or
`{`, `[` or a code fence as the first non-blank text for formats without a marker); a suffix that could be the start
of a marker is held, never emitted early. From the marker on everything is jailed: up to the call's end
marker for a format that has one (hermes' `</tool_call>`: the call goes out then, and the text after it
flows again), else to the end of the output, then parsed whole. The client gets each call once,
complete, as OpenAI's deltas (index, id, type and name first, then the arguments), and text the parser
could not read comes back as content.
"""

from __future__ import annotations

import uuid
from typing import Any

from dynamo_cli.frontend.tools.parsers import ParsedCall, ToolParser
from dynamo_cli.frontend.tools.text import partial_marker


class ToolCallJail:
    """Feed content pieces (`push`), take the calls completed so far (`take`), then `finish`; one per request."""

    __slots__ = ("_held", "_jailed", "_parser", "_ready", "_seen_text")

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._held = ""
        self._jailed: str | None = None
        """From a call marker on, everything (up to the call's end marker, when the format has one); None while free."""
        self._seen_text = False
        """Non-blank text went out: a leading-only marker can no longer open a call."""
        self._ready: list[ParsedCall] = []
        """Calls released by their end marker, not yet taken."""

    def push(self, text: str) -> str:
        """Content safe to emit now (before any call `take` then returns)."""
        if self._jailed is not None:
            self._jailed += text
            self._release()
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
            self._release()
        else:
            keep = partial_marker(window, self._parser.markers)
            self._held = window[len(window) - keep :] if keep else ""
            window = window[: len(window) - keep]
        self._seen_text = self._seen_text or bool(window.strip())
        return window

    def take(self) -> list[ParsedCall]:
        """The calls completed since the last take."""
        ready, self._ready = self._ready, []
        return ready

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content still to emit, calls not yet taken) at the end of the output."""
        content = ""
        while self._jailed is None and self._held:  # text after a released call may hold further calls
            held = self._held
            content += self.push("")
            if self._held == held:
                break
        held, self._held = self._held, ""
        if self._jailed is None:
            return content + held, self.take()
        jailed, self._jailed = self._jailed, None
        rest, calls = self._parser.parse(jailed)
        return (content + rest, self.take() + calls) if calls else (content + jailed, self.take())

    def _release(self) -> None:
        """A jailed call complete at its end marker goes out now; the text after it is free again."""
        end = self._parser.end_marker
        cut = self._jailed.find(end) if end and self._jailed is not None else -1
        if cut < 0 or self._jailed is None:
            return
        block, rest = self._jailed[: cut + len(end)], self._jailed[cut + len(end) :]
        _, calls = self._parser.parse(block)
        if calls:  # else the block stays jailed, to come back as text at the end
            self._ready += calls
            self._jailed, self._held, self._seen_text = None, rest, True


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
    return [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
