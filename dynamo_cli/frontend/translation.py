"""The APIs served as translations onto chat completions (/v1/responses, /v1/messages): how each one
parses its body, becomes a chat request, and writes its reply."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dynamo_cli.frontend import messages, responses
from dynamo_cli.frontend.openai import ChatCompletionRequest
from dynamo_cli.frontend.pipeline import Generation


class Writer(Protocol):
    """One reply of a translated API."""

    async def body(self) -> bytes: ...

    def events(self) -> AsyncIterator[bytes]: ...

    def error_event(self, exc: Exception) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Translation:
    """One API served on top of chat."""

    name: str
    """Its label in the request metrics."""
    parse: Callable[[bytes], Any]
    """Body -> the API's request (RequestError naming the field)."""
    to_chat: Callable[[Any], ChatCompletionRequest]
    writer: Callable[[Any, Generation], Writer]


TRANSLATIONS = {
    "/v1/responses": Translation("responses", responses.parse_responses, responses.to_chat, responses.ResponseWriter),
    "/v1/messages": Translation("messages", messages.parse_messages, messages.to_chat, messages.MessageWriter),
}
"""Path -> the API served there."""
