"""Holding a worker: a request's claim on one worker, counted in one place from the choice to the release.

    choose(pool, wanted, busy, excluded)  the pool's policy picks among its live, not busy, not excluded
                                          workers (the least loaded where it has no policy): a Hold
    wait_for(pool, wanted, ...)           the same, once a worker stops being busy (the model's wait queue)
    choose_or_wait(pool, wanted, ...)     `choose`, and where every worker is busy `wait_for`
    Hold(worker, request_id)              a given worker held without a choice (a canary, a LoRA command)
    hold.stamped(request)                 the request on the worker's data-parallel rank the choice named
    hold.queue_prefill(n)                 n prompt tokens the worker prefills for the request, until...
    hold.first_token()                    ...its first token: the policy and the replicas hear it
    hold.release()                        the end, for any reason: the worker's counts, the policy, the
                                          replicas and the wait queue hear it, once

NOTE: this module is the only writer of a worker's in-flight ledger (`Worker.num_inflight`, what this process
has open on it, and `Worker.pending_prefill_tokens`, what it sent it to prefill); the busy thresholds, the
disaggregation decision, the canary's idle rule and the metrics read it. Every path to a worker holds one: the
decode and prefill hops, the SGLang rendezvous, embeddings, LoRA commands and canaries.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from dynamo_cli.config import BusyThresholds, QueueConfig, SessionConfig
from dynamo_cli.core.affinity import Affinity, affinity_of
from dynamo_cli.core.queue import BACKGROUND_WAIT_S, QueuedRequest, WaitQueue
from dynamo_cli.core.registry import Worker, free_of_prefill, not_busy
from dynamo_cli.core.waits import interruptible
from dynamo_cli.errors import NoWorkers, Overloaded
from dynamo_cli.kv.images import ImageRun
from dynamo_cli.routing.base import RouteDecision, RouteRequest, RoutingPolicy
from dynamo_cli.routing.sessions import Session, SessionTable
from dynamo_cli.routing.target import Target, targets_of
from dynamo_cli.wire import GenerateRequest

if TYPE_CHECKING:
    from dynamo_cli.core.replicas import ReplicaSync

ONLY_HUNG = BusyThresholds()
"""Busy thresholds under which only a hung worker is busy: for commands that are not load (LoRA admin)."""

_monotonic = time.monotonic


@dataclass(frozen=True, slots=True)
class Pool:
    """The workers of one model and role as a choice sees them, and who hears of a hold on one of them."""

    model: str
    workers: dict[int, Worker]
    policy: RoutingPolicy | None = None
    """Chooses and counts the pool's requests; None: the worker with the least in flight (embeddings leave no
    KV to route to, commands are not load)."""
    noun: str = "workers"
    """What the workers are called in an error ('prefill workers', 'routers')."""
    where: str = ""
    """What has no worker, in a NoWorkers error ("": model '<model>')."""
    queue: WaitQueue | None = None
    """The model's wait queue: a release frees a place in it, a first token may let background work in."""
    replicas: ReplicaSync | None = None
    """Router replicas that share this pool's decisions, first tokens and ends."""
    sessions: SessionTable | None = None
    """Where each session's last call went (the model's; None: a pool without session affinity)."""
    session_rules: SessionConfig = SessionConfig()


UNCHOSEN = Pool("", {})
"""The pool of a worker held without a choice (a canary, a LoRA command): no policy, queue or replicas hear of it."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a choice looks at."""

    request_id: str
    token_ids: Sequence[int] = ()
    pinned: int | None = None
    """The worker the caller asked for: it is waited for rather than replaced (if it is a candidate at all)."""
    lora: str = ""
    """Only workers serving this adapter, each at what loading it there would cost."""
    is_background: bool = False
    """Background work (a batch line) goes only to a worker prefilling nothing this process sent it."""
    images: Sequence[ImageRun] = ()
    """The prompt's images (their placeholders route as their content)."""
    session: Session | None = None
    """The agent session of the call (core/affinity.py)."""


