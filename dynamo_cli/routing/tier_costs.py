"""What a KV cache hit on a lower storage tier is worth to the router: onboard time and weight per tier.

    onboard_s(t) = blocks_t * bytes_per_block / bandwidth_t + latency_t      (0 without a hit on t)
    w_t = clamp(1 - (bytes_per_block / bandwidth_t) / (block_size / R), 0, 1)

The `time` cost (time_cost.py) adds onboard_s instead of the blocks' recompute time; the `dynamo` cost counts
a hit on tier t as w_t of a device hit (`--router-tier-weights host=W,disk=W` overrides). Defaults: host
20 GB/s + 20 us, disk 4 GB/s + 200 us (config.py's TIER_*, shared with the mocker), documented figures.

Design: docs/design/kv-tier-filter.md (the figures' basis, bytes per block, a worked example).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dynamo_cli.config import TIER_DISK_LATENCY_S, TIER_HOST_LATENCY_S
from dynamo_cli.kv.events import DISK, HOST


@dataclass(frozen=True, slots=True)
class TierCosts:
    """Per lower tier: seconds to onboard one block, a transfer's latency, and the `dynamo` cost's weight.
    The default makes a lower-tier hit as good as a device hit (no onboard time, weight 1)."""

    host_block_s: float = 0.0
    """Seconds to copy one block from host memory into the engine's cache."""
    disk_block_s: float = 0.0
    """Seconds to copy one block from disk into the engine's cache."""
    host_latency_s: float = 0.0
    """Fixed seconds per request that onboards from host."""
    disk_latency_s: float = 0.0
    """Fixed seconds per request that onboards from disk."""
    host_weight: float = 1.0
    """`dynamo` cost: a host hit counts as this many device hits."""
    disk_weight: float = 1.0
    """`dynamo` cost: a disk hit counts as this many device hits."""


AS_DEVICE = TierCosts()
"""Lower-tier hits counted as device hits (no onboard time, weight 1)."""


def tier_costs(
    *,
    block_size: int,
    bytes_per_block: int,
    host_gbs: float,
    disk_gbs: float,
    prefill_tps: float,
    weights: Mapping[str, float] | None = None,
) -> TierCosts:
    """The tier costs of a model with `bytes_per_block` of KV per `block_size` tokens (see the docstring)."""
    host_s, disk_s = bytes_per_block / (host_gbs * 1e9), bytes_per_block / (disk_gbs * 1e9)
    recompute_s = block_size / prefill_tps
    chosen: dict[str, float] = {HOST: _saved(host_s, recompute_s), DISK: _saved(disk_s, recompute_s)}
    chosen.update(weights or {})
    return TierCosts(host_s, disk_s, TIER_HOST_LATENCY_S, TIER_DISK_LATENCY_S, chosen[HOST], chosen[DISK])


def _saved(onboard_s: float, recompute_s: float) -> float:
    return min(1.0, max(0.0, 1.0 - onboard_s / recompute_s))
