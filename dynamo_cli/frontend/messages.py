"""`POST /v1/messages`: Anthropic's Messages API (text only) as a translation onto chat completions.

NOTE: as for /v1/responses, only the shape is this module's: the request becomes a
`ChatCompletionRequest` (system -> a system message, stop_sequences -> stop) and runs through the same
preparation and dispatch; the reply is Anthropic's message object, or its event stream (message_start,
content_block_start, content_block_delta, content_block_stop, message_delta, message_stop).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dynamo_cli.errors import RequestError
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


class AnthropicMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ImageBlock]


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


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that computes this message."""
    messages = [Message(role="system", content=_text(request.system))] if request.system else []
    messages += [
        Message(role=m.role, content=_parts(m.content, f"messages[{i}]")) for i, m in enumerate(request.messages)
    ]
    return ChatCompletionRequest(
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
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": g.dispatch.model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(g.dispatch.plan.prompt_ids),
                "output_tokens": 0 if text is None else g.completion_tokens,
            },
        }

    async def body(self) -> bytes:
        return _json(self.message("".join([piece async for piece in self.generation.text()])))

    async def events(self) -> AsyncIterator[bytes]:
        yield _event("message_start", message=self.message(None))
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
        return _event("error", error={"type": "api_error", "message": str(exc)})


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json({"type": kind, **fields}) + b"\n\n"
