"""The KV-aware routing policy: indexer + in-flight load + cost, behind the `RoutingPolicy` seam.

NOTE: one decision is: hash the prompt's full blocks, ask the indexer (or, in approximate mode, the
router's own past decisions) how much of the prefix each candidate caches, read each candidate's
in-flight load, choose by cost (cost.py), then count the request's load on the chosen worker at once.
Every path that routes, the pinned one included, goes through that last step, so load is never lost.

At scale (benchmarks/indexer.py, 128 workers x 100k blocks): the prefix query already walks the
prompt's hashes once over a hash -> worker-bitmask map (indexer.py), and the load totals are kept
incrementally (sequences.py). A profile put ~60 % of a decision in building two Python objects per
candidate and explaining all of them, and ~20 % in per-block `struct.pack` when hashing. So the
candidates are columns, costed in a few numpy operations at many workers (cost.py), only the 16 cheapest
are explained, and the prompt is packed once (kv/hashing.py). p50 went from 343 to 153 us at 128 workers.
At 4 workers the same numpy calls were half of a decision; there the cost is evaluated per candidate on
plain numbers, a quarter less CPU per decision. The explanation itself is built only when read
(`RouteDecision.explain`): most requests never ask for it.

NOTE: a worker is routed precisely (from the index its KV events fill) from its first event batch on; until then,
and for good when it publishes none (an engine server with events off, `--engine http` without `kv_events=`), it is
routed approximately, from this router's own decisions (approx.py), in the same decision as the precise ones. A worker
that still has sent none BLIND_AFTER_S after its first routed prompt is named once in a warning with the fix, and
`/metrics` shows each worker's mode (`snapshot().precise`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.kv.events import DEVICE, BlockStored, KvDump, KvEventBatch
from dynamo_cli.kv.hashing import lora_seed, sequence_hashes
from dynamo_cli.kv.images import routed_tokens
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.approx import ApproxConfig, ApproxIndexer
from dynamo_cli.routing.base import InFlightLoad, PolicySnapshot, RouteDecision, RouteRequest
from dynamo_cli.routing.cost import Candidates, CostConfig, Reason, Rounds, Selection, explain_pinned, select
from dynamo_cli.routing.indexer import Gap, KvIndexer, TierHits
from dynamo_cli.routing.sequences import STALE_REQUEST_S, ActiveSequences
from dynamo_cli.routing.target import Target
from dynamo_cli.routing.tier_costs import TierCosts, tier_costs
from dynamo_cli.routing.time_cost import PRIOR_PREFILL_TPS, SpeedEstimator
from dynamo_cli.wire import LoadMetrics

logger = logging.getLogger(__name__)

BLIND_AFTER_S = 10.0
"""A worker with no KV event this long after the first full prompt block routed to it is reported as blind."""


def cost_config(config: KvRouterConfig) -> CostConfig:
    """The selection knobs of a resolved config (its block size known: see `KvRouterConfig.for_card`)."""
    assert config.block_size is not None, "KvRouterConfig.block_size unresolved; call for_card(card)"
    return CostConfig(config.block_size, config, config_tier_costs(config))


def config_tier_costs(config: KvRouterConfig) -> TierCosts:
    """What host and disk hits cost under a resolved config (routing/tier_costs.py)."""
    assert config.block_size is not None
    return tier_costs(
        block_size=config.block_size,
        bytes_per_block=config.kv_bytes_per_block or 0,
        host_gbs=config.host_bandwidth_gbs,
        disk_gbs=config.disk_bandwidth_gbs,
        prefill_tps=config.prefill_tokens_per_s or PRIOR_PREFILL_TPS,
        weights=dict(config.tier_weights),
    )


def approx_config(config: KvRouterConfig) -> ApproxConfig:
    """The approximate-mode cache settings."""
    return ApproxConfig(ttl_s=config.approx_ttl_s, max_blocks=config.approx_max_blocks)


@dataclass(slots=True)
class RouterCounters:
    """Monotonic counters for Prometheus (the exporter reads the attributes)."""

    num_decisions: int = 0
    num_request_blocks: int = 0
    """Full prompt blocks of every routed request (the hit-rate denominator)."""
    num_hit_blocks: int = 0
    """Cached prefix blocks on the chosen workers (achieved hits), on any tier."""
    num_host_hit_blocks: int = 0
    """Of those, blocks onboarded from host memory."""
    num_disk_hit_blocks: int = 0
    """Of those, blocks onboarded from disk."""
    num_reachable_hit_blocks: int = 0
    """Best cached prefix among the candidates of each decision (reachable hits)."""
    num_hot_spot_decisions: int = 0
    num_pinned_decisions: int = 0
    num_kv_gaps: int = 0
    """Event-id gaps seen in the workers' KV event streams."""

    def to_dict(self) -> dict[str, int]:
        """Name -> value."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KvRoutingPolicy:
    """Routes each request to the worker with the lowest KV-aware cost; tracks what it routed."""

    def __init__(
        self,
        config: KvRouterConfig,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        """Resolved: its block size is known (`KvRouterConfig.for_card`)."""
        self._cost = cost_config(self.config)
        self._rng = rng or random.Random()
        self._clock = clock
        self.indexer = KvIndexer()
        self.approx = ApproxIndexer(approx_config(self.config))
        self.sequences = ActiveSequences()
        self.counters = RouterCounters()
        self.speed = SpeedEstimator(config.prefill_tokens_per_s)
        """Prefill speed and time in flight, learned from first tokens and ends of streams (time cost)."""
        self._speed_probes: dict[str, int] = {}
        """Requests in flight routed to a worker with no prefill queued -> their uncached tokens."""
        self._capacity: dict[Target, int] = {}
        """Target -> KV blocks it published (`LoadMetrics.total_blocks`, a rank's `RankLoad.total_blocks`); else the
        card's."""
        self._gaps: list[Gap] = []
        self._reported_event_id: dict[int, int] = {}
        self._rounds = Rounds()
        """Deals near-ties (time cost) in rounds."""
        self._precise: set[int] = set()
        """Workers whose KV events arrived (none in approximate mode, which reads no events): routed from the
        index; the others from the router's own decisions."""
        self._blind_since: dict[int, float] = {}
        """Worker -> when a prompt with full blocks was first routed to it while it had sent no events (the
        self-check); a worker reported blind maps to inf."""

    ##### RoutingPolicy #####

    def select(self, request: RouteRequest, targets: Sequence[Target]) -> RouteDecision:
        """Choose a target for `request` among `targets` (never empty) and count its load there."""
        hashes, selection, now = self._choose(request, targets)
        isl = len(request.token_ids)
        c, at, target = selection.table.candidates, selection.index, selection.target
        overlap = selection.overlap_blocks
        prefill_tokens = max(0, isl - overlap * self._cost.block_size)
        self.sequences.add_request(request.request_id, target, hashes, prefill_tokens, now)
        if c.active_prefill_tokens[at] or c.host_blocks[at] or c.disk_blocks[at]:
            self._speed_probes.pop(request.request_id, None)  # its TTFT also holds a queue or an onboard
        else:  # nothing queued before it: its time to first token measures its own prefill
            self._speed_probes[request.request_id] = prefill_tokens
        if target.worker not in self._precise:
            self.approx.record(target, hashes, now)
            if hashes and self.config.use_kv_events:
                self._check_blind(target.worker, now)
        self._count(selection, len(hashes))
        self._log(request.request_id, selection)
        return RouteDecision(target, overlap, selection.to_dict)

    def peek(self, request: RouteRequest, targets: Sequence[Target]) -> RouteDecision:
        """The decision `select` would make now, counting nothing (`dyn router`'s `best_worker_id`)."""
        _, selection, _ = self._choose(request, targets)
        return RouteDecision(selection.target, selection.overlap_blocks, selection.to_dict)

    def add_remote(self, request_id: str, target: Target, hashes: Sequence[int], prefill_tokens: int) -> None:
        """Count a request another router replica routed, so every replica sees the same load."""
        now = self._clock()
        self.sequences.add_request(request_id, target, hashes, prefill_tokens, now)
        if target.worker not in self._precise:
            self.approx.record(target, hashes, now)

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill is done: its prompt tokens leave the worker's prefill load."""
        uncached, started = self._speed_probes.pop(request_id, None), self.sequences.started(request_id)
        if self.sequences.mark_prefill_completed(request_id) and uncached is not None and started is not None:
            self.speed.observe_first_token(uncached, self._clock() - started)

    def on_finish(self, request_id: str) -> None:
        """The request left its worker: free its blocks (idempotent)."""
        started = self.sequences.started(request_id)
        self._speed_probes.pop(request_id, None)
        if self.sequences.free(request_id) and started is not None:
            self.speed.observe_lifetime(self._clock() - started)

    def remove_worker(self, worker_id: int) -> None:
        """The worker left discovery: drop its cached blocks and in-flight load."""
        self.indexer.remove_worker(worker_id)
        self.approx.remove_worker(worker_id)
        for request_id in self.sequences.remove_worker(worker_id):
            self._speed_probes.pop(request_id, None)
        for target in [t for t in self._capacity if t.worker == worker_id]:
            del self._capacity[target]
        self._reported_event_id.pop(worker_id, None)
        self._gaps = [gap for gap in self._gaps if gap.worker_id != worker_id]
        self._precise.discard(worker_id)
        self._blind_since.pop(worker_id, None)

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        """Ingest a worker's KV events; a gap is queued for `take_gaps` (ignored in approximate mode)."""
        if not self.config.use_kv_events:
            return
        self._heard_from(batch.worker_id)
        gap = self.indexer.apply_batch(batch)
        if gap is not None:
            self.counters.num_kv_gaps += 1
            self._gaps.append(gap)
        now, target = self._clock(), Target(batch.worker_id, batch.dp_rank)
        for event in batch.events:  # a pass storing a pending prompt's last block is computing it
            if type(event) is BlockStored and event.tier == DEVICE:
                self.sequences.mark_stored(target, [block.block_hash for block in event.blocks], now)

    def snapshot(self, targets: Iterable[Target] = ()) -> PolicySnapshot:
        s = self.sequences
        in_flight = {
            t: InFlightLoad(s.num_requests(t), s.active_blocks(t), s.active_prefill_tokens(t)) for t in targets
        }
        return PolicySnapshot(self.counters.to_dict(), in_flight, frozenset(self._precise))

    def apply_load(self, metrics: LoadMetrics) -> None:
        """Load itself is predicted from the router's own decisions (sequences.py); the worker's last
        KV event id is compared with the index, so events lost with nothing after them are noticed.
        Its KV capacity (each rank's, for a worker of several) is the time cost's C."""
        if metrics.ranks:
            for rank in metrics.ranks:
                if rank.total_blocks > 0:
                    self._capacity[Target(metrics.worker_id, rank.dp_rank)] = rank.total_blocks
        elif metrics.total_blocks > 0:
            self._capacity[Target(metrics.worker_id)] = metrics.total_blocks
        if not self.config.use_kv_events:
            return
        # The previous report, not this one: events and load travel on separate subscriptions and may
        # be reordered by a few ms; an id reported one report ago and still missing was lost.
        previous = self._reported_event_id.get(metrics.worker_id, -1)
        self._reported_event_id[metrics.worker_id] = metrics.kv_event_id
        expected = self.indexer.next_event_id(metrics.worker_id)  # 0 for a worker never heard of
        if previous >= expected:
            self._gaps.append(Gap(metrics.worker_id, expected, previous))

    ##### Repair and housekeeping #####

    def take_gaps(self) -> list[Gap]:
        """Gaps seen since the last call, one per worker (widest range); the caller asks for a dump."""
        merged: dict[int, Gap] = {}
        for gap in self._gaps:
            seen = merged.get(gap.worker_id)
            if seen is None or gap.last_missing > seen.last_missing:
                merged[gap.worker_id] = gap
        self._gaps = []
        return list(merged.values())

    def load_dump(self, dump: KvDump) -> None:
        """Replace a worker's cached blocks (every rank, every tier) by its dump."""
        self.indexer.load_dump(dump)
        if self.config.use_kv_events and dump.last_event_id >= 0:  # the dump of a worker that publishes events
            self._heard_from(dump.worker_id)

    def expire_stale(self, max_age: float = STALE_REQUEST_S) -> list[str]:
        """Free requests in flight for longer than `max_age` seconds (streams whose end was lost)."""
        expired = self.sequences.expire(self._clock(), max_age)
        for request_id in expired:
            self._speed_probes.pop(request_id, None)
        return expired

    ##### Internals #####

    def _choose(self, request: RouteRequest, targets: Sequence[Target]) -> tuple[list[int], Selection, float]:
        tokens = request.token_ids
        if request.images and self.config.image_hashes:
            tokens = routed_tokens(tokens, request.images)
        hashes = sequence_hashes(tokens, self._cost.block_size, seed=lora_seed(request.lora))
        isl = len(request.token_ids)
        now = self._clock()
        candidates = self._candidates(hashes, targets, now, request.lora_load_s)
        speed = self.speed.speed
        if request.pinned_worker is not None and any(t.worker == request.pinned_worker for t in targets):
            pinned = explain_pinned(request.pinned_worker, candidates, isl, len(hashes), self._cost, speed)
            return hashes, pinned, now
        return hashes, select(candidates, isl, len(hashes), self._cost, self._rng, speed, self._rounds), now

    def _candidates(
        self, hashes: list[int], workers: Sequence[Target], now: float, load_s: Mapping[int, float] | None
    ) -> Candidates:
        # One list comprehension per column over plain dicts: a few microseconds each at 128 workers.
        overlaps, cached, tiers = self._cached(hashes, workers, now)
        active_overlaps = self.sequences.active_overlaps(hashes)
        prefill, active, in_flight = self.sequences.totals(workers)
        capacity, default = self._capacity.get, self.config.total_kv_blocks or 0
        return Candidates.of(
            workers,
            [overlaps.get(w, 0) for w in workers] if overlaps else [0] * len(workers),
            prefill,
            active,
            [active_overlaps.get(w, 0) for w in workers] if active_overlaps else [0] * len(workers),
            cached,
            in_flight,
            [capacity(w, default) for w in workers],
            *(_tier_columns(tiers, workers) if tiers else ()),
            pass_elapsed_s=self.sequences.pass_elapsed(workers, now) if self.config.use_kv_events else None,
            lora_load_s=None if load_s is None else [load_s.get(w.worker, 0.0) for w in workers],
        )

    def _cached(
        self, hashes: list[int], workers: Sequence[Target], now: float
    ) -> tuple[dict[Target, int], list[int], dict[Target, TierHits] | None]:
        """Each worker's cached prefix of `hashes` and its cached blocks: the index's for the workers whose KV events
        arrived, this router's own decisions for the others; and where the index's prefixes lie (None: on device)."""
        if not self.config.use_kv_events:
            return self.approx.find_matches(hashes, now), self.approx.block_counts(workers), None
        overlaps, cached = self.indexer.find_matches(hashes), self.indexer.block_counts(workers)
        tiers = self.indexer.tier_hits(hashes, overlaps) if overlaps else None
        precise = self._precise
        blind = [i for i, w in enumerate(workers) if not cached[i] and w not in overlaps and w.worker not in precise]
        if blind:
            guessed = self.approx.find_matches(hashes, now)
            overlaps, cached = dict(overlaps), list(cached)
            for i, count in zip(blind, self.approx.block_counts([workers[i] for i in blind]), strict=True):
                cached[i], overlaps[workers[i]] = count, guessed.get(workers[i], 0)
        return overlaps, cached, tiers

    def _heard_from(self, worker_id: int) -> None:
        """The worker's cache is known from here on: its facts replace this router's guesses."""
        if worker_id in self._precise:
            return
        self._precise.add(worker_id)
        self.approx.remove_worker(worker_id)
        if self._blind_since.pop(worker_id, None) == float("inf"):
            logger.info("worker %x: KV events arrive now; it is routed precisely", worker_id)

    def _check_blind(self, worker_id: int, now: float) -> None:
        """The self-check: a worker routed prompts BLIND_AFTER_S ago that has sent no KV events since is named once."""
        since = self._blind_since.setdefault(worker_id, now)
        if now - since < BLIND_AFTER_S:
            return
        self._blind_since[worker_id] = float("inf")
        logger.warning(
            "worker %x has published no KV events in %.0f s of prompts routed to it: it is routed approximately "
            "(from this router's decisions). An engine server behind --engine http publishes them with its own "
            "flag (vLLM: --kv-events-config) and the worker's --engine-arg kv_events=tcp://HOST:PORT; another "
            "worker's reach this router over the event plane (NATS)",
            worker_id,
            now - since,
        )

    def _count(self, selection: Selection, num_blocks: int) -> None:
        counters = self.counters
        counters.num_decisions += 1
        counters.num_request_blocks += num_blocks
        c, at = selection.table.candidates, selection.index
        counters.num_hit_blocks += c.overlap_blocks[at]
        counters.num_host_hit_blocks += c.host_blocks[at]
        counters.num_disk_hit_blocks += c.disk_blocks[at]
        counters.num_reachable_hit_blocks += max(c.overlap_blocks)
        if selection.reason is Reason.HOT_SPOT:
            counters.num_hot_spot_decisions += 1
        elif selection.reason is Reason.PINNED:
            counters.num_pinned_decisions += 1

    def _log(self, request_id: str, selection: Selection) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        w = self.config.overlap_score_weight
        for c in selection.candidates:
            if c.times:
                logger.debug(
                    "route %s: formula for %s: %.6f s = %.6f prefill + %.6f evict + %.6f memory (overlap %d blocks)",
                    request_id,
                    c.target.label(),
                    c.logit,
                    c.times["prefill_s"],
                    c.times["evict_s"],
                    c.times["memory_s"],
                    c.overlap_blocks,
                )
                continue
            logger.debug(
                "route %s: formula for %s: %.3f = %.2f * %.3f prefill + %d decode (overlap %d blocks)",
                request_id,
                c.target.label(),
                c.logit,
                w,
                c.prefill_blocks,
                c.decode_blocks,
                c.overlap_blocks,
            )
        logger.debug(
            "route %s: chose %s (%s, margin %s)",
            request_id,
            selection.target.label(),
            selection.reason.value,
            selection.margin,
        )


def _tier_columns(tiers: dict[Target, TierHits], workers: Sequence[Target]) -> tuple[list[int], list[int]]:
    """The host and disk hit columns (0 for workers whose prefix is all on device)."""
    none = TierHits(0, 0, 0)
    hits = [tiers.get(w, none) for w in workers]
    return [h.host for h in hits], [h.disk for h in hits]


def kv_policy_factory(config: KvRouterConfig) -> Callable[[ModelCard], KvRoutingPolicy]:
    """One KvRoutingPolicy per model (and role pool), with the card's block size unless `config` sets one."""
    return lambda card: KvRoutingPolicy(config.for_card(card))


def explanation_summary(explanation: dict[str, Any]) -> str:
    """One line for an INFO log or a header: `worker=3 reason=argmin margin=1.5 candidates=4`."""
    return (
        f"worker={explanation.get('worker_id')} reason={explanation.get('reason')} "
        f"margin={explanation.get('margin')} candidates={len(explanation.get('candidates', []))}"
    )
