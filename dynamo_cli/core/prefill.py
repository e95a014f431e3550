"""The prefill hop of a disaggregated request: run the prompt on a prefill worker with max_tokens 1 and
bring back its first token and KV handle (core/disagg.py decides whether to run it at all).

The prefill worker is chosen among the live, not busy prefill workers by the model's prefill policy
(`--prefill-router-mode`: KV-aware by overlap and load, round-robin or random) and held for the hop's
length, so its queue is known to the next decision before its published load says so. A prefill
worker that fails (dies, disconnects) is excluded and another one tried; when none is left the caller
prefills locally on the decode worker. Cancelling the hop (the client left) cancels the stream, which
aborts the prefill and frees its KV. A handle that is never used (the client left after the prefill, or
the first token ended the request) is released on the prefill worker (`kv_release`); the worker's own
expiry frees it anyway if that message is lost. A rendezvous (SGLang) holds its prefill worker the same
way, from the choice until its prefill stream, drained beside the decode, ends (`Rendezvous`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_cli.config import BusyThresholds
from dynamo_cli.core.holds import Hold, Pool, Wanted, choose
from dynamo_cli.core.registry import ModelEntry, Worker
from dynamo_cli.core.stalls import NO_DEADLINE, Deadline
from dynamo_cli.errors import TransportError
from dynamo_cli.kv.handles import PULLED_KINDS, UNKNOWN_FIRST_TOKEN, KvHandle, SglangKv
from dynamo_cli.routing.base import RouteDecision
from dynamo_cli.runtime.request_client import ResponseStream
from dynamo_cli.runtime.supervisor import cancel_and_wait
from dynamo_cli.wire import GENERATE, KV_RELEASE, GenerateChunk, GenerateRequest, KvRelease, TokenLogprob

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import RequestTrace

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the prefill worker returned."""

    first_token: int
    """UNKNOWN_FIRST_TOKEN for a rendezvous (SGLang): the decode stream brings every token."""
    finish_reason: str | None
    """Set when the first token already ends the request (EOS, a stop token, max_tokens 1)."""
    handle: KvHandle | None
    cached_tokens: int | None
    worker_id: int
    decision: RouteDecision | None = None
    """The prefill policy's choice of the worker: `explanation` builds why, for a request that asks."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """The first token's logprobs, when the request asked for them."""

    @property
    def explanation(self) -> dict[str, Any]:
        """Why this prefill worker (x-dyn-explain-route); built anew on each read."""
        decision = self.decision
        return {"overlap_blocks": decision.overlap_blocks, **decision.explanation} if decision is not None else {}


