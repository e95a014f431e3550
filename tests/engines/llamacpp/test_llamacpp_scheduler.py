"""The llamacpp scheduler alone (no model): chunked prefill, batching order, prefix reuse, KV events,
eviction and preemption, with exact memory ops and hashes."""

from __future__ import annotations

from dyn_engines.llamacpp.plan import MemoryOp
from dyn_engines.llamacpp.scheduler import Scheduler, Sequence

from dynamo_cli.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, StoredBlock
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.wire import GenerateRequest

BS = 16


def make_scheduler(capacity: int = 1024, n_batch: int = 64, max_cached: int = 4) -> Scheduler:
    return Scheduler(block_size=BS, capacity=capacity, max_num_seqs=4, max_cached=max_cached, n_batch=n_batch)


def make_seq(tokens: list[int], max_tokens: int = 8) -> Sequence:
    request = GenerateRequest(request_id="r", token_ids=tokens, max_tokens=max_tokens)
    return Sequence(request=request, tokens=list(tokens), num_prompt_tokens=len(tokens))


def step(scheduler: Scheduler, sampled_token: int = 7) -> list[tuple[int, int, bool]]:
    """One step with every sampled token = `sampled_token`; returns (seq_id, tokens fed, sampled)."""
    _, scheduled = scheduler.schedule()
    for part in scheduled:
        scheduler.commit(part)
        if part.is_sampled:
            part.seq.tokens.append(sampled_token)
    return [(p.seq.seq_id, p.num_tokens, p.is_sampled) for p in scheduled]


def test_a_long_prompt_is_fed_in_n_batch_chunks_and_sampled_once_at_its_end() -> None:
    scheduler = make_scheduler(n_batch=32)
    seq = make_seq(list(range(100, 170)))
    scheduler.add(seq)
    assert [step(scheduler) for _ in range(3)] == [[(0, 32, False)], [(0, 32, False)], [(0, 6, True)]]
    assert scheduler.num_prefill_tokens_computed == 70


def test_decoding_sequences_get_their_token_before_a_new_prompt_fills_the_rest_of_the_batch() -> None:
    scheduler = make_scheduler(n_batch=32)
    scheduler.add(make_seq(list(range(100, 110))))
    step(scheduler)
    scheduler.add(make_seq(list(range(200, 260))))
    plan, _ = scheduler.schedule()
    assert plan.seq_ids == [0] + [1] * 31
    assert plan.positions[:2] == [10, 0]
    assert plan.logits_rows == [0]


def test_a_finished_sequence_keeps_its_full_blocks_and_a_new_prompt_shares_them() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 140))  # 40 tokens: two full blocks
    first = make_seq(prompt)
    scheduler.add(first)
    step(scheduler)
    scheduler.finish(first)
    assert scheduler.pending_ops == [MemoryOp("rm", 0, start=32, end=-1)]
    second = make_seq(prompt[:32] + [5, 6, 7])
    scheduler.add(second)
    plan, scheduled = scheduler.schedule()
    assert plan.memory_ops[-1] == MemoryOp("cp", 1, src_seq_id=0, end=32)
    assert (second.num_cached_tokens, scheduled[0].num_tokens) == (32, 3)
    assert scheduler.num_prefill_tokens_cached == 32


def test_blocks_are_stored_once_and_removed_when_their_last_holder_is_evicted() -> None:
    scheduler = make_scheduler(max_cached=1)
    prompt = list(range(100, 140))
    first, second = make_seq(prompt), make_seq(prompt[:32] + [1] * 20)
    scheduler.add(first)
    step(scheduler)
    hashes, locals_ = sequence_hashes(prompt, BS), block_hashes(prompt, BS)
    stored = BlockStored(parent_hash=None, blocks=[StoredBlock(h, t) for h, t in zip(hashes, locals_, strict=True)])
    assert scheduler.drain_events() == [stored]
    scheduler.add(second)
    step(scheduler)  # shares both blocks, stores its own third block
    third = sequence_hashes(second.tokens, BS)[2]
    assert scheduler.drain_events() == [
        BlockStored(parent_hash=hashes[1], blocks=[StoredBlock(third, block_hashes(second.tokens, BS)[2])])
    ]
    scheduler.finish(first)  # covered by the running second sequence: dropped, its blocks still held
    assert scheduler.drain_events() == []
    scheduler.finish(second)  # kept as the one cached prefix
    assert scheduler.drain_events() == []
    scheduler.add(third_seq := make_seq([8] * 40))
    step(scheduler)
    scheduler.finish(third_seq)  # a second cached prefix evicts the first (max_cached=1)
    removed = [e for e in scheduler.drain_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=[hashes[0], hashes[1], third])]


