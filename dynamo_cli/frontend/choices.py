"""Responses with more than one plain text: `n` choices and per-token logprobs, in OpenAI's shapes.

NOTE: a request with n > 1 is n generations of the same prompt, each dispatched on its own (the prefix
cache and the KV router share the prompt); their streams are merged as they come, every chunk naming
its choice's index. Plain requests (n = 1, no logprobs) never come here: completions.py's plain stream
and body serve them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.streaming import usage
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.wire import TokenLogprob

_json = msgspec.json.encode

OnPiece = Callable[[int, str | None, list[tuple[int, TokenLogprob]]], Awaitable[None]]
"""Called with (choice index, text piece or None at the choice's end, logprobs since the last call)."""


class LogprobFormatter:
    """One choice's logprobs in OpenAI's shape: chat `content[]` entries or completions' parallel lists."""

    def __init__(self, tokenizer: Tokenizer, *, is_chat: bool, text_offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        self._offset = text_offset
        """Completions: characters before the next token (the echoed prompt's, then each token's)."""

    def _token(self, token_id: int) -> tuple[str, bytes]:
        table = self._tokenizer.token_bytes
        if table is not None and 0 <= token_id < len(table):
            raw = table[token_id]
            return raw.decode("utf-8", errors="replace"), raw
        text = self._tokenizer.decode([token_id])
        return text, text.encode()

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def format(self, items: list[tuple[int, TokenLogprob]]) -> dict[str, Any] | None:
        """The `logprobs` object of a choice (or of a chunk) covering `items`; None when there are none."""
        if not items:
            return None
        if self._is_chat:
            content = []
            for token_id, lp in items:
                entry = self._entry(token_id, lp.logprob)
                entry["top_logprobs"] = [self._entry(t, p) for t, p in lp.top]
                content.append(entry)
            return {"content": content}
        tokens, offsets = [], []
        for token_id, _ in items:
            text, _raw = self._token(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in items],
            "top_logprobs": [{self._token(t)[0]: p for t, p in lp.top} for _, lp in items],
            "text_offset": offsets,
        }


async def fan_in(generations: list[Generation], on_piece: OnPiece) -> None:
    """Run every choice's text at once and hand each piece to `on_piece` as it comes (one at a time);
    the first choice to fail ends them all and its error propagates."""
    queue: asyncio.Queue[tuple[int, str | None, BaseException | None]] = asyncio.Queue(4 * len(generations))

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for piece in generation.text():
                await queue.put((index, piece, None))  # bounded: a slow client slows the generations
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    async with asyncio.TaskGroup() as group:  # owns the pumps; the body raising cancels them
        for index, generation in enumerate(generations):
            group.create_task(pump(index, generation))
        left = len(generations)
        while left:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            left -= piece is None
            await on_piece(index, piece, generations[index].take_logprobs())


class ChoicesResponse:
    """Builds the body (or SSE events) of a request with n choices and/or logprobs."""

    def __init__(
        self, request_id: str, model: str, generations: list[Generation], *, is_chat: bool, wants_logprobs: bool
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.generations = generations
        self.is_chat = is_chat
        self.created = int(time.time())
        self.formatters = [
            LogprobFormatter(g.tokenizer, is_chat=is_chat, text_offset=len(g.echo)) if wants_logprobs else None
            for g in generations
        ]

    def usage(self) -> dict[str, Any]:
        """The prompt counted once, the completions summed."""
        first = self.generations[0]
        completion = sum(g.completion_tokens for g in self.generations)
        return usage(len(first.dispatch.plan.prompt_ids), completion, first.cached_tokens)

    def _logprobs(self, index: int, items: list[tuple[int, TokenLogprob]]) -> dict[str, Any] | None:
        formatter = self.formatters[index]
        return formatter.format(items) if formatter is not None else None

    async def body(self) -> bytes:
        """The non-streaming response."""
        texts: list[list[str]] = [[] for _ in self.generations]
        logprobs: list[list[tuple[int, TokenLogprob]]] = [[] for _ in self.generations]

        async def collect(index: int, piece: str | None, items: list[tuple[int, TokenLogprob]]) -> None:
            if piece is not None:
                texts[index].append(piece)
            logprobs[index] += items

        await fan_in(self.generations, collect)
        choices = []
        for index, generation in enumerate(self.generations):
            text, reason = "".join(texts[index]), generation.finish_reason or "length"
            choice: dict[str, Any] = {"index": index}
            if self.is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(index, logprobs[index])
            choice["finish_reason"] = reason
            choices.append(choice)
        return _json(
            {
                "id": self.request_id,
                "object": "chat.completion" if self.is_chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": self.usage(),
            }
        )

    def event(self, index: int, piece: str | None, items: list[tuple[int, TokenLogprob]], *, is_first: bool) -> bytes:
        """One SSE chunk of choice `index`: a text piece, or (piece None) its finish."""
        choice: dict[str, Any] = {"index": index}
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if is_first else {}
            if piece is not None:
                delta["content"] = piece
            choice["delta"] = delta
        else:
            choice["text"] = piece or ""
        choice["logprobs"] = self._logprobs(index, items)
        choice["finish_reason"] = None if piece is not None else self.generations[index].finish_reason or "length"
        return self._sse({"choices": [choice]})

    def usage_event(self) -> bytes:
        return self._sse({"choices": [], "usage": self.usage()})

    def _sse(self, fields: dict[str, Any]) -> bytes:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        head = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        return b"data: " + _json({**head, **fields}) + b"\n\n"
