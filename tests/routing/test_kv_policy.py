"""The KV-aware routing policy end to end, without sockets: events in, decisions and load out."""

from __future__ import annotations

import logging
import random

import pytest

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.errors import ConfigError
from dynamo_cli.kv.events import AllBlocksCleared, BlockStored, KvDump, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.routing.base import RouteRequest, RoutingPolicy
from dynamo_cli.routing.indexer import Gap
from dynamo_cli.routing.kv_policy import KvRoutingPolicy, explanation_summary
from dynamo_cli.routing.target import Target, targets_of
from dynamo_cli.routing.time_cost import SpeedEstimator

BLOCK = 16
SYSTEM = list(range(1, 129))  # an 8-block system prompt


def prompt(suffix: int, blocks: int = 2) -> list[int]:
    return SYSTEM + [10_000 * suffix + i for i in range(blocks * BLOCK)]


def stored_batch(worker: int, event_id: int, tokens: list[int]) -> KvEventBatch:
    seq, local = sequence_hashes(tokens, BLOCK), block_hashes(tokens, BLOCK)
    blocks = [StoredBlock(s, t) for s, t in zip(seq, local, strict=True)]
    return KvEventBatch(event_id=event_id, worker_id=worker, events=[BlockStored(parent_hash=None, blocks=blocks)])


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(**overrides: object) -> KvRoutingPolicy:
    # A CPU-like 1,000 tokens/s: a hit of a few 16-token blocks saves more than one pass (T0 = 20 ms), so
    # it is not a near-tie taken in turn (routing/time_cost.py, point 5).
    overrides.setdefault("prefill_tokens_per_s", 1000.0)
    config = KvRouterConfig(block_size=BLOCK, **overrides)  # type: ignore[arg-type]
    return KvRoutingPolicy(config, rng=random.Random(0))


def test_it_implements_the_routing_policy_protocol() -> None:
    routing: RoutingPolicy = policy()
    assert routing.select(RouteRequest("r", prompt(1)), targets_of([1])).target == Target(1)


def test_the_worked_example_chooses_the_second_worker() -> None:
    kv = policy(cost="dynamo")  # Dynamo's formula, no longer the default (routing/time_cost.py)
    tokens = prompt(0, blocks=0)[:64]  # 4 blocks
    hashes = sequence_hashes(tokens, BLOCK)
    kv.indexer.store_blocks(Target(2), hashes[:3])
    kv.indexer.store_blocks(Target(3), hashes)
    kv.sequences.add_request("a", Target(1), [901, 902, 903, 904, 905, 906], prefill_tokens=64)
    kv.sequences.add_request("b", Target(2), [*hashes[:3], 907], prefill_tokens=64)
    kv.sequences.add_request("c", Target(3), [*hashes, 908, 909, 910, 911, 912], prefill_tokens=32)

    decision = kv.select(RouteRequest("new", tokens), targets_of([1, 2, 3]))

    assert [c["logit"] for c in decision.explanation["candidates"]] == [18.0, 10.0, 11.0]
    assert (decision.target, decision.overlap_blocks, decision.explanation["margin"]) == (Target(2), 3, 1.0)


def test_a_request_lands_on_the_worker_holding_its_prefix() -> None:
    kv = policy()
    kv.apply_kv_events(stored_batch(2, 0, prompt(1)))

    decision = kv.select(RouteRequest("r", prompt(2)), targets_of([1, 2, 3]))

    assert (decision.target, decision.overlap_blocks) == (Target(2), 8)
    assert decision.explanation["reason"] == "argmin"
    assert kv.counters.to_dict() == {
        "num_decisions": 1,
        "num_request_blocks": 10,
        "num_hit_blocks": 8,
        "num_host_hit_blocks": 0,
        "num_disk_hit_blocks": 0,
        "num_reachable_hit_blocks": 8,
        "num_hot_spot_decisions": 0,
        "num_pinned_decisions": 0,
        "num_kv_gaps": 0,
    }


def test_routing_counts_load_until_first_token_and_finish() -> None:
    kv = policy()
    kv.apply_kv_events(stored_batch(1, 0, SYSTEM))
    kv.select(RouteRequest("r", prompt(1)), targets_of([1, 2]))

    assert (kv.sequences.active_prefill_tokens(Target(1)), kv.sequences.active_blocks(Target(1))) == (32, 10)
    kv.on_first_token("r")
    assert (kv.sequences.active_prefill_tokens(Target(1)), kv.sequences.active_blocks(Target(1))) == (0, 10)
    kv.on_finish("r")
    kv.on_finish("r")
    assert (kv.sequences.active_prefill_tokens(Target(1)), kv.sequences.active_blocks(Target(1))) == (0, 0)


