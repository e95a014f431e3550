"""One request's journey behind the HTTP layer: route, stream tokens, detokenize, stop, migrate.

NOTE: workers speak token ids; everything textual (detokenization, stop strings) happens here, so a
request migrated to another worker mid-stream continues seamlessly: the tokens generated so far are
appended to the prompt and `max_tokens` shrinks by as many.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from dynamo_cli.engine import GenerateChunk, GenerateRequest
from dynamo_cli.errors import ContextOverflow, NoWorkers, Overloaded, TransportError
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.models import BusyThresholds, ModelEntry, Worker
from dynamo_cli.frontend.stops import StopMatcher
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.router.base import RouteDecision, RouteRequest
from dynamo_cli.runtime.transport import ResponseStream

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode_chunk = msgspec.msgpack.Decoder(GenerateChunk).decode


@dataclass(frozen=True, slots=True)
class Sampling:
    """Generation parameters after OpenAI-level validation."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


class Generation:
    """Runs one request; iterate `text()` for text pieces, then read the counters."""

    def __init__(
        self,
        entry: ModelEntry,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        sampling: Sampling,
        request_id: str,
        *,
        migration_limit: int,
        metrics: FrontendMetrics,
        pinned_worker: int | None = None,
        busy: BusyThresholds | None = None,
        explain: bool = False,
    ) -> None:
        self.entry = entry
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.request_id = request_id
        self.migration_limit = migration_limit
        self.metrics = metrics
        self.pinned_worker = pinned_worker
        self.busy = busy or BusyThresholds()
        self.explain = explain
        """The caller asked to see the routing decision (header x-dyn-explain-route)."""
        self.max_tokens = self._max_tokens(sampling)
        self.sampling = sampling
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.cached_tokens: int | None = None
        self.decision: RouteDecision | None = None
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.num_migrations = 0
        self.is_aborted = False
        self._stream: ResponseStream | None = None
        self.first_worker = self._route(set())
        """Routed up front, so "no worker" is a clean 503 and the response can name the worker."""

    def abort(self) -> None:
        """The client left: cancel the worker's stream (freeing its KV) and end `text()`."""
        self.is_aborted = True
        if self._stream is not None:
            self._stream.cancel()

    def _max_tokens(self, sampling: Sampling) -> int:
        context = self.entry.card.context_length
        room = context - len(self.prompt_ids)
        wanted = sampling.max_tokens if sampling.max_tokens is not None else room
        if room < 1 or wanted > room:
            raise ContextOverflow(len(self.prompt_ids), wanted, context)
        return wanted

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    async def text(self) -> AsyncIterator[str]:
        """Text pieces as they become final; ends with `finish_reason` set."""
        detok = self.tokenizer.detokenizer()
        stops = StopMatcher(list(self.sampling.stop))
        async for token_ids in self._tokens():
            piece = stops.push(detok.push(token_ids))
            if piece:
                yield piece
            if stops.stopped:
                self.finish_reason = "stop"
                return
        tail = stops.push(detok.flush()) + ("" if stops.stopped else stops.flush())
        if stops.stopped:
            self.finish_reason = "stop"
        if tail:
            yield tail

    async def _tokens(self) -> AsyncIterator[list[int]]:
        """Token ids across workers: re-dispatch on a migratable failure, up to the migration limit."""
        excluded: set[int] = set()
        worker = self.first_worker
        while not self.is_aborted:
            try:
                async for token_ids in self._stream_from(worker):
                    yield token_ids
                return
            except TransportError as exc:
                if not exc.is_migratable or self.num_migrations >= self.migration_limit:
                    raise
                self.num_migrations += 1
                excluded.add(worker.instance_id)
                kind = "ongoing_request" if self.output_ids else "new_request"
                self.metrics.migrations.labels(self.entry.name, kind).inc()
                logger.warning("request %s: worker %x failed (%s); migrating (%d/%d)", self.request_id,
                               worker.instance_id, exc, self.num_migrations, self.migration_limit)  # fmt: skip
                worker = self._route(excluded)

    def _route(self, excluded: set[int]) -> Worker:
        workers = self.entry.workers
        candidates = [w for w in workers if w not in excluded]
        if not candidates:
            raise NoWorkers(f"model '{self.entry.name}'")
        reasons = [r for w in candidates if (r := workers[w].busy_reason(self.busy))]
        if len(reasons) == len(candidates):
            raise Overloaded(f"all {len(candidates)} workers of '{self.entry.name}' are busy ({reasons[0]})")
        if reasons:
            candidates = [w for w in candidates if workers[w].busy_reason(self.busy) is None]
        route = RouteRequest(self.request_id, self.prompt_ids + self.output_ids, self.pinned_worker)
        self.decision = self.entry.policy.select(route, candidates)
        return workers[self.decision.worker_id]

    async def _stream_from(self, worker: Worker) -> AsyncIterator[list[int]]:
        request = self._request()
        policy = self.entry.policy
        stream: ResponseStream | None = None
        worker.num_inflight += 1
        try:
            stream = self._stream = await worker.client.open_stream(worker.record.endpoint, _encode(request))
            while batch := await stream.next_batch():
                token_ids: list[int] = []
                for raw in batch:
                    chunk = _decode_chunk(raw)
                    token_ids += chunk.token_ids
                    if chunk.num_cached_tokens is not None and self.cached_tokens is None:
                        self.cached_tokens = chunk.num_cached_tokens
                    if chunk.finish_reason is not None:
                        self.finish_reason = chunk.finish_reason
                if token_ids:
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                        policy.on_first_token(self.request_id)
                    self.output_ids += token_ids
                    yield token_ids
            if self.is_aborted:
                self.finish_reason = "cancelled"
            stream = None
        finally:
            worker.num_inflight -= 1
            self._stream = None
            policy.on_finish(self.request_id)
            if stream is not None:
                stream.cancel()  # consumer left (client gone or stop string): abort on the worker

    def _request(self) -> GenerateRequest:
        s = self.sampling
        produced = len(self.output_ids)
        return GenerateRequest(
            request_id=self.request_id,
            token_ids=self.prompt_ids + self.output_ids,
            max_tokens=self.max_tokens - produced,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            min_tokens=max(0, s.min_tokens - produced),
        )
