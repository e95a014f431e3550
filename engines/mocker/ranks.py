"""A data-parallel mocker: `data_parallel_size` ranks in one engine, each a whole `MockerEngine` (its scheduler, KV
cache and step loop), behind one `Engine` contract, as Dynamo's mocker runs `--data-parallel-size`.

The router treats each (worker, rank) as a routing target and names the rank it chose in `GenerateRequest.dp_rank`;
a request that names none goes to the ranks in turn. The ranks' KV events form one stream with one numbering, each
batch stamped with its rank (events.RankEvents), and the load reports the ranks' sums and each rank
(`LoadMetrics.ranks`). With `data_parallel_hidden` the engine keeps its ranks to itself, as vLLM's internal load
balancer does: its card, load and events are rank-blind, and it sends each request to its least loaded rank.
docs/guides/mocker.md says how to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from dynamo_cli.engine import EngineArgs, EngineInfo
from dynamo_cli.errors import ConfigError, RequestError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.wire import GenerateChunk, GenerateRequest, LoadMetrics, RankLoad

from .config import MockerConfig
from .engine import WORK_COUNTERS, MockerEngine
from .events import EventRing, RankEvents


def mocker_engine(args: EngineArgs) -> MockerEngine | RankedMocker:
    """The `dyn.engines` entry point: one mocker (rank-blind, the default), or a `RankedMocker` when `args` name
    data-parallel ranks (`data_parallel_size` > 1, or a `data_parallel_start_rank` other than 0)."""
    config = MockerConfig.from_args(args)
    return RankedMocker(args, config) if config.is_ranked else MockerEngine(args, config)


class RankedMocker:
    """The ranks `data_parallel_start_rank` .. + `data_parallel_size` - 1, each a `MockerEngine` of the same
    settings (`num_gpu_blocks` blocks each), serving as one engine."""

    def __init__(self, args: EngineArgs, config: MockerConfig | None = None) -> None:
        self.config = config = config if config is not None else MockerConfig.from_args(args)
        if args.kv_tiers.enabled:
            raise ConfigError(
                f"mocker option data_parallel_size={config.data_parallel_size}: the mocker's host and disk KV tiers "
                "serve one rank; drop --kv-host-cache-gb and --kv-disk-cache-gb, or set data_parallel_size=1"
            )
        self._events = EventRing()
        """Every rank's KV event batches, in one numbering: the ranks append (RankEvents), `kv_events()` reads."""
        one_rank = dataclasses.replace(config, data_parallel_size=1, data_parallel_start_rank=0)
        first, is_hidden = config.data_parallel_start_rank, config.data_parallel_hidden
        self.ranks = {
            dp_rank: MockerEngine(args, one_rank, RankEvents(self._events, 0 if is_hidden else dp_rank))
            for dp_rank in range(first, first + config.data_parallel_size)
        }
        """Global rank -> its mocker."""
        self._turn = 0
        """How many requests that named no rank were placed (round-robin)."""
        self._in_flight: dict[str, MockerEngine] = {}
        """Request id -> the rank running it."""

    ##### The Engine contract #####

    async def start(self) -> EngineInfo:
        """Start every rank at once: one rank's info, with the ranks' capacity summed and, unless hidden, the ranks
        in `extra` (`dp_start`, `dp_size`: the card's `ranks`)."""
        infos = await asyncio.gather(*(rank.start() for rank in self.ranks.values()))
        config, extra = self.config, dict(infos[0].extra)
        if not config.data_parallel_hidden:
            extra.update(dp_start=config.data_parallel_start_rank, dp_size=config.data_parallel_size)
        return dataclasses.replace(
            infos[0],
            total_kv_blocks=sum(info.total_kv_blocks for info in infos),
            max_num_seqs=sum(info.max_num_seqs for info in infos),
            extra=extra,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Run the request on rank `dp_rank` (None: the next rank in turn); closing or cancelling the iterator
        aborts it there."""
        rank = self._rank_for(request)
        request_id = request.request_id
        is_new = request_id not in self._in_flight  # a repeated id is refused by the rank running the first
        if is_new:
            self._in_flight[request_id] = rank
        try:
            chunks = cast(AsyncGenerator[GenerateChunk, None], rank.generate(request))
            async with contextlib.aclosing(chunks):  # closed here and now, so the rank frees its blocks at once
                async for chunk in chunks:
                    yield chunk
        finally:
            if is_new:
                del self._in_flight[request_id]

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """Every rank's KV cache changes in one event-id order from 0, each batch with its `dp_rank`, until stop()."""
        return self._events.subscribe()

    def load_metrics(self) -> LoadMetrics:
        """The ranks' sums, and each rank's share in `ranks` (none when the ranks are hidden)."""
        metrics = {dp_rank: rank.load_metrics() for dp_rank, rank in self.ranks.items()}
        ranks = [_rank_load(dp_rank, load) for dp_rank, load in metrics.items()]
        return LoadMetrics(
            num_running=sum(rank.num_running for rank in ranks),
            num_waiting=sum(rank.num_waiting for rank in ranks),
            active_blocks=sum(rank.active_blocks for rank in ranks),
            total_blocks=sum(rank.total_blocks for rank in ranks),
            active_prefill_tokens=sum(rank.active_prefill_tokens for rank in ranks),
            num_prefill_tokens_computed=sum(load.num_prefill_tokens_computed for load in metrics.values()),
            num_prefill_tokens_cached=sum(load.num_prefill_tokens_cached for load in metrics.values()),
            ranks=[] if self.config.data_parallel_hidden else ranks,
        )

    async def stop(self) -> None:
        """Stop every rank (each ends its streams as cancelled and puts its last KV events in the ring), then end
        the KV event stream. Idempotent."""
        await asyncio.gather(*(rank.stop() for rank in self.ranks.values()))
        self._events.close()

    ##### Optional abilities #####

    async def load_lora(self, name: str, path: str) -> None:
        """Load adapter `name` on every rank at once (`ServesLoras`): a request of it may go to any rank."""
        await asyncio.gather(*(rank.load_lora(name, path) for rank in self.ranks.values()))

    async def unload_lora(self, name: str) -> None:
        """Free adapter `name` on every rank. Idempotent."""
        for rank in self.ranks.values():
            await rank.unload_lora(name)

    async def clear_kv_blocks(self) -> int:
        """`ClearsKv`: every rank's cache emptied."""
        return sum([await rank.clear_kv_blocks() for rank in self.ranks.values()])

    def work_counters(self) -> dict[str, float]:
        """`WORK_COUNTERS` summed over the ranks (`CountsWork`); an adapter load counts once per rank."""
        counts = [rank.work_counters() for rank in self.ranks.values()]
        return {name: sum(count[name] for count in counts) for name in WORK_COUNTERS}

    ##### Ranks #####

    def _rank_for(self, request: GenerateRequest) -> MockerEngine:
        serving = self._in_flight.get(request.request_id)
        if serving is not None:
            return serving  # a repeated request id: the rank running it refuses it (check_request)
        if request.dp_rank is None:
            return self._least_loaded() if self.config.data_parallel_hidden else self._next_in_turn()
        pinned = self.ranks.get(request.dp_rank)
        if pinned is None:
            first, last = min(self.ranks), max(self.ranks)
            raise RequestError(
                f"dp_rank {request.dp_rank} is not served by this worker (ranks {first}..{last}); "
                "send one of those, or none to let the engine pick",
                param="dp_rank",
            )
        return pinned

    def _next_in_turn(self) -> MockerEngine:
        """Dynamo's mocker: round-robin."""
        ranks = list(self.ranks.values())
        rank = ranks[self._turn % len(ranks)]
        self._turn += 1
        return rank

    def _least_loaded(self) -> MockerEngine:
        """vLLM's internal balancer (`DPLBAsyncMPClient`): the lowest 4 x waiting + running, the first rank of a tie."""
        loads = [rank.load_metrics() for rank in self.ranks.values()]
        scores = [4 * load.num_waiting + load.num_running for load in loads]
        return list(self.ranks.values())[scores.index(min(scores))]


def _rank_load(dp_rank: int, load: LoadMetrics) -> RankLoad:
    return RankLoad(
        dp_rank=dp_rank,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        active_blocks=load.active_blocks,
        total_blocks=load.total_blocks,
        active_prefill_tokens=load.active_prefill_tokens,
    )