def test_in_flight_load_spreads_identical_cold_requests() -> None:
    kv = policy()
    targets = [kv.select(RouteRequest(f"r{n}", prompt(n)), targets_of([1, 2, 3])).target for n in range(3)]

    assert sorted(targets) == targets_of([1, 2, 3])


def test_a_pinned_request_goes_to_its_worker_and_is_counted() -> None:
    kv = policy()
    kv.apply_kv_events(stored_batch(2, 0, prompt(1)))

    decision = kv.select(RouteRequest("r", prompt(1), pinned_worker=3), targets_of([1, 2, 3]))

    assert (decision.target, decision.overlap_blocks, decision.explanation["reason"]) == (Target(3), 0, "pinned")
    assert kv.sequences.active_prefill_tokens(Target(3)) == 160
    assert (
        kv.counters.num_pinned_decisions,
        kv.counters.num_hit_blocks,
        kv.counters.num_reachable_hit_blocks,
    ) == (
        1,
        0,
        10,
    )


def test_a_pin_to_a_worker_outside_the_candidates_is_ignored() -> None:
    kv = policy()
    kv.apply_kv_events(stored_batch(2, 0, prompt(1)))

    assert kv.select(RouteRequest("r", prompt(1), pinned_worker=9), targets_of([1, 2])).target == Target(2)


def test_temperature_zero_routes_the_same_way_whatever_the_seed() -> None:
    def route(seed: int) -> list[Target]:
        kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK), rng=random.Random(seed))
        for worker in (1, 2, 3):
            kv.apply_kv_events(stored_batch(worker, 0, prompt(worker, blocks=worker)))
        return [
            kv.select(RouteRequest(f"r{n}", prompt(n % 4, blocks=3)), targets_of([1, 2, 3])).target for n in range(12)
        ]

    assert route(1) == route(2) == route(3)


def test_a_kv_event_gap_is_queued_for_repair_and_a_dump_fixes_the_worker() -> None:
    kv = policy()
    kv.apply_kv_events(stored_batch(1, 0, SYSTEM[:32]))
    kv.apply_kv_events(KvEventBatch(event_id=2, worker_id=1, events=[AllBlocksCleared()]))
    kv.apply_kv_events(KvEventBatch(event_id=3, worker_id=1, events=[AllBlocksCleared()]))

    assert kv.take_gaps() == [Gap(worker_id=1, first_missing=1, last_missing=2)]
    assert kv.take_gaps() == []
    assert kv.counters.num_kv_gaps == 2

    kv.load_dump(KvDump(worker_id=1, block_hashes=sequence_hashes(SYSTEM, BLOCK), last_event_id=3))
    assert kv.select(RouteRequest("r", prompt(1)), targets_of([1, 2])).overlap_blocks == 8


def test_removing_a_worker_drops_its_blocks_and_load() -> None:
    kv = policy()
    kv.apply_kv_events(stored_batch(1, 0, prompt(1)))
    kv.select(RouteRequest("r", prompt(1)), targets_of([1, 2]))
    kv.remove_worker(1)

    assert kv.indexer.num_blocks(Target(1)) == 0
    assert kv.sequences.active_blocks(Target(1)) == 0
    assert kv.select(RouteRequest("s", prompt(1)), targets_of([1, 2])).overlap_blocks == 0


def test_approximate_mode_remembers_its_own_decisions_for_the_ttl() -> None:
    clock = Clock()
    kv = KvRoutingPolicy(
        KvRouterConfig(block_size=BLOCK, use_kv_events=False, prefill_tokens_per_s=1000.0),
        rng=random.Random(5),
        clock=clock,
    )
    kv.apply_kv_events(stored_batch(3, 0, prompt(1)))  # ignored: no events in approximate mode

    first = kv.select(RouteRequest("a", prompt(1)), targets_of([1, 2, 3]))
    kv.on_finish("a")
    clock.now += 119.0
    second = kv.select(RouteRequest("b", prompt(2)), targets_of([1, 2, 3]))
    kv.on_finish("b")

    assert first.overlap_blocks == 0
    assert (second.target, second.overlap_blocks) == (first.target, 8)
    clock.now += 119.0  # 238 s after "a", 119 s after "b" refreshed the prefix
    assert kv.select(RouteRequest("c", prompt(3)), targets_of([1, 2, 3])).overlap_blocks == 8
    clock.now += 500.0
    assert kv.select(RouteRequest("d", prompt(4)), targets_of([1, 2, 3])).overlap_blocks == 0


