"""The request core: one request's token stream across workers, as named hops, for the frontend and `dyn router`.

    route    choose a worker by policy among the live, not busy, not failed ones (or wait in the model's queue)
    prepare  disaggregation: prefill remotely (core/prefill.py) or on the chosen worker (core/disagg.py)
    open     send the request (what is left of it) to the held worker
    relay    its chunks as they come; the policy learns the first token
    migrate  the worker failed: let it go and choose another, the tokens so far appended to the prompt
    release  the end of the held worker's part, for any reason: policy, replicas and queue hear it

NOTE: the core sees token ids only; text (detokenizing, stop strings) is the frontend's. So a request migrated
to another worker mid-stream continues seamlessly: the tokens generated so far join the prompt and
`max_tokens` shrinks by as many (`GenerateRequest.continued`). Each chosen worker is held from `route` to
`release`: that is the one place the policy hears `on_finish`, as `relay` is the one place it hears
`on_first_token`. What a "worker" is, is the upstream's business (`Upstream`): the workers themselves, or
`dyn router` replicas that choose one and report which; the hops do not branch on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from dynamo_cli.config import BusyThresholds, DisaggConfig, QueueConfig, SessionConfig
from dynamo_cli.core.encode_stage import encode_stage
from dynamo_cli.core.holds import Hold, Pool, Wanted, choose, choose_or_wait
from dynamo_cli.core.output import Output
from dynamo_cli.core.prefill_stage import PrefillStage
from dynamo_cli.core.queue import BACKGROUND_WAIT_S, LOWEST_CLIENT_PRIORITY
from dynamo_cli.core.registry import ModelEntry, Worker
from dynamo_cli.core.replicas import ReplicaSync
from dynamo_cli.core.request_plan import DispatchMetrics, NoMetrics, RequestPlan
from dynamo_cli.core.shares import Share, tenant_annotations
from dynamo_cli.core.stalls import NO_DEADLINE, Deadline
from dynamo_cli.core.waits import interruptible
from dynamo_cli.errors import Overloaded, RemoteError, StreamTimeout, TransportError, UnknownInstance
from dynamo_cli.routing.base import RouteDecision
from dynamo_cli.runtime.request_client import ResponseStream
from dynamo_cli.wire import (
    DEADLINE_ANNOTATION,
    GENERATE,
    PARENT_SESSION_ANNOTATION,
    PIN_ANNOTATION,
    PRIORITY_ANNOTATION,
    REPORT_WORKER_ANNOTATION,
    SESSION_ANNOTATION,
    GenerateRequest,
)

logger = logging.getLogger(__name__)

_monotonic = time.monotonic
_perf_counter = time.perf_counter


##### Upstreams: what "a worker" is #####


class Upstream(Protocol):
    """The transport to a worker, as the hops see it."""

    def pin(self, plan: RequestPlan) -> int | None:
        """The worker the policy must choose, if the caller pinned one that this side chooses among."""
        ...

    def annotations(self, plan: RequestPlan) -> dict[str, str]:
        """What the request carries besides the generation itself."""
        ...

    async def settle(self, dispatch: Dispatch) -> None:
        """After the first choice: learn who serves (a router reports the backend it chose)."""
        ...

    def moved(self, dispatch: Dispatch) -> None:
        """After a migration's choice: who serves now, where this side knows it at once."""
        ...

    async def prepare(self, dispatch: Dispatch) -> None:
        """After settling, before the first `open`: the prefill stage where this side runs it."""
        ...

    def router_id(self, dispatch: Dispatch) -> int | None:
        """The router replica that routed the request, if a router chooses the backend."""
        ...


class ToWorkers:
    """The workers themselves: a pin names one of them, and the prefill stage runs here."""

    def pin(self, plan: RequestPlan) -> int | None:
        return plan.pinned_worker

    def annotations(self, plan: RequestPlan) -> dict[str, str]:
        return {}

    async def settle(self, dispatch: Dispatch) -> None:
        self.moved(dispatch)

    def moved(self, dispatch: Dispatch) -> None:
        assert dispatch.worker is not None
        dispatch.served_by = dispatch.worker.instance_id

    async def prepare(self, dispatch: Dispatch) -> None:
        await dispatch.run_encode_stage()
        await dispatch.run_prefill_stage()

    def router_id(self, dispatch: Dispatch) -> int | None:
        return None


