"""The prefill stage of one request, between choosing its decode worker and opening it: prefill remotely or
on the decode worker (core/disagg.py decides), and if remotely run the prefill hop (core/prefill.py).

The stage owns what a remote prefill leaves behind until the request ends: the prefilled KV's handle until a
decode worker pulls it (a decode worker that fails first hands it on to the next; still held at the end, it is
released on the prefill worker), SGLang's rendezvous drained beside the decode, and why the prompt went where
it did (`explanation`, for x-dyn-explain-route and x-dyn-prefill-instance-id).

The hop is not tied to the client (Dynamo's rule: a prefill cut off mid-transfer leaks KV); a client gone by
then has the handle released in `aclose()`. No prefill worker left, or all busy: the decode worker prefills
(503 with `--enforce-disagg`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, Protocol

from dynamo_cli.config import BusyThresholds, DisaggConfig
from dynamo_cli.core import prefill
from dynamo_cli.core.disagg import falls_back, prefill_choice
from dynamo_cli.core.registry import ModelEntry, Worker
from dynamo_cli.core.request_plan import DispatchMetrics, RequestPlan
from dynamo_cli.core.stalls import Deadline
from dynamo_cli.errors import NoWorkers, Overloaded, RemoteError, TransportError
from dynamo_cli.kv.handles import UNKNOWN_FIRST_TOKEN, KvHandle
from dynamo_cli.routing.base import RouteDecision
from dynamo_cli.wire import GenerateRequest

logger = logging.getLogger(__name__)


class StageRules(Protocol):
    """What the stage reads of the process's `DispatchRules` (core/dispatch.py)."""

    @property
    def migration_limit(self) -> int: ...
    @property
    def busy(self) -> BusyThresholds: ...
    @property
    def disagg(self) -> DisaggConfig: ...
    @property
    def deadline(self) -> Deadline: ...
    @property
    def metrics(self) -> DispatchMetrics: ...


class PrefillStage:
    """One request's prefill stage: `await run(...)` once, `decoded()` when a decode worker has the KV,
    `close()` or `aclose()` at the end."""

    __slots__ = ("entry", "plan", "rules", "explanation", "handle", "failed", "_prefill_worker", "_rendezvous")

    def __init__(self, entry: ModelEntry, plan: RequestPlan, rules: StageRules) -> None:
        self.entry = entry
        self.plan = plan
        self.rules = rules
        self.explanation: dict[str, Any] | None = None
        """Where the prompt was prefilled and why; None where the model has no prefill stage."""
        self.handle: KvHandle | None = None
        """The prefill's KV handle until a decode worker answers; the decode request carries it."""
        self.failed: list[int] = []
        """Prefill workers that failed this request (its decode worker falls back to prefilling)."""
        self._prefill_worker: Worker | None = None
        self._rendezvous: prefill.Rendezvous | None = None
        """NOTE: SGLang's prefill, drained beside the decode; owned here, closed in `close`/`aclose`."""

    async def run(
        self, decode: Worker, decision: RouteDecision | None, excluded: Collection[int], request: GenerateRequest
    ) -> prefill.PrefillResult | None:
        """Prefill `request` for `decode` if the rule sends it to the prefill pool: the prefill's result (its
        first token is the stream's), or None where the decode worker prefills."""
        entry, config = self.entry, self.rules.disagg
        pool = [w for w in entry.prefill_workers.values() if w.instance_id not in excluded]
        overlap = decision.overlap_blocks if decision is not None else 0
        chosen = prefill_choice(config, entry.name, decode, pool, len(self.plan.prompt_ids), overlap)
        if chosen is None:
            return None
        choice, inputs = chosen
        self.explanation = choice.explain(inputs, config.policy)
        if not choice.is_prefill_remote:
            self.rules.metrics.count_disagg(entry.name, choice.outcome)
            return None
        return await self._run_remote(choice.outcome, request)

    def decoded(self) -> None:
        """A decode worker sent a token: it has pulled the KV, so there is nothing left to release."""
        self.handle = None

    def close(self) -> None:
        """Abort a rendezvous prefill still running (idempotent, synchronous)."""
        if self._rendezvous is not None:
            self._rendezvous.close()

    async def aclose(self) -> None:
        """`close()`, and free on its prefill worker a prefilled KV no decode worker took (the client left)."""
        if self._rendezvous is not None:
            await self._rendezvous.aclose()
        if self.handle is not None and self._prefill_worker is not None:
            handle, self.handle = self.handle, None
            await prefill.release(self._prefill_worker, handle)

    async def _run_remote(self, outcome: str, request: GenerateRequest) -> prefill.PrefillResult | None:
        rules = self.rules
        hop = prefill.PrefillHop(
            self.entry,
            request,
            rules.busy,
            attempts=rules.migration_limit + 1,
            trace=self.plan.trace,
            deadline=rules.deadline,
        )
        try:
            result = await hop.run()
        except (NoWorkers, Overloaded, TransportError) as exc:
            if isinstance(exc, RemoteError) and exc.is_client_error:
                raise exc.as_request_error() from None
            if not falls_back(rules.disagg, exc):
                raise
            logger.warning(
                "request %s: remote prefill failed (%s); prefilling on the decode worker", self.plan.request_id, exc
            )
            self.failed = hop.failed
            outcome = "local_fallback"
            return None
        else:
            if hop.rendezvous is not None:  # SGLang: the prefill runs on while the decode meets it
                self._rendezvous = hop.rendezvous
                self._rendezvous.start()
            self._took(result)
            return None if result.first_token == UNKNOWN_FIRST_TOKEN else result
        finally:
            hop.cancel()  # a no-op once it ended; aborts the prefill if this request was cancelled meanwhile
            rules.metrics.count_disagg(self.entry.name, outcome)
            if self.explanation is not None:
                self.explanation["outcome"] = outcome

    def _took(self, result: prefill.PrefillResult) -> None:
        """The decode worker gets the prefill's handle and no prefill."""
        assert self.explanation is not None
        self._prefill_worker = self.entry.prefill_workers.get(result.worker_id)
        self.rules.metrics.count_served(self.entry.name, result.worker_id, "prefill")
        self.handle = result.handle
        self.explanation["prefill_worker_id"] = result.worker_id
        if self.plan.is_explained:  # built for a request that shows it only (x-dyn-explain-route)
            self.explanation["prefill_route"] = result.explanation
