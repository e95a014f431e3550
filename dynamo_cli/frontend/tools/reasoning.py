"""Reasoning text (`<think>…</think>`) split from the answer into `reasoning_content`, whole or streamed.

Two rules (`--reasoning-parser`):
- `basic` (alias `qwen3`): reasoning is what an explicit `<think>` … `</think>` pair encloses at the start.
- `deepseek_r1`: the output starts inside the reasoning (the template opened `<think>` already; a
  leading `<think>` is dropped) and `</think>` ends it; an output that never closes it is all reasoning.
"""

from __future__ import annotations

from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.tools.text import partial_marker

START, END = "<think>", "</think>"
REASONING_PARSERS = ("basic", "qwen3", "deepseek_r1")


class ReasoningSplitter:
    """Feed text pieces; get (reasoning, content) pieces safe to emit. One per request."""

    __slots__ = ("_held", "_state")

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ConfigError(f"unknown reasoning parser '{name}'; choose one of {', '.join(REASONING_PARSERS)}")
        self._state = "start_r1" if name == "deepseek_r1" else "start"
        """start: may open with <think>; start_r1: inside reasoning, may repeat <think>; reasoning;
        after: just past </think>; content."""
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of `text` that is final now; a possible partial tag is held back."""
        window, self._held = self._held + text, ""
        reasoning = content = ""
        while window:
            if self._state in ("start", "start_r1"):
                stripped = window.lstrip()
                if START.startswith(stripped) and len(stripped) < len(START):
                    self._held = window  # could still be "<think>"
                    return reasoning, content
                if stripped.startswith(START):
                    window = stripped[len(START) :]
                    self._state = "reasoning"
                    continue
                self._state = "reasoning" if self._state == "start_r1" else "content"
                continue
            if self._state == "content":
                return reasoning, content + window
            cut = window.find(END)
            if cut >= 0:
                reasoning += window[:cut]
                window = window[cut + len(END) :]
                self._state = "after"
                continue
            if self._state == "after":  # the blank lines between reasoning and answer are dropped
                window = window.lstrip()
                if window:
                    self._state = "content"
                continue
            keep = partial_marker(window, (END,))
            self._held = window[len(window) - keep :] if keep else ""
            return reasoning + window[: len(window) - keep], content
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held at the end of the stream."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or self._state == "start_r1":
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        r1, c1 = self.push(text)
        r2, c2 = self.flush()
        return r1 + r2, c1 + c2