class ToRouters:
    """`dyn router` replicas, which choose the backend (and run the prefill stage, and queue): a pin and the
    queue's priority, deadline, tenant and class travel to them as annotations, and each first reports the
    backend chosen."""

    def pin(self, plan: RequestPlan) -> int | None:
        return None

    def annotations(self, plan: RequestPlan) -> dict[str, str]:
        annotations = {REPORT_WORKER_ANNOTATION: "1"}
        if plan.pinned_worker is not None:
            annotations[PIN_ANNOTATION] = f"{plan.pinned_worker:x}"
        queued = plan.queued
        if queued.priority:
            annotations[PRIORITY_ANNOTATION] = str(queued.priority)
        if queued.deadline is not None:
            annotations[DEADLINE_ANNOTATION] = str(max(0, round((queued.deadline - time.monotonic()) * 1000)))
        if queued.tenant:
            annotations.update(tenant_annotations(queued))
        if plan.session is not None:
            annotations[SESSION_ANNOTATION] = plan.session.id
            if plan.session.parent is not None:
                annotations[PARENT_SESSION_ANNOTATION] = plan.session.parent
        return annotations

    async def settle(self, dispatch: Dispatch) -> None:
        while dispatch.served_by is None:
            try:
                await self.await_report(dispatch)
            except TransportError as exc:
                dispatch.migrate(exc)

    async def await_report(self, dispatch: Dispatch) -> None:
        """Behind a router: its first batch names the backend (an older router's does not: the router then
        stands for it); a 4xx from the router, such as an unknown pin, is the client's error."""
        try:
            batch = await dispatch.first_batch()  # interruptible: a client that leaves a router's queue leaves it
        except RemoteError as exc:
            if exc.is_client_error:
                raise exc.as_request_error() from None
            if exc.status == 503:  # the router's wait queue refused it: the 503 + Retry-After of our own queue
                raise Overloaded.relayed(str(exc), exc.retry_after) from None
            raise
        if dispatch.served_by is None:
            reported = (GENERATE.decode_reply(raw).worker_id for raw in batch)
            dispatch.served_by = next((w for w in reported if w is not None), None)
        if dispatch.served_by is None and dispatch.worker is not None:
            dispatch.served_by = dispatch.worker.instance_id

    def moved(self, dispatch: Dispatch) -> None:
        pass  # the backend the next router chooses is in its own first report, which a stream's headers precede

    async def prepare(self, dispatch: Dispatch) -> None:
        pass

    def router_id(self, dispatch: Dispatch) -> int | None:
        return dispatch.worker.instance_id if dispatch.worker is not None else None


@dataclass(frozen=True, slots=True)
class DispatchRules:
    """How one process dispatches every request."""

    migration_limit: int
    """Re-dispatches of a stream whose worker died; 0 disables migration."""
    busy: BusyThresholds
    """When a worker counts as busy; a request finding every worker busy waits in the queue, then 503."""
    upstream: Upstream = field(default_factory=ToWorkers)
    disagg: DisaggConfig = DisaggConfig()
    """When a model with prefill workers has its prompt prefilled remotely."""
    queue: QueueConfig = QueueConfig()
    """How long, in what order and how many requests wait when every worker is busy."""
    sessions: SessionConfig = SessionConfig()
    """Session affinity: how long a session stays bound, how firmly, how many are remembered."""
    migrates_after_output: bool = True
    """False (`dyn router`): once tokens went out, a failure goes back to the caller, which migrates."""
    metrics: DispatchMetrics = field(default_factory=NoMetrics)
    replicas: ReplicaSync | None = None
    """Router replicas (`dyn router`s, frontends with `--router-replica-sync`) share each decision, first token and
    end with their peers."""
    deadline: Deadline = NO_DEADLINE
    """How long a stream waits on a worker that sends nothing at all before the worker counts as hung."""


