"""The data-parallel ranks of one vLLM engine (`--engine-arg data_parallel_size=N`), each a routing target.

vLLM's internal load balancing: one `AsyncLLM` drives N engine cores (processes), one per rank, each with a
scheduler and a KV cache of its own (for a dense model the ranks never talk to each other). The engine serves
ranks 0 .. N-1 (`EngineInfo.extra` `dp_start`/`dp_size`, the card's ranks); a request that names its rank
(`GenerateRequest.dp_rank`) is pinned there with `AsyncLLM.generate(data_parallel_rank=...)`, one that names none
is placed by vLLM's own balancer. Each rank publishes its KV events at the endpoint's port + rank (kv_events.py
merges them). Each rank's load comes from the counts vLLM's DP coordinator sends its client about every 100 ms
(`DPLBAsyncMPClient.lb_engines`: waiting, running, KV usage per rank), read without a call into the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo_cli.engine import EngineInfo
from dynamo_cli.errors import ConfigError, RequestError
from dynamo_cli.wire import GenerateRequest, LoadMetrics, RankLoad

EXTERNAL_KEYS = (
    "data_parallel_rank",
    "data_parallel_start_rank",
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
)
"""vLLM's external and hybrid load balancing (a process per rank or per node): not mapped to a worker's ranks."""


@dataclass(frozen=True, slots=True)
class VllmRanks:
    """Ranks 0 .. `dp_size` - 1 of one engine; `dp_size` 1 is a rank-blind engine (no rank named, none pinned)."""

    dp_size: int = 1

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> VllmRanks:
        """The ranks `AsyncEngineArgs(**kwargs)` will run; ConfigError for a size vLLM would not take, or a
        load-balancing mode whose ranks live in other processes."""
        size = kwargs.get("data_parallel_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"vllm option data_parallel_size must be a positive integer, got {size!r}")
        external = sorted(key for key in EXTERNAL_KEYS if kwargs.get(key) not in (None, False))
        if size > 1 and external:
            raise ConfigError(
                f"{', '.join(external)}: dyn maps vLLM's internal load balancing only (one worker, all its ranks); "
                "drop them and give data_parallel_size alone"
            )
        return cls(size)

    @property
    def is_ranked(self) -> bool:
        return self.dp_size > 1

    def pin(self, request: GenerateRequest) -> dict[str, Any]:
        """`AsyncLLM.generate`'s keyword pinning the request to its rank (none for a rank-blind engine or a request
        that names no rank); RequestError (param "dp_rank") for a rank this engine does not serve."""
        rank = request.dp_rank
        if rank is None or not self.is_ranked:
            if rank not in (None, 0):
                raise RequestError(f"dp_rank {rank}: this vllm engine is one rank (0); send 0 or none", "dp_rank")
            return {}
        if not 0 <= rank < self.dp_size:
            raise RequestError(
                f"dp_rank {rank} is not served by this worker (ranks 0..{self.dp_size - 1}); send one of those, "
                "or none to let vLLM pick",
                param="dp_rank",
            )
        return {"data_parallel_rank": rank}

    def widen(self, info: EngineInfo) -> EngineInfo:
        """One rank's view of the engine (vLLM's config: each rank's `max_num_seqs`, every rank's KV blocks summed)
        as the whole engine's, and the ranks in `extra` (the card's `dp_start`, `dp_size`)."""
        if not self.is_ranked:
            return info
        extra = info.extra | {"dp_start": 0, "dp_size": self.dp_size}
        return dataclasses.replace(info, max_num_seqs=info.max_num_seqs * self.dp_size, extra=extra)

    def load(self, metrics: LoadMetrics, engine: Any) -> LoadMetrics:
        """`metrics` (requests in flight, prompt tokens) with each rank's load, and the ranks' waiting requests and
        KV blocks in use summed; as given where vLLM keeps no per-rank counts (a client without a coordinator)."""
        counts = getattr(getattr(engine, "engine_core", None), "lb_engines", None)
        if not self.is_ranked or not isinstance(counts, list) or len(counts) != self.dp_size:
            return metrics
        per_rank = metrics.total_blocks // self.dp_size
        ranks = [_rank_load(rank, row, per_rank) for rank, row in enumerate(counts)]
        return msgspec.structs.replace(
            metrics,
            num_waiting=sum(rank.num_waiting for rank in ranks),
            active_blocks=sum(rank.active_blocks for rank in ranks),
            ranks=ranks,
        )


def _rank_load(dp_rank: int, row: Any, total_blocks: int) -> RankLoad:
    """vLLM's `[waiting, running, kv_cache_usage]` of one rank as ours."""
    waiting, running, usage = (list(row) + [0, 0, 0.0])[:3]
    return RankLoad(
        dp_rank=dp_rank,
        num_running=int(running),
        num_waiting=int(waiting),
        active_blocks=round(float(usage) * total_blocks),
        total_blocks=total_blocks,
    )
