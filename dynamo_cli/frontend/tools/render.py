"""Tools and tool turns put into the prompt: through the model's chat template when it has a tool
section, else through a documented fallback.

A template that reads `tools` (Qwen, Hermes, Llama 3.1+, Mistral …) gets them as OpenAI function objects,
earlier assistant calls as `tool_calls` (arguments decoded to objects, as Hugging Face templates expect)
and tool results as role `tool` messages with `tool_call_id`.

Fallback, for a template without one (SmolLM2's, say): a system block is prepended to the first system
message (or becomes one) that lists the functions as JSON in `<tools>` and states the answer format the
request's mode expects: the parser's own call format (auto), a JSON array of `{"name", "parameters"}`
(required) or the named function's arguments object (named). Earlier assistant calls are written into
the assistant's content in the parser's format, and tool results become user turns wrapped in
`<tool_response>` … `</tool_response>` (a role `tool` is not something every template accepts).
"""

from __future__ import annotations

import json
from typing import Any

from dynamo_cli.frontend.openai import Message, message_text
from dynamo_cli.frontend.tools.parsers import ParsedCall, ToolParser
from dynamo_cli.frontend.tools.types import Tool
from dynamo_cli.model.chat_template import ChatTemplate


def render_inputs(
    messages: list[Message],
    tools: tuple[Tool, ...],
    mode: str,
    named: str,
    parser: ToolParser,
    template: ChatTemplate | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template."""
    has_turns = any(m.role == "tool" or m.tool_calls for m in messages)
    if not tools and not has_turns:
        return [{"role": m.role, "content": message_text(m)} for m in messages], None
    if template is not None and template.uses_tools:
        return [_native(m) for m in messages], [_function(t) for t in tools] or None
    out = [_fallback(m, parser) for m in messages]
    if tools:
        block = _system_block(tools, mode, named, parser)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _function(tool: Tool) -> dict[str, Any]:
    f = tool.function
    body: dict[str, Any] = {
        "name": f.name,
        "description": f.description or "",
        "parameters": f.parameters or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": body}


def _native(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": message_text(m)}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _fallback(m: Message, parser: ToolParser) -> dict[str, Any]:
    text = message_text(m)
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if m.tool_calls:
        calls = [ParsedCall(c.function.name, json.dumps(_arguments(c.function.arguments))) for c in m.tool_calls]
        text = (text + "\n" if text else "") + parser.render(calls)
    return {"role": m.role, "content": text}


def _system_block(tools: tuple[Tool, ...], mode: str, named: str, parser: ToolParser) -> str:
    listing = "\n".join(json.dumps(_function(t)["function"], ensure_ascii=False) for t in tools)
    if mode == "required":
        how = 'Answer with a JSON array of calls: [{"name": <function name>, "parameters": {<arguments>}}].'
    elif mode == "named":
        how = f"Call {named}: answer with its arguments as one JSON object."
    else:
        how = f"To call a function, answer with:\n{parser.example}\nOtherwise answer normally."
    return (
        f"You can call these functions:\n<tools>\n{listing}\n</tools>\n{how}\n"
        "Function results come back in <tool_response></tool_response> blocks."
    )


def _arguments(text: str) -> Any:
    """A call's arguments for a template: the decoded object (the JSON text itself when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