def test_a_worker_without_kv_events_is_routed_from_the_routers_decisions_beside_one_with_them() -> None:
    clock = Clock()
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK, prefill_tokens_per_s=1000.0), random.Random(1), clock)
    kv.apply_kv_events(stored_batch(1, 0, prompt(9)))  # worker 1 publishes; worker 2 never does

    first = kv.select(RouteRequest("a", prompt(1)), [Target(2)])  # only worker 2 can take it
    kv.on_finish("a")
    again = kv.select(RouteRequest("b", prompt(1)), targets_of([1, 2]))

    assert (again.target, again.overlap_blocks) == (Target(2), 10)  # its guessed cache wins the prefix
    assert kv.select(RouteRequest("c", prompt(9)), targets_of([1, 2])).target == Target(1)  # worker 1's facts
    assert kv.snapshot().precise == frozenset({1})
    kv.apply_kv_events(stored_batch(2, 0, prompt(7)))  # worker 2's first events: its guesses give way
    assert kv.snapshot().precise == frozenset({1, 2})
    assert first.overlap_blocks == 0
    assert kv.select(RouteRequest("d", prompt(1)), [Target(2)]).overlap_blocks == 8  # the system prompt only


def test_a_worker_that_never_sends_kv_events_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "dynamo_cli.routing.kv_policy")
    clock = Clock()
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK, prefill_tokens_per_s=1000.0), random.Random(1), clock)
    for i in range(4):
        kv.select(RouteRequest(f"r{i}", prompt(i)), [Target(0xB1)])
        kv.on_finish(f"r{i}")
        clock.now += 5.0

    blind = [r.getMessage() for r in caplog.records if "published no KV events" in r.getMessage()]
    assert len(blind) == 1 and blind[0].startswith("worker b1 ") and "--kv-events-config" in blind[0]
    kv.apply_kv_events(stored_batch(0xB1, 0, prompt(1)))
    assert any("KV events arrive now" in r.getMessage() for r in caplog.records)


def test_the_empty_dump_of_a_worker_that_never_published_leaves_it_approximate() -> None:
    kv = policy()
    kv.load_dump(KvDump(worker_id=1, last_event_id=-1, block_hashes=[]))  # a join's catch-up: nothing to say
    kv.load_dump(KvDump(worker_id=2, last_event_id=4, block_hashes=[]))  # it published, then evicted all
    assert kv.snapshot().precise == frozenset({2})


def test_approximate_mode_counts_no_worker_as_precise() -> None:
    kv = policy(use_kv_events=False)
    kv.apply_kv_events(stored_batch(1, 0, prompt(1)))
    assert kv.snapshot().precise == frozenset()


def test_stale_requests_can_be_expired() -> None:
    clock = Clock()
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK), rng=random.Random(0), clock=clock)
    kv.select(RouteRequest("leaked", prompt(1)), targets_of([1]))
    clock.now += 301.0

    assert kv.expire_stale() == ["leaked"]
    assert kv.sequences.active_blocks(Target(1)) == 0


def test_each_candidates_formula_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    kv = policy(cost="dynamo")
    with caplog.at_level(logging.DEBUG, logger="dynamo_cli.routing.kv_policy"):
        kv.select(RouteRequest("r7", prompt(1)), targets_of([4, 5]))

    formulas = [r.getMessage() for r in caplog.records if "formula" in r.getMessage()]
    assert formulas == [
        "route r7: formula for 4: 20.000 = 1.00 * 10.000 prefill + 10 decode (overlap 0 blocks)",
        "route r7: formula for 5: 20.000 = 1.00 * 10.000 prefill + 10 decode (overlap 0 blocks)",
    ]


