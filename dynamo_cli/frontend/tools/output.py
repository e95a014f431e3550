"""A chat response's text turned into OpenAI's message parts: `reasoning_content`, `content`, `tool_calls`.

One `ChatOutput` per request. The text passes the reasoning splitter (when a `--reasoning-parser` is set),
then one of four tool modes: `none` (content as is), `auto` (the jailed stream and the model's parser),
`required` (guided: a JSON array of `{"name", "parameters"}`, parsed at the end) and `named` (guided:
the text is the arguments of the one named function, streamed as they come).
"""

from __future__ import annotations

import json
from typing import Any

from dynamo_cli.frontend.tools.parsers import ParsedCall, ToolParser
from dynamo_cli.frontend.tools.reasoning import ReasoningSplitter
from dynamo_cli.frontend.tools.stream_jail import ToolCallJail, call_deltas, header_delta, message_calls

MODES = ("none", "auto", "required", "named")


class ChatOutput:
    """Feed text pieces (`push`) for stream deltas, `finish` at the end; or `message` for a whole text."""

    def __init__(self, mode: str, parser: ToolParser, reasoning: str | None = None, named: str = "") -> None:
        self.mode = mode
        self._named = named
        self._reasoning = ReasoningSplitter(reasoning) if reasoning else None
        self._jail = ToolCallJail(parser) if mode == "auto" else None
        self._guided_text: list[str] = []
        self.num_calls = 0
        """Tool calls emitted so far (finish_reason becomes "tool_calls" when the output ended normally)."""

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    ##### Streaming #####

    def push(self, text: str) -> list[dict[str, Any]]:
        """Deltas that are final after `text`."""
        reasoning, content = self._reasoning.push(text) if self._reasoning else ("", text)
        return self._deltas(reasoning, content)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held at the end of the output (the jailed calls among them)."""
        reasoning, content = self._reasoning.flush() if self._reasoning else ("", "")
        deltas = self._deltas(reasoning, content)
        if self._jail is not None:
            rest, calls = self._jail.finish()
            deltas += [{"content": rest}] if rest else []
            deltas += call_deltas(calls, self.num_calls)
            self.num_calls += len(calls)
        elif self.mode == "required":
            text = "".join(self._guided_text)
            calls = required_calls(text)
            deltas += call_deltas(calls) if calls else ([{"content": text}] if text else [])
            self.num_calls = len(calls)
        return deltas

    def _deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if not content:
            return deltas
        if self.mode == "none":
            deltas.append({"content": content})
        elif self._jail is not None:
            free = self._jail.push(content)
            deltas += [{"content": free}] if free else []
            calls = self._jail.take()
            deltas += call_deltas(calls, self.num_calls)
            self.num_calls += len(calls)
        elif self.mode == "required":
            self._guided_text.append(content)
        else:  # named: the arguments, as they come
            if not self.num_calls:
                deltas.append(header_delta(0, self._named))
                self.num_calls = 1
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": content}}]})
        return deltas

    ##### Whole text #####

    def message(self, text: str) -> dict[str, Any]:
        """The response message of a whole output."""
        reasoning, content = self._reasoning.split(text) if self._reasoning else ("", text)
        calls: list[ParsedCall] = []
        if self.mode == "auto" and self._jail is not None:
            content = self._jail.push(content)
            calls = self._jail.take()
            rest, more = self._jail.finish()
            content, calls = content + rest, calls + more
        elif self.mode == "required":
            calls = required_calls(content)
        elif self.mode == "named":
            calls = [ParsedCall(self._named, content.strip())]
        message: dict[str, Any] = {"role": "assistant", "content": None if calls else content}
        if calls:
            message["content"] = (content.strip() or None) if self.mode == "auto" else None
            message["tool_calls"] = message_calls(calls)
        if self._reasoning is not None:
            message["reasoning_content"] = reasoning or None
        self.num_calls = len(calls)
        return message


def required_calls(text: str) -> list[ParsedCall]:
    """The calls of a `tool_choice: required` output (a JSON array of {"name", "parameters"}); none when
    it does not parse (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    items = [v for v in value if isinstance(v, dict) and isinstance(v.get("name"), str)]
    return [ParsedCall(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False)) for v in items]
