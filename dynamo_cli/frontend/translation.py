"""The generation APIs the edge serves, each an `Api` that its one lifecycle runs (lifecycle.py): OpenAI's chat
completions and completions (completions.py), and the APIs served as translations onto chat (/v1/responses,
/v1/messages): how each one parses its body, becomes a generation request, and writes its reply."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Receive, Send

from dynamo_cli.frontend import messages, responses_api
from dynamo_cli.frontend.completions import CHAT, COMPLETIONS
from dynamo_cli.frontend.headers import id_headers
from dynamo_cli.frontend.openai import ChatCompletionRequest, OpenAiRequest
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.replies import Write, reply_json, stream_sse


class Api(Protocol):
    """One generation API at the edge."""

    @property
    def name(self) -> str:
        """Its label in the request metrics."""
        ...

    @property
    def id_prefix(self) -> str:
        """Of its request ids (`chatcmpl-`, `cmpl-`)."""
        ...

    def parse(self, body: bytes) -> Any:
        """Body -> the API's request (RequestError naming the field); its `stream` says how it is answered."""
        ...

    def to_generate(self, request: Any) -> OpenAiRequest:
        """The generation request underneath."""
        ...

    async def reply(self, request: Any, generations: list[Generation], send: Send, receive: Receive) -> str:
        """Write the reply of the prepared `generations`; the status for the metrics (success, cancelled, error)."""
        ...


class Writer(Protocol):
    """One reply of a translated API."""

    async def body(self) -> bytes: ...

    def events(self) -> AsyncIterator[bytes]: ...

    def error_event(self, exc: Exception) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Translation:
    """One API served on top of chat."""

    name: str
    parse: Callable[[bytes], Any]
    to_generate: Callable[[Any], ChatCompletionRequest]
    writer: Callable[[Any, Generation], Writer]
    id_prefix: str = "chatcmpl-"  # a chat request underneath

    async def reply(self, request: Any, generations: list[Generation], send: Send, receive: Receive) -> str:
        """The API's own object, or its events."""
        generation = generations[0]
        writer, d = self.writer(request, generation), generation.dispatch
        if not request.stream:
            return await reply_json(send, writer.body, lambda: id_headers(generation), d.plan.request_id)

        async def produce(write: Write) -> bytes:
            async for event in writer.events():
                await write(event)
            return b""

        headers = id_headers(generation)
        return await stream_sse(
            send, receive, headers, produce, d.abort, writer.error_event, d.plan.request_id, done=b""
        )


APIS: dict[str, Api] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": Translation(
        "responses", responses_api.parse_responses, responses_api.to_chat, responses_api.ResponseWriter
    ),
    messages.MESSAGES_PATH: Translation("messages", messages.parse_messages, messages.to_chat, messages.MessageWriter),
}
"""Path -> the API served there."""
