"""One request to one of a model's workers on a side endpoint (`embed`, `score`), with one reply, for the frontend
and `dyn router` (which forwards a `--router remote` frontend's to its backends): the worker held
as a generation's is (core/holds.py), the fewest requests in flight among the live, not busy ones (these requests
leave no KV behind to route to); with every one busy the request waits in the model's queue; a worker that fails
or sends nothing for the stall timeout (it is hung) is left for another, up to the migration limit.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from dynamo_cli.core.dispatch import DispatchRules
from dynamo_cli.core.holds import Hold, Pool, Wanted, choose_or_wait
from dynamo_cli.core.queue import QueuedRequest
from dynamo_cli.core.registry import ModelEntry
from dynamo_cli.errors import RemoteError, TransportError
from dynamo_cli.wire import EndpointSpec

Rep = TypeVar("Rep")

CALL_TIMEOUT_S = 120.0
"""Longest wait for a worker's reply, its wait for a worker included."""


async def call_worker(
    entry: ModelEntry, spec: EndpointSpec[Any, Rep], request: Any, request_id: str, rules: DispatchRules
) -> Rep:
    """`spec`'s one reply to `request` from a worker of `entry`'s model, held under the process's `rules`."""
    pool = Pool(entry.name, entry.workers, queue=entry.queue)
    wanted, failed = Wanted(request_id), set[int]()
    async with asyncio.timeout(CALL_TIMEOUT_S):
        while True:
            hold = await choose_or_wait(pool, wanted, rules.busy, failed, QueuedRequest(), rules.queue)
            try:
                return await _call_on(hold, spec, request, rules, entry.name)
            except RemoteError as exc:
                if exc.is_client_error:
                    raise exc.as_request_error() from None
                raise
            except TransportError as exc:
                if not exc.is_migratable or len(failed) >= rules.migration_limit:
                    raise
                failed.add(hold.worker.instance_id)
            finally:
                hold.release()


async def _call_on(hold: Hold, spec: EndpointSpec[Any, Rep], request: Any, rules: DispatchRules, model: str) -> Rep:
    worker, stream = hold.worker, None
    try:
        stream = await rules.deadline.open(worker, model, spec, request)
        batch = await rules.deadline.next_batch(stream, worker, model)
        if not batch:
            raise RemoteError(f"worker {worker.instance_id:x} returned no {spec.name} reply")
        return spec.decode_reply(batch[0])
    finally:
        if stream is not None:
            stream.cancel()
