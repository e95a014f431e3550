"""What the workers have sent of one request so far, across migrations and the prefill hop: the request core's
accumulator (`Dispatch.output`), read by the frontend's pipeline, its replies and its metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from dynamo_cli.core.prefill import PrefillResult
from dynamo_cli.errors import RemoteError
from dynamo_cli.kv.handles import TransferReport
from dynamo_cli.wire import GENERATE, GenerateChunk, TokenLogprob

_decode_chunk = GENERATE.reply_decoder
_encode = GENERATE.encode
_perf_counter = time.perf_counter


class Output:
    """The token ids, logprobs, finish reason and cached-prompt count of one request's stream so far."""

    __slots__ = ("token_ids", "logprobs", "finish_reason", "cached_tokens", "first_token_at", "_on_transfer")

    def __init__(self, on_transfer: Callable[[TransferReport], None]) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        """With `sampling.logprobs` set: one per output id, as the workers sent them."""
        self.finish_reason: str | None = None
        self.cached_tokens: int | None = None
        """The prompt tokens the first worker found cached (its first report; a migration does not change it)."""
        self.first_token_at: float | None = None
        self._on_transfer = on_transfer
        """Hears each KV transfer a decode worker reports (the dispatch's metrics)."""

    def absorb(self, batch: list[msgspec.Raw]) -> list[int]:
        """One batch of encoded chunks: the token ids it brings, which are added to the output."""
        token_ids: list[int] = []
        for raw in batch:
            try:
                chunk = _decode_chunk(raw)
            except msgspec.DecodeError as exc:  # free unless raised (a zero-cost try)
                raise RemoteError(f"malformed generate reply (GenerateChunk): {exc}", status=502) from exc
            token_ids += chunk.token_ids
            if chunk.logprobs:
                self.logprobs += chunk.logprobs
            if chunk.num_cached_tokens is not None and self.cached_tokens is None:
                self.cached_tokens = chunk.num_cached_tokens
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
            if chunk.transfer is not None:
                self._on_transfer(chunk.transfer)
        if token_ids:
            if self.first_token_at is None:
                self.first_token_at = _perf_counter()
            self.token_ids += token_ids
        return token_ids

    def took_prefill(self, result: PrefillResult) -> None:
        """A remote prefill's first token is the stream's first."""
        self.token_ids = [result.first_token]
        self.logprobs = list(result.logprobs)
        self.first_token_at = _perf_counter()
        self.cached_tokens = result.cached_tokens
        self.finish_reason = result.finish_reason

    def encoded(self) -> bytes:
        """The output so far as one encoded GenerateChunk (`dyn router` relays a remote prefill's first token so)."""
        return _encode(
            GenerateChunk(
                token_ids=list(self.token_ids),
                finish_reason=self.finish_reason,
                num_cached_tokens=self.cached_tokens,
                logprobs=list(self.logprobs) or None,
            )
        )
