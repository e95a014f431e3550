"""Tool-call formats per model family: how a model writes its calls, and how they are read back.

Each parser turns the model's whole output into (content, calls) and tells the streaming jail where a
call may begin (`markers`, anywhere in the text, or `leading`, only as the first non-blank text). When
the text between markers does not parse, nothing is lost: the whole output is returned as content.

| name        | what the model writes                                              | families            |
|-------------|--------------------------------------------------------------------|---------------------|
| hermes      | `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (repeated)  | Hermes, Qwen 2.5/3  |
| llama3_json | `<|python_tag|>{"name": …, "parameters": {…}}` or bare JSON (`;`)  | Llama 3.1-3.3       |
| mistral     | `[TOOL_CALLS][{"name": …, "arguments": {…}}]` or `[TOOL_CALLS]f[ARGS]{…}` | Mistral      |
| pythonic    | `[get_weather(city="Paris"), now()]`                               | Llama 3.2/4, others |
| json        | a JSON object `{"name": …, "arguments": {…}}` or an array of them   | anything (generic)  |
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.tools.reasoning import REASONING_PARSERS


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from model text."""

    name: str
    arguments: str
    """The arguments object as JSON text."""


class ToolParser:
    """Base: a JSON-object format; subclasses set the markers and override `parse_calls` / `render`."""

    name = "json"
    markers: tuple[str, ...] = ()
    """Text that opens a call wherever it appears."""
    leading: tuple[str, ...] = ("{", "[", "```")
    """Text that opens a call only as the first non-blank text of the output."""
    end_marker = ""
    """Text that closes one call (the stream releases it there); empty: calls run to the end of the output."""
    example = '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}'

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole output; no calls (and all of `text` as content) when it does not parse."""
        start = self.call_start(text)
        if start < 0:
            return text, []
        try:
            calls = self.parse_calls(text[start:])
        except (ValueError, TypeError, KeyError, SyntaxError, RecursionError):
            return text, []
        return (text[:start].rstrip(), calls) if calls else (text, [])

    def call_start(self, text: str) -> int:
        """Where the calls begin in `text`, or -1."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return min(found)
        stripped = text.lstrip()
        if any(stripped.startswith(m) for m in self.leading):
            return len(text) - len(stripped)
        return -1

    def parse_calls(self, text: str) -> list[ParsedCall]:
        """The calls of `text`, which starts at a call; raises ValueError (or kin) when it does not parse."""
        body = _unfence(text)
        value = json.loads(body)
        return [_call(item) for item in (value if isinstance(value, list) else [value])]

    def render(self, calls: list[ParsedCall]) -> str:
        """Calls as this model writes them (earlier assistant turns, when the template knows no tools)."""
        return json.dumps([_as_dict(c, "arguments") for c in calls]) if len(calls) > 1 else _json_call(calls[0])


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    leading = ()
    end_marker = "</tool_call>"
    example = '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        content, calls = super().parse(text)
        if not calls:
            return content, calls
        tail = text[text.rfind("</tool_call>") + len("</tool_call>") :] if "</tool_call>" in text else ""
        return (content + (" " if content and tail.strip() else "") + tail.strip()).strip(), calls

    def parse_calls(self, text: str) -> list[ParsedCall]:
        return [_call(json.loads(m.group(1))) for m in self._BLOCK.finditer(text) if m.group(1)]

    def render(self, calls: list[ParsedCall]) -> str:
        return "\n".join(f"<tool_call>\n{_json_call(c)}\n</tool_call>" for c in calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    leading = ("{",)
    example = '{"name": "<function name>", "parameters": {<arguments as a JSON object>}}'

    def parse_calls(self, text: str) -> list[ParsedCall]:
        body = text.removeprefix("<|python_tag|>").strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            value, end = decoder.raw_decode(body, at)
            calls.append(_call(value))
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return calls

    def render(self, calls: list[ParsedCall]) -> str:
        return "<|python_tag|>" + "; ".join(json.dumps(_as_dict(c, "parameters")) for c in calls)


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    leading = ()
    example = '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as a JSON object>}}]'
    _ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def parse_calls(self, text: str) -> list[ParsedCall]:
        body = text.removeprefix("[TOOL_CALLS]").strip()
        if body.startswith(("[", "{")):
            value = json.JSONDecoder().raw_decode(body)[0]
            return [_call(item) for item in (value if isinstance(value, list) else [value])]
        calls = []  # v11+: name[ARGS]{...}, repeated after further [TOOL_CALLS]
        for part in body.split("[TOOL_CALLS]"):
            match = self._ARGS.match(part)
            if match is None:
                raise ValueError("no [ARGS] after the function name")
            arguments = json.JSONDecoder().raw_decode(part, match.end())[0]
            calls.append(_call({"name": match.group(1), "arguments": arguments}))
        return calls

    def render(self, calls: list[ParsedCall]) -> str:
        return "[TOOL_CALLS]" + json.dumps([_as_dict(c, "arguments") for c in calls])


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("<|python_start|>",)
    leading = ("[",)
    example = "[<function name>(<argument>=<value>, ...), ...]"

    def parse_calls(self, text: str) -> list[ParsedCall]:
        body = text.removeprefix("<|python_start|>").split("<|python_end|>")[0].strip()
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                raise ValueError("only calls with keyword arguments")
            # literal_eval reads literals only (no names, calls or attributes: nothing runs) from the model's
            # own output, bounded by max_tokens; anything else raises and the text is returned as content.
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append(ParsedCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
        return calls

    def render(self, calls: list[ParsedCall]) -> str:
        def one(call: ParsedCall) -> str:
            args = json.loads(call.arguments or "{}")
            return f"{call.name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"

        return "[" + ", ".join(one(c) for c in calls) + "]"


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (ToolParser, HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}
"""Every `--tool-call-parser` name."""

_FAMILY_MARKS = (
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
)


def tool_parser(name: str, template_source: str = "") -> ToolParser:
    """The parser `name` ("auto": the one the chat template's markers suggest, else the generic json)."""
    if name == "auto":
        name = next((parser for mark, parser in _FAMILY_MARKS if mark in template_source), "json")
    if name not in PARSERS:
        raise ConfigError(f"unknown tool-call parser '{name}'; choose auto or one of {', '.join(PARSERS)}")
    return PARSERS[name]()


def check_parsers(tool_call_parser: str, reasoning_parser: str | None) -> None:
    """ConfigError for a parser name that does not exist (checked once, at startup)."""
    if tool_call_parser != "auto" and tool_call_parser not in PARSERS:
        raise ConfigError(f"--tool-call-parser {tool_call_parser}: choose auto or one of {', '.join(PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser {reasoning_parser}: choose one of {', '.join(REASONING_PARSERS)}")


def _unfence(text: str) -> str:
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    return body


def _call(value: Any) -> ParsedCall:
    """A call from a decoded JSON object with `name` and `arguments` (or `parameters`)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("a call is an object with a string name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _as_dict(call: ParsedCall, key: str) -> dict[str, Any]:
    return {"name": call.name, key: json.loads(call.arguments or "{}")}


def _json_call(call: ParsedCall) -> str:
    return json.dumps(_as_dict(call, "arguments"), ensure_ascii=False)
