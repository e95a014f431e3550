"""One request's token stream across workers, as named hops: choose a worker, open a stream, relay its
tokens, migrate on worker loss.

NOTE: this module sees token ids only; text (detokenizing, stop strings) is pipeline.py's. So a request
migrated to another worker mid-stream continues seamlessly: the tokens generated so far are appended to
the prompt and `max_tokens` shrinks by as many (`num_generated` tells the next worker which of them
penalties count). Disaggregation adds one hop before `_open`: choose a
prefill worker, run the prompt there with max_tokens 1, and hand its KV handle to the decode hop
(`GenerateRequest.kv_transfer`); the text side does not change. Each chosen worker is held from
`_choose` to `_release`: that is the one place the policy hears `on_finish`, as `_relay` is the one
place it hears `on_first_token`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgspec

from dynamo_cli.config import DisaggConfig, QueueConfig
from dynamo_cli.engine import (
    DEADLINE_ANNOTATION,
    PIN_ANNOTATION,
    PRIORITY_ANNOTATION,
    REPORT_WORKER_ANNOTATION,
    GenerateChunk,
    GenerateRequest,
    Guided,
    TokenLogprob,
)
from dynamo_cli.errors import (
    ContextOverflow,
    NoWorkers,
    Overloaded,
    RemoteError,
    RequestError,
    TransportError,
    UnknownInstance,
)
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.models import BusyThresholds, ModelEntry, Worker
from dynamo_cli.frontend.replies import interruptible
from dynamo_cli.kv.handles import UNKNOWN_FIRST_TOKEN, KvHandle
from dynamo_cli.router import prefill
from dynamo_cli.router.base import RouteDecision, RouteRequest
from dynamo_cli.router.disagg import falls_back, prefill_choice
from dynamo_cli.router.queue import QueuedRequest
from dynamo_cli.router.registry import not_busy
from dynamo_cli.runtime.transport import ResponseStream

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode_chunk = msgspec.msgpack.Decoder(GenerateChunk).decode


@dataclass(frozen=True, slots=True)
class Sampling:
    """Generation parameters after OpenAI-level validation."""

    max_tokens: int | None
    """None = as many as the context leaves."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings (the text side's); the workers see `stop_token_ids` only."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    guided: Guided | None = None
    """Constrained decoding (response_format, tool_choice required/named)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """Token id -> bias, as pairs (the plan is frozen)."""
    min_p: float = 0.0
    logprobs: int | None = None
    """None: no logprobs; N: each token's logprob and N alternatives (`Dispatch.logprobs`)."""


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What one request asks of the workers, fixed before it is dispatched."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    """Output tokens allowed, checked against the model's context."""
    pinned_worker: int | None = None
    """The worker the caller asked for (header `x-worker-instance-id`); a backend behind a router too."""
    is_explained: bool = False
    """The caller asked to see the routing decision (header `x-dyn-explain-route`)."""
    client_request_id: str | None = None
    """The caller's `x-request-id`, echoed back; `request_id` is always the frontend's own."""
    queued: QueuedRequest = QueuedRequest()
    """Its place in the wait queue when every worker is busy: priority and deadline (headers), job size."""


def plan_request(
    entry: ModelEntry,
    request_id: str,
    prompt_ids: list[int],
    sampling: Sampling,
    *,
    pinned_worker: int | None = None,
    is_explained: bool = False,
    client_request_id: str | None = None,
    priority: int = 0,
    deadline: float | None = None,
) -> RequestPlan:
    """The plan of a request to `entry`'s model, or ContextOverflow when it cannot fit the context."""
    context = entry.card.context_length
    room = context - len(prompt_ids)
    wanted = sampling.max_tokens if sampling.max_tokens is not None else room
    if room < 1 or wanted > room:
        raise ContextOverflow(len(prompt_ids), wanted, context)
    queued = QueuedRequest(priority, len(prompt_ids) + wanted, deadline)
    return RequestPlan(request_id, prompt_ids, sampling, wanted, pinned_worker, is_explained, client_request_id, queued)


def queue_annotations(queued: QueuedRequest) -> dict[str, str]:
    """A router's wait queue learns the request's priority and deadline (ms left now) from these annotations."""
    annotations = {PRIORITY_ANNOTATION: str(queued.priority)} if queued.priority else {}
    if queued.deadline is not None:
        annotations[DEADLINE_ANNOTATION] = str(max(0, round((queued.deadline - time.monotonic()) * 1000)))
    return annotations


