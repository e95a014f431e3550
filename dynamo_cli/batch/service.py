"""The Batch API on one frontend: its store, its routes, and (on the frontend that runs batches) its runner
and the batch series of /metrics.

Every frontend of a deployment serves `/v1/files` and `/v1/batches` over the same database; the runner's
line leases (batch/store.py) let any number of them run lines without running one twice. `dyn serve
--frontends N` runs it on its first frontend only; frontends on several hosts sharing a PostgreSQL database
each run one, and split `--batch-max-inflight` between them (batch/runner.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.routing import Route

from dynamo_cli.batch.api import BatchApi
from dynamo_cli.batch.metrics import BatchMetrics
from dynamo_cli.batch.runner import BatchRunner
from dynamo_cli.batch.sql import without_password
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
    where = settings.where(config.namespace)
    try:
        store = BatchStore(where)
    except Exception as exc:  # noqa: BLE001  (sqlite3's, psycopg's, the filesystem's: each named in the line)
        shown = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--batch-db '{without_password(where)}' cannot be opened ({shown}); pass a writable path, a reachable"
            " postgresql:// URL, or --batch-db off"
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
    logger.info("batch API on %s (%s)", store.name, "runs batches" if runs else "serves them")
    if not runs:
        return api.routes(), None
    # the series on the running frontend only: the others of a `--frontends N` group would add the same
    # database's figures up N times in the group's /metrics
    metrics = BatchMetrics(store, lambda: runner.inflight)
    frontend.metrics.registry.register(metrics)

    async def loop() -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(runner.run())
            tasks.create_task(metrics.refresh())

    return api.routes(), loop


def _json(reply: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(reply)
    except ValueError:
        payload = None
    return payload if isinstance(payload, dict) else {"error": {"message": reply.decode(errors="replace")[:500]}}
