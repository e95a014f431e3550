"""OpenAI's own two generation APIs, `/v1/chat/completions` and `/v1/completions`, as implementations of the `Api`
protocol (translation.py) that the edge's one lifecycle serves (lifecycle.py): one JSON body, an SSE stream, or `n`
choices and logprobs (choices.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Send

from dynamo_cli.errors import DynError
from dynamo_cli.frontend.choices import ChoicesResponse, fan_in
from dynamo_cli.frontend.headers import id_headers
from dynamo_cli.frontend.openai import OpenAiRequest as Request
from dynamo_cli.frontend.openai import parse_chat, parse_completion
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.replies import Write, reply_json, stream_sse, watching
from dynamo_cli.frontend.replies import error_type as _error_type
from dynamo_cli.frontend.streaming import DONE, ChunkFormatter


@dataclass(frozen=True, slots=True)
class OpenAiApi:
    """Chat completions (`is_chat`) or completions: the request is its own generation request."""

    name: str
    id_prefix: str
    is_chat: bool
    parse: Callable[[bytes], Request]

    def to_generate(self, request: Request) -> Request:
        return request

    async def reply(self, request: Request, generations: list[Generation], send: Send, receive: Receive) -> str:
        first = generations[0]
        if len(generations) > 1 or first.dispatch.plan.request.sampling.logprobs is not None:
            return await _choices(generations, request, send, receive, self.is_chat)
        if request.stream:
            return await _stream(first, request, send, receive, self.is_chat)
        return await _complete(first, send, receive, self.is_chat)


CHAT = OpenAiApi("chat_completions", "chatcmpl-", True, parse_chat)
COMPLETIONS = OpenAiApi("completions", "cmpl-", False, parse_completion)


async def _stream(gen: Generation, request: Request, send: Send, receive: Receive, is_chat: bool) -> str:
    d = gen.dispatch
    fmt = ChunkFormatter(d.plan.request_id, d.model, is_chat=is_chat)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    out = gen.output
    head = [fmt.role()] if is_chat else []  # rides with the first content chunk: one write fewer

    def unsent() -> bytes:
        return head.pop() if head else b""

    async def produce(write: Write) -> bytes:
        async for piece in gen.text():
            body = fmt.text(piece) if out is None else b"".join(fmt.delta(x) for x in out.push(piece))
            if body:
                await write(unsent() + body)
        reason = gen.finish_reason or "length"
        tail = b"" if out is None else b"".join(fmt.delta(x) for x in out.finish())
        tail += fmt.finish(out.finish_reason(reason) if out else reason)
        if include_usage:
            tail += fmt.usage(len(d.plan.prompt_ids), gen.completion_tokens, gen.cached_tokens)
        return unsent() + tail

    def error_event(exc: DynError) -> bytes:  # the stream still ends with an error event and [DONE]
        return unsent() + fmt.error(str(exc), _error_type(exc), exc.code)

    return await stream_sse(send, receive, id_headers(gen), produce, d.abort, error_event, d.plan.request_id, done=DONE)


async def _complete(gen: Generation, send: Send, receive: Receive, is_chat: bool) -> str:
    """One JSON body; a client that leaves meanwhile aborts the work (the worker frees its KV at once)."""
    d = gen.dispatch
    fmt = ChunkFormatter(d.plan.request_id, d.model, is_chat=is_chat)

    async def body() -> bytes:
        text = "".join([piece async for piece in gen.text()])
        reason, out = gen.finish_reason or "length", gen.output
        message = out.message(text) if out is not None else None
        reason = out.finish_reason(reason) if out is not None else reason
        return fmt.full(text, reason, len(d.plan.prompt_ids), gen.completion_tokens, gen.cached_tokens, message)

    async with watching(receive, d.abort):
        status = await reply_json(send, body, lambda: id_headers(gen), d.plan.request_id)
    return "cancelled" if d.is_aborted else status


async def _choices(gens: list[Generation], request: Request, send: Send, receive: Receive, is_chat: bool) -> str:
    """n choices and/or logprobs (choices.py): one body, or SSE events naming each choice's index."""
    d = gens[0].dispatch
    wants_logprobs = d.plan.request.sampling.logprobs is not None
    response = ChoicesResponse(d.plan.request_id, d.model, gens, is_chat=is_chat, wants_logprobs=wants_logprobs)
    if not request.stream:
        return await reply_json(send, response.body, lambda: id_headers(gens[0]), d.plan.request_id)
    started: set[int] = set()
    include_usage = bool(request.stream_options and request.stream_options.include_usage)

    async def produce(write: Write) -> bytes:
        async def on_piece(index: int, piece: str | None, items: list[Any]) -> None:
            await write(response.event(index, piece, items, is_first=index not in started))
            started.add(index)

        await fan_in(gens, on_piece)
        return response.usage_event() if include_usage and not d.is_aborted else b""

    def abort() -> None:
        for gen in gens:
            gen.dispatch.abort()

    def error_tail(exc: DynError) -> bytes:
        return ChunkFormatter("", "", is_chat=is_chat).error(str(exc), _error_type(exc), exc.code)

    return await stream_sse(
        send, receive, id_headers(gens[0]), produce, abort, error_tail, d.plan.request_id, done=DONE
    )
