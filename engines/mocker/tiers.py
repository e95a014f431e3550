"""The mocker's KV tiers: the real tiered block store under its simulated cache, with a time per transfer.

The store (dynamo_cli/kv/tiers.py) does the same bookkeeping as for a real engine, without payloads:
blocks the KvManager evicts are offloaded to host (then disk, through the frequency filter), and a
request whose prefix continues below the device has those blocks onboarded, i.e. brought back into
the KvManager as cached, so the scheduler counts them as prefix hits instead of computing them. The
onboard takes simulated time, waited by the request's own coroutine, never by the step loop:

    t = sum over tiers of (blocks x bytes per block / bandwidth + latency) / speedup_ratio

Bandwidths and latencies are mocker options (`--engine-arg kv_host_bandwidth=20` ...); their defaults
are the router's (config.py TIER_*: 20 GB/s and 0.02 ms for host, 4 GB/s and 0.2 ms for disk), so the
router's cost of a lower-tier hit is the mocker's time for it. Offloads (device to host) are not timed: real engines
copy them off the critical path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynamo_cli.config import TIER_DISK_GBS, TIER_HOST_GBS
from dynamo_cli.kv.events import DISK, HOST, KvEvent, Tier
from dynamo_cli.kv.tiers import KvTierConfig, KvTierStats, OffloadBlock, TieredBlockStore

from .config import DISK_MS, HOST_MS, MockerConfig
from .kv_manager import KvManager


@dataclass(frozen=True, slots=True)
class TierTiming:
    """How long moving blocks up from a tier takes (before the speedup ratio)."""

    host_bandwidth_gbs: float = TIER_HOST_GBS
    """Host to device, GB/s."""
    disk_bandwidth_gbs: float = TIER_DISK_GBS
    """Disk to device, GB/s."""
    host_latency_ms: float = HOST_MS
    """Fixed cost of one onboard from host."""
    disk_latency_ms: float = DISK_MS
    """Fixed cost of one onboard that reads disk."""
    speedup_ratio: float = 1.0
    """Divides every time, as it divides the passes."""

    def onboard_s(self, tiers: Sequence[Tier], block_bytes: int) -> float:
        """Seconds to bring blocks on `tiers` (one entry per block) into the device."""
        seconds = 0.0
        for tier, bandwidth, latency in (
            (HOST, self.host_bandwidth_gbs, self.host_latency_ms),
            (DISK, self.disk_bandwidth_gbs, self.disk_latency_ms),
        ):
            count = tiers.count(tier)
            if count:
                seconds += count * block_bytes / (bandwidth * 1e9) + latency / 1000
        return seconds / self.speedup_ratio


class MockerTiers:
    """The store under one mocker's KvManager, and the onboard of a request's prefix."""

    def __init__(
        self, config: KvTierConfig, kv: KvManager, *, timing: TierTiming, block_bytes: int, fingerprint: str
    ) -> None:
        self._kv = kv
        self._timing = timing
        self._block_bytes = block_bytes
        self.store = TieredBlockStore(config, fingerprint=fingerprint, block_size=kv.block_size)
        kv.collect_evicted = True

    @classmethod
    def for_mocker(cls, mocker: MockerConfig, config: KvTierConfig, kv: KvManager) -> MockerTiers:
        """The tiers of a mocker with these settings: its bandwidths, latencies and bytes per block."""
        timing = TierTiming(
            mocker.kv_host_bandwidth,
            mocker.kv_disk_bandwidth,
            mocker.kv_host_latency_ms,
            mocker.kv_disk_latency_ms,
            mocker.speedup_ratio,
        )
        block_bytes = mocker.kv_bytes_per_token * mocker.block_size
        fingerprint = f"mocker:{mocker.model}:{mocker.block_size}:{mocker.kv_bytes_per_token}"
        return cls(config, kv, timing=timing, block_bytes=block_bytes, fingerprint=fingerprint)

    def plan(self, seq_hashes: Sequence[int]) -> tuple[int, list[Tier], float]:
        """For a prompt's full blocks: device hits, the tiers of the blocks that continue them below, and
        the seconds their onboard takes."""
        start = self._kv.num_prefix_hits(seq_hashes)
        below = self.store.match(seq_hashes[start:])
        return start, below, self._timing.onboard_s(below, self._block_bytes)

    async def onboard(
        self, seq_hashes: Sequence[int], local_hashes: Sequence[int], start: int, count: int, seconds: float
    ) -> int:
        """After the transfer time (`seconds`, simulated, also what the metrics record): the blocks
        `start .. start + count - 1` come back into the cache as cached (whatever the device gained
        meanwhile is kept); returns how many were inserted."""
        found = await self.store.onboard(seq_hashes[start : start + count], seconds=seconds)
        now = self._kv.num_prefix_hits(seq_hashes[: start + len(found)])
        if now >= start + len(found):
            return 0
        return self._kv.insert_cached(seq_hashes, local_hashes, now, start + len(found) - now)

    def after_pass(self) -> None:
        """Offload what the pass evicted, and queue the tiers' events behind the cache's own."""
        evicted, self._kv.evicted = self._kv.evicted, []
        if evicted:
            size = self._block_bytes
            self.store.offload([OffloadBlock(key, tokens, parent, None, size) for key, tokens, parent in evicted])
        events: list[KvEvent] = self.store.drain_events()
        if events:
            self._kv.add_events(events)

    @property
    def stats(self) -> KvTierStats:
        """The store's counters (published in LoadMetrics)."""
        return self.store.stats
