"""`POST /v1/messages`: Anthropic's Messages API as a translation onto chat completions.

NOTE: as for /v1/responses, only the shape is this module's: the request becomes a
`ChatCompletionRequest` (system -> a system message, stop_sequences -> stop, tools -> functions, tool_choice
auto/any/tool/none -> auto/required/named/none, an assistant's `tool_use` blocks -> its tool_calls, a user's
`tool_result` blocks -> role tool messages, images -> image_url parts) and runs through the same preparation and
dispatch; the reply is Anthropic's message object, or its event stream (message_start, then per content block
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) / content_block_stop,
message_delta with the stop reason and usage, message_stop). With tools or a reasoning parser the blocks are known
once the output ends (the tool-call parser holds the text until then): they are sent then, in order.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.types import Message as AsgiMessage
from starlette.types import Send

from dynamo_cli.errors import DynError, RequestError
from dynamo_cli.frontend.openai import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    ContentPart,
    ImageUrl,
    MaxTokens,
    Message,
    TopP,
    decode_body,
)
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.tools.types import (
    MAX_TOOLS,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolChoice,
)

_json = msgspec.json.encode


class TextBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="text"):
    text: str


class ImageSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["base64", "url"]
    media_type: str | None = None
    """base64: the image's type (image/png, image/jpeg, image/webp, image/gif)."""
    data: str | None = None
    """base64: the image file in base64."""
    url: str | None = None
    """url: where the image is (frontend/media.py's policy applies)."""


class ImageBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="image"):
    source: ImageSource


class ToolUseBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="tool_use"):
    """An assistant's call, in the conversation so far."""

    id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="tool_result"):
    """A call's result, in the user turn after it."""

    tool_use_id: Annotated[str, Meta(min_length=1, max_length=256)]
    content: str | list[TextBlock] = ""
    is_error: bool = False


class AnthropicTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """type tool: the tool to call."""
    disable_parallel_tool_use: bool = False


class ThinkingBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="thinking"):
    """An assistant's reasoning sent back in the history (coding agents do): dropped from the prompt, as chat
    templates drop earlier reasoning."""

    thinking: str
    signature: str = ""


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class AnthropicMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Messages fields this server honours (text in, text out)."""

    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    max_tokens: MaxTokens
    system: str | list[TextBlock] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    """Anthropic's range is 0..1 (a subset of OpenAI's: passed through as is)."""
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    tools: Annotated[list[AnthropicTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    """Metadata (Anthropic's user_id): accepted, asks nothing of generation."""


_decoder = msgspec.json.Decoder(MessagesRequest)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def parse_messages(body: bytes) -> MessagesRequest:
    request: MessagesRequest = decode_body(_decoder, body)
    if request.stop_sequences and not all(request.stop_sequences):
        raise RequestError("stop_sequences must be non-empty strings", param="stop_sequences")
    return request


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _parts(content: str | list[TextBlock | ImageBlock], where: str) -> str | list[ContentPart]:
    """A message's content as chat content: its text, or its parts with images as image_url parts."""
    if isinstance(content, str) or all(isinstance(block, TextBlock) for block in content):
        return _text(content)  # type: ignore[arg-type]
    return [
        ContentPart(type="text", text=block.text)
        if isinstance(block, TextBlock)
        else ContentPart(type="image_url", image_url=ImageUrl(url=_image_url(block.source, f"{where}.content[{i}]")))
        for i, block in enumerate(content)
    ]


def _image_url(source: ImageSource, where: str) -> str:
    if source.type == "url":
        if not source.url:
            raise RequestError(f"{where}.source.url is missing", param=f"{where}.source.url")
        return source.url
    if not source.media_type or not source.data:
        raise RequestError(f"{where}.source needs media_type and data", param=f"{where}.source")
    return f"data:{source.media_type};base64,{source.data}"


def _turns(m: AnthropicMessage, where: str) -> list[Message]:
    """One Anthropic message as chat messages: an assistant's text and tool calls; a user's tool results (role
    tool messages, in order) then the rest of its content."""
    if isinstance(m.content, str):
        return [Message(role=m.role, content=m.content)]
    uses = [block for block in m.content if isinstance(block, ToolUseBlock)]
    results = [block for block in m.content if isinstance(block, ToolResultBlock)]
    rest: list[TextBlock | ImageBlock] = [b for b in m.content if isinstance(b, TextBlock | ImageBlock)]
    if m.role == "user" and uses or m.role == "assistant" and (results or any(isinstance(b, ImageBlock) for b in rest)):
        raise RequestError(f"{where}: a {m.role} message cannot hold those blocks", param=where)
    if m.role == "assistant":
        calls = [
            ToolCall(id=u.id, function=ToolCallFunction(name=u.name, arguments=msgspec.json.encode(u.input).decode()))
            for u in uses
        ]
        return [Message(role="assistant", content=_text(rest), tool_calls=calls or None)]  # type: ignore[arg-type]
    out = [
        Message(role="tool", tool_call_id=r.tool_use_id, content=("error: " if r.is_error else "") + _text(r.content))
        for r in results
    ]
    if rest or not results:
        out.append(Message(role="user", content=_parts(rest, where)))
    return out


def _tool_choice(choice: AnthropicToolChoice | None, tools: list[Tool]) -> ToolChoice | None:
    if choice is None or not tools:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice type tool needs a name", param="tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]  # type: ignore[return-value]


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that computes this message."""
    messages = [Message(role="system", content=_text(request.system))] if request.system else []
    for i, m in enumerate(request.messages):
        messages += _turns(m, f"messages[{i}]")
    tools = [
        Tool(type="function", function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema))
        for t in request.tools or ()
    ]
    parallel = request.tool_choice is None or not request.tool_choice.disable_parallel_tool_use
    return ChatCompletionRequest(
        tools=tools or None,
        tool_choice=_tool_choice(request.tool_choice, tools),
        parallel_tool_calls=parallel,
        model=request.model,
        messages=messages,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=request.stop_sequences,
        stream=request.stream,
    )


class MessageWriter:
    """One reply as Anthropic's message object, or as its stream of events."""

    def __init__(self, request: MessagesRequest, generation: Generation) -> None:
        self.request = request
        self.generation = generation
        self.id = "msg_" + uuid.uuid4().hex

    def message(self, text: str | None) -> dict[str, Any]:
        """The message: empty with no stop reason while `text` is None (message_start), else finished."""
        g = self.generation
        reason = None if text is None else _STOP_REASONS.get(g.finish_reason or "length", "end_turn")
        if reason == "end_turn" and g.is_stopped:
            reason = "stop_sequence"
        blocks = [] if text is None else self.blocks(text)
        if any(block["type"] == "tool_use" for block in blocks) and reason == "end_turn":
            reason = "tool_use"
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": g.dispatch.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(g.dispatch.plan.prompt_ids),
                "output_tokens": 0 if text is None else g.completion_tokens,
            },
        }

    def blocks(self, text: str) -> list[dict[str, Any]]:
        """The content blocks of the whole output: thinking, text, tool_use (through the chat output's parsers)."""
        output = self.generation.output
        if output is None:
            return [{"type": "text", "text": text}]
        message = output.message(text)
        blocks: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            arguments = _arguments(call["function"]["arguments"])
            blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
        return blocks or [{"type": "text", "text": ""}]

    async def body(self) -> bytes:
        return _json(self.message("".join([piece async for piece in self.generation.text()])))

    async def events(self) -> AsyncIterator[bytes]:
        yield _event("message_start", message=self.message(None))
        if self.generation.output is not None:  # tools or reasoning: the blocks are known at the end
            final = self.message("".join([piece async for piece in self.generation.text()]))
            for index, block in enumerate(final["content"]):
                for event in _block_events(index, block):
                    yield event
        else:
            yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            pieces = []
            async for piece in self.generation.text():
                pieces.append(piece)
                yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
            yield _event("content_block_stop", index=0)
            final = self.message("".join(pieces))
        yield _event(
            "message_delta",
            delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
            usage={"output_tokens": final["usage"]["output_tokens"]},
        )
        yield _event("message_stop")

    def error_event(self, exc: Exception) -> bytes:
        status = exc.status if isinstance(exc, DynError) else 500
        return _event("error", error={"type": error_type(status), "message": str(exc)})


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    """One whole content block as its start, delta and stop events."""
    kind = block["type"]
    if kind == "tool_use":
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": msgspec.json.encode(block["input"]).decode()}
    elif kind == "thinking":
        start, delta = (
            {"type": "thinking", "thinking": "", "signature": ""},
            {"type": "thinking_delta", "thinking": block["thinking"]},
        )
    else:
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    return [
        _event("content_block_start", index=index, content_block=start),
        _event("content_block_delta", index=index, delta=delta),
        _event("content_block_stop", index=index),
    ]


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's `input`); text that is not one is kept under "arguments"."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


MESSAGES_PATH = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (`api_error` for any other)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def anthropic_errors(send: Send) -> Send:
    """`send`, with an error response's OpenAI-shaped body (replies.py, the edge's every refusal) rewritten in
    Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`: the status and headers stay."""
    status = 200

    async def sending(message: AsgiMessage) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = [(k, v) for k, v in message.get("headers", ()) if k != b"content-length"]
            message = {**message, "headers": headers} if status >= 400 else message
        elif message["type"] == "http.response.body" and status >= 400:
            try:
                error = msgspec.json.decode(message.get("body", b""))["error"]
                detail, param = str(error["message"]), error.get("param")
            except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
                detail, param = message.get("body", b"").decode("utf-8", "replace"), None
            if param and str(param) not in detail:
                detail = f"{param}: {detail}"  # Anthropic's shape has no field of its own for it
            body = _json({"type": "error", "error": {"type": error_type(status), "message": detail}})
            message = {**message, "body": body}
        await send(message)

    return sending


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json({"type": kind, **fields}) + b"\n\n"
