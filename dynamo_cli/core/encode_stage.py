"""The encode stage of one request (E/P/D): its images' embeddings computed on encode workers (`--role encode`)
before the prompt goes to its prefill or aggregated worker, which pulls them (worker.py `take_images`).

Conditional, as the prefill stage is: an image goes to the encode pool only when the model has encode workers, the
image is at least `--encode-min-kb` (a small image costs the serving worker's own encoder less than a hop), and
the chosen worker does not hold the image's blocks already (the routing decision's overlap covers its run: the
engine will not encode it at all). Each image goes to one encode worker by rendezvous hashing on its digest (the
same image, the same encoder, whose embedding cache then holds it), or the next one in that order when it has
`--encode-max-inflight` calls open. An encode that fails or takes over `--encode-timeout` leaves its images to
the serving worker's encoder; the request goes on either way. Outcomes per image are counted as disaggregation
decisions (`dynamo_frontend_disagg_decisions_total{outcome="encode_..."}`): remote, encoder_cache, prefix_cached,
small, failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from typing import Protocol

import msgspec

from dynamo_cli.config import DisaggConfig
from dynamo_cli.core.holds import Hold
from dynamo_cli.core.registry import ModelEntry, Worker
from dynamo_cli.core.request_plan import DispatchMetrics
from dynamo_cli.errors import DynError
from dynamo_cli.routing.base import RouteDecision
from dynamo_cli.wire import ENCODE, EncodeReply, EncodeRequest, GenerateRequest, ImageInput

logger = logging.getLogger(__name__)


class EncodeRules(Protocol):
    """What the stage reads of the process's `DispatchRules` (core/dispatch.py)."""

    @property
    def disagg(self) -> DisaggConfig: ...
    @property
    def metrics(self) -> DispatchMetrics: ...


async def encode_stage(
    entry: ModelEntry, request: GenerateRequest, decision: RouteDecision | None, rules: EncodeRules
) -> GenerateRequest:
    """`request` with embeddings from the encode pool on the images that go there (as is when none do)."""
    pool = [w for w in entry.encode_workers.values() if w.hung is None]
    if not pool or not request.images or request.kv_transfer is not None:
        return request
    config, metrics, model = rules.disagg, rules.metrics, entry.name
    covered = decision.overlap_blocks * entry.card.kv_cache_block_size if decision is not None else 0
    wanted: dict[int, tuple[Worker, list[int]]] = {}  # encode worker id -> it, and the images it gets
    for i, image in enumerate(request.images):
        if image.offset + image.length <= covered:
            metrics.count_encode(model, "prefix_cached", 1)
        elif len(image.data) < config.encode_min_bytes:
            metrics.count_encode(model, "small", 1)
        else:
            encoder = encoder_for(pool, image.digest, config.encode_max_inflight)
            wanted.setdefault(encoder.instance_id, (encoder, []))[1].append(i)
    if not wanted:
        return request
    images = list(request.images)
    calls = [_encode(request, worker, ids, config.encode_timeout_s) for worker, ids in wanted.values()]
    for (_, ids), reply in zip(wanted.values(), await asyncio.gather(*calls), strict=True):
        if reply is None:
            metrics.count_encode(model, "failed", len(ids))
            continue
        metrics.count_encode(model, "encoder_cache", reply.cached)
        metrics.count_encode(model, "remote", len(ids) - reply.cached)
        for i, embeds in zip(ids, reply.embeds, strict=True):
            images[i] = msgspec.structs.replace(images[i], embeds=embeds)
    return msgspec.structs.replace(request, images=images)


def encoder_for(pool: Sequence[Worker], digest: str, max_inflight: int) -> Worker:
    """The encode worker for an image: the first by rendezvous hash of (digest, worker) with a call slot free,
    else the least loaded."""
    ranked = sorted(pool, key=lambda w: hashlib.blake2b(f"{digest}:{w.instance_id:x}".encode(), digest_size=8).digest())
    free = next((w for w in ranked if w.num_inflight < max_inflight), None)
    return free if free is not None else min(ranked, key=lambda w: w.num_inflight)


async def _encode(request: GenerateRequest, worker: Worker, ids: list[int], timeout_s: float) -> EncodeReply | None:
    """One encode call for the images `ids` of `request`; None when it failed or came late (logged)."""
    images: list[ImageInput] = [request.images[i] for i in ids]
    hold = Hold(worker, request.request_id)  # counted in flight there until the reply
    try:
        async with asyncio.timeout(timeout_s):
            reply = await worker.client.call(ENCODE, EncodeRequest(request_id=request.request_id, images=images))
        if len(reply.embeds) != len(ids):
            raise DynError(f"{len(reply.embeds)} embeddings for {len(ids)} images")
        return reply
    except (DynError, TimeoutError) as exc:
        logger.warning(
            "request %s: encode worker %x failed %d images (%s); the serving worker encodes them",
            request.request_id,
            worker.instance_id,
            len(ids),
            exc or type(exc).__name__,
        )
        return None
    finally:
        hold.release()
