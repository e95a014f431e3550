"""The tiered KV store's counters and holdings, as workers publish them and frontends show them."""

from __future__ import annotations

import msgspec


class KvTierStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since start (monotonic) and current holdings, for metrics. Directions as Dynamo names
    them: d2h device→host, h2d host→disk on offload (KVBM's G2→G3), host→device on onboard, d2d disk→device.
    Workers publish it in `LoadMetrics.kv_tiers`; frontends show it as `kvbm_*` series."""

    lookup_blocks: int = 0
    """Blocks asked about by `match` (past the device)."""
    host_hit_blocks: int = 0
    """Of those, found in host (the leading run)."""
    disk_hit_blocks: int = 0
    """Of those, found on disk and not in host (the leading run)."""
    matched_tokens: int = 0
    """Tokens of matched blocks (blocks x block size)."""
    offload_blocks_d2h: int = 0
    """Blocks offloaded device→host (or device→disk without a host tier, counted in h2d)."""
    offload_bytes_d2h: int = 0
    """Their bytes."""
    offload_seconds_d2h: float = 0.0
    """Time the engine spent taking them out of its cache (as `offload` was told)."""
    offload_blocks_h2d: int = 0
    """Blocks written to disk."""
    offload_bytes_h2d: int = 0
    """Their file bytes."""
    offload_seconds_h2d: float = 0.0
    """Time spent writing them."""
    onboard_blocks_h2d: int = 0
    """Blocks onboarded host→device."""
    onboard_bytes_h2d: int = 0
    """Their bytes."""
    onboard_seconds_h2d: float = 0.0
    """Time spent on onboards that read from host only."""
    onboard_blocks_d2d: int = 0
    """Blocks onboarded disk→device."""
    onboard_bytes_d2d: int = 0
    """Their bytes."""
    onboard_seconds_d2d: float = 0.0
    """Time spent on onboards that read from disk (reading and checking the files)."""
    filtered_blocks: int = 0
    """Host evictions the frequency filter kept off disk."""
    dropped_blocks: int = 0
    """Disk offloads dropped: the writer queue was full, or a write failed."""
    corrupt_files: int = 0
    """Block files skipped: truncated, bad header or checksum."""
    foreign_files: int = 0
    """Block files skipped: another model's."""
    host_blocks: int = 0
    """Blocks in host now."""
    host_used_bytes: int = 0
    """Their bytes."""
    disk_blocks: int = 0
    """Blocks on disk now (written or queued)."""
    disk_used_bytes: int = 0
    """Bytes the disk tier's files take (queued writes reserved; other models' files included)."""

    @property
    def host_hit_rate(self) -> float:
        """Host hits per block looked up."""
        return self.host_hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    @property
    def disk_hit_rate(self) -> float:
        """Disk hits per block looked up."""
        return self.disk_hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


KVBM_SERIES = {
    "kvbm_matched_tokens": "matched_tokens",
    "kvbm_offload_blocks_d2h": "offload_blocks_d2h",
    "kvbm_offload_blocks_h2d": "offload_blocks_h2d",
    "kvbm_onboard_blocks_h2d": "onboard_blocks_h2d",
    "kvbm_onboard_blocks_d2d": "onboard_blocks_d2d",
    "kvbm_host_cache_hit_rate": "host_hit_rate",
    "kvbm_disk_cache_hit_rate": "disk_hit_rate",
    "kvbm_offload_bytes_d2h": "offload_bytes_d2h",
    "kvbm_offload_seconds_d2h": "offload_seconds_d2h",
    "kvbm_offload_bytes_h2d": "offload_bytes_h2d",
    "kvbm_offload_seconds_h2d": "offload_seconds_h2d",
    "kvbm_onboard_bytes_h2d": "onboard_bytes_h2d",
    "kvbm_onboard_seconds_h2d": "onboard_seconds_h2d",
    "kvbm_onboard_bytes_d2d": "onboard_bytes_d2d",
    "kvbm_onboard_seconds_d2d": "onboard_seconds_d2d",
    "kvbm_filtered_blocks": "filtered_blocks",
    "kvbm_dropped_blocks": "dropped_blocks",
    "kvbm_disk_files_corrupt": "corrupt_files",
    "kvbm_disk_files_foreign": "foreign_files",
    "kvbm_host_blocks": "host_blocks",
    "kvbm_host_bytes": "host_used_bytes",
    "kvbm_disk_blocks": "disk_blocks",
    "kvbm_disk_bytes": "disk_used_bytes",
}
"""Prometheus series of the workers' KV tiers (`KvTierStats`), with Dynamo's KVBM names where it has one.
Directions as KVBM names them: offload d2h device→host, offload h2d host→disk (G2→G3), onboard h2d
host→device, onboard d2d disk→device."""