def test_making_room_for_a_prompt_evicts_the_prefix_it_shares_last() -> None:
    scheduler = make_scheduler(capacity=112)
    shared, other = make_seq([1] * 40), make_seq([2] * 40)
    for seq in (shared, other):  # `shared` is the least recent cached prefix, `other` the most
        scheduler.add(seq)
        step(scheduler)
        scheduler.finish(seq)
    nxt = make_seq([1] * 32 + [3] * 40)  # 72 + 1 cells: one of the two 32-cell prefixes must go
    scheduler.add(nxt)
    plan, _ = scheduler.schedule()
    assert list(scheduler.cached) == [0]  # `other` (seq id 1) went, though more recent
    assert plan.memory_ops[-1] == MemoryOp("cp", nxt.seq_id, src_seq_id=0, end=32)
    assert nxt.num_cached_tokens == 32


def test_a_prompt_that_needs_the_cells_of_the_prefix_it_shares_shares_it_before_it_goes() -> None:
    scheduler = make_scheduler(capacity=112)
    scheduler.offload = True  # with tiers on the evicted prefix is exported too, after the share
    first = make_seq([1] * 40)
    scheduler.add(first)
    step(scheduler)
    scheduler.finish(first)
    nxt = make_seq([1] * 32 + [3] * 60)  # 32 cached + 93 cells > 112, counted per sequence: the prefix goes
    scheduler.add(nxt)
    plan, _ = scheduler.schedule()
    ops = [(op.kind, op.seq_id) for op in plan.memory_ops]
    assert ops[-3:] == [("cp", nxt.seq_id), ("export", 0), ("rm", 0)]
    assert (nxt.num_cached_tokens, list(scheduler.cached)) == (32, [])


def test_a_cached_prefix_a_waiting_prompt_will_share_is_not_the_one_evicted() -> None:
    scheduler = Scheduler(block_size=BS, capacity=1024, max_num_seqs=1, max_cached=4, n_batch=64, max_cached_tokens=40)
    shared, running = make_seq([1] * 40), make_seq([2] * 40)
    scheduler.add(shared)
    step(scheduler)
    scheduler.finish(shared)
    scheduler.add(running)
    step(scheduler)
    waiting = make_seq([1] * 32 + [3] * 8)
    scheduler.add(waiting)  # waits: max_num_seqs=1
    step(scheduler)
    scheduler.finish(running)  # two prefixes > 40 tokens: one goes, not the least recent `shared` one
    assert list(scheduler.cached) == [0]
    step(scheduler)
    assert waiting.num_cached_tokens == 32


def test_out_of_kv_cells_the_newest_sequence_is_preempted_and_later_recomputed() -> None:
    scheduler = make_scheduler(capacity=64, max_cached=0)
    old, new = make_seq([1] * 28), make_seq([2] * 28)
    scheduler.add(old)
    scheduler.add(new)
    assert step(scheduler) == [(0, 28, True), (1, 28, True)]
    for _ in range(4):
        assert step(scheduler) == [(0, 1, True), (1, 1, True)]  # 33 + 33 tokens after the fourth
    assert step(scheduler) == [(0, 1, True)]  # 66 > 64 cells: `new` goes back to the front of the queue
    assert scheduler.waiting[0] is new and new.num_computed == 0
    scheduler.finish(old)
    num_tokens = len(new.tokens)  # prompt and the 5 tokens it had sampled, recomputed in one chunk
    assert step(scheduler) == [(0, num_tokens, True)]
    assert new.num_output_tokens == 6


