"""The planner's simulator against the mocker's scheduler: the same pass takes the same time in both, since
both take it from one timing model (dynamo_cli/timing.py)."""

from __future__ import annotations

import math

import pytest
from dyn_engines.mocker.kv_manager import KvManager
from dyn_engines.mocker.scheduler import MockRequest, PassResult, Scheduler, SchedulerConfig

from dynamo_cli.planner.simworker import SimRank, SimRequest, Stats
from dynamo_cli.timing import DEFAULT_MAX_NUM_BATCHED_TOKENS, TimingModel

BS = 16
NUM_BLOCKS = 16384  # the mocker's default cache: 262144 tokens
KV = NUM_BLOCKS * BS
USAGE_TOLERANCE_MS = 0.01
"""The simulator counts a request's KV as isl + osl // 2 tokens for its whole life, the mocker as its length at
each pass; on one request of a 262144-token cache that is a few tokens, under 1e-3 ms a pass."""


def mocker_pass(num_prefill_tokens: int, num_decoding: int, context: int) -> tuple[PassResult, int]:
    """One mocker pass in which `num_decoding` requests of `context` prompt tokens decode while a longer
    prompt computes a chunk of `num_prefill_tokens` (so it emits nothing): the budget is exactly both. Also
    the tokens of the decoding requests before it: the mocker's KV usage (Dynamo's rule) is those over the cache."""
    kv = KvManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    warmup = Scheduler(kv, SchedulerConfig(), TimingModel())
    for i in range(num_decoding):
        warmup.add(MockRequest(f"d{i}", [i] * context, max_tokens=1000, block_size=BS, seed=i))
    while warmup.waiting or any(request.num_output_tokens == 0 for request in warmup.running):
        warmup.step()
    budget = num_decoding + num_prefill_tokens
    scheduler = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=max(budget, 1)), TimingModel())
    scheduler.running = warmup.running
    num_decoding_tokens = sum(len(request.token_ids) for request in scheduler.running)
    if num_prefill_tokens:
        scheduler.add(MockRequest("p", list(range(num_prefill_tokens + 1)), max_tokens=1, block_size=BS, seed=0))
    return scheduler.step(), num_decoding_tokens


@pytest.mark.parametrize("num_prefill_tokens", [0, 1, 512, 3000, DEFAULT_MAX_NUM_BATCHED_TOKENS - 16])
@pytest.mark.parametrize("num_decoding", [0, 1, 16])
@pytest.mark.parametrize("context", [16, 1000, 12000], ids=["small-cache-use", "some-cache-use", "most-of-the-cache"])
def test_a_pass_takes_the_same_time_in_the_simulator_as_in_the_mockers_scheduler(
    num_prefill_tokens: int, num_decoding: int, context: int
) -> None:
    result, num_decoding_tokens = mocker_pass(num_prefill_tokens, num_decoding, context)
    assert (result.num_prefill_tokens, len(result.emitted)) == (num_prefill_tokens, num_decoding)
    worker = SimRank(KV, started_s=0.0, active_kv=num_decoding_tokens)  # the mocker's KV usage exactly
    assert worker.pass_ms(num_prefill_tokens, num_decoding) == result.duration_ms


def mocker_request(isl: int, osl: int) -> tuple[float, float]:
    """(first token, end) in ms of one request alone on the mocker's default scheduler."""
    scheduler = Scheduler(KvManager(NUM_BLOCKS, BS), SchedulerConfig(), TimingModel())
    scheduler.add(MockRequest("a", list(range(isl)), max_tokens=osl, block_size=BS, seed=0))
    now, first = 0.0, math.nan
    while scheduler.has_work:
        result = scheduler.step()
        now += result.duration_ms
        if result.emitted and math.isnan(first):
            first = now
    return first, now


def simulated_request(isl: int, osl: int) -> tuple[float, float]:
    """(first token, end) in ms of one request alone on a simulated worker's rank."""
    stats = Stats(ttft_ms=math.inf, itl_ms=math.inf)
    worker = SimRank(KV, started_s=0.0)
    worker.waiting.append([SimRequest(0.0, isl, osl), isl])
    worker.advance(math.inf, stats)
    return stats.sums["time_to_first_token_seconds"] * 1000, stats.sums["request_duration_seconds"] * 1000


def test_one_requests_decode_passes_take_the_same_time_in_the_simulator_as_in_the_mocker() -> None:
    """ISL 3000 fits one pass's budget (no chunking) and OSL 8 leaves 7 decode passes after the first token."""
    mocker_first, mocker_end = mocker_request(3000, 8)
    sim_first, sim_end = simulated_request(3000, 8)
    assert sim_end - sim_first == pytest.approx(mocker_end - mocker_first, abs=USAGE_TOLERANCE_MS)


def test_one_request_gets_its_first_token_and_ends_at_the_same_time_in_the_simulator_as_in_the_mocker() -> None:
    """ISL 3000 OSL 8 alone: both schedulers run one pass computing the whole prompt (it fits the 8192-token
    budget, so the simulator's unchunked view is the mocker's) whose first token adds no decode term (as in
    Dynamo 1.6.1's core: 65.841 ms), then 7 decode passes; they agree to within the KV usage each counts."""
    mocker = mocker_request(3000, 8)
    assert simulated_request(3000, 8) == pytest.approx(mocker, abs=USAGE_TOLERANCE_MS)
