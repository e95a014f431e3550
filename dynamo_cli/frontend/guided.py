"""What a chat request's `tools`, `tool_choice` and `response_format` ask of the engine and of the output.

`response_format` json_object / json_schema and `tool_choice` required / named become a `Guided`
constraint the engine enforces while sampling (constrained decoding), so the output always parses:
- json_schema: the client's schema; json_object: any JSON object;
- required: a JSON array (one item without `parallel_tool_calls`) of `{"name": <a tool>, "parameters":
  <its parameters>}` objects, one `anyOf` branch per tool;
- named: the named tool's parameters object.
Schemas are checked here, at the edge (JSON Schema meta-schema, size and depth limits), with a 400
naming the field; an engine without `Feature.GUIDED_JSON` is refused with a 400 naming the field and the engine.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import jsonschema
import msgspec

from dynamo_cli.engine import Feature
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.openai import ChatCompletionRequest
from dynamo_cli.frontend.tools.types import NamedToolChoice, Tool
from dynamo_cli.wire import Guided

MAX_SCHEMA_BYTES = 64 * 1024
"""Largest JSON schema (encoded) a request may carry, per tool and for response_format."""
MAX_SCHEMA_DEPTH = 12
"""Deepest nesting of objects and arrays inside a schema."""


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request treats tools and structured output."""

    mode: str
    """none | auto | required | named (tools/output.py)."""
    tools: tuple[Tool, ...] = ()
    """The tools shown to the model (none with tool_choice "none")."""
    named: str = ""
    """mode named: the function to call."""
    guided: Guided | None = None
    """The engine's constraint; None: free text."""


def plan_tools(request: ChatCompletionRequest, features: Collection[str], engine: str, model: str) -> ToolPlan:
    """Check the request's tool and format fields and decide what they ask for (RequestError: a 400)."""
    tools = tuple(request.tools or ())
    _check_tools(tools)
    for i, message in enumerate(request.messages):
        if message.role == "tool" and not message.tool_call_id:
            param = f"messages[{i}].tool_call_id"
            raise RequestError(f"{param}: a tool message names the call it answers", param=param)
    choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    mode, named = (choice, "") if isinstance(choice, str) else ("named", choice.function.name)
    if mode in ("required", "named") and not tools:
        raise RequestError(f"tool_choice '{mode}' needs tools; send the functions in `tools`", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and named not in {t.function.name for t in tools}:
        raise RequestError(f"tool_choice names function '{named}', which is not among the tools", param="tool_choice")
    guided = _format_guided(request)
    if guided is not None and mode in ("required", "named"):
        raise RequestError(
            "response_format and tool_choice required/named both constrain the output; send one",
            param="response_format",
        )
    if mode == "required":
        schema = _required_schema(tools, request.parallel_tool_calls)
        guided = Guided(kind="json_schema", schema=json.dumps(schema), param="tool_choice")
    elif mode == "named":
        tool = next(t for t in tools if t.function.name == named)
        guided = Guided(kind="json_schema", schema=json.dumps(_parameters(tool)), param="tool_choice")
    if guided is not None and Feature.GUIDED_JSON.value not in features:
        field = "response_format" if mode not in ("required", "named") else "tool_choice"
        raise RequestError(
            f"{field} needs guided decoding (guided_json), which engine '{engine}' serving model "
            f"'{model}' does not support; serve the model with an engine that has it (llamacpp, "
            "vllm) or leave the field out",
            param=field,
        )
    return ToolPlan(mode, () if mode == "none" else tools, named, guided)


def _format_guided(request: ChatCompletionRequest) -> Guided | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Guided(kind="json_object")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise RequestError("response_format json_schema needs json_schema.schema", param="response_format.json_schema")
    check_schema(fmt.json_schema.schema, "response_format.json_schema.schema")
    return Guided(kind="json_schema", schema=json.dumps(fmt.json_schema.schema))


def _check_tools(tools: tuple[Tool, ...]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            param = f"tools[{i}].function.name"
            raise RequestError(f"{param}: two tools are named '{name}'; names must be unique", param=param)
        seen.add(name)
        if tool.function.parameters is not None:
            check_schema(tool.function.parameters, f"tools[{i}].function.parameters")


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` unless `schema` is a valid JSON schema within the size and depth limits."""
    size = len(msgspec.json.encode(schema))
    if size > MAX_SCHEMA_BYTES:
        raise RequestError(f"{param} is {size} bytes; at most {MAX_SCHEMA_BYTES}", param=param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise RequestError(f"{param} is not a valid JSON schema at {where}: {exc.message}", param=param) from None


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def _required_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