def test_a_reset_after_a_failed_step_drops_everything_and_clears_the_cache() -> None:
    scheduler = make_scheduler()
    running, waiting = make_seq(list(range(100, 140))), make_seq([3] * 20)
    scheduler.add(running)
    step(scheduler)
    scheduler.drain_events()
    scheduler.add(waiting)
    assert scheduler.reset() == [running, waiting]
    assert scheduler.drain_events() == [AllBlocksCleared()]
    assert scheduler.pending_ops == [MemoryOp("clear", -1)]
    assert (scheduler.running, list(scheduler.waiting), scheduler.refcounts) == ([], [], {})


def imported_seq(prompt: list[int], first_token: int) -> Sequence:
    """A decode request of prompt + [first_token] whose prompt's KV comes with a (checked) state."""
    from dyn_engines.llamacpp.kv_state import CheckedState

    seq = make_seq([*prompt, first_token])
    seq.kv_state, seq.num_imported = CheckedState(b"state", 0, len(prompt), 12, 5), len(prompt)
    return seq


def test_an_imported_prompt_is_loaded_then_its_first_token_decoded_with_no_prefill_counted() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 140))
    seq = imported_seq(prompt, 7)
    scheduler.add(seq)
    plan, scheduled = scheduler.schedule()
    assert [op.kind for op in plan.memory_ops] == ["import"]
    assert (plan.tokens, plan.positions, plan.logits_rows) == ([7], [40], [0])  # first_token, decoded
    assert [b.block_hash for e in scheduler.drain_events() for b in e.blocks] == sequence_hashes(prompt, BS)[:2]
    for part in scheduled:
        scheduler.commit(part)
    assert seq.num_computed == 41
    assert (scheduler.num_prefill_tokens_computed, scheduler.num_prefill_tokens_cached) == (0, 0)


def test_a_state_llama_cpp_refused_leaves_no_cached_prefix_behind() -> None:
    scheduler = make_scheduler()
    seq = imported_seq(list(range(100, 140)), 7)
    scheduler.add(seq)
    scheduler.schedule()
    scheduler.drain_events()
    scheduler.forget_import(seq)
    scheduler.finish(seq)
    assert scheduler.cached == {}
    assert scheduler.pending_ops == [MemoryOp("rm", 0, start=-1, end=-1)]
    assert isinstance(scheduler.drain_events()[0], BlockRemoved)


def test_a_refused_onboard_is_imported_again_once_after_the_cached_prefixes_are_evicted() -> None:
    # llama.cpp imports a state into one contiguous run of free cells; cached prefixes may fragment the cache
    scheduler = make_scheduler()
    old = make_seq(list(range(300, 340)))
    scheduler.add(old)
    step(scheduler)
    scheduler.finish(old)  # a cached prefix (seq 0)
    prompt = list(range(100, 150))
    seq = make_seq(prompt)
    state = object()
    seq.kv_state, seq.num_onboarded = state, 32  # type: ignore[assignment]
    scheduler.add(seq)
    scheduler.pending_ops.clear()
    scheduler.schedule()
    assert scheduler.num_prefill_tokens_cached == 32 and seq.onboard_state is state
    scheduler.retry_onboard(seq)  # the step's import was refused
    assert not scheduler.cached and scheduler.num_prefill_tokens_cached == 0
    assert seq.kv_state is state and seq.num_onboarded == 32 and scheduler.waiting[0] is seq
    ops, _ = scheduler.schedule()
    assert [op.kind for op in ops.memory_ops][-1] == "import" and seq.num_cached_tokens == 32
    scheduler.retry_onboard(seq)  # refused again: recomputed
    assert seq.kv_state is None and seq.num_onboarded == 0 and seq.onboard_state is None
    scheduler.schedule()
    assert seq.num_computed == 0 and scheduler.num_prefill_tokens_cached == 0
