"""The runner over a real store, SQLite and PostgreSQL (the same tests on each), with the request call as the
seam: lines checked up front, run at most `max_inflight` at once, each result committed once, files in input
order; a restart on the same database runs only the unfinished lines; cancel and expiry keep what finished;
two runners on one database run each line once and share the budget."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from dynamo_cli.batch import runner as runner_module
from dynamo_cli.batch.runner import BatchRunner
from dynamo_cli.batch.store import BatchStore, Line, Result, Status, new_id

CHAT = "/v1/chat/completions"


@pytest.fixture(params=["sqlite", "postgres"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The database a test's store opens: a SQLite file, or a fresh PostgreSQL database (skipped without one)."""
    if request.param == "sqlite":
        return str(tmp_path / "b.db")
    return str(request.getfixturevalue("postgres_url"))


def _line(custom_id: str, content: str = "hi", **body: Any) -> bytes:
    request = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": request}).encode()


def _batch(store: BatchStore, lines: list[bytes], window_s: int = 3600) -> str:
    file_id = new_id("file-")
    store.put_file(file_id, "batch", "in.jsonl", io.BytesIO(b"\n".join(lines) + b"\n"))
    batch_id = new_id("batch_")
    store.create_batch(batch_id, CHAT, file_id, window_s, {"k": "v"})
    return batch_id


class Calls:
    """The request seam: answers each line with its content echoed, counting concurrency."""

    def __init__(self, delay: float = 0.0, gate: asyncio.Event | None = None) -> None:
        self.delay, self.gate = delay, gate
        self.seen: list[str] = []
        self.now = self.most = 0

    async def __call__(self, endpoint: str, raw: bytes, left_s: float) -> Result:
        body = json.loads(raw)
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.delay)
            content = body["messages"][0]["content"]
            self.seen.append(content)
            reply = {
                "choices": [{"message": {"content": content}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
            return Result(200, reply, 3, 1)
        finally:
            self.now -= 1


async def _until(store: BatchStore, batch_id: str, statuses: set[str], runner: BatchRunner | None) -> dict[str, Any]:
    task = asyncio.create_task(runner.run() if runner is not None else asyncio.sleep(3600))
    try:
        for _ in range(500):
            batch = store.batch(batch_id)
            assert batch is not None
            if batch["status"] in statuses:
                return batch
            await asyncio.sleep(0.02)
        raise AssertionError(f"batch stayed {batch['status']}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _rows(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    return [] if file_id is None else [json.loads(x) for x in (store.file_bytes(file_id) or b"").splitlines()]


async def test_a_batch_runs_its_good_lines_and_refuses_its_bad_ones_each_once_in_order(where: str) -> None:
    store = BatchStore(where)
    good = [_line(f"r{i}", f"q{i}") for i in range(20)]
    bad = [b"not json", _line("r3"), _line("r20", max_tokens=-1), _line("r21", stream=True)]
    batch_id = _batch(store, good[:10] + bad + good[10:])
    calls = Calls(delay=0.01)
    batch = await _until(store, batch_id, {"completed"}, BatchRunner(store, calls, lambda: 3))
    assert batch["request_counts"] == {"total": 24, "completed": 20, "failed": 4}
    assert calls.most <= 3 and sorted(calls.seen) == sorted(f"q{i}" for i in range(20))
    out, err = _rows(store, batch["output_file_id"]), _rows(store, batch["error_file_id"])
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(20)]
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in out] == [f"q{i}" for i in range(20)]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in err] == [
        (None, 400),
        (None, 400),  # r3 again: its custom_id repeats an earlier line's
        ("r20", 400),
        ("r21", 400),
    ]
    assert err[2]["response"]["body"]["error"]["param"] == "max_tokens"
    assert store.figures()[1] == {"prompt": 60, "completion": 20}


async def test_a_restart_runs_only_the_unfinished_lines(where: str) -> None:
    store = BatchStore(where)
    batch_id = _batch(store, [_line(f"r{i}", f"q{i}") for i in range(10)])
    gate = asyncio.Event()
    first = Calls(gate=gate)
    runner = BatchRunner(store, first, lambda: 4, owner=f"{socket.gethostname()}:999999999:x")  # a gone pid
    task = asyncio.create_task(runner.run())
    while first.now < 4:
        await asyncio.sleep(0.01)
    store.finish_line(
        batch_id, 0, Result(200, {"done": "before"}), runner.owner
    )  # as if line 0 had finished before the kill
    task.cancel()  # the "kill": 4 lines in flight, cancelled, never committed
    await asyncio.gather(task, return_exceptions=True)
    second = Calls()
    batch = await _until(BatchStore(where), batch_id, {"completed"}, BatchRunner(store, second, lambda: 4))
    assert sorted(second.seen) == sorted(f"q{i}" for i in range(1, 10))
    out = _rows(store, batch["output_file_id"])
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(10)]
    assert out[0]["response"]["body"] == {"done": "before"}


