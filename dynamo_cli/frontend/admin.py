"""The admin endpoints: `POST /v1/admin/clear_kv_blocks` empties the prefix caches of a model's workers (or of every
model's, or of one worker), as an operator does after a model or adapter update (Dynamo's `clear_kv_blocks`,
vLLM's `reset_prefix_cache`).

Only an API key whose key-file line says `role=admin` is let in: with API keys but no admin key, and with no keys
at all, the endpoints answer 403; they are never open by default. Each worker evicts the blocks no running request
holds and publishes the evictions as `BlockRemoved` events, so every router's index (the frontends', `dyn
router`s') drops them as it drops any eviction; the reply says what each worker evicted, or why it could not.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from dynamo_cli.config import FrontendConfig
from dynamo_cli.core.holds import Hold
from dynamo_cli.core.registry import Worker
from dynamo_cli.errors import DynError, RequestError
from dynamo_cli.frontend.loras import request_body
from dynamo_cli.frontend.replies import error_response
from dynamo_cli.frontend.served_models import FrontendRegistry
from dynamo_cli.frontend.tenants import KEY_INDEX_SCOPE
from dynamo_cli.wire import KV_CLEAR, KvClear, KvCleared

logger = logging.getLogger(__name__)

CLEAR_CALL_S = 30.0
"""How long one worker may take to clear its cache."""


class Forbidden(RequestError):
    """The key may not do this (403)."""

    status = 403
    error_type = "permission_error"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, code=code)


class ClearKvBlocks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """One model's workers (its LoRA adapters' too: they share the base's workers); default: every model's."""
    worker_id: str | None = None
    """One worker, by its instance id in hex (as `/health` and `x-worker-instance-id` name it)."""


_CLEAR = msgspec.json.Decoder(ClearKvBlocks)


class Admin:
    """The admin routes over the frontend's registry."""

    def __init__(self, config: FrontendConfig, registry: FrontendRegistry) -> None:
        self._keys = config.auth.api_keys
        self._admins = frozenset(config.auth.admin_keys)
        self._behind_routers = config.router == "remote"
        self._registry = registry

    async def clear_kv_blocks(self, request: Request) -> Response:
        try:
            self._check_admin(request.scope)
            body: ClearKvBlocks = await request_body(request, _CLEAR)
            return JSONResponse(await self._clear(body))
        except DynError as exc:
            return error_response(exc)

    def _check_admin(self, scope: Scope) -> None:
        """The request came with an admin key (the gate, which ran first, put its key's index in the scope)."""
        if not self._admins:
            raise Forbidden(
                "the admin endpoints are off: give a key `role=admin` on its --api-key-file line", "forbidden"
            )
        index = scope.get(KEY_INDEX_SCOPE)
        if index is None or index >= len(self._keys) or self._keys[index] not in self._admins:
            raise Forbidden("this API key is not an admin key (`role=admin` on its --api-key-file line)", "forbidden")

    async def _clear(self, body: ClearKvBlocks) -> dict[str, Any]:
        if self._behind_routers:
            raise RequestError(
                "with --router remote the workers are the dyn routers' backends: clear them from a frontend that "
                "routes to them itself",
                param="model",
            )
        targets = self._targets(body)
        request_id = "clear-kv-" + uuid.uuid4().hex[:12]
        logger.warning("clearing the prefix caches of %d workers (%s)", len(targets), request_id)
        replies = await asyncio.gather(*(_clear_on(w, request_id) for _, w in targets), return_exceptions=True)
        rows: list[dict[str, Any]] = []
        for (model, worker), reply in zip(targets, replies, strict=True):
            row: dict[str, Any] = {"model": model, "worker_id": f"{worker.instance_id:x}"}
            if isinstance(reply, KvCleared):
                row["blocks_cleared"] = reply.blocks
            elif isinstance(reply, Exception):
                row["error"] = str(reply)
            else:
                raise reply  # a cancellation
            rows.append(row)
        total = sum(row.get("blocks_cleared", 0) for row in rows)
        return {"object": "clear_kv_blocks", "request_id": request_id, "blocks_cleared": total, "workers": rows}

    def _targets(self, body: ClearKvBlocks) -> list[tuple[str, Worker]]:
        """(model, worker) for each worker asked: a model's (or every model's), or the one named."""
        entries = [self._registry.resolve(body.model)[0]] if body.model is not None else self._registry.servable()
        targets = [
            (entry.name, worker)
            for entry in entries
            for pool in (entry.workers, entry.prefill_workers)
            for worker in pool.values()
        ]
        if body.worker_id is not None:
            targets = [(m, w) for m, w in targets if f"{w.instance_id:x}" == body.worker_id.lower()]
            if not targets:
                raise RequestError(f"no worker '{body.worker_id[:32]}' serves here", param="worker_id")
        return targets


async def _clear_on(worker: Worker, request_id: str) -> KvCleared:
    hold = Hold(worker, request_id)
    try:
        async with asyncio.timeout(CLEAR_CALL_S):
            reply: KvCleared = await worker.client.call(KV_CLEAR, KvClear(request_id=request_id))
            return reply
    finally:
        hold.release()
