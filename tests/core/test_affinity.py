"""Session affinity (routing/sessions.py, core/affinity.py): a bounded, expiring table, and choices that keep a
session on its worker (soft: unless busy or its cache lost the context; hard: always), starting a sub-agent where
its parent is, moving a session whose worker left, and saying so in the explanation."""

from __future__ import annotations

import pytest

from dynamo_cli.config import BusyThresholds, KvRouterConfig, SessionConfig
from dynamo_cli.core.holds import Pool, Wanted, choose
from dynamo_cli.errors import ConfigError, Overloaded, RequestError
from dynamo_cli.kv.events import BlockStored, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.sessions import Session, SessionTable, session_from, session_of
from dynamo_cli.routing.target import Target
from tests.core.test_holds import worker

PROMPT = list(range(1, 65))
ONE_EACH = BusyThresholds(max_inflight=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_table_expires_bounds_and_forgets_departed_workers() -> None:
    clock = Clock()
    table = SessionTable(clock)
    table.bind("a", Target(1), max_entries=3)
    assert table.get("a", ttl_s=10, workers={1, 2}) == Target(1)
    clock.now = 11
    assert table.get("a", ttl_s=10, workers={1, 2}) is None and len(table) == 0  # expired, dropped
    for i in range(100_000):
        table.bind(f"s{i}", Target(i % 4), max_entries=65_536)
    assert len(table) == 65_536 and table.get("s0", 10, range(4)) is None  # the oldest went first
    assert table.get("s99999", 10, range(4)) == Target(99_999 % 4)
    assert table.get("s99998", 10, {0}) is None  # its worker (2) left: the session moves


def test_session_ids_are_checked_like_headers() -> None:
    assert session_of({b"x-dynamo-session-id": b"abc", b"x-dyn-parent-session-id": b"root"}) == Session("abc", "root")
    assert session_of({}) is None
    for bad in (b"", b"a b", b"x" * 257, "é".encode()):
        with pytest.raises(RequestError, match="x-dyn-session-id"):
            session_of({b"x-dyn-session-id": bad})
    assert session_from("s", None, ("session_id", "parent_session_id")) == Session("s")
    with pytest.raises(ConfigError):
        SessionConfig(mode="sticky")


def kv_pool(*ids: int, mode: str = "soft") -> tuple[Pool, KvRoutingPolicy]:
    policy = KvRoutingPolicy(KvRouterConfig(block_size=16))
    workers = {i: worker(i) for i in ids}
    return Pool("m", workers, policy, sessions=SessionTable(), session_rules=SessionConfig(mode=mode)), policy


def cache(policy: KvRoutingPolicy, worker_id: int, tokens: list[int], event_id: int = 0) -> None:
    """The worker reports it holds `tokens`' blocks."""
    hashes, local = sequence_hashes(tokens, 16), block_hashes(tokens, 16)
    blocks = [StoredBlock(h, lh) for h, lh in zip(hashes, local, strict=True)]
    stored = BlockStored(parent_hash=None, blocks=blocks)
    policy.apply_kv_events(KvEventBatch(worker_id=worker_id, event_id=event_id, events=[stored]))


ANY = BusyThresholds()


def call(p: Pool, request_id: str, session: Session, prompt: list[int] = PROMPT, busy: BusyThresholds = ANY) -> int:
    hold = choose(p, Wanted(request_id, prompt, session=session), busy)
    hold.release()
    return hold.worker.instance_id


async def test_soft_affinity_keeps_a_session_on_its_worker_and_explains_it() -> None:
    p, policy = kv_pool(1, 2, 3, 4)
    first = call(p, "r0", Session("agent"))
    assert all(call(p, f"r{i}", Session("agent"), PROMPT + [i]) == first for i in range(1, 8))
    hold = choose(p, Wanted("r9", PROMPT, session=Session("agent")), BusyThresholds())
    explained = hold.decision.explanation if hold.decision is not None else None
    hold.release()
    assert explained is not None and explained["session"]["outcome"] == "kept"
    assert explained["session"]["bound_worker_id"] == f"{first:x}"


async def test_soft_affinity_moves_a_session_whose_worker_is_busy_or_lost_its_context() -> None:
    p, policy = kv_pool(1, 2)
    first = call(p, "r0", Session("agent"))
    other = 2 if first == 1 else 1
    busy = choose(p, Wanted("hog", [9, 9, 9]), BusyThresholds())  # fills `first`'s one slot
    if busy.worker.instance_id != first:
        busy.release()
        busy = choose(p, Wanted("hog", [9, 9, 9], pinned=first), BusyThresholds())
    assert call(p, "r1", Session("agent"), busy=ONE_EACH) == other  # soft: the busy worker is left
    busy.release()
    assert call(p, "r2", Session("agent")) == other  # ... and the session now lives there
    cache(policy, other, [3] * 32)  # both workers publish KV events: `other` holds another prompt's blocks
    cache(policy, first, PROMPT)  # the context is cached on `first` only now
    assert call(p, "r3", Session("agent")) == first  # the KV cost moves it back


async def test_hard_affinity_waits_for_its_busy_worker() -> None:
    p, _ = kv_pool(1, 2, mode="hard")
    first = call(p, "r0", Session("agent"))
    held = choose(p, Wanted("hog", PROMPT, pinned=first), BusyThresholds())
    with pytest.raises(Overloaded):  # the queue (choose_or_wait) would wait for it; it never goes elsewhere
        choose(p, Wanted("r1", PROMPT, session=Session("agent")), ONE_EACH)
    held.release()
    assert call(p, "r2", Session("agent"), busy=ONE_EACH) == first


async def test_a_sub_agent_starts_where_its_parent_is_and_a_departed_worker_moves_the_session() -> None:
    p, _ = kv_pool(1, 2, 3, 4)
    parent = call(p, "p0", Session("root"), [5] * 64)
    assert call(p, "c0", Session("child", parent="root"), [7] * 64) == parent  # no context of its own yet
    del p.workers[parent]  # the worker left discovery
    moved = call(p, "p1", Session("root"), [5] * 64)
    assert moved != parent and call(p, "p2", Session("root"), [5] * 64) == moved