async def test_cancel_keeps_what_finished_and_stops_the_rest(where: str) -> None:
    store = BatchStore(where)
    batch_id = _batch(store, [_line(f"r{i}", f"q{i}") for i in range(50)])
    calls = Calls(delay=0.05)
    runner = BatchRunner(store, calls, lambda: 2)
    task = asyncio.create_task(runner.run())
    while store.batch(batch_id)["request_counts"]["completed"] < 4:  # type: ignore[index]
        await asyncio.sleep(0.01)
    assert store.set_status(batch_id, Status.CANCELLING)
    runner.wake()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    batch = await _until(store, batch_id, {"cancelled"}, runner)
    out = _rows(store, batch["output_file_id"])
    assert batch["request_counts"]["completed"] == len(out) < 50
    assert len({r["custom_id"] for r in out}) == len(out)


async def test_an_expired_batch_reports_its_counts(where: str) -> None:
    store = BatchStore(where)
    batch_id = _batch(store, [_line(f"r{i}") for i in range(5)] + [b"[]"], window_s=0)
    batch = await _until(store, batch_id, {"expired"}, BatchRunner(store, Calls(), lambda: 2))
    assert batch["request_counts"] == {"total": 6, "completed": 0, "failed": 1}
    assert batch["output_file_id"] is None and len(_rows(store, batch["error_file_id"])) == 1


@pytest.mark.parametrize("content", [b"", b"\n\n"])
async def test_an_empty_file_fails_the_batch(where: str, content: bytes) -> None:
    store = BatchStore(where)
    file_id = new_id("file-")
    store.put_file(file_id, "batch", "in.jsonl", io.BytesIO(content))
    store.create_batch("batch_x", CHAT, file_id, 60, None)
    batch = await _until(store, "batch_x", {"failed"}, BatchRunner(store, Calls(), lambda: 2))
    assert json.loads(batch["errors"])["data"][0]["code"] == "empty_file"