def test_the_explanation_summary_is_one_line() -> None:
    decision = policy().select(RouteRequest("r", prompt(1)), targets_of([1]))

    assert explanation_summary(decision.explanation) == "worker=1 reason=only margin=None candidates=1"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("block_size", 0, id="block-size-zero"),
        pytest.param("temperature", -0.5, id="negative-temperature"),
        pytest.param("overlap_score_weight", -1.0, id="negative-weight"),
        pytest.param("approx_ttl_s", 0.0, id="zero-ttl"),
    ],
)
def test_an_invalid_setting_names_itself_and_its_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field} \\({value}\\)"):
        KvRouterConfig(**{field: value})  # type: ignore[arg-type]


def test_an_event_id_reported_twice_but_never_received_queues_a_gap_for_repair() -> None:
    from dynamo_cli.routing.kv_policy import KvRouterConfig, KvRoutingPolicy
    from dynamo_cli.wire import LoadMetrics

    policy = KvRoutingPolicy(KvRouterConfig(block_size=4))
    policy.apply_load(LoadMetrics(worker_id=7, kv_event_id=-1))
    assert policy.take_gaps() == []
    policy.apply_load(LoadMetrics(worker_id=7, kv_event_id=3))
    assert policy.take_gaps() == []  # the events may still be on their way
    policy.apply_load(LoadMetrics(worker_id=7, kv_event_id=3))
    gaps = policy.take_gaps()
    assert [(g.worker_id, g.first_missing, g.last_missing) for g in gaps] == [(7, 0, 3)]


def test_first_tokens_and_ends_of_streams_teach_the_time_cost_its_speeds() -> None:
    clock = Clock()
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK), rng=random.Random(0), clock=clock)
    kv.select(RouteRequest("r1", prompt(1)), targets_of([1, 2]))
    clock.now += 0.5
    kv.on_first_token("r1")
    clock.now += 1.5
    kv.on_finish("r1")
    kv.on_finish("r1")  # a second report of the same end is not a second observation

    assert kv.speed.speed.lifetime_s == 2.0


class RecordingSpeed(SpeedEstimator):
    """Keeps the first-token observations it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float]] = []

    def observe_first_token(self, uncached_tokens: int, ttft_s: float) -> None:
        self.seen.append((uncached_tokens, ttft_s))


def test_only_requests_with_no_prefill_queued_ahead_teach_the_prefill_speed() -> None:
    clock = Clock()
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK), rng=random.Random(0), clock=clock)
    kv.speed = recorder = RecordingSpeed()
    kv.select(RouteRequest("alone", prompt(1)), targets_of([1]))  # 10 blocks, nothing cached, nothing queued
    kv.select(RouteRequest("behind", prompt(2)), targets_of([1]))  # queued behind the first one's 160 tokens
    clock.now += 0.25
    kv.on_first_token("alone")
    kv.on_first_token("behind")

    assert recorder.seen == [(160, 0.25)]


def test_when_every_worker_has_a_prefill_queued_it_joins_one_still_waiting_not_one_seen_computing() -> None:
    # Issue 15's closed-loop p99: with a prefill queued everywhere, turns sent a request to a worker whose
    # queued prefill had already started its pass (its KV event came), so it waited that whole pass too.
    clock = Clock()
    kv = KvRoutingPolicy(KvRouterConfig(block_size=BLOCK, prefill_tokens_per_s=1e6), rng=random.Random(0), clock=clock)
    for worker in (1, 2):
        kv.apply_kv_events(stored_batch(worker, 0, SYSTEM))
    first = kv.select(RouteRequest("a", prompt(1)), targets_of([1, 2])).target
    other = kv.select(RouteRequest("b", prompt(2)), targets_of([1, 2])).target
    assert {first, other} == {Target(1), Target(2)}  # near-ties in turn
    kv.apply_kv_events(stored_batch(first.worker, 1, prompt(1)))  # "a"'s pass started; "b" still waits for one
    clock.now += 0.004

    decision = kv.select(RouteRequest("c", prompt(3)), targets_of([1, 2]))

    assert decision.target == other  # in turn it would have been `first` again
    busy = {Target(c["worker_id"], c["dp_rank"]): c["busy_s"] for c in decision.explanation["candidates"]}
    assert busy[other] == 0.0 and busy[first] == pytest.approx(kv.speed.speed.pass_s - 0.004)
    kv.on_first_token("a")  # that pass ended: nothing is known to be computing any more
    assert kv.sequences.pass_elapsed(targets_of([1, 2]), clock.now) == [float("inf")] * 2
