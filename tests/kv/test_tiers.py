"""The tiered block store: exact block accounting per tier, the frequency filter, capacities, events,
and the disk tier's files (warm restart; corrupt, truncated and foreign files skipped)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynamo_cli.kv import disk
from dynamo_cli.kv.events import BlockRemoved, BlockStored, KvEvent, StoredBlock
from dynamo_cli.kv.tiers import KvTierConfig, OffloadBlock, TieredBlockStore

SIZE = 100
"""Payload bytes of every test block."""
FILE = disk.file_size(SIZE)


def chain(first: int, n: int, parent: int | None = None, payload: bool = False) -> list[OffloadBlock]:
    """`n` blocks with hashes first..first+n-1, each the parent of the next."""
    out = []
    for h in range(first, first + n):
        out.append(OffloadBlock(h, h + 1000, parent, bytes([h % 256]) * SIZE if payload else None, SIZE))
        parent = h
    return out


def stored(tier: str, parent: int | None, *hashes: int) -> BlockStored:
    return BlockStored(parent_hash=parent, blocks=[StoredBlock(h, h + 1000) for h in hashes], tier=tier)  # type: ignore[arg-type]


def removed(tier: str, *hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), tier=tier)  # type: ignore[arg-type]


def holdings(events: list[KvEvent]) -> dict[str, set[int]]:
    """What a router would believe each tier holds after `events`."""
    held: dict[str, set[int]] = {"host": set(), "disk": set()}
    for e in events:
        if isinstance(e, BlockStored):
            held[e.tier].update(b.block_hash for b in e.blocks)
        elif isinstance(e, BlockRemoved):
            held[e.tier].difference_update(e.block_hashes)
    return held


def test_offload_enters_host_with_one_stored_event_per_chain() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=10 * SIZE), fingerprint="m", block_size=16)
    store.offload(chain(1, 3))
    store.offload(chain(10, 2, parent=99))
    assert store.drain_events() == [stored("host", None, 1, 2, 3), stored("host", 99, 10, 11)]
    assert store.match([1, 2, 3, 4]) == ["host", "host", "host"]
    assert store.match([2, 3]) == ["host", "host"]
    assert store.match([5, 1]) == []
    s = store.stats
    assert (s.host_blocks, s.host_used_bytes, s.offload_blocks_d2h, s.offload_bytes_d2h) == (5, 500, 5, 500)
    assert (s.lookup_blocks, s.host_hit_blocks, s.matched_tokens) == (8, 5, 80)
    assert s.host_hit_rate == pytest.approx(5 / 8)


def test_host_capacity_evicts_suffixes_first_and_never_overflows() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=4 * SIZE), fingerprint="m")
    store.offload(chain(1, 3))
    store.drain_events()
    store.offload(chain(20, 2))
    # the deepest block of the older chain goes first: the prefix stays reachable
    assert store.drain_events() == [removed("host", 3), stored("host", None, 20, 21)]
    assert store.match([1, 2, 3]) == ["host", "host"]
    assert store.stats.host_used_bytes == 4 * SIZE
    store.offload(chain(30, 9))  # larger than the tier: the leading part that fits is kept
    assert store.stats.host_used_bytes <= 4 * SIZE
    assert store.match(list(range(30, 39))) == ["host"] * 4


def test_reoffloading_a_held_block_only_refreshes_it() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=3 * SIZE), fingerprint="m")
    store.offload(chain(1, 1) + chain(2, 1) + chain(3, 1))
    store.drain_events()
    store.offload(chain(1, 1))  # 1 becomes most recent: 3, then 2 are next to go
    store.offload(chain(4, 1))
    assert store.drain_events() == [removed("host", 3), stored("host", None, 4)]
    assert store.stats.offload_blocks_d2h == 4


def test_the_filter_sends_only_blocks_hit_twice_to_disk() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=2 * SIZE, disk_bytes=10 * FILE), fingerprint="m")
    store.offload(chain(1, 2))
    assert asyncio.run(store.onboard([1])) == [None]  # block 1 hit: frequency 2
    store.drain_events()
    store.offload(chain(10, 2))
    assert store.drain_events() == [
        removed("host", 2, 1),
        stored("disk", None, 1),
        stored("host", None, 10, 11),
    ]
    s = store.stats
    assert (s.filtered_blocks, s.disk_blocks, s.host_blocks, s.onboard_blocks_h2d) == (1, 1, 2, 1)
    assert store.match([1, 2]) == ["disk"]


def test_without_the_filter_every_host_eviction_goes_to_disk() -> None:
    store = TieredBlockStore(
        KvTierConfig(host_bytes=2 * SIZE, disk_bytes=10 * SIZE, disk_filter=False), fingerprint="m"
    )
    store.offload(chain(1, 2))
    store.offload(chain(10, 2))
    events = store.drain_events()
    assert events[1:3] == [removed("host", 2, 1), stored("disk", None, 1, 2)]  # parents first on disk
    assert store.match([1, 2, 3]) == ["disk", "disk"]
    assert store.stats.filtered_blocks == 0


def test_disk_capacity_evicts_lru_and_exact_events_replay_to_the_holdings() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=SIZE, disk_bytes=3 * SIZE, disk_filter=False), fingerprint="m")
    all_events: list[KvEvent] = []
    for i in range(10):
        store.offload(chain(100 + i, 1))
        all_events += store.drain_events()
        s = store.stats
        assert s.host_used_bytes <= SIZE and s.disk_used_bytes <= 3 * SIZE
    held = holdings(all_events)
    assert held == {"host": {109}, "disk": {106, 107, 108}}
    assert [store.match([h]) for h in (105, 106, 109)] == [[], ["disk"], ["host"]]


def test_a_block_in_host_and_disk_matches_host_and_onboard_bumps_both() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=SIZE, disk_bytes=5 * SIZE, disk_filter=False), fingerprint="m")
    store.offload(chain(1, 1))
    store.offload(chain(2, 1))  # 1 → disk
    store.offload(chain(1, 1))  # 1 comes back to host (2 → disk); it is also still on disk
    assert store.match([1]) == ["host"]
    assert holdings(store.drain_events()) == {"host": {1}, "disk": {1, 2}}


def test_no_host_tier_offloads_straight_to_disk() -> None:
    store = TieredBlockStore(KvTierConfig(disk_bytes=2 * SIZE), fingerprint="m")
    store.offload(chain(1, 3))
    assert store.drain_events() == [stored("disk", None, 1, 2)]  # the leading blocks that fit
    assert store.stats.dropped_blocks == 1
    store.offload(chain(10, 1))  # the suffix goes first: the prefix stays reachable
    assert store.drain_events() == [removed("disk", 2), stored("disk", None, 10)]
    assert store.match([1, 2]) == ["disk"]


def test_frequency_decays_so_an_old_hit_no_longer_passes_the_filter() -> None:
    from dynamo_cli.kv import tiers

    store = TieredBlockStore(KvTierConfig(host_bytes=2 * SIZE, disk_bytes=10 * SIZE), fingerprint="m")
    store.offload(chain(1, 1))
    asyncio.run(store.onboard([1]))
    store._tick += tiers.DECAY_BLOCKS  # one decay step: 2 → 1
    store.offload(chain(2, 2))
    assert store.stats.filtered_blocks == 1 and store.stats.disk_blocks == 0


# -- the disk tier's files ----------------------------------------------------------------------------


@pytest.fixture
async def disk_store(tmp_path: Path) -> AsyncIterator[TieredBlockStore]:
    store = TieredBlockStore(
        KvTierConfig(host_bytes=SIZE, disk_bytes=6 * FILE, disk_dir=str(tmp_path), disk_filter=False),
        fingerprint="model-a",
    )
    await store.start()
    yield store
    await store.aclose()


async def flush(store: TieredBlockStore) -> None:
    for _ in range(200):
        if store.is_disk_idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the disk writer did not drain its queue")


async def test_payloads_round_trip_through_host_and_disk(disk_store: TieredBlockStore, tmp_path: Path) -> None:
    blocks = chain(1, 4, payload=True)
    for b in blocks:  # host holds one block: each pushes the one before to disk
        disk_store.offload([b])
    await flush(disk_store)
    assert disk_store.match([1, 2, 3, 4]) == ["disk", "disk", "disk", "host"]
    got = await disk_store.onboard([1, 2, 3, 4])
    assert got == [b.payload for b in blocks]
    s = disk_store.stats
    assert (s.onboard_blocks_d2d, s.onboard_blocks_h2d, s.offload_blocks_h2d) == (3, 1, 3)
    assert s.onboard_bytes_d2d == 3 * SIZE and s.offload_bytes_h2d == 3 * FILE
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{h:016x}.kvb" for h in (1, 2, 3)]


async def test_the_directory_never_exceeds_its_size(disk_store: TieredBlockStore, tmp_path: Path) -> None:
    for i in range(20):
        disk_store.offload(chain(100 + i, 1, payload=True))
    await flush(disk_store)
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total <= 6 * FILE and disk_store.stats.disk_used_bytes == total == 6 * FILE
    assert holdings(disk_store.drain_events())["disk"] == set(range(113, 119))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_a_damaged_file_is_skipped_counted_and_deleted(
    disk_store: TieredBlockStore, tmp_path: Path, damage: str
) -> None:
    disk_store.offload(chain(1, 1, payload=True))
    disk_store.offload(chain(2, 1, payload=True, parent=1))
    disk_store.offload(chain(3, 1, payload=True, parent=2))
    await flush(disk_store)
    path = disk.block_path(tmp_path, 2)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
    else:
        data = data[:-7]
    path.write_bytes(bytes(data))
    disk_store.drain_events()
    got = await disk_store.onboard([1, 2, 3])
    assert got == [chain(1, 1, payload=True)[0].payload]  # stops before the damaged block
    assert disk_store.stats.corrupt_files == 1
    assert disk_store.drain_events() == [removed("disk", 2)]
    await flush(disk_store)
    assert not path.exists() and disk_store.match([2]) == []


async def test_a_warm_restart_loads_valid_files_and_skips_foreign_and_broken_ones(tmp_path: Path) -> None:
    config = KvTierConfig(host_bytes=SIZE, disk_bytes=20 * FILE, disk_dir=str(tmp_path), disk_filter=False)
    first = TieredBlockStore(config, fingerprint="model-a")
    await first.start()
    for b in chain(1, 4, payload=True):
        first.offload([b])
    first.offload(chain(50, 1, payload=True))
    await first.aclose()  # flushes: 1..4 on disk, 50 in host (lost)
    other = disk.encode(disk.BlockHeader(77, None, 1077, SIZE), b"x" * SIZE, disk.fingerprint_digest("model-b"))
    disk.block_path(tmp_path, 77).write_bytes(other)
    disk.block_path(tmp_path, 88).write_bytes(b"DYNKVB\x00\x01 too short")
    (tmp_path / "0000000000000099.tmp").write_bytes(b"half")
    os.utime(disk.block_path(tmp_path, 1), (1, 1))  # oldest: still loads

    second = TieredBlockStore(config, fingerprint="model-a")
    await second.start()
    try:
        events = second.drain_events()
        assert events == [stored("disk", None, 1, 2, 3, 4)]
        s = second.stats
        assert (s.disk_blocks, s.foreign_files, s.corrupt_files) == (4, 1, 1)
        assert s.disk_used_bytes == 4 * FILE + len(other)  # the foreign file counts against the size
        assert sorted(p.name for p in tmp_path.iterdir())[-1] == f"{77:016x}.kvb"  # kept, not ours to delete
        assert not disk.block_path(tmp_path, 88).exists() and not (tmp_path / "0000000000000099.tmp").exists()
        assert await second.onboard([1, 2, 3, 4]) == [b.payload for b in chain(1, 4, payload=True)]
        assert await second.onboard([77]) == []
    finally:
        await second.aclose()


async def test_a_restart_on_a_smaller_size_drops_the_oldest_files(tmp_path: Path) -> None:
    big = KvTierConfig(disk_bytes=10 * FILE, disk_dir=str(tmp_path))
    first = TieredBlockStore(big, fingerprint="m")
    await first.start()
    first.offload(chain(1, 5, payload=True))
    await first.aclose()
    for i, h in enumerate(range(1, 6)):
        os.utime(disk.block_path(tmp_path, h), (100 + i, 100 + i))
    second = TieredBlockStore(KvTierConfig(disk_bytes=3 * FILE, disk_dir=str(tmp_path)), fingerprint="m")
    await second.start()
    await second.aclose()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{h:016x}.kvb" for h in (3, 4, 5)]


def test_a_file_naming_another_block_is_corrupt(tmp_path: Path) -> None:
    digest = disk.fingerprint_digest("m")
    disk.write_block(tmp_path, disk.BlockHeader(5, None, 6, 3), b"abc", digest)
    os.replace(disk.block_path(tmp_path, 5), disk.block_path(tmp_path, 9))
    with pytest.raises(disk.BlockFileError) as err:
        disk.read_header(disk.block_path(tmp_path, 9), digest)
    assert err.value.fault is disk.FileFault.CORRUPT


def test_touch_refreshes_only_a_prefix_held_wholly_in_host() -> None:
    store = TieredBlockStore(KvTierConfig(host_bytes=3 * SIZE), fingerprint="m")
    store.offload(chain(1, 2))
    store.offload(chain(9, 1))
    store.drain_events()
    assert not store.touch([1, 2, 3]) and store.touch([1, 2])
    store.offload(chain(20, 1))  # 9 is now the oldest
    assert store.drain_events() == [removed("host", 9), stored("host", None, 20)]
    assert store.stats.offload_blocks_d2h == 4 and store.stats.lookup_blocks == 0


async def test_other_models_files_leave_less_room_and_are_never_evicted(tmp_path: Path) -> None:
    other = disk.encode(disk.BlockHeader(77, None, 1077, SIZE), b"x" * SIZE, disk.fingerprint_digest("model-b"))
    disk.block_path(tmp_path, 77).write_bytes(other)
    store = TieredBlockStore(KvTierConfig(disk_bytes=3 * FILE, disk_dir=str(tmp_path)), fingerprint="model-a")
    await store.start()
    try:
        for b in chain(1, 4, payload=True):
            store.offload([b])
        await flush(store)
        assert store.stats.disk_blocks == 2 and store.stats.disk_used_bytes == 3 * FILE
        assert disk.block_path(tmp_path, 77).exists()
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * FILE
    finally:
        await store.aclose()