async def test_two_runners_on_one_database_run_each_line_once_and_share_the_budget(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frontends on several hosts: each line runs on one of them, once; together they hold the budget, not
    each; one of them writes the files."""
    monkeypatch.setattr(runner_module, "HEARTBEAT_S", 0.0)  # the share counted each round, not every 10 s
    store = BatchStore(where)
    batch_id = _batch(store, [_line(f"r{i}", f"q{i}") for i in range(40)])
    calls, by = Calls(delay=0.1), {"a": 0, "b": 0}  # long enough for both to take part (a poll is 1 s)

    def tagged(tag: str) -> Any:
        async def call(endpoint: str, raw: bytes, left_s: float) -> Result:
            by[tag] += 1
            return await calls(endpoint, raw, left_s)

        return call

    runners = [BatchRunner(BatchStore(where), tagged(tag), lambda: 4, owner=f"host-{tag}:1:x") for tag in by]
    for runner in runners:  # both alive before either claims a line
        store.runners(runner.owner, 30.0)
    tasks = [asyncio.create_task(runner.run()) for runner in runners]
    try:
        batch = await _until(store, batch_id, {"completed"}, None)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert sorted(calls.seen) == sorted(f"q{i}" for i in range(40))  # each line once
    assert calls.most <= 4 and by["a"] > 0 and by["b"] > 0
    assert [r["custom_id"] for r in _rows(store, batch["output_file_id"])] == [f"r{i}" for i in range(40)]


def test_only_one_runner_writes_a_batchs_files_until_its_lease_runs_out(where: str) -> None:
    store = BatchStore(where)
    batch_id = _batch(store, [_line("r0")])
    assert store.claim_finalizing(batch_id, "host-a:1:x", 30.0)
    assert not store.claim_finalizing(batch_id, "host-b:1:x", 30.0)
    assert store.claim_finalizing(batch_id, "host-a:1:x", -1.0)  # its own again (a lease already over, now)
    assert store.claim_finalizing(batch_id, "host-b:1:x", 30.0)  # a's lease ran out
    second = _batch(store, [_line("r0")])
    assert store.claim_finalizing(second, f"{socket.gethostname()}:999999999:x", 30.0)  # a process now gone
    assert store.claim_finalizing(second, "host-d:1:x", 30.0)  # taken at once, not after its lease


def _scanned(store: BatchStore) -> tuple[dict[str, int], dict[str, int]]:
    """The figures counted the slow way: every line ever run."""
    with store.database.connection() as db:
        rows = db.execute("SELECT state, COUNT(*) FROM lines GROUP BY state").fetchall()
        tokens = db.execute("SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM lines")
        prompt, completion = tokens.fetchone()
    lines = {"pending": 0, "done": 0, "failed": 0} | {state: int(n) for state, n in rows}
    return lines, {"prompt": int(prompt), "completion": int(completion)}


async def test_the_metrics_figures_read_closed_batches_from_their_tallies_and_agree_with_every_line(
    where: str,
) -> None:
    """/metrics sums a closed batch's tallies (kept when it closed) instead of scanning its lines: the figures
    are those of every line, open batches and closed ones, cancelled lines left pending included."""
    store = BatchStore(where)
    done = _batch(store, [_line(f"r{i}", f"q{i}") for i in range(6)] + [b"[]"])
    await _until(store, done, {"completed"}, BatchRunner(store, Calls(), lambda: 3))
    cancelled = _batch(store, [_line(f"r{i}", f"q{i}") for i in range(30)])
    runner = BatchRunner(store, Calls(delay=0.05), lambda: 2)
    task = asyncio.create_task(runner.run())
    while store.batch(cancelled)["request_counts"]["completed"] < 2:  # type: ignore[index]
        await asyncio.sleep(0.01)
    store.set_status(cancelled, Status.CANCELLING)
    runner.wake()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    closed = await _until(store, cancelled, {"cancelled"}, runner)
    still_open = _batch(store, [_line("o0"), b"{"])
    await _until(store, still_open, {"in_progress"}, BatchRunner(store, Calls(gate=asyncio.Event()), lambda: 1))
    assert store.figures() == _scanned(store)
    with store.database.connection() as db:  # the closed ones are read from their rows
        row = db.one("SELECT lines_pending, lines_done, lines_failed FROM batches WHERE id = ?", (cancelled,))
    assert row is not None and row["lines_done"] == closed["request_counts"]["completed"] >= 2
    assert row["lines_pending"] + row["lines_done"] == 30 and row["lines_failed"] == 0


def test_no_line_is_committed_once_a_runner_writes_the_batchs_files(where: str) -> None:
    """Two frontends, a cancel: the one writing the files holds the batch, and a line the other was running
    stays pending (out of the files and the counts) instead of landing after the files were read."""
    store = BatchStore(where)
    batch_id = _batch(store, [_line("r0"), _line("r1")])
    store.add_lines(batch_id, [Line(0, "r0", b"{}"), Line(1, "r1", b"{}")], [])
    assert [line.line_no for line in store.claim(batch_id, "host-a:1:x", 2, 30.0)] == [0, 1]
    assert store.finish_line(batch_id, 0, Result(200, {"ok": 0}), "host-a:1:x")
    assert store.claim_finalizing(batch_id, "host-b:1:x", 30.0)
    assert not store.finish_line(batch_id, 1, Result(200, {"ok": 1}), "host-a:1:x")
    store.close_batch(batch_id, Status.CANCELLED, None, None)
    assert store.batch(batch_id)["request_counts"] == {"total": 2, "completed": 1, "failed": 0}  # type: ignore[index]


def test_a_database_whose_closed_batches_have_no_tallies_gets_them_when_opened(where: str) -> None:
    """A database a version before the tallies closed batches in: the store counts them once, when opened."""
    store = BatchStore(where)
    batch_id = _batch(store, [_line("r0")])
    store.add_lines(batch_id, [Line(0, "r0", b"{}")], [])
    store.claim(batch_id, "host-a:1:x", 1, 30.0)
    store.finish_line(batch_id, 0, Result(200, {}, 5, 2), "host-a:1:x")
    store.set_status(batch_id, Status.COMPLETED)  # closed with no tallies, as before them
    assert BatchStore(where).figures() == ({"pending": 0, "done": 1, "failed": 0}, {"prompt": 5, "completion": 2})


async def test_the_runner_outlives_a_database_outage_and_finishes_the_batch(postgres_server: object) -> None:
    """PostgreSQL stopped mid-batch: each round fails (said once in the log), the runner, and so the frontend,
    goes on; with the server back the batch completes with every line once."""
    from tests.postgres import find_postgres, start_postgres

    bindir = find_postgres()
    assert bindir is not None
    pg = start_postgres(bindir)
    try:
        store = BatchStore(pg.new_database())
        batch_id = _batch(store, [_line(f"r{i}", f"q{i}") for i in range(30)])
        calls = Calls(delay=0.05)
        task = asyncio.create_task(BatchRunner(store, calls, lambda: 2).run())
        while len(calls.seen) < 4:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(2.5)  # two rounds or more against no server
        assert not task.done()
        await asyncio.to_thread(pg.start)
        batch = None
        for _ in range(600):
            with contextlib.suppress(*store.database.unavailable):  # this thread's own connection broke too
                batch = await asyncio.to_thread(store.batch, batch_id)
            if batch is not None and batch["status"] == "completed":
                break
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert batch is not None and batch["status"] == "completed", batch
        out = _rows(store, batch["output_file_id"])
        assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(30)]
    finally:
        pg.remove()
