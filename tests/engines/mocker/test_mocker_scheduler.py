"""The vLLM-style pass: chunked prefill, admission limits, prefix hits, LIFO/FIFO preemption, timing, and the
rules that follow Dynamo 1.6.1's core (decode term, transferred KV) with the options that keep dyn's earlier ones."""

import random

import pytest
from dyn_engines.mocker.kv_manager import KvManager
from dyn_engines.mocker.scheduler import MockRequest, PassResult, Scheduler, SchedulerConfig

from dynamo_cli.kv.events import BlockRemoved, BlockStored, StoredBlock
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.timing import TimingModel, decode_ms, prefill_ms

BS = 4


def make_scheduler(
    num_blocks: int = 64, max_num_seqs: int = 256, budget: int = 8192, is_prefill_only: bool = False, **rules: str
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, is_prefill_only, **rules)
    return Scheduler(KvManager(num_blocks, BS), config, TimingModel())


def add(scheduler: Scheduler, request_id: str, tokens: list[int], max_tokens: int, **kw: object) -> MockRequest:
    request = MockRequest(request_id, tokens, max_tokens, BS, seed=7, **kw)  # type: ignore[arg-type]
    scheduler.add(request)
    return request


def emitted_ids(result: PassResult) -> list[str]:
    return [r.request_id for r in result.emitted]


def stored(tokens: list[int], first: int, last: int) -> BlockStored:
    seq, local = sequence_hashes(tokens, BS), block_hashes(tokens, BS)
    blocks = [StoredBlock(block_hash=seq[i], tokens_hash=local[i]) for i in range(first, last)]
    return BlockStored(parent_hash=seq[first - 1] if first else None, blocks=blocks)


@pytest.mark.parametrize(
    ("rule", "last_passes_ms"),
    [
        # Dynamo: the first token comes with the prompt's last chunk, no decode term; then the decode term counts
        # the 21 tokens of the sequence (prompt + first token) of the 64 x 4 the cache holds.
        pytest.param("decoding_tokens", [prefill_ms(4), decode_ms(21 / 256)], id="decoding-tokens"),
        # dyn before issue 35: a decode term in every pass that emits, at the blocks referenced (5, then 6 of 64).
        pytest.param("active_blocks", [prefill_ms(4) + decode_ms(5 / 64), decode_ms(6 / 64)], id="active-blocks"),
    ],
)
def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_then_decoded(rule: str, last_passes_ms: list[float]) -> None:
    scheduler = make_scheduler(budget=8, decode_kv_input=rule)
    add(scheduler, "a", list(range(20)), max_tokens=2)
    results = [scheduler.step() for _ in range(4)]
    assert [(r.num_prefill_tokens, len(r.emitted)) for r in results] == [(8, 0), (8, 0), (4, 1), (0, 1)]
    assert [r.duration_ms for r in results] == pytest.approx([prefill_ms(8), prefill_ms(8), *last_passes_ms])
    assert not scheduler.has_work
    assert scheduler.kv.num_active_blocks == 0


def test_running_requests_come_first_and_admission_stops_at_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        add(scheduler, request_id, [ord(request_id)] * 4, max_tokens=2)
    assert [emitted_ids(scheduler.step()) for _ in range(4)] == [["a", "b"], ["a", "b"], ["c"], ["c"]]


def test_a_cached_prefix_counts_as_computed_at_first_schedule() -> None:
    scheduler = make_scheduler()
    prompt = list(range(10))
    add(scheduler, "a", prompt, max_tokens=1)
    assert scheduler.step().num_prefill_tokens == 10
    second = add(scheduler, "b", prompt, max_tokens=1)
    result = scheduler.step()
    assert (result.num_prefill_tokens, second.num_cached_tokens) == (2, 8)
    assert (scheduler.num_prefill_tokens_computed, scheduler.num_prefill_tokens_cached) == (12, 8)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", list(range(8)), max_tokens=1)
    scheduler.step()
    second = add(scheduler, "b", list(range(8)), max_tokens=1)
    result = scheduler.step()
    assert (result.num_prefill_tokens, second.num_cached_tokens, emitted_ids(result)) == (1, 7, ["b"])


