"""OpenAI response bodies: SSE chunks for streams, one JSON object otherwise.

Chunk JSON is assembled from a per-request prefix and suffix around the escaped text, so a token
costs one string escape instead of building and encoding a dict.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

_json = msgspec.json.encode


class ChunkFormatter:
    """Formats one request's SSE events (chat or completions)."""

    __slots__ = ("_created", "_is_chat", "_model", "_prefix", "request_id")

    def __init__(self, request_id: str, model: str, *, is_chat: bool) -> None:
        self.request_id = request_id
        self._model = model
        self._is_chat = is_chat
        self._created = int(time.time())
        kind = "chat.completion.chunk" if is_chat else "text_completion"
        self._prefix = (
            b'data: {"id":'
            + _json(request_id)
            + b',"object":"'
            + kind.encode()
            + b'","created":'
            + str(self._created).encode()
            + b',"model":'
            + _json(model)
            + b',"choices":[{"index":0,'
        )

    def role(self) -> bytes:
        """The first chat chunk, announcing the assistant role."""
        return self._prefix + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

    def text(self, piece: str) -> bytes:
        if self._is_chat:
            return self._prefix + b'"delta":{"content":' + _json(piece) + b'},"finish_reason":null}]}\n\n'
        return self._prefix + b'"text":' + _json(piece) + b',"finish_reason":null}]}\n\n'

    def delta(self, delta: dict[str, Any]) -> bytes:
        """A chat chunk with any delta (reasoning_content, tool_calls)."""
        return self._prefix + b'"delta":' + _json(delta) + b',"finish_reason":null}]}\n\n'

    def finish(self, reason: str) -> bytes:
        body = b'"delta":{}' if self._is_chat else b'"text":""'
        return self._prefix + body + b',"finish_reason":' + _json(reason) + b"}]}\n\n"

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> bytes:
        kind = "chat.completion.chunk" if self._is_chat else "text_completion"
        payload = {
            "id": self.request_id,
            "object": kind,
            "created": self._created,
            "model": self._model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }
        return b"data: " + _json(payload) + b"\n\n"

    def error(self, message: str, error_type: str, code: str | None) -> bytes:
        return b"data: " + _json({"error": {"message": message, "type": error_type, "code": code}}) + b"\n\n"

    def full(
        self,
        text: str,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached: int | None,
        message: dict[str, Any] | None = None,
    ) -> bytes:
        """The non-streaming response (chat: `message` when given, else `text` as the content)."""
        if self._is_chat:
            choice: dict[str, Any] = {"index": 0, "message": message or {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = reason
        return _json(
            {
                "id": self.request_id,
                "object": "chat.completion" if self._is_chat else "text_completion",
                "created": self._created,
                "model": self._model,
                "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens, cached),
            }
        )


DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
