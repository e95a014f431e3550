"""What a KV cache hit on a lower storage tier is worth to the router: onboard time and weight per tier.

A block a worker holds in host memory or on disk is not recomputed, but it is not free either: the
engine copies it back into its own cache first (Dynamo's KVBM "onboarding"). Per request and tier t,

    onboard_s(t) = blocks_t * bytes_per_block / bandwidth_t + latency_t      (0 without a hit on t)

The `time` cost (time_cost.py) adds this instead of the blocks' recompute time `blocks_t * block_size / R`.
Dynamo's `dynamo` cost counts prompt blocks, so a hit on tier t counts as `w_t` of a device hit:

    w_t = clamp(1 - (bytes_per_block / bandwidth_t) / (block_size / R), 0, 1)

the share of a block's recompute time an onboard saves, with R the prefill speed (`--router-prefill-tps`,
else `PRIOR_PREFILL_TPS`). `--router-tier-weights host=W,disk=W` overrides either weight.

Defaults (config.py's TIER_*, shared with the mocker's timing model; flags `--router-host-bandwidth-gbs`,
`--router-disk-bandwidth-gbs`), documented figures, not measured here (this machine has no GPU and a
shared disk):

- host 20 GB/s: pinned host -> device copies over PCIe 4.0 x16 run at ~25 GB/s peak, 20 sustained;
  latency 20 us per transfer (a CUDA copy's launch and synchronisation).
- disk 4 GB/s: one NVMe Gen4 SSD's sequential read (3-7 GB/s); latency 200 us (an NVMe read's queueing
  and completion, plus the hop through host memory).
- bytes per block: the card's `kv_bytes_per_block` when the engine publishes it, else 128 KiB per token
  times the block size (Llama-3-8B in fp16: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes).

With these, a 16-token block of that model (2 MiB) onboards in 105 us from host and 524 us from disk
against 800 us to recompute at 20 k tokens/s: w_host = 0.87, w_disk = 0.34.
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