def test_when_blocks_run_out_the_newest_request_is_preempted_and_recomputed() -> None:
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", list(range(7)), max_tokens=3)
    b = add(scheduler, "b", list(range(100, 107)), max_tokens=3)
    first, second = scheduler.step(), scheduler.step()  # 4 blocks in use, each sequence now 9 tokens
    assert emitted_ids(first) == emitted_ids(second) == ["a", "b"]
    third = scheduler.step()  # a needs a 3rd block: b gives its blocks back
    assert (third.num_preempted, emitted_ids(third)) == (1, ["a"])
    assert a.num_output_tokens == 3 and b.num_computed_tokens == 0
    fourth = scheduler.step()  # b recomputes prompt + 2 outputs; its first block was still cached
    assert (fourth.num_preempted, fourth.num_prefill_tokens, emitted_ids(fourth)) == (0, 5, ["b"])
    assert b.num_output_tokens == 3 and not scheduler.has_work


@pytest.mark.parametrize(
    ("mode", "gives_way", "goes_on"),
    [pytest.param("lifo", "b", "a", id="lifo"), pytest.param("fifo", "a", "b", id="fifo")],
)
def test_the_preemption_mode_picks_the_newest_or_the_oldest_running_request(
    mode: str, gives_way: str, goes_on: str
) -> None:
    scheduler = make_scheduler(num_blocks=4, preemption_mode=mode)
    requests = {"a": add(scheduler, "a", list(range(5)), max_tokens=5), "b": add(scheduler, "b", list(range(9, 16)), 5)}
    scheduler.step(), scheduler.step()  # a: 7 tokens in 2 blocks, b: 9 tokens in the other 2
    third = scheduler.step()  # b needs a 3rd block; fifo: a, already scheduled this pass, gives its tokens back
    assert (third.num_preempted, emitted_ids(third)) == (1, [goes_on])
    assert requests[gives_way].num_computed_tokens == 0 and scheduler.waiting[0] is requests[gives_way]
    while scheduler.has_work:
        scheduler.step()
    assert [r.num_output_tokens for r in requests.values()] == [5, 5]


def test_preemption_and_recompute_publish_the_exact_event_sequence() -> None:
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", list(range(7)), max_tokens=3)
    b = add(scheduler, "b", list(range(100, 107)), max_tokens=3)
    batches = []
    for _ in range(4):
        scheduler.step()
        batches.append(scheduler.kv.take_events())
    a_seq, b_seq = sequence_hashes(a.token_ids, BS), sequence_hashes(b.token_ids, BS)
    assert [batch.event_id for batch in batches if batch] == [0, 1, 2, 3]
    assert [batch.events for batch in batches if batch] == [
        [stored(a.token_ids, 0, 1), stored(b.token_ids, 0, 1)],
        [stored(a.token_ids, 1, 2), stored(b.token_ids, 1, 2)],
        [BlockRemoved(block_hashes=[b_seq[1]])],  # b's deepest block goes first
        [BlockRemoved(block_hashes=[a_seq[1]]), stored(b.token_ids, 1, 2)],
    ]


def test_tokens_are_reproducible_from_the_seed_and_in_the_mockers_range() -> None:
    runs = []
    for _ in range(2):
        scheduler = make_scheduler()
        request = add(scheduler, "a", list(range(5)), max_tokens=20)
        while scheduler.has_work:
            scheduler.step()
        runs.append(request.token_ids[5:])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 20 and all(1000 <= t < 2000 for t in runs[0])


def test_abort_frees_a_requests_blocks_at_once() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", list(range(10)), max_tokens=50)
    scheduler.step()
    assert scheduler.kv.num_active_blocks == 3
    assert scheduler.abort("a")
    assert scheduler.kv.num_active_blocks == 0 and not scheduler.has_work
    assert not scheduler.abort("a")


def test_a_prefill_worker_pass_has_no_decode_time() -> None:
    scheduler = make_scheduler(num_blocks=256, is_prefill_only=True)
    add(scheduler, "a", list(range(512)), max_tokens=1)
    result = scheduler.step()
    assert emitted_ids(result) == ["a"]
    assert result.duration_ms == pytest.approx(prefill_ms(512))


def test_a_request_prefilled_elsewhere_allocates_blocks_but_pays_only_decode_time() -> None:
    scheduler = make_scheduler(num_blocks=256)
    add(scheduler, "a", list(range(512)), max_tokens=2, is_prefilled=True)
    result = scheduler.step()
    assert (result.num_prefill_tokens, emitted_ids(result)) == (0, ["a"])
    assert result.duration_ms == pytest.approx(decode_ms(512 / 1024))
    assert scheduler.kv.num_active_blocks == 128


