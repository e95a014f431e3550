"""Disaggregation's two decisions and its prefill hop, shared by the frontend and `dyn router`.

Whoever routes the request orchestrates it (Dynamo's wiring): it chooses the decode worker first, then
`decide`s whether the prompt is prefilled there (local) or on a prefill worker (remote, with max_tokens 1;
the first token streams to the client at once). The rule is conditional disaggregation after Dynamo's DEP
#11514: `isl`, `load`, `isl-or-load`, `always`, and the default `adaptive`: remote unless the prefill pool's
queued tokens exceed the local cost, the decode worker's queue plus the prompt once for itself and
STALL_WEIGHT times for each stream it would stall. A circuit breaker on the decode worker's KV usage applies
to every policy.

Design: docs/design/conditional-disagg.md (the inputs, the rule, why adaptive, the weight's measurement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamo_cli.config import DisaggConfig
from dynamo_cli.core.registry import Worker
from dynamo_cli.engine import Role
from dynamo_cli.errors import NoWorkers, Overloaded, RemoteError, TransportError

STALL_WEIGHT = 8
"""`adaptive`: what one stream stalled by a local prefill costs, in prompts' worth of queueing. A stalled
stream misses a tight ITL target at once while a queued prompt only spends some of a looser TTFT budget;
in the mocker's model (benchmarks/disagg_model.py, mixed traffic past saturation) a weight of 1 let long
prompts onto busy decode workers and broke ITL for every stream there (goodput 10.6 vs 19.6 req/s at
40 req/s), while 4 and 8 did not, 8 holding best at 48 req/s."""

OUTCOMES = (
    "remote",
    "local_short",
    "local_prefill_busy",
    "local_cheaper",
    "local_no_prefill_worker",
    "remote_decode_busy",
    "local_fallback",
)
"""Every outcome `decide` (and the prefill hop's fallback) can report: the `/metrics` label values."""


@dataclass(frozen=True, slots=True)
class DisaggInputs:
    """What the local-or-remote decision looks at, for one request and its chosen decode worker."""

    effective_isl: int
    """Prompt tokens the decode worker would compute (prompt minus its cached prefix)."""
    decode_pending_tokens: int
    """Prefill tokens already queued on the decode worker."""
    decode_running: int
    """Streams the decode worker is running (each stalls while it prefills)."""
    decode_kv_usage: float
    """The decode worker's active / total KV blocks (0 when unknown)."""
    prefill_pending_tokens: int | None
    """Prefill tokens queued on the least-queued prefill worker; None = no live prefill worker."""
    prefill_queue: int
    """Prefills queued on that worker (requests)."""


@dataclass(frozen=True, slots=True)
class DisaggChoice:
    """Local or remote, and why (one of OUTCOMES)."""

    is_prefill_remote: bool
    outcome: str

    def explain(self, inputs: DisaggInputs, policy: str) -> dict[str, Any]:
        return {
            "prefill": "remote" if self.is_prefill_remote else "local",
            "outcome": self.outcome,
            "policy": policy,
            "effective_isl": inputs.effective_isl,
            "decode_pending_tokens": inputs.decode_pending_tokens,
            "decode_running": inputs.decode_running,
            "decode_kv_usage": round(inputs.decode_kv_usage, 3),
            "prefill_pending_tokens": inputs.prefill_pending_tokens,
            "prefill_queue": inputs.prefill_queue,
        }


def decide(config: DisaggConfig, inputs: DisaggInputs) -> DisaggChoice:
    """Prefill this request on a prefill worker (remote) or on its decode worker (local)?"""
    if inputs.prefill_pending_tokens is None:
        return DisaggChoice(False, "local_no_prefill_worker")
    if config.policy == "always":
        return DisaggChoice(True, "remote")
    is_long = inputs.effective_isl > config.max_local_prefill_length
    if is_long and inputs.decode_kv_usage >= config.decode_busy_threshold:
        return DisaggChoice(True, "remote_decode_busy")  # the circuit breaker, whatever the policy
    if config.policy in ("isl", "isl-or-load", "adaptive") and not is_long:
        return DisaggChoice(False, "local_short")
    if config.policy in ("load", "isl-or-load") and inputs.prefill_queue >= config.max_prefill_queue:
        return DisaggChoice(False, "local_prefill_busy")
    if config.policy == "adaptive":
        local_cost = inputs.decode_pending_tokens + inputs.effective_isl * (1 + STALL_WEIGHT * inputs.decode_running)
        if inputs.prefill_pending_tokens > local_cost:
            return DisaggChoice(False, "local_cheaper")
    return DisaggChoice(True, "remote")


def prefill_choice(
    config: DisaggConfig, model: str, decode: Worker, pool: list[Worker], prompt_tokens: int, overlap_blocks: int
) -> tuple[DisaggChoice, DisaggInputs] | None:
    """Where a request routed to `decode` has its prompt prefilled (`pool`: the live prefill workers), or None
    for an aggregated model, which has no prefill stage. `--enforce-disagg` makes every choice remote, and
    raises NoWorkers naming the pool when it is empty."""
    if not pool and config.enforce:
        raise NoWorkers(f"the prefill pool of model '{model}' (--enforce-disagg)")
    if not pool and decode.card.role != Role.DECODE.value:
        return None  # aggregated; a decode worker whose model lost its pool is decided (local_no_prefill_worker)
    inputs = inputs_for(decode, pool, prompt_tokens, overlap_blocks)
    choice = decide(config, inputs)
    if config.enforce and not choice.is_prefill_remote:
        choice = DisaggChoice(True, "remote")
    return choice, inputs


def falls_back(config: DisaggConfig, exc: Exception) -> bool:
    """Whether a failed remote prefill is prefilled on the decode worker instead: yes, unless
    `--enforce-disagg`, or unless the prefill worker refused the request itself (a 4xx: the client's error)."""
    if not isinstance(exc, NoWorkers | Overloaded | TransportError) or config.enforce:
        return False
    return not (isinstance(exc, RemoteError) and exc.is_client_error)


def inputs_for(decode: Worker, prefill_pool: list[Worker], prompt_tokens: int, overlap_blocks: int) -> DisaggInputs:
    """The decision's inputs from this router's view of the workers: their published load plus what this
    router has queued on them since (`Worker.pending_prefill_tokens`, which the load lags behind)."""
    load = decode.load
    usage = load.active_blocks / load.total_blocks if load is not None and load.total_blocks else 0.0
    effective = max(0, prompt_tokens - overlap_blocks * decode.card.kv_cache_block_size)
    best = min(prefill_pool, key=queued_tokens, default=None)
    return DisaggInputs(
        effective_isl=effective,
        decode_pending_tokens=queued_tokens(decode),
        decode_running=max(decode.num_inflight - 1, load.num_running if load is not None else 0),
        decode_kv_usage=usage,
        prefill_pending_tokens=queued_tokens(best) if best is not None else None,
        prefill_queue=queued_requests(best) if best is not None else 0,
    )


def queued_tokens(worker: Worker) -> int:
    """Prefill tokens waiting on `worker`: its published queue or this router's own, whichever is larger."""
    published = worker.load.active_prefill_tokens if worker.load is not None else 0
    return max(published, worker.pending_prefill_tokens)


def queued_requests(worker: Worker) -> int:
    """Prefills waiting or running on `worker`, as published or as this router counts them."""
    load = worker.load
    published = load.num_running + load.num_waiting if load is not None else 0
    return max(published, worker.num_inflight)
