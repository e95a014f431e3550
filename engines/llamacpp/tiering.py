"""The llamacpp engine's KV tiers: evicted prefixes go down to the tiered store, prompts get them back.

NOTE: the flow. When the scheduler evicts a cached prefix it exports the prefix's sequence state in the
step (an `export` op, before the `rm`); `offload` queues that state, and the offload task cuts it into
per-block payloads (`kv_blocks.split`) in a thread and hands them to the `TieredBlockStore`. When a
request arrives, `onboard` asks the store how far its prompt's blocks sit in host or disk beyond what
the device holds; if further, it reads them (disk files checked in a thread), joins them into one state
for positions 0..n-1 and checks it with `kv_state.check` in a thread, all before the sequence reaches
the scheduler, which imports it at admission instead of recomputing those tokens. None of it runs on
the step loop but the export itself. A request whose client leaves while it onboards holds nothing yet.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
from collections.abc import Callable

from dynamo_cli.kv.events import KvEvent
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.kv.tiers import KvTierConfig, KvTierStats, OffloadBlock, TieredBlockStore

from . import kv_blocks, kv_state
from .kv_state import StateLayout
from .plan import StepResult
from .scheduler import PendingOffload, Scheduler, Sequence

logger = logging.getLogger(__name__)

OFFLOAD_QUEUE_SIZE = 64
"""Evicted prefix states waiting to be cut into blocks at most; beyond it they are dropped (counted)."""
LANDING_WAIT_S = 0.5
"""Longest a prompt waits for blocks on their way down (evicted, not yet in host) before it goes without."""
LANDING_POLL_S = 0.005


def fingerprint(model_path: str, layout: StateLayout, block_size: int) -> str:
    """The identity block files are written under: the model file (size and first MiB), the state
    layout (types, row sizes, V transposed or not) and the block size."""
    h = hashlib.blake2b(f"{os.path.getsize(model_path)}|{block_size}|{layout!r}".encode(), digest_size=16)
    with open(model_path, "rb") as f:
        h.update(f.read(1 << 20))
    return "llamacpp:" + h.hexdigest()


class KvTiering:
    """The tiered store behind one llamacpp engine, and the task that feeds it."""

    def __init__(self, store: TieredBlockStore, layout: StateLayout, max_cells: int, publish: Callable[[], None]):
        self.store = store
        self.layout = layout
        self.block_size = store.block_size
        self.max_cells = max_cells
        self._publish = publish
        self._queue: asyncio.Queue[tuple[PendingOffload, bytes, float]] = asyncio.Queue(OFFLOAD_QUEUE_SIZE)
        self._task: asyncio.Task[None] | None = None
        self._in_transit: collections.Counter[int] = collections.Counter()
        """Blocks of queued offloads, not yet in the store."""
        self.num_dropped = 0
        """Evicted prefixes not offloaded because the queue was full."""

    @classmethod
    async def open(
        cls,
        config: KvTierConfig,
        model_path: str,
        layout: StateLayout | None,
        block_size: int,
        max_cells: int,
        publish: Callable[[], None],
    ) -> KvTiering | None:
        """Tiers for this engine, started (a warm restart announces the disk's blocks); None when off or
        this model's states cannot be cut into blocks."""
        if not config.enabled:
            return None
        if layout is None or not kv_blocks.supports(layout):
            logger.warning("llamacpp: this model's KV state cannot be split into blocks; KV tiers are off")
            return None
        store = TieredBlockStore(config, fingerprint=fingerprint(model_path, layout, block_size), block_size=block_size)
        await store.start()
        tiering = cls(store, layout, max_cells, publish)
        tiering._task = asyncio.create_task(tiering._offload_loop(), name="llamacpp-kv-offload")
        return tiering

    async def aclose(self) -> None:
        """Stop the offload task, then the store (queued disk writes finish)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.store.aclose()

    @property
    def stats(self) -> KvTierStats:
        return self.store.stats

    def drain_events(self) -> list[KvEvent]:
        return self.store.drain_events()

    ##### Offload #####

    def offload(self, scheduler: Scheduler, result: StepResult) -> None:
        """Queue the states the step exported for evicted prefixes (never waits)."""
        seconds = result.evict_seconds / max(1, len(result.evicted))
        for key, state in result.evicted.items():
            pending = scheduler.take_offload(key)
            if pending is None:
                continue
            try:
                self._queue.put_nowait((pending, state, seconds))
            except asyncio.QueueFull:
                self.num_dropped += 1
            else:
                self._in_transit.update(pending.hashes)

    async def _offload_loop(self) -> None:
        while True:
            pending, state, seconds = await self._queue.get()
            try:
                await asyncio.to_thread(self._store_blocks, pending, state, seconds)
            except Exception:  # noqa: BLE001 - one bad state loses its blocks, not the tiers
                logger.exception("llamacpp: could not offload an evicted prefix")
            finally:
                for h in pending.hashes:
                    self._in_transit[h] -= 1
                    if not self._in_transit[h]:
                        del self._in_transit[h]
            self._publish()

    def _store_blocks(self, pending: PendingOffload, state: bytes, seconds: float) -> None:
        payloads = kv_blocks.split(state, self.layout, self.block_size, list(range(len(pending.hashes))))
        parents = [None, *pending.hashes[:-1]]
        blocks = [
            OffloadBlock(h, local, parent, payload, len(payload))
            for h, local, parent, payload in zip(pending.hashes, pending.local_hashes, parents, payloads, strict=True)
        ]
        self.store.offload(blocks, seconds=seconds)

    def refresh_if_held(self, hashes: list[int]) -> bool:
        """Whether host holds every block of this evicted prefix (then they are only made recent again,
        and the engine need not export it)."""
        return self.store.touch(hashes)

    ##### Onboard #####

    async def onboard(self, seq: Sequence, scheduler: Scheduler) -> None:
        """Give `seq` the prefix the tiers hold beyond the device's (as `kv_state` + `num_onboarded`)."""
        bs = self.block_size
        usable = (len(seq.tokens) - 1) // bs  # at least one prompt token is computed, for its logits
        if usable <= 0:
            return
        hashes = sequence_hashes(seq.tokens[: usable * bs], bs, seed=seq.hash_seed)
        await self._landed(hashes, scheduler)
        device = scheduler.device_match(hashes)
        tiers = self.store.match(hashes)
        if len(tiers) <= device:
            return
        payloads = await self.store.onboard(hashes[: len(tiers)])
        found = [p for p in payloads if p is not None]
        if len(found) <= device or len(found) != len(payloads):
            return
        try:
            seq.kv_state = await asyncio.to_thread(self._joined, found)
        except kv_state.StateFormatError as exc:
            logger.warning(
                "llamacpp: onboarded KV for request %s failed its check (%s); recomputing", seq.request.request_id, exc
            )
            return
        seq.num_onboarded = len(found) * bs

    async def _landed(self, hashes: list[int], scheduler: Scheduler) -> None:
        """Wait (at most LANDING_WAIT_S) while blocks of this prompt are on their way down: evicted from the
        device (exported in the next step), then cut and stored here. Without it, a conversation's next
        turn arriving right after its last one ended found its newest blocks nowhere and recomputed them."""
        wanted = set(hashes)
        deadline = asyncio.get_running_loop().time() + LANDING_WAIT_S
        while asyncio.get_running_loop().time() < deadline and (
            any(h in self._in_transit for h in wanted) or scheduler.is_exporting(wanted)
        ):
            await asyncio.sleep(LANDING_POLL_S)

    def _joined(self, payloads: list[bytes]) -> kv_state.CheckedState:
        blob = kv_blocks.join(payloads, self.layout, self.block_size)
        return kv_state.check(blob, self.layout, len(payloads) * self.block_size, self.max_cells)
