"""The local-or-remote rule of conditional disaggregation (core/disagg.py), policy by policy."""

from __future__ import annotations

import pytest

from dynamo_cli.config import DisaggConfig
from dynamo_cli.core.disagg import OUTCOMES, STALL_WEIGHT, DisaggInputs, decide
from dynamo_cli.errors import ConfigError


def inputs(**changes: object) -> DisaggInputs:
    base: dict[str, object] = dict(
        effective_isl=3000,
        decode_pending_tokens=0,
        decode_running=4,
        decode_kv_usage=0.2,
        prefill_pending_tokens=0,
        prefill_queue=0,
    )
    base.update(changes)
    return DisaggInputs(**base)  # type: ignore[arg-type]


def outcome(policy: str, **changes: object) -> str:
    choice = decide(DisaggConfig(policy=policy, max_local_prefill_length=512, max_prefill_queue=2), inputs(**changes))
    assert choice.outcome in OUTCOMES
    assert choice.is_prefill_remote == choice.outcome.startswith("remote")
    return choice.outcome


def test_no_prefill_worker_means_local_whatever_the_policy() -> None:
    for policy in ("adaptive", "always", "isl", "load", "isl-or-load"):
        assert outcome(policy, prefill_pending_tokens=None) == "local_no_prefill_worker"


def test_always_sends_even_short_prompts_to_the_prefill_pool() -> None:
    assert outcome("always", effective_isl=10, prefill_queue=99) == "remote"


@pytest.mark.parametrize("policy", ["isl", "isl-or-load", "adaptive"])
def test_isl_bounded_policies_prefill_short_or_cached_prompts_locally(policy: str) -> None:
    assert outcome(policy, effective_isl=512) == "local_short"
    assert outcome(policy, effective_isl=513) == "remote"


def test_load_policies_fall_back_to_local_when_the_prefill_pool_is_saturated() -> None:
    assert outcome("load", effective_isl=10, prefill_queue=1) == "remote"  # load alone ignores the length
    assert outcome("load", prefill_queue=2) == "local_prefill_busy"
    assert outcome("isl-or-load", prefill_queue=2) == "local_prefill_busy"
    assert outcome("isl", prefill_queue=50) == "remote"  # isl alone ignores the queue


def test_the_circuit_breaker_keeps_long_prompts_off_a_full_decode_worker() -> None:
    assert outcome("isl-or-load", prefill_queue=9, decode_kv_usage=0.95) == "remote_decode_busy"
    assert outcome("adaptive", prefill_pending_tokens=10**6, decode_kv_usage=0.9) == "remote_decode_busy"
    assert outcome("adaptive", effective_isl=100, decode_kv_usage=0.99) == "local_short"  # short: harmless


def test_adaptive_weighs_the_prefill_queue_against_what_local_prefill_costs_the_decode_worker() -> None:
    # Local cost = decode queue + prompt x (1 + STALL_WEIGHT x streams stalled) = 3000 x (1 + 8 x 4) = 99,000.
    assert STALL_WEIGHT == 8
    assert outcome("adaptive", prefill_pending_tokens=99_000) == "remote"
    assert outcome("adaptive", prefill_pending_tokens=99_001) == "local_cheaper"
    # An idle decode worker is cheap to use; one stream running already pushes the prompt to the prefill pool.
    assert outcome("adaptive", prefill_pending_tokens=6_000, decode_running=0) == "local_cheaper"
    assert outcome("adaptive", prefill_pending_tokens=6_000, decode_running=1) == "remote"
    busy_queue = {"decode_running": 0, "decode_pending_tokens": 3_001}
    assert outcome("adaptive", prefill_pending_tokens=6_000, **busy_queue) == "remote"


def test_bad_settings_are_config_errors_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--disagg-policy"):
        DisaggConfig(policy="sometimes")
    with pytest.raises(ConfigError, match="--max-prefill-queue"):
        DisaggConfig(max_prefill_queue=0)
    with pytest.raises(ConfigError, match="--decode-busy-threshold"):
        DisaggConfig(decode_busy_threshold=0)
    with pytest.raises(ConfigError, match="--prefill-router-mode"):
        DisaggConfig(prefill_router_mode="remote")