@dataclass(frozen=True, slots=True)
class DispatchRules:
    """How this frontend dispatches every request."""

    migration_limit: int
    """Re-dispatches of a stream whose worker died; 0 disables migration."""
    busy: BusyThresholds
    """When a worker counts as busy; a request finding every worker busy gets a 503."""
    is_remote: bool
    """The workers are `dyn router` replicas: a pin travels to them as an annotation, and they name
    the backend that serves."""
    disagg: DisaggConfig = DisaggConfig()
    """When a model with prefill workers has its prompt prefilled remotely."""
    queue: QueueConfig = QueueConfig()
    """How long, in what order and how many requests wait when every worker is busy."""


class Dispatch:
    """Runs one plan on the workers: `start()` before the response, then iterate `tokens()`; `close()` last."""

    def __init__(self, entry: ModelEntry, plan: RequestPlan, rules: DispatchRules, metrics: FrontendMetrics) -> None:
        self.entry = entry
        self.plan = plan
        self.rules = rules
        self.metrics = metrics
        self.worker: Worker | None = None
        """The worker (or router) the request is on now."""
        self.served_by: int | None = None
        """The backend instance serving the request: the worker, or the one a router reports."""
        self.decision: RouteDecision | None = None
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        """With `sampling.logprobs` set: one per output id, as the workers sent them."""
        self.finish_reason: str | None = None
        self.cached_tokens: int | None = None
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.num_migrations = 0
        self.is_aborted = False
        self._excluded: set[int] = set()
        self._stream: ResponseStream | None = None
        self._pending: list[msgspec.Raw] = []
        """A first batch read by `start` (a router's report), relayed first."""
        self._is_held = False
        self._is_prefilled = False
        self.prefill: dict[str, object] | None = None
        """Disaggregation: where the prompt was prefilled and why (x-dyn-explain-route)."""
        self._handle: KvHandle | None = None
        """The prefill's KV handle until a decode worker answers (a decode worker that fails first hands it
        on to the next); still set at the end, it is released on the prefill worker."""
        self._prefill_worker: Worker | None = None
        self._rendezvous: prefill.Rendezvous | None = None
        """NOTE: SGLang's prefill, drained beside the decode; owned here, closed in `close`/`aclose`."""
        self._local_prefill_tokens = 0
        """Tokens the held worker prefills itself, counted in its queue until its first token."""

    ##### Public API #####

    async def start(self) -> None:
        """Choose the worker now, so "no worker" or a bad pin is a clean 4xx/503 and the response can name
        the worker; behind a router, open the stream and wait for the router's report of the backend."""
        try:
            self._check_pin()
            await self._choose_or_wait()
            if not self.rules.is_remote:
                await self._prefill_stage()
            while self.rules.is_remote and self.served_by is None:
                try:
                    await self._await_report()
                except TransportError as exc:
                    self._migrate(exc)
        except BaseException:
            self.close()
            raise

    async def tokens(self) -> AsyncGenerator[list[int], None]:
        """Token ids as the workers send them, across migrations; ends with `finish_reason` set."""
        try:
            if self.output_ids and not self.is_aborted:
                yield list(self.output_ids)  # the remote prefill's first token
            while not self.is_aborted and self.finish_reason is None:
                try:
                    stream = self._stream or await self._open()
                    async for token_ids in self._relay(stream):
                        yield token_ids
                    return
                except TransportError as exc:
                    self._migrate(exc)
        finally:
            self._release()

    def abort(self) -> None:
        """The client left: cancel the worker's stream (freeing its KV) and end `tokens()`."""
        self.is_aborted = True
        if self._stream is not None:
            self._stream.cancel()

    def close(self) -> None:
        """Let go of the worker, whatever happened (idempotent): load never leaks."""
        self._release()
        if self._rendezvous is not None:
            self._rendezvous.close()

    async def aclose(self) -> None:
        """`close()`, and free on its prefill worker a prefilled KV no decode worker was sent (the client left)."""
        self._release()
        if self._rendezvous is not None:
            await self._rendezvous.aclose()
        if self._handle is not None and self._prefill_worker is not None:
            handle, self._handle = self._handle, None
            await prefill.release(self._prefill_worker, handle)

    ##### Hops #####

    def _choose(self) -> Worker:
        """Hop 1: pick a worker by policy among the live, not busy, not failed ones; hold it."""
        workers = self.entry.workers
        candidates = [w for w in workers if w not in self._excluded]
        if not candidates:
            raise NoWorkers(f"model '{self.entry.name}'")
        candidates = not_busy(candidates, workers, self.rules.busy, f"workers of '{self.entry.name}'")
        pinned = None if self.rules.is_remote else self.plan.pinned_worker
        route = RouteRequest(self.plan.request_id, self.plan.prompt_ids + self.output_ids, pinned)
        self.decision = self.entry.policy.select(route, candidates)
        worker = self.worker = workers[self.decision.worker_id]
        worker.num_inflight += 1
        self._is_held, self._is_prefilled = True, False
        if not self.rules.is_remote and self.served_by is None:
            self.served_by = worker.instance_id
        return worker

    async def _choose_or_wait(self) -> Worker:
        """Hop 1, at the start: every worker busy, wait in the model's queue for one (503 when the queue is
        full or the wait too long; at once with `--router-queue-size 0`)."""
        try:
            return self._choose()
        except Overloaded:
            if not self.rules.queue.max_size:
                raise
        queued_at = time.perf_counter()
        try:
            with interruptible():  # a client that leaves meanwhile leaves the queue
                return await self.entry.queue.take(self._choose, self.plan.queued, self.rules.queue)
        finally:
            self.metrics.queue_wait.labels(self.entry.name).observe(time.perf_counter() - queued_at)

    async def _open(self) -> ResponseStream:
        """Hop 2: send the request (what is left of it) to the held worker."""
        assert self.worker is not None and self._is_held, "open only a chosen worker"
        worker, request = self.worker, self._request()
        if not self._is_prefilled:
            self._local_prefill_tokens = len(request.token_ids)
            worker.pending_prefill_tokens += self._local_prefill_tokens
        self._stream = await worker.client.open_stream(worker.record.endpoint, _encode(request))
        return self._stream

    async def _relay(self, stream: ResponseStream) -> AsyncGenerator[list[int], None]:
        """Hop 3: the worker's tokens as they come; the policy learns the first one of each worker."""
        batch, self._pending = self._pending or await stream.next_batch(), []
        while batch:
            token_ids = self._absorb(batch)
            if token_ids:
                self._handle = None  # the decode worker has pulled the KV: nothing left to release
                if not self._is_prefilled:
                    self._is_prefilled = True
                    self._unqueue_local_prefill()
                    self.entry.policy.on_first_token(self.plan.request_id)
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.output_ids += token_ids
                yield token_ids
            batch = await stream.next_batch()
        if self.is_aborted:
            self.finish_reason = "cancelled"
        self._stream = None  # ended cleanly: nothing to cancel

    def _migrate(self, exc: TransportError) -> Worker:
        """Hop 4: the worker failed; let it go and choose another, up to the migration limit."""
        worker = self.worker
        self._release()
        if not exc.is_migratable or self.num_migrations >= self.rules.migration_limit or worker is None:
            raise exc
        self.num_migrations += 1
        self._excluded.add(worker.instance_id)
        kind = "ongoing_request" if self.output_ids else "new_request"
        self.metrics.migrations.labels(self.entry.name, kind).inc()
        logger.warning(
            "request %s: worker %x failed (%s); migrating (%d/%d)",
            self.plan.request_id,
            worker.instance_id,
            exc,
            self.num_migrations,
            self.rules.migration_limit,
        )
        return self._choose()

    async def _prefill_stage(self) -> None:
        """Disaggregation, between choosing the decode worker and opening it: prefill remotely or locally
        (router/disagg.py), and if remotely run the prefill hop now; its first token is the stream's first.

        The hop is not tied to the client (Dynamo's rule: a prefill cut off mid-transfer leaks KV); a
        client gone by then has the handle released in `aclose()`. No prefill worker left, or all busy:
        the decode worker prefills (503 with `--enforce-disagg`)."""
        entry, config, worker = self.entry, self.rules.disagg, self.worker
        assert worker is not None
        pool = [w for w in entry.prefill_workers.values() if w.instance_id not in self._excluded]
        overlap = self.decision.overlap_blocks if self.decision is not None else 0
        chosen = prefill_choice(config, entry.name, worker, pool, len(self.plan.prompt_ids), overlap)
        if chosen is None:
            return
        choice, inputs = chosen
        self.prefill = choice.explain(inputs, config.policy)
        if choice.is_remote:
            await self._run_prefill(choice.outcome)
        else:
            self.metrics.disagg.labels(entry.name, choice.outcome).inc()

    async def _run_prefill(self, outcome: str) -> None:
        hop = prefill.PrefillHop(self.entry, self._request(), self.rules.busy, attempts=self.rules.migration_limit + 1)
        try:
            result = await hop.run()
        except (NoWorkers, Overloaded, TransportError) as exc:
            if isinstance(exc, RemoteError) and 400 <= exc.status < 500:
                raise RequestError(str(exc), code=exc.code) from None
            if not falls_back(self.rules.disagg, exc):
                raise
            logger.warning(
                "request %s: remote prefill failed (%s); prefilling on the decode worker", self.plan.request_id, exc
            )
            self._excluded.update(hop.failed)
            outcome = "local_fallback"
        else:
            if hop.rendezvous is not None:  # SGLang: the prefill runs on while the decode meets it
                self._rendezvous = hop.rendezvous
                self._rendezvous.start()
            self._take_prefill(result)
        finally:
            self.metrics.disagg.labels(self.entry.name, outcome).inc()
            if self.prefill is not None:
                self.prefill["outcome"] = outcome

    def _take_prefill(self, result: prefill.PrefillResult) -> None:
        """The prefill's first token is the stream's; the decode worker gets its handle and no prefill."""
        assert self.prefill is not None
        self._prefill_worker = self.entry.prefill_workers.get(result.worker_id)
        self._handle = result.handle
        self.prefill.update(prefill_worker_id=result.worker_id, prefill_route=result.explanation)
        if result.first_token == UNKNOWN_FIRST_TOKEN:
            return  # a rendezvous: the decode stream brings every token
        self.output_ids = [result.first_token]
        self.logprobs = list(result.logprobs)
        self.first_token_at = time.perf_counter()
        self.cached_tokens = result.cached_tokens
        self.finish_reason = result.finish_reason
        if not self._is_prefilled:
            self._is_prefilled = True
            self.entry.policy.on_first_token(self.plan.request_id)

    ##### Internals #####

    def _check_pin(self) -> None:
        pinned = self.plan.pinned_worker
        if pinned is not None and not self.rules.is_remote and pinned not in self.entry.workers:
            raise UnknownInstance(pinned, self.entry.name, list(self.entry.workers))

    async def _await_report(self) -> None:
        """Behind a router: its first batch names the backend (an older router's does not: the router then
        stands for it); a 4xx from the router, such as an unknown pin, is the client's error."""
        stream = self._stream or await self._open()
        try:
            with interruptible():  # the router may queue it; a client that leaves meanwhile leaves that queue
                self._pending = await stream.next_batch()
        except RemoteError as exc:
            if 400 <= exc.status < 500:
                raise RequestError(str(exc), code=exc.code) from None
            if exc.status == 503:  # the router's wait queue refused it: the 503 + Retry-After of our own queue
                raise Overloaded.relayed(str(exc), exc.retry_after) from None
            raise
        self._absorb(self._pending, count=False)
        if self.served_by is None and self.worker is not None:
            self.served_by = self.worker.instance_id

    def _absorb(self, batch: list[msgspec.Raw], *, count: bool = True) -> list[int]:
        token_ids: list[int] = []
        for raw in batch:
            chunk = _decode_chunk(raw)
            if chunk.worker_id is not None and self.served_by is None:
                self.served_by = chunk.worker_id
            if not count:
                continue
            token_ids += chunk.token_ids
            if chunk.logprobs:
                self.logprobs += chunk.logprobs
            if chunk.num_cached_tokens is not None and self.cached_tokens is None:
                self.cached_tokens = chunk.num_cached_tokens
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
            if chunk.transfer is not None:
                self.metrics.observe_transfer(self.entry.name, chunk.transfer)
        return token_ids

    def _release(self) -> None:
        """The end of the held worker's part, for any reason: done, failed, migrated, client gone."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()  # the consumer left (client gone, stop string) or the stream failed: abort it
        self._unqueue_local_prefill()
        if self._is_held and self.worker is not None:
            self._is_held = False
            self.worker.num_inflight -= 1
            self.entry.policy.on_finish(self.plan.request_id)
            self.entry.queue.freed()

    def _unqueue_local_prefill(self) -> None:
        if self._local_prefill_tokens and self.worker is not None:
            self.worker.pending_prefill_tokens -= self._local_prefill_tokens
        self._local_prefill_tokens = 0

    def _request(self) -> GenerateRequest:
        s, produced = self.plan.sampling, len(self.output_ids)
        annotations: dict[str, str] = {}
        if self.rules.is_remote:
            annotations[REPORT_WORKER_ANNOTATION] = "1"
            if self.plan.pinned_worker is not None:
                annotations[PIN_ANNOTATION] = f"{self.plan.pinned_worker:x}"
            annotations.update(queue_annotations(self.plan.queued))
        return GenerateRequest(
            request_id=self.plan.request_id,
            token_ids=self.plan.prompt_ids + self.output_ids,
            max_tokens=self.plan.max_tokens - produced,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            min_tokens=max(0, s.min_tokens - produced),
            kv_transfer=self._handle,
            annotations=annotations,
            guided=msgspec.structs.replace(s.guided, num_accepted=produced) if s.guided and produced else s.guided,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            logit_bias=dict(s.logit_bias),
            min_p=s.min_p,
            logprobs=s.logprobs,
            num_generated=produced,
        )
