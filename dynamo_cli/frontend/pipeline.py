"""One request's text: the dispatched token stream, detokenized and cut at stop strings.

NOTE: workers speak token ids and the request core (core/dispatch.py) moves them (routing, migration); everything
textual happens here, so the text side is the same whatever hops the request takes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from dynamo_cli.core.dispatch import Dispatch
from dynamo_cli.frontend.stops import StopMatcher
from dynamo_cli.frontend.tools.output import ChatOutput
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.wire import TokenLogprob


class Generation:
    """Iterate `text()` for text pieces, then read `finish_reason` and the dispatch's counters."""

    def __init__(self, dispatch: Dispatch, tokenizer: Tokenizer, *, echo: str = "", stop: tuple[str, ...] = ()) -> None:
        self.dispatch = dispatch
        self.tokenizer = tokenizer
        self.echo = echo
        """Text sent before the generated text (completions' `echo`: the prompt)."""
        self.stop = stop
        """Stop strings: the text ends before the first one (the workers see stop token ids only)."""
        self.is_stopped = False
        """A stop string ended the text."""
        self.output: ChatOutput | None = None
        """Chat: reads the text into reasoning, content and tool calls (tools/output.py); None: text as is."""
        self._num_logprobs_taken = 0
        self.first_shown_at: float | None = None
        """When the first token was sent, where it was held for the decode worker's (`--disagg-first-token`)."""

    def take_logprobs(self) -> list[tuple[int, TokenLogprob]]:
        """(token id, logprobs) of the tokens received since the last call (when the request asked)."""
        output, start = self.dispatch.output, self._num_logprobs_taken
        self._num_logprobs_taken = len(output.logprobs)
        return list(zip(output.token_ids[start:], output.logprobs[start:], strict=False))

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.is_stopped else self.dispatch.output.finish_reason

    @property
    def completion_tokens(self) -> int:
        return len(self.dispatch.output.token_ids)

    @property
    def cached_tokens(self) -> int | None:
        return self.dispatch.output.cached_tokens

    async def text(self) -> AsyncIterator[str]:
        """Text pieces as they become final; ends with `finish_reason` set."""
        if self.echo:
            yield self.echo
        detok = self.tokenizer.detokenizer()
        stops = StopMatcher(list(self.stop))
        holds = self.dispatch.rules.disagg.first_token == "with-decode"
        held: list[int] = []
        async with contextlib.aclosing(self.dispatch.stream()) as stream:  # a stop string aborts the worker now
            async for batch, token_ids in stream:
                if not token_ids:
                    continue
                if holds and not batch and not held:
                    held = token_ids  # the prefill worker's first token: it goes with the decode worker's first
                    continue
                if held:
                    token_ids, held = held + token_ids, []
                    self.first_shown_at = time.perf_counter()
                piece = stops.push(detok.push(token_ids))
                if piece:
                    yield piece
                if stops.stopped:
                    self.is_stopped = True
                    return
        tail = stops.push(detok.push(held)) if held else ""
        tail += stops.push(detok.flush()) + ("" if stops.stopped else stops.flush())
        self.is_stopped = stops.stopped
        if tail:
            yield tail
