"""In-flight load: prefill tokens until the first token, deduplicated active blocks until the end."""

from __future__ import annotations

from dynamo_cli.routing.sequences import ActiveSequences
from dynamo_cli.routing.target import Target

A, B, C, D, X, Y = 11, 12, 13, 14, 21, 22


def test_a_routed_request_adds_its_prefill_tokens_and_blocks() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", target=Target(1), hashes=[A, B, C], prefill_tokens=40)

    assert sequences.active_prefill_tokens(Target(1)) == 40
    assert sequences.active_blocks(Target(1)) == 3
    assert sequences.active_blocks(Target(2)) == 0
    assert sequences.target_of("r1") == Target(1)
    assert sequences.num_requests(Target(1)) == 1


def test_the_first_token_clears_prefill_but_keeps_the_blocks() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A, B], prefill_tokens=32)
    sequences.add_request("r2", Target(1), [X], prefill_tokens=16)

    assert sequences.mark_prefill_completed("r1") is True
    assert sequences.active_prefill_tokens(Target(1)) == 16
    assert sequences.active_blocks(Target(1)) == 3
    assert sequences.mark_prefill_completed("r1") is False
    assert sequences.active_prefill_tokens(Target(1)) == 16


def test_requests_sharing_a_prefix_on_one_worker_count_its_blocks_once() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A, B, C], 0)
    sequences.add_request("r2", Target(1), [A, B, D], 0)
    sequences.add_request("r3", Target(2), [A, B, C], 0)

    assert sequences.active_blocks(Target(1)) == 4
    assert sequences.active_blocks(Target(2)) == 3
    sequences.free("r1")
    assert sequences.active_blocks(Target(1)) == 3  # A and B still used by r2
    sequences.free("r2")
    assert sequences.active_blocks(Target(1)) == 0
    assert sequences.active_blocks(Target(2)) == 3


def test_free_is_idempotent() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A, B], prefill_tokens=32)
    sequences.add_request("r2", Target(1), [A], prefill_tokens=16)

    assert sequences.free("r1") is True
    assert sequences.free("r1") is False  # finish, then disconnect: counted once
    assert sequences.mark_prefill_completed("r1") is False
    assert (sequences.active_prefill_tokens(Target(1)), sequences.active_blocks(Target(1))) == (16, 1)
    assert sequences.free("never-routed") is False


def test_freeing_before_the_first_token_also_drops_the_prefill_load() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A], prefill_tokens=500)
    sequences.free("r1")

    assert (sequences.active_prefill_tokens(Target(1)), sequences.active_blocks(Target(1))) == (0, 0)


def test_active_overlap_counts_the_contiguous_prefix_already_in_flight() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A, B, C], 0)
    sequences.add_request("r2", Target(2), [A, X], 0)
    sequences.add_request("r3", Target(3), [B, C], 0)

    assert sequences.active_overlaps([A, B, C, D]) == {Target(1): 3, Target(2): 1}
    sequences.free("r1")
    assert sequences.active_overlaps([A, B, C, D]) == {Target(2): 1}


def test_a_request_id_routed_again_moves_its_load() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A, B], prefill_tokens=32)
    sequences.add_request("r1", Target(2), [A, B], prefill_tokens=16)

    assert (sequences.active_blocks(Target(1)), sequences.active_prefill_tokens(Target(1))) == (0, 0)
    assert (sequences.active_blocks(Target(2)), sequences.active_prefill_tokens(Target(2))) == (2, 16)


def test_removing_a_worker_frees_its_requests() -> None:
    sequences = ActiveSequences()
    sequences.add_request("r1", Target(1), [A, B], 32)
    sequences.add_request("r2", Target(1), [A, Y], 32)
    sequences.add_request("r3", Target(2), [A], 16)

    assert sorted(sequences.remove_worker(1)) == ["r1", "r2"]
    assert sequences.active_blocks(Target(1)) == 0
    assert sequences.active_overlaps([A, B]) == {Target(2): 1}
    assert sequences.free("r1") is False


def test_requests_older_than_the_stale_age_expire() -> None:
    sequences = ActiveSequences()
    sequences.add_request("old", Target(1), [A], 16, now=0.0)
    sequences.add_request("new", Target(1), [B], 16, now=200.0)

    assert sequences.expire(now=300.0) == []  # exactly 300 s old is not yet stale
    assert sequences.expire(now=300.5) == ["old"]
    assert (sequences.active_blocks(Target(1)), sequences.active_prefill_tokens(Target(1))) == (1, 16)


##### The per-target totals are incremental: they must equal a recount from the requests in flight #####

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, 7),
            st.builds(Target, st.integers(0, 2), st.integers(0, 1)),
            st.lists(st.integers(0, 9), max_size=6),
            st.integers(0, 300),
        ),
        st.tuples(st.just("first"), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("remove"), st.integers(0, 2)),
    ),
    max_size=60,
)


def recount(sequences: ActiveSequences, ids: range, target: Target) -> tuple[int, int, int]:
    """Prefill tokens, unique active blocks and requests of `target`, from scratch."""
    mine = [d for d in map(sequences.describe, (f"r{i}" for i in ids)) if d is not None and d[0] == target]
    return sum(d[2] for d in mine), len({h for d in mine for h in d[1]}), len(mine)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_incremental_totals_equal_a_recount_after_any_history(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    sequences, ids = ActiveSequences(), range(8)
    targets = [Target(w, r) for w in (0, 1, 2) for r in (0, 1)]  # "remove" drops both ranks of a worker
    for op in ops:
        if op[0] == "add":
            _, n, target, hashes, prefill = op
            sequences.add_request(f"r{n}", target, hashes, prefill)
        elif op[0] == "first":
            sequences.mark_prefill_completed(f"r{op[1]}")
        elif op[0] == "free":
            sequences.free(f"r{op[1]}")
        else:
            sequences.remove_worker(op[1])
        expected = [recount(sequences, ids, t) for t in targets]
        assert list(zip(*sequences.totals(targets), strict=True)) == expected
        assert [
            (sequences.active_prefill_tokens(t), sequences.active_blocks(t), sequences.num_requests(t)) for t in targets
        ] == expected
        assert sequences.active_overlaps(QUERY) == recount_overlaps(sequences, ids)


QUERY = [0, 1, 2, 3, 4, 5]


def recount_overlaps(sequences: ActiveSequences, ids: range) -> dict[Target, int]:
    """Target -> contiguous blocks of QUERY active there, from scratch (0s omitted)."""
    active: dict[Target, set[int]] = {}
    for d in map(sequences.describe, (f"r{i}" for i in ids)):
        if d is not None:
            active.setdefault(d[0], set()).update(d[1])
    depths = {w: next((i for i, h in enumerate(QUERY) if h not in held), len(QUERY)) for w, held in active.items()}
    return {w: depth for w, depth in depths.items() if depth}
