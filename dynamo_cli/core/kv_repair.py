"""Repair the KV router's view when a worker's event stream has a gap: replay, else a full dump."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from dynamo_cli.core.registry import Registry, Worker
from dynamo_cli.errors import TransportError
from dynamo_cli.routing.base import RepairsKvGaps
from dynamo_cli.wire import KV_DUMP, KV_EVENTS_SINCE, KvDumpQuery, KvEventsSince

logger = logging.getLogger(__name__)

REPAIR_INTERVAL_S = 0.5
REPAIR_TIMEOUT_S = 5.0


async def repair_loop(registry: Registry[Any], on_repair: Callable[[str], None] | None = None) -> None:
    """Every REPAIR_INTERVAL_S, ask workers whose event ids jumped for what the router missed."""
    while True:
        await asyncio.sleep(REPAIR_INTERVAL_S)
        for entry in list(registry.models.values()):
            for policy, pool in ((entry.policy, entry.workers), (entry.prefill_policy, entry.prefill_workers)):
                if not isinstance(policy, RepairsKvGaps):
                    continue
                for gap in policy.take_gaps():
                    worker = pool.get(gap.worker_id)
                    if worker is not None:
                        kind = await repair_gap(policy, worker, gap.first_missing)
                        if on_repair is not None:
                            on_repair(kind)


async def repair_gap(policy: RepairsKvGaps, worker: Worker, first_missing: int) -> str:
    """Replay from `first_missing`; when the worker no longer keeps it, load its dump. Returns which."""
    try:
        async with asyncio.timeout(REPAIR_TIMEOUT_S):
            try:
                stream = await worker.client.open(KV_EVENTS_SINCE, KvEventsSince(first_event_id=first_missing))
                async for raw in stream:
                    policy.apply_kv_events(KV_EVENTS_SINCE.decode_reply(raw))
                logger.info("KV router: replayed events of worker %x from %d", worker.instance_id, first_missing)
                return "replay"
            except TransportError as exc:
                if exc.code != "too_old":
                    raise
            dump = await worker.client.call(KV_DUMP, KvDumpQuery())
            policy.load_dump(msgspec.structs.replace(dump, worker_id=worker.instance_id))
            logger.info("KV router: reloaded worker %x from a dump", worker.instance_id)
            return "dump"
    except (TransportError, TimeoutError) as exc:
        logger.warning("KV router: cannot repair worker %x's events: %s", worker.instance_id, exc)
        return "failed"