class Hold:
    """One request's claim on one worker; `release()` is idempotent, so a hold never leaks."""

    __slots__ = (
        "_prefill_tokens",
        "decision",
        "has_first_token",
        "is_held",
        "lora_loaded",
        "pool",
        "rank",
        "request_id",
        "worker",
    )

    def __init__(
        self,
        worker: Worker,
        request_id: str,
        pool: Pool = UNCHOSEN,
        decision: RouteDecision | None = None,
        lora_loaded: bool | None = None,
    ) -> None:
        self.worker = worker
        self.request_id = request_id
        self.pool = pool
        """Who hears of the hold: the pool's policy, queue and replicas (none for a worker held without a choice)."""
        self.decision = decision
        """The policy's decision (None for a worker held without one)."""
        self.rank = decision.target.rank if pool.policy is not None and decision and worker.card.is_ranked else None
        """The data-parallel rank the request runs on there (`GenerateRequest.dp_rank`); None: a rank-blind worker,
        or one held without a policy's choice (its engine picks)."""
        self.lora_loaded = lora_loaded
        """With a LoRA adapter: whether the worker had it loaded (False: it loads it first)."""
        self.has_first_token = False
        self.is_held = True
        self._prefill_tokens = 0
        worker.num_inflight += 1
        worker.used_at = _monotonic()

    def stamped(self, request: GenerateRequest) -> GenerateRequest:
        """`request` as the held worker gets it: on the rank the choice named (as is for a rank-blind worker)."""
        if request.dp_rank == self.rank:
            return request
        return msgspec.structs.replace(request, dp_rank=self.rank)

    def queue_prefill(self, num_tokens: int) -> None:
        """The worker prefills `num_tokens` for the request: counted in its queue until the first token."""
        if self.is_held and not self.has_first_token:
            self._prefill_tokens += num_tokens
            self.worker.pending_prefill_tokens += num_tokens

    def first_token(self) -> None:
        """The request's prefill on the worker is done (its first token, or the remote prefill's): the policy
        and the replicas hear it, and background work may now go to the worker. Idempotent."""
        if self.has_first_token:
            return
        self.has_first_token = True
        self._unqueue_prefill()
        pool = self.pool
        if pool.queue is not None:
            pool.queue.notify()
        if pool.policy is not None:
            pool.policy.on_first_token(self.request_id)
        if pool.replicas is not None:
            pool.replicas.prefill_completed(pool.model, self.request_id)

    def release(self) -> None:
        """The end of the request's part on the worker, for any reason: done, failed, migrated, client gone."""
        if not self.is_held:
            return
        self.is_held = False
        self._unqueue_prefill()
        worker = self.worker
        worker.num_inflight -= 1
        worker.used_at = _monotonic()
        pool = self.pool
        if pool.policy is not None:
            pool.policy.on_finish(self.request_id)
        if pool.replicas is not None:
            pool.replicas.freed(pool.model, self.request_id)
        if pool.queue is not None:
            pool.queue.freed()

    def _unqueue_prefill(self) -> None:
        if self._prefill_tokens:
            self.worker.pending_prefill_tokens -= self._prefill_tokens
            self._prefill_tokens = 0


