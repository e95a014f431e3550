"""The Batch API on one frontend: its store, its routes, and (on the frontend that runs batches) its runner.

Every frontend of a deployment serves `/v1/files` and `/v1/batches` over the same database; the runner's
line leases (batch/store.py) let any number of them run lines without running one twice, but `dyn serve
--frontends N` runs it on its first frontend only, so `--batch-max-inflight` holds for the deployment.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.routing import Route

from dynamo_cli.batch.api import BatchApi
from dynamo_cli.batch.metrics import BatchMetrics
from dynamo_cli.batch.runner import BatchRunner
from dynamo_cli.batch.store import BatchStore, Result
from dynamo_cli.config import FrontendConfig
from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend import internal
from dynamo_cli.frontend.app import Frontend

logger = logging.getLogger(__name__)

PER_WORKER = 4
"""Batch lines per worker when neither `--batch-max-inflight` nor `--max-inflight-per-worker` says."""


def batch_service(
    config: FrontendConfig, frontend: Frontend, *, runs: bool
) -> tuple[list[Route], Callable[[], Coroutine[Any, Any, None]] | None]:
    """The routes to add to `frontend`, and the runner's loop when this frontend `runs` batches."""
    settings = config.batch
    path = settings.path(config.namespace)
    try:
        store = BatchStore(path)
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(
            f"--batch-db '{path}' cannot be opened ({exc}); pass a writable path, or --batch-db off"
        ) from None

    async def call(endpoint: str, raw: bytes, seconds_left: float) -> Result:
        status, reply = await internal.call(frontend.serve_internal, endpoint, raw, seconds_left)
        payload = _json(reply)
        usage = payload.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        return Result(status, payload, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))

    def budget() -> int:
        if settings.max_inflight:
            return settings.max_inflight
        per_worker = config.busy.max_inflight // 2 or PER_WORKER
        return max(1, per_worker * frontend.registry.num_workers())

    runner = BatchRunner(store, call, budget)
    api = BatchApi(store, runner, settings.max_file_bytes, settings.max_lines)
    frontend.metrics.registry.register(BatchMetrics(store, (lambda: runner.inflight) if runs else None))
    logger.info("batch API on %s (%s)", store.path, "runs batches" if runs else "serves them")
    return api.routes(), runner.run if runs else None


def _json(reply: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(reply)
    except ValueError:
        payload = None
    return payload if isinstance(payload, dict) else {"error": {"message": reply.decode(errors="replace")[:500]}}