class Dispatch:
    """Runs one plan on the workers: `start()` (or `route()` then `prepare()`) before the response, then
    iterate `stream()` (batches and their token ids) or `frames(dispatch)` (encoded chunks); `aclose()` last."""

    def __init__(self, entry: ModelEntry, plan: RequestPlan, rules: DispatchRules) -> None:
        self.entry = entry
        self.plan = plan
        self.rules = rules
        self.worker: Worker | None = None
        """The worker (or router) the request is on now."""
        self.served_by: int | None = None
        """The backend instance serving the request: the worker, or the one a router reports."""
        self.served_rank: int | None = None
        """The data-parallel rank of `served_by` the request runs on (None: a rank-blind worker, or behind a router)."""
        self.decision: RouteDecision | None = None
        self.output = Output(functools.partial(rules.metrics.observe_transfer, entry.name))
        """What the workers have sent so far, across migrations."""
        self.prefill = PrefillStage(entry, plan, rules)
        """Disaggregation: the prefill stage, its KV handle and why the prompt went where it did."""
        self.started_at = _perf_counter()
        self.num_migrations = 0
        self.is_aborted = False
        self.lora_loaded: bool | None = None
        """With a LoRA adapter: whether the chosen worker had it loaded (False: it loads it first)."""
        self._pool = Pool(
            entry.name,
            entry.workers,
            entry.policy,
            queue=entry.queue,
            replicas=rules.replicas,
            sessions=entry.sessions,
            session_rules=rules.sessions,
        )
        self._hold: Hold | None = None
        """The claim on `worker` (core/holds.py), from its choice to its release."""
        may_pause = rules.migrates_after_output and isinstance(rules.upstream, ToWorkers)  # the worker is ours
        self._share = Share(entry.queue, plan.queued, rules.queue, entry.card.kv_cache_block_size, may_pause)
        self.queue_wait_s = 0.0
        """Seconds it waited in the model's queue, all waits together."""
        self._excluded: set[int] = set()
        self._stream: ResponseStream | None = None
        self._pending: list[msgspec.Raw] = []
        """A first batch read by `first_batch` (a router's report), relayed first."""

    @property
    def model(self) -> str:
        """The model the client asked for: the LoRA adapter's name, else the base model's."""
        return self.plan.request.lora or self.entry.name

    @property
    def router_id(self) -> int | None:
        """Behind `dyn router`s: the replica that routed (the backend is `served_by`)."""
        return self.rules.upstream.router_id(self)

    ##### Public API #####

    async def start(self) -> None:
        """`route()` then `prepare()`."""
        await self.route()
        await self.prepare()

    async def route(self) -> None:
        """Choose the worker now, so "no worker" or a bad pin is a clean 4xx/503 and the response can name the
        worker (behind a router: its report of the backend)."""
        try:
            self._check_pin()
            rules = self.rules
            chosen = await choose_or_wait(
                self._pool, self._wanted(), rules.busy, self._excluded, self.plan.queued, rules.queue, self._waited
            )
            self._took(chosen)
            await self.rules.upstream.settle(self)
        except BaseException:
            self.close()
            raise
        if self.plan.trace is not None:
            self.plan.trace.routed(self.started_at, self.served_by, self.decision, self.router_id)

    async def prepare(self) -> None:
        """The prefill stage (disaggregation), where this side runs it."""
        try:
            await self.rules.upstream.prepare(self)
        except BaseException:
            self.close()
            raise

    async def stream(self) -> AsyncGenerator[tuple[list[msgspec.Raw], list[int]], None]:
        """Each batch of chunks the workers send, with its token ids, across migrations; the remote prefill's
        first token comes first (with no batch). Ends with `output.finish_reason` set."""
        output = self.output
        try:
            if output.token_ids and not self.is_aborted:
                yield [], list(output.token_ids)
            while not self.is_aborted and output.finish_reason is None:
                try:
                    stream = self._stream or await self._open()
                    async for batch in self._relay(stream):
                        yield batch
                    if not self._share.was_preempted() or self.is_aborted or output.finish_reason is not None:
                        return
                    await self._resume()
                except TransportError as exc:
                    self.migrate(exc)
        finally:
            self._release()

    def abort(self) -> None:
        """The client left: cancel the worker's stream (freeing its KV) and end the iteration."""
        self.is_aborted = True
        if self._stream is not None:
            self._stream.cancel()

    def close(self) -> None:
        """Let go of the worker, whatever happened (idempotent): load never leaks."""
        self._release()
        self.prefill.close()

    async def aclose(self) -> None:
        """`close()`, and free on its prefill worker a prefilled KV no decode worker was sent (the client left)."""
        self._release()
        await self.prefill.aclose()

    ##### Hops #####

    def _choose(self) -> Worker:
        """Hop 1: pick a worker by policy among the live, not busy, not failed ones; hold it."""
        return self._took(choose(self._pool, self._wanted(), self.rules.busy, self._excluded))

    def _wanted(self) -> Wanted:
        plan = self.plan
        return Wanted(
            plan.request_id,
            plan.prompt_ids + self.output.token_ids,
            self.rules.upstream.pin(plan),
            plan.request.lora,
            plan.queued.priority < LOWEST_CLIENT_PRIORITY,
            plan.request.images,
            plan.session,
        )

    def _took(self, hold: Hold) -> Worker:
        self._hold = hold
        self._share.held(self, hold.decision, len(self.plan.prompt_ids), self._preempt)
        self.decision = hold.decision
        if hold.lora_loaded is not None:
            self.lora_loaded = hold.lora_loaded
        worker = self.worker = hold.worker
        self.served_rank = hold.rank
        self.rules.metrics.count_served(self.entry.name, worker.instance_id, worker.card.role)
        return worker

    def _waited(self, queued_at: float) -> None:
        """Hop 1 waited in the model's queue since `queued_at` (every worker was busy)."""
        waited = _perf_counter() - queued_at
        self.queue_wait_s += waited
        self.rules.metrics.observe_queue_wait(self.entry.name, waited)
        if self.plan.trace is not None:
            self.plan.trace.queued(queued_at)

    async def first_batch(self) -> list[msgspec.Raw]:
        """The held worker's first batch (its stream opened if not yet), relayed first: an upstream's report."""
        stream = self._stream or await self._open()
        with interruptible():
            self._pending = await stream.next_batch()
        return self._pending

    async def _open(self) -> ResponseStream:
        """Hop 2: send the request (what is left of it) to the held worker."""
        hold = self._hold
        assert hold is not None and hold.is_held, "open only a chosen worker"
        worker, request = hold.worker, hold.stamped(self._request())
        hold.queue_prefill(len(request.token_ids))  # none once the prefill's first token came
        self._stream = await self.rules.deadline.open(
            worker, self.entry.name, GENERATE, request, name=worker.record.endpoint
        )
        return self._stream

    async def _relay(self, stream: ResponseStream) -> AsyncGenerator[tuple[list[msgspec.Raw], list[int]], None]:
        """Hop 3: the worker's chunks as they come; the policy learns the first token of each worker. Each wait
        is under the stall deadline (core/stalls.py), inline: this loop runs once per batch of every stream."""
        hold, deadline, output = self._hold, self.rules.deadline, self.output
        assert hold is not None
        worker = hold.worker
        stall = deadline.stall_s or None
        batch, self._pending = self._pending, []
        while True:
            if not batch:
                try:
                    batch = await stream.next_batch(stall)
                except StreamTimeout:
                    batch = await deadline.waited(stream, worker, self.entry.name)
                if stall:
                    worker.heard_at = _monotonic()
                if not batch:
                    break
            token_ids = output.absorb(batch)
            if token_ids:
                self.prefill.decoded()
                if not hold.has_first_token:
                    hold.first_token()
            yield batch, token_ids
            batch = []
        if self.is_aborted:
            output.finish_reason = "cancelled"
        self._stream = None  # ended cleanly: nothing to cancel

    def migrate(self, exc: TransportError) -> Worker:
        """Hop 4: the worker failed; let it go and choose another, up to the migration limit."""
        worker = self.worker
        self._release()
        rules, is_ongoing = self.rules, bool(self.output.token_ids)
        rules.deadline.failed(worker, self.entry.name, exc)
        if (
            not exc.is_migratable
            or worker is None
            or self.num_migrations >= rules.migration_limit
            or (is_ongoing and not rules.migrates_after_output)
        ):
            raise exc
        self.num_migrations += 1
        self._excluded.add(worker.instance_id)
        rules.metrics.count_migration(self.entry.name, "ongoing_request" if is_ongoing else "new_request")
        logger.warning(
            "request %s: worker %x failed (%s); migrating (%d/%d)",
            self.plan.request_id,
            worker.instance_id,
            exc,
            self.num_migrations,
            rules.migration_limit,
        )
        chosen = self._choose()
        rules.upstream.moved(self)  # a unary reply's headers, sent after its body, name the worker that served
        if self.plan.trace is not None:
            self.plan.trace.migrated(worker.instance_id, chosen.instance_id, str(exc), self.num_migrations)
        return chosen

    def _preempt(self, only_decoding: bool) -> bool:
        """A waiting higher class wants this bulk request's worker: cancel its stream (aggregated only), so that
        `stream()` lets the worker go and `_resume`s, the output so far in its prompt (`only_decoding`: not
        before its first token)."""
        is_running = not self.is_aborted and self.prefill.handle is None
        if only_decoding and not (self._hold is not None and self._hold.has_first_token):
            return False
        return self._share.preempt(self._stream if is_running else None)

    async def _resume(self) -> None:
        """After a preemption: wait in the queue again at the request's own class (as long as background work
        may), then carry on where it stopped."""
        self._release()
        self.rules.metrics.count_preemption(self.entry.name)
        queue = dataclasses.replace(self.rules.queue, max_wait_s=max(self.rules.queue.max_wait_s, BACKGROUND_WAIT_S))
        wanted, busy, queued = self._wanted(), self.rules.busy, self.plan.queued
        self._took(await choose_or_wait(self._pool, wanted, busy, self._excluded, queued, queue, self._waited))

    async def run_encode_stage(self) -> None:
        """E/P/D, once the serving worker is chosen (core/encode_stage.py): the images' embeddings from the encode
        pool, which the serving (or prefill) worker pulls."""
        request = await encode_stage(self.entry, self.plan.request, self.decision, self.rules)
        if request is not self.plan.request:
            self.plan = dataclasses.replace(self.plan, request=request)

    async def run_prefill_stage(self) -> None:
        """Disaggregation, between choosing the decode worker and opening it (core/prefill_stage.py): a remote
        prefill's first token is the stream's first, and the decode worker's queue and policy see it done."""
        assert self.worker is not None
        result = await self.prefill.run(self.worker, self.decision, self._excluded, self._request())
        self._excluded.update(self.prefill.failed)
        if result is not None:
            self.output.took_prefill(result)
            if self._hold is not None:
                self._hold.first_token()

    ##### Internals #####

    def _check_pin(self) -> None:
        pinned = self.rules.upstream.pin(self.plan)
        if pinned is not None and pinned not in self.entry.workers:
            raise UnknownInstance(pinned, self.entry.name, list(self.entry.workers))

    def _release(self) -> None:
        """The end of the held worker's part, for any reason: done, failed, migrated, client gone."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()  # the consumer left (client gone, stop string) or the stream failed: abort it
        if self._hold is not None:
            self._hold.release()
            self._share.released(self, len(self.output.token_ids))

    def _request(self) -> GenerateRequest:
        """What the held worker gets now: the plan's request, carried on after the output so far."""
        request, handle = self.plan.request, self.prefill.handle
        if self.output.token_ids:
            request = request.continued(self.output.token_ids, handle)
        elif handle is not None:
            request = msgspec.structs.replace(request, kv_transfer=handle)
        annotations = self.rules.upstream.annotations(self.plan)
        if not annotations:
            return request
        # added to the plan's own (its trace context), which the next hop carries on
        return msgspec.structs.replace(request, annotations={**request.annotations, **annotations})


async def frames(dispatch: Dispatch) -> AsyncGenerator[bytes, None]:
    """The dispatch's stream as encoded GenerateChunks (`dyn router`'s relay): the prefill's first token, then the
    worker's chunks as received."""
    async with contextlib.aclosing(dispatch.stream()) as stream:
        async for batch, _ in stream:
            if not batch:  # the remote prefill's first token
                yield dispatch.output.encoded()
            for raw in batch:
                yield bytes(raw)