def choose(pool: Pool, wanted: Wanted, busy: BusyThresholds, excluded: Collection[int] = ()) -> Hold:
    """Hold the worker the pool's policy picks among the live, not busy, not `excluded` ones serving `wanted`.
    NoWorkers when none is left to try, Overloaded (with the first reason) when every one is busy."""
    workers = pool.workers
    candidates = [w for w in workers if w not in excluded] if excluded else list(workers)
    where = pool.where or f"model '{pool.model}'"
    if not candidates:
        raise NoWorkers(where)
    affinity = affinity_of(pool.sessions, pool.session_rules, wanted.session, workers)
    pinned = wanted.pinned if wanted.pinned is not None or affinity is None else affinity.pin()
    if pinned in candidates:  # a pin waits for its own worker rather than going elsewhere
        candidates = [pinned]
    lora = wanted.lora
    if lora:
        candidates = [w for w in candidates if workers[w].adapters.serves(lora)]
        if not candidates:
            raise NoWorkers(f"LoRA adapter '{lora}' of {where}")
    candidates = not_busy(candidates, workers, busy, f"{pool.noun} of '{pool.model}'")
    if wanted.is_background:
        candidates = free_of_prefill(candidates, workers)
    policy = pool.policy
    if policy is None:
        decision = RouteDecision(Target(min(candidates, key=lambda w: workers[w].num_inflight)))
    else:
        load_s = {w: workers[w].adapters.cost_s(lora) for w in candidates} if lora else None
        route = RouteRequest(wanted.request_id, wanted.token_ids, pinned, lora, load_s, wanted.images)
        decision = _select(policy, route, pool_targets(workers, candidates), candidates, affinity)
    if affinity is not None and pool.sessions is not None:
        pool.sessions.bind(affinity.session.id, decision.target, pool.session_rules.max_entries)
    worker = workers[decision.worker_id]
    lora_loaded = None
    if lora:
        lora_loaded = worker.adapters.is_resident(lora)
        worker.adapters.routed(lora)
    hold = Hold(worker, wanted.request_id, pool, decision, lora_loaded)
    if pool.replicas is not None and policy is not None:
        session = affinity.session.id if affinity is not None else ""
        pool.replicas.added(pool.model, wanted.request_id, policy, session)  # type: ignore[arg-type]
    return hold


def _select(
    policy: RoutingPolicy,
    route: RouteRequest,
    targets: Sequence[Target],
    candidates: Sequence[int],
    affinity: Affinity | None,
) -> RouteDecision:
    """The policy's decision, steered by the session's affinity where there is one (core/affinity.py)."""
    if affinity is None:
        return policy.select(route, targets)
    route, why = affinity.steer(policy, route, candidates, targets)
    return affinity.explained(policy.select(route, targets), why)


def pool_targets(workers: dict[int, Worker], candidates: Sequence[int]) -> list[Target]:
    """The routing targets of `candidates`: each rank of a worker serving several, rank 0 of a rank-blind one."""
    ranks = {w: card.ranks for w in candidates if (card := workers[w].card).is_ranked}
    return targets_of(candidates, ranks)


async def wait_for(
    pool: Pool,
    wanted: Wanted,
    busy: BusyThresholds,
    excluded: Collection[int],
    queued: QueuedRequest,
    config: QueueConfig,
) -> Hold:
    """`choose` once this request is at the head of the pool's wait queue and a worker is free; Overloaded when
    the queue is full or the wait too long. A client that leaves meanwhile leaves the queue."""
    assert pool.queue is not None, "a pool without a queue cannot wait"
    with interruptible():
        return await pool.queue.take(lambda: choose(pool, wanted, busy, excluded), queued, config)


async def choose_or_wait(
    pool: Pool,
    wanted: Wanted,
    busy: BusyThresholds,
    excluded: Collection[int],
    queued: QueuedRequest,
    config: QueueConfig,
    waited: Callable[[float], None] | None = None,
) -> Hold:
    """`choose`; where every worker is busy, or others already wait, `wait_for` one (Overloaded at once where the
    pool has no queue or `--router-queue-size` is 0). Background work waits its turn, however long. `waited` hears
    when a wait that began (its `time.perf_counter()`) ends, however it ends."""
    if pool.queue is None or not config.max_size or not len(pool.queue):  # with some waiting, wait behind them
        try:
            return choose(pool, wanted, busy, excluded)
        except Overloaded:
            if not config.max_size or pool.queue is None:
                raise
    if wanted.is_background:
        config = dataclasses.replace(config, max_wait_s=BACKGROUND_WAIT_S)
    queued_at = time.perf_counter()
    try:
        return await wait_for(pool, wanted, busy, excluded, queued, config)
    finally:
        if waited is not None:
            waited(queued_at)