class PrefillHop:
    """One request's prefill on the prefill pool: `await run()`, `cancel()` from anywhere."""

    def __init__(
        self,
        entry: ModelEntry,
        request: GenerateRequest,
        busy: BusyThresholds,
        attempts: int,
        trace: RequestTrace | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> None:
        self.entry = entry
        sampling = msgspec.structs.replace(request.sampling, min_tokens=0)
        self.request = msgspec.structs.replace(request, max_tokens=1, sampling=sampling, kv_transfer=None)
        self.span = trace.child("prefill") if trace is not None else None
        """The hop's `prefill` span (tracing on): the prefill worker's stream is its child."""
        if self.span is not None:
            self.request = self.span.carried_by(self.request)
        self.busy = busy
        self.deadline = deadline
        """A prefill worker that sends nothing at all for its stall timeout is hung: the hop tries another."""
        self.attempts = max(1, attempts)
        self.failed: list[int] = []
        """Prefill workers that failed this request (excluded from the next choice)."""
        self._stream: ResponseStream | None = None
        self._is_cancelled = False
        self.rendezvous: Rendezvous | None = None
        """SGLang: the prefill still running beside the decode (see `run`); the caller owns it."""

    async def run(self) -> PrefillResult:
        """The prefill's result; NoWorkers when no prefill worker is left to try, Overloaded when all are busy.

        A prefill worker with a bootstrap server (SGLang) cannot finish before its decode engine meets it:
        the result then comes at once, with the rendezvous handle and no first token, and `rendezvous`
        holds the running prefill, which the caller drains (`Rendezvous.start`) while the decode runs and
        closes (`Rendezvous.aclose`) when the request ends."""
        if self.span is None:
            return await self._attempts()
        try:
            result = await self._attempts()
        except BaseException as exc:
            self.span.end_prefill(None, self.failed, exc)
            raise
        self.span.end_prefill(result.worker_id, self.failed)
        return result

    async def _attempts(self) -> PrefillResult:
        pool = Pool(
            self.entry.name,
            self.entry.prefill_workers,
            self.entry.prefill_policy,
            noun="prefill workers",
            where=f"the prefill pool of model '{self.entry.name}'",
        )
        wanted = Wanted(
            self.request.request_id, self.request.token_ids, lora=self.request.lora, images=self.request.images
        )
        while True:
            hold = choose(pool, wanted, self.busy, self.failed)
            worker = hold.worker
            try:
                if worker.card.bootstrap is not None:
                    return await self._start_rendezvous(hold)
                return await self._run_on(hold)
            except TransportError as exc:
                if not exc.is_migratable or self._is_cancelled or len(self.failed) + 1 >= self.attempts:
                    raise
                self.failed.append(worker.instance_id)
                logger.warning(
                    "request %s: prefill worker %x failed (%s); trying another",
                    self.request.request_id,
                    worker.instance_id,
                    exc,
                )

    def cancel(self) -> None:
        """The client left: abort the prefill (the worker frees its KV)."""
        self._is_cancelled = True
        if self._stream is not None:
            self._stream.cancel()

    async def _run_on(self, hold: Hold) -> PrefillResult:
        worker = hold.worker
        hold.queue_prefill(len(self.request.token_ids))
        try:
            self._stream = stream = await self.deadline.open(
                worker, self.entry.name, GENERATE, hold.stamped(self.request), name=worker.record.endpoint
            )
            chunks: list[GenerateChunk] = []
            while batch := await self.deadline.next_batch(stream, worker, self.entry.name):
                chunks += [GENERATE.decode_reply(raw) for raw in batch]
            return _result(chunks, worker.instance_id, hold.decision)
        finally:
            self._stream = None
            hold.release()

    async def _start_rendezvous(self, hold: Hold) -> PrefillResult:
        worker = hold.worker
        held = Rendezvous(hold, len(self.request.token_ids))
        try:
            host, _, port = (worker.card.bootstrap or "").rpartition(":")
            handle = SglangKv(
                num_tokens=len(self.request.token_ids),
                first_token=UNKNOWN_FIRST_TOKEN,
                bootstrap_host=host,
                bootstrap_port=int(port),
                bootstrap_room=secrets.randbits(63),
            )
            request = hold.stamped(msgspec.structs.replace(self.request, kv_transfer=handle))
            held.stream = await self.deadline.open(
                worker, self.entry.name, GENERATE, request, name=worker.record.endpoint
            )
        except BaseException:
            held.close()
            raise
        self.rendezvous = held
        return PrefillResult(UNKNOWN_FIRST_TOKEN, None, handle, None, worker.instance_id, hold.decision)


class Rendezvous:
    """SGLang: one request's prefill stream, running beside its decode until it ends (no token comes).

    It takes over the prefill hop's hold on the prefill worker (in flight, its prompt tokens queued, counted by
    the prefill policy); `close` (idempotent, also at the end of the drain) releases it and aborts the prefill
    if it still runs (the decode ended first or the client left). The owner calls `start` once and `aclose`
    always."""

    def __init__(self, hold: Hold, num_tokens: int) -> None:
        self.hold = hold
        self.request_id = hold.request_id
        self.stream: ResponseStream | None = None
        self._task: asyncio.Task[None] | None = None
        hold.queue_prefill(num_tokens)

    def start(self) -> None:
        """Drain the prefill stream in a task this object owns."""
        if self._task is None and self.hold.is_held:
            self._task = asyncio.get_running_loop().create_task(self._drain(), name=f"rendezvous-{self.request_id}")

    def close(self) -> None:
        """Abort the prefill if it still runs and free the prefill worker (idempotent, synchronous)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.stream is not None:
            self.stream.cancel()  # a no-op once the stream ended
        self.hold.release()

    async def aclose(self) -> None:
        """`close()`, and wait for the drain task to end."""
        self.close()
        await cancel_and_wait(self._task)

    async def _drain(self) -> None:
        # Its failure is logged only: the decode side reports its own.
        try:
            if self.stream is not None:
                async for _ in _batches(self.stream):
                    pass
        except TransportError as exc:
            logger.warning("request %s: the rendezvous prefill failed: %s", self.request_id, exc)
        finally:
            self.close()


async def _batches(stream: ResponseStream) -> AsyncIterator[list[msgspec.Raw]]:
    while batch := await stream.next_batch():
        yield batch


def _result(chunks: list[GenerateChunk], worker_id: int, decision: RouteDecision | None) -> PrefillResult:
    tokens = [t for c in chunks for t in c.token_ids]
    if not tokens:
        raise TransportError(f"prefill worker {worker_id:x} returned no token")
    handle = next((c.kv_transfer for c in chunks if c.kv_transfer is not None), None)
    cached = next((c.num_cached_tokens for c in chunks if c.num_cached_tokens is not None), None)
    finish = chunks[-1].finish_reason
    # A prefill worker ends its one-token stream with "length" when it exported KV: the request goes on.
    is_done = finish is not None and (finish != "length" or handle is None)
    logprobs = [lp for c in chunks for lp in c.logprobs or ()][:1]
    return PrefillResult(tokens[0], finish if is_done else None, handle, cached, worker_id, decision, logprobs)


async def release(worker: Worker, handle: KvHandle) -> None:
    """Free an unused handle's payload on its prefill worker now (best effort; its expiry is the backstop)."""
    if not isinstance(handle, PULLED_KINDS) or handle.blob is None:
        return
    with contextlib.suppress(TransportError, TimeoutError):
        async with asyncio.timeout(RELEASE_TIMEOUT_S):
            await worker.client.call(KV_RELEASE, KvRelease(transfer_id=handle.blob.transfer_id))