@pytest.mark.parametrize(
    ("admission", "emitted_per_pass", "prompt_chunks"),
    [
        # Dynamo's ReservedVllmDecode: the KV arrives computed, so all three join the running batch in one pass,
        # taking none of the 16-token budget, which goes whole to the prompt behind them.
        pytest.param("materialized", [["a", "b", "c", "p"], ["a", "b", "c", "p"]], [16, 0], id="materialized"),
        # dyn before issue 35: each takes len(prompt) + 1 = 9 tokens of the budget, so b is chunked behind a,
        # c waits a pass, and the prompt is chunked behind them: its first token comes two passes later.
        pytest.param("prompt", [["a"], ["a", "b", "c"], ["a", "b", "c", "p"]], [0, 4, 12], id="prompt"),
    ],
)
def test_requests_whose_kv_arrived_join_at_once_and_leave_the_budget_to_prompts(
    admission: str, emitted_per_pass: list[list[str]], prompt_chunks: list[int]
) -> None:
    scheduler = make_scheduler(num_blocks=256, budget=16, prefilled_admission=admission)
    for request_id in "abc":
        add(scheduler, request_id, [ord(request_id)] * 9, max_tokens=4, is_prefilled=True)
    add(scheduler, "p", list(range(16)), max_tokens=4)
    results = [scheduler.step() for _ in emitted_per_pass]
    assert [emitted_ids(r) for r in results] == emitted_per_pass
    assert [r.num_prefill_tokens for r in results] == prompt_chunks
    first = results[0]  # the materialized ones decode in the pass they join: 3 x 9 tokens of 256 x 4
    if admission == "materialized":
        assert first.duration_ms == pytest.approx(prefill_ms(16) + decode_ms(27 / 1024))


@pytest.mark.parametrize(
    ("rule", "expected_ms"),
    [
        # The prompt's first token is free; the decode term counts the decoding request alone (its 8 tokens).
        pytest.param("decoding_tokens", prefill_ms(12) + decode_ms(8 / 256), id="decoding-tokens"),
        # Every emitting request brings the decode term, at the blocks held by both: 2 + 3 of 64.
        pytest.param("active_blocks", prefill_ms(12) + decode_ms(5 / 64), id="active-blocks"),
    ],
)
def test_a_prompt_finishing_beside_a_decode_adds_nothing_to_the_decode_term(rule: str, expected_ms: float) -> None:
    scheduler = make_scheduler(decode_kv_input=rule)
    add(scheduler, "a", list(range(7)), max_tokens=5)
    scheduler.step()
    add(scheduler, "b", list(range(100, 112)), max_tokens=5)
    result = scheduler.step()
    assert (emitted_ids(result), result.num_prefill_tokens) == (["a", "b"], 12)
    assert result.duration_ms == pytest.approx(expected_ms)


def test_replaying_the_kv_events_rebuilds_exactly_the_cached_blocks_under_heavy_preemption() -> None:
    rng = random.Random(3)
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=16, budget=64)
    prefixes = [[rng.randrange(50_000) for _ in range(16)] for _ in range(4)]
    requests = []
    for i in range(60):
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
        requests.append(add(scheduler, str(i), rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 40)))
    seen: set[int] = set()
    num_preempted = 0
    while scheduler.has_work:
        num_preempted += scheduler.step().num_preempted
        batch = scheduler.kv.take_events()
        for event in batch.events if batch else []:
            if isinstance(event, BlockStored):
                assert not seen & {b.block_hash for b in event.blocks}
                seen |= {b.block_hash for b in event.blocks}
            else:
                assert isinstance(event, BlockRemoved) and set(event.block_hashes) <= seen
                seen -= set(event.block_hashes)
    assert num_preempted > 0
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert scheduler.kv.num_active_blocks == 0
    assert seen == set(scheduler.kv.cached_lru_order())


def test_a_request_whose_data_breaks_the_pass_fails_alone_and_the_others_go_on() -> None:
    scheduler = make_scheduler()
    bad = add(scheduler, "bad", [2**40], max_tokens=8)  # hashed only once its first block fills
    good = add(scheduler, "good", [1, 2, 3], max_tokens=8)
    failed: list[tuple[MockRequest, str]] = []
    for _ in range(8):
        failed += scheduler.step().failed
    assert [(request.request_id, "Error: " in reason) for request, reason in failed] == [("bad", True)]
    assert bad not in scheduler.running and good.num_output_tokens == 8
    assert not scheduler.has_work and scheduler.kv.num_active_blocks == 0
