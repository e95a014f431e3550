"""`POST /v1/responses`: OpenAI's Responses API as a stateless translation onto chat completions.

NOTE: stateless, as Dynamo's (PR #5854): nothing is stored, so `previous_response_id` is not accepted
(400, an unknown field) and `store: true` is refused. The request becomes a `ChatCompletionRequest`
(instructions -> a system message, input -> messages, max_output_tokens -> max_tokens) and runs through
the same preparation and dispatch as chat; only the output's shape is this module's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.openai import (
    ChatCompletionRequest,
    ContentPart,
    ImageUrl,
    MaxTokens,
    Message,
    Temperature,
    TopP,
    decode_body,
)
from dynamo_cli.frontend.pipeline import Generation

_json = msgspec.json.encode


class InputPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["input_text", "output_text", "text", "input_image"]
    text: str | None = None
    image_url: str | None = None
    """input_image: a data:, https: or file: URL (frontend/media.py's policy applies)."""
    detail: Literal["auto", "low", "high"] = "auto"


class InputMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]
    type: Literal["message"] = "message"


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Responses fields this server honours (text in, text out, stateless)."""

    model: str
    input: str | Annotated[list[InputMessage], Meta(min_length=1)]
    instructions: str | None = None
    """A system message put before the input."""
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool = False
    """Must stay false: this server keeps no responses."""
    user: str | None = None
    """Metadata: accepted, asks nothing of generation."""
    metadata: dict[str, str] | None = None
    """Metadata: accepted, asks nothing of generation."""


_decoder = msgspec.json.Decoder(ResponsesRequest)


def parse_responses(body: bytes) -> ResponsesRequest:
    """Decode and check a /v1/responses body."""
    request: ResponsesRequest = decode_body(_decoder, body)
    if request.store:
        raise RequestError(
            "store: true is not supported; this server keeps no responses (send store: false)",
            param="store",
            code="unsupported_parameter",
        )
    return request


def to_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that computes this response."""
    messages = [Message(role="system", content=request.instructions)] if request.instructions else []
    if isinstance(request.input, str):
        messages.append(Message(role="user", content=request.input))
    else:
        for i, item in enumerate(request.input):
            messages.append(Message(role=item.role, content=_content(item.content, f"input[{i}]")))
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
    )


def _content(content: str | list[InputPart], where: str) -> str | list[ContentPart]:
    """An input item's content as chat content (input_image parts become image_url parts)."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            if not part.image_url:
                raise RequestError(f"{where}.content[{j}].image_url is missing", param=f"{where}.content[{j}]")
            parts.append(ContentPart(type="image_url", image_url=ImageUrl(url=part.image_url, detail=part.detail)))
        elif part.text is None:
            raise RequestError(f"{where}.content[{j}].text is missing", param=f"{where}.content[{j}]")
        else:
            parts.append(ContentPart(type="text", text=part.text))
    if all(p.type == "text" for p in parts):
        return "".join(p.text or "" for p in parts)
    return parts


class ResponseWriter:
    """One response's JSON object or its stream of typed SSE events."""

    def __init__(self, request: ResponsesRequest, generation: Generation) -> None:
        self.request = request
        self.generation = generation
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self._sequence = 0

    def response(self, text: str | None) -> dict[str, Any]:
        """The response object: in progress while `text` is None, else finished."""
        g, r = self.generation, self.request
        output, status, incomplete, usage = [], "in_progress", None, None
        if text is not None:
            output = [self.item(text, "completed")]
            is_cut = g.finish_reason == "length"
            status = "incomplete" if is_cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if is_cut else None
            prompt, completion = len(g.dispatch.plan.prompt_ids), g.completion_tokens
            usage = {
                "input_tokens": prompt,
                "output_tokens": completion,
                "total_tokens": prompt + completion,
                "input_tokens_details": {"cached_tokens": g.cached_tokens or 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": g.dispatch.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "metadata": r.metadata or {},
            "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "store": False,
        }

    def item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    async def body(self) -> bytes:
        text = "".join([piece async for piece in self.generation.text()])
        return _json(self.response(text))

    async def events(self) -> AsyncIterator[bytes]:
        """response.created … response.output_text.delta … response.completed, as SSE."""
        yield self._event("response.created", response=self.response(None))
        yield self._event("response.output_item.added", output_index=0, item=self.item("", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self._event("response.content_part.added", **where, part=part)
        pieces = []
        async for piece in self.generation.text():
            pieces.append(piece)
            yield self._event("response.output_text.delta", **where, delta=piece, logprobs=[])
        text = "".join(pieces)
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part={**part, "text": text})
        yield self._event("response.output_item.done", output_index=0, item=self.item(text, "completed"))
        final = self.response(text)
        yield self._event(
            "response.completed" if final["status"] == "completed" else "response.incomplete", response=final
        )

    def error_event(self, exc: Exception) -> bytes:
        return self._event("error", message=str(exc), code=getattr(exc, "code", None), param=None)

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        data = _json({"type": kind, "sequence_number": self._sequence, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
