"""LoRA adapters loaded and unloaded at run time on a model's workers: the fan-out both the frontend
(`POST /v1/load_lora_adapter`) and a `dyn router` (its `lora` endpoint, for frontends behind routers) run.

A load goes to the model's adapter-taking workers that are not hung (every one, or the `replicas` least loaded of
each pool) over the request plane, each held while its command runs (core/holds.py); each worker loads the file,
which checks it, then publishes a card listing the adapter. The call returns once the caller's registry sees every
one of those cards, so the next request for the adapter finds it. A file one worker refuses is the client's error,
and the workers that had loaded it unload it again:
an adapter is served by the workers asked, or by none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from dynamo_cli.core.holds import Hold
from dynamo_cli.core.registry import EntryT, ModelEntry, Registry, Worker
from dynamo_cli.errors import ModelNotFound, NoWorkers, RemoteError, RequestError
from dynamo_cli.wire import LORA, LoraCommand, LoraReply

LORA_CALL_S = 120.0
"""How long one worker may take to load an adapter (a large file, a busy engine)."""
SEEN_S = 10.0
"""How long a load or unload waits for the caller's registry to see the workers' new cards."""


async def load(registry: Registry[Any], entry: ModelEntry, command: LoraCommand, replicas: int) -> list[Worker]:
    """Load `command`'s adapter on `entry`'s workers (all, or `replicas` of each pool); the workers that took it.
    A refusal (a bad file) is RequestError(param="lora_path") and no worker keeps the adapter."""
    targets = _targets(entry, replicas)
    results = await _on_each(targets, command)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        loaded = [w for w, r in zip(targets, results, strict=True) if not isinstance(r, BaseException)]
        await _on_each(loaded, LoraCommand(action="unload", name=command.name))
        raise client_error(failed, "lora_path")
    await seen(registry, lambda: all(w.adapters.serves(command.name) for w in targets))
    return targets


async def unload(registry: Registry[EntryT], name: str) -> EntryT:
    """Unload adapter `name` from every worker serving it; the entry of its base. ModelNotFound if none does."""
    entry = registry.adapters.get(name)
    if entry is None:
        raise ModelNotFound(name, sorted(registry.adapters))
    targets = [w for w in (*entry.workers.values(), *entry.prefill_workers.values()) if w.adapters.serves(name)]
    results = await _on_each(targets, LoraCommand(action="unload", name=name))
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None and not isinstance(failed, RemoteError):  # a worker that had it no more: fine
        raise failed
    await seen(registry, lambda: name not in registry.adapters)
    return entry


async def _on_each(workers: list[Worker], command: LoraCommand) -> list[LoraReply | BaseException]:
    """`command` on each of `workers` at once, each held meanwhile: each one's reply or error."""
    holds = [Hold(w, f"lora-{command.action}-{command.name}") for w in workers]
    try:
        return await asyncio.gather(*(call(h, command) for h in holds), return_exceptions=True)
    finally:
        for hold in holds:
            hold.release()


async def call(hold: Hold, command: LoraCommand) -> LoraReply:
    """One `lora` command on one held worker (or `dyn router`)."""
    async with asyncio.timeout(LORA_CALL_S):
        return await hold.worker.client.call(LORA, command)


async def seen(registry: Registry[Any], done: Callable[[], bool]) -> None:
    """Wait up to SEEN_S until `done()` holds in `registry` (the workers' new cards arrived)."""
    deadline = time.monotonic() + SEEN_S
    while not done():
        registry.changed.clear()
        left = deadline - time.monotonic()
        if left <= 0:
            return  # confirmed by the workers; this view catches up on its own
        try:
            async with asyncio.timeout(left):  # not wait_for: on 3.11 it can swallow a cancellation
                await registry.changed.wait()
        except TimeoutError:
            return


def client_error(exc: BaseException, param: str) -> BaseException:
    """A worker's refusal (a bad file, a bad name) as the client's 4xx; anything else as it is."""
    if isinstance(exc, RemoteError) and exc.is_client_error:
        return exc.as_request_error(param)
    return exc


def _targets(entry: ModelEntry, replicas: int) -> list[Worker]:
    """Each pool's adapter-taking workers that are not hung, or its `replicas` least loaded of them. A hung
    worker would hold the command until it timed out; it serves the adapters of its card when it is back."""
    targets: list[Worker] = []
    for pool in (entry.workers, entry.prefill_workers):
        takers = sorted((w for w in pool.values() if w.card.max_loras and w.hung is None), key=_load_of)
        targets += takers[:replicas] if replicas else takers
    if not any(w.instance_id in entry.workers for w in targets):
        if any(w.card.max_loras for w in entry.workers.values()):
            raise NoWorkers(f"an adapter-taking worker of '{entry.name}' that answers (every one is hung)")
        raise RequestError(
            f"the workers of '{entry.name}' ({entry.card.engine} engine) serve no LoRA adapters", param="model"
        )
    return targets


def _load_of(worker: Worker) -> int:
    load = worker.load
    return worker.num_inflight + (load.num_running + load.num_waiting if load is not None else 0)
