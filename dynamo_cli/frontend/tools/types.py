"""The wire types of tool calling and structured output in OpenAI chat requests (msgspec, checked at the edge)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MAX_TOOLS = 1536
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
"""OpenAI's rule for function names: letters, digits, `_`, `-` (and `.`), at most 64."""


class FunctionDef(msgspec.Struct, kw_only=True):
    """A function the model may call."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (None: no arguments)."""
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str
    """The arguments object as JSON text (as OpenAI sends it)."""


class ToolCall(msgspec.Struct, kw_only=True):
    """A call the assistant made (in an earlier assistant message, or in a response)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`response_format`: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
