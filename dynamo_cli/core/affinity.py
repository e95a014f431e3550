"""Session affinity in a choice: the worker a session is bound to (routing/sessions.py's table), kept or left as
the mode says, and the binding updated to where the call went.

hard: the bound worker is the call's pin (a busy one is waited for, as a pinned worker is). soft: the bound
worker is pinned unless it is busy (then the policy chooses among the others) or the KV policy finds more of the
prompt cached elsewhere than there (its cache lost the context: the session moves). A session with no binding yet
starts where its parent session's last call went, if it names one. Every choice of a session binds it to the
target chosen, here and, through the replica sync, on the other routers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_cli.config import SessionConfig
from dynamo_cli.routing.base import RouteDecision, RouteRequest, RoutingPolicy
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.sessions import Session, SessionTable
from dynamo_cli.routing.target import Target


@dataclass(frozen=True, slots=True)
class Affinity:
    """One call of a session in one choice."""

    session: Session
    bound: Target | None
    """Where its last call (or its parent's) went, if that binding is alive."""
    mode: str

    def pin(self) -> int | None:
        """hard: the bound worker, whatever its load (the choice then waits for it)."""
        if self.mode == "hard" and self.bound is not None:
            return self.bound.worker
        return None

    def steer(
        self, policy: RoutingPolicy | None, route: RouteRequest, candidates: Sequence[int], targets: Sequence[Target]
    ) -> tuple[RouteRequest, str]:
        """The route the policy gets (pinned to the bound worker, or free) and why."""
        bound = self.bound
        if bound is None:
            return route, "new session" if self.session.parent is None else "new session, no parent binding"
        if route.pinned_worker is not None:
            return route, "bound (hard)" if self.mode == "hard" else "pinned by the caller"
        if bound.worker not in candidates:
            return route, "moved: the bound worker is busy"
        pinned = dataclasses.replace(route, pinned_worker=bound.worker)
        if isinstance(policy, KvRoutingPolicy):
            best = policy.peek(route, targets)
            if best.worker_id != bound.worker:  # only then can another worker hold more of the prompt
                here = policy.peek(pinned, targets).overlap_blocks
                if best.overlap_blocks > here:
                    return route, f"moved: {best.overlap_blocks} blocks cached elsewhere, {here} on the bound worker"
        return pinned, "kept"

    def explained(self, decision: RouteDecision, why: str) -> RouteDecision:
        """`decision` with the session in its explanation (`x-dyn-route`)."""
        inner = decision.explain
        if inner is None:
            return decision
        session = {
            "id": self.session.id,
            "parent": self.session.parent,
            "mode": self.mode,
            "bound_worker_id": f"{self.bound.worker:x}" if self.bound is not None else None,
            "outcome": why,
        }

        def explain() -> dict[str, Any]:
            return {**inner(), "session": session}

        return dataclasses.replace(decision, explain=explain)


def affinity_of(
    table: SessionTable | None, rules: SessionConfig, session: Session | None, workers: Any
) -> Affinity | None:
    """The session's affinity in a choice among `workers` (None: no session, or affinity off)."""
    if session is None or table is None or not rules.ttl_s:
        return None
    bound = table.get(session.id, rules.ttl_s, workers)
    if bound is None and session.parent is not None:
        bound = table.get(session.parent, rules.ttl_s, workers)
    return Affinity(session, bound, rules.mode)
