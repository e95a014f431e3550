"""The batch runner: takes up every unfinished batch, runs its lines through the frontend, writes its files.

Each line is one request to the frontend's own request path, in process (no socket): the same validation,
routing, router queue and metrics as an HTTP request, at the lowest priority (frontend/internal.py
`INTERNAL_PRIORITY`, below any a client may send) with the batch's window as its deadline. So a busy deployment
serves interactive requests first, and the runner never holds more than its budget of requests at once.

NOTE: the loop, once a second or when woken (a batch created or cancelled):
    take up each open batch (validating: check its lines; in_progress: start lines up to the budget;
    past its window: expire; cancelling: stop its lines; every line finished: finalize), then sleep.
A restart runs the same loop over the same database: finished lines are kept, pending ones run again.
Runners on several frontends may share one database (PostgreSQL): each line is run by the one holding its
lease, the files by the one holding the batch's finalizing lease, and each runs its share of the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dynamo_cli.batch.lines import ENDPOINTS, check_lines, refusal
from dynamo_cli.batch.store import TERMINAL, BatchStore, Line, LineState, Result, Status, runner_name
from dynamo_cli.errors import RequestError
from dynamo_cli.runtime.supervisor import cancel_and_wait

logger = logging.getLogger(__name__)

Call = Callable[[str, bytes, float], Awaitable[Result]]
"""Runs one request: (endpoint path, body JSON, seconds left in the window) -> its status and body."""

POLL_S = 1.0
"""How often the runner looks for work when nothing wakes it (and renews its leases)."""
OVERLOAD_PAUSE_S = 1.0
"""After a line was refused for overload, new lines wait this long (interactive requests come first)."""
LEASE_S = 30.0
"""How long a line this runner holds stays its own without renewal: after that (a frontend on another host
gone), another runner may take it. A holder on this host that is gone loses its lines at once."""
FINALIZE_LEASE_S = 600.0
"""How long a runner writing a batch's files holds it (a runner of another host that died mid-way: another
takes over after this; one of this host, at once). Long: a 200 MB output takes well under it to write."""
HEARTBEAT_S = 10.0
"""How often the runner says it is alive in the database, and counts the runners sharing the budget."""


class BatchRunner:
    """Runs the lines of every open batch in `store`, at most `budget()` at once."""

    def __init__(self, store: BatchStore, call: Call, budget: Callable[[], int], owner: str | None = None) -> None:
        self.store = store
        self.owner = owner or runner_name()
        """This runner's name on the lines it holds (several frontends may share one database)."""
        self._call = call
        self._budget = budget
        """The most lines in flight now (the workers serving change: it is asked each round)."""
        self._held_until = 0.0
        """After an overload reply (503, 429), no new line starts before this `time.monotonic()`."""
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        """The lines in flight, by (batch id, line number); each task owned here and cancelled on close."""
        self._wake = asyncio.Event()
        self._share = 1
        """The runners sharing the database (frontends on several hosts): each runs its part of the budget."""
        self._said_at = -HEARTBEAT_S
        self._failing = False
        """The last round failed (said once in the log, not every round)."""

    def wake(self) -> None:
        """A batch was created or cancelled: look at once, not at the next poll."""
        self._wake.set()

    @property
    def inflight(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        """Until cancelled (the owner's task group): advance every open batch, then wait."""
        try:
            while True:
                try:
                    await self._round()
                except Exception as exc:  # noqa: BLE001  (the database out of reach: the next round tries again)
                    if not self._failing:
                        logger.warning("batch runner: %s; trying again every %.0f s", exc, POLL_S)
                    self._failing = True
                else:
                    if self._failing:
                        logger.info("batch runner: the database answers again")
                    self._failing = False
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel
                    async with asyncio.timeout(POLL_S):
                        await self._wake.wait()
        finally:
            await cancel_and_wait(*self._running.values())
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.leave, self.owner)

    async def _round(self) -> None:
        if time.monotonic() - self._said_at >= HEARTBEAT_S:
            self._share = await asyncio.to_thread(self.store.runners, self.owner, LEASE_S)
            self._said_at = time.monotonic()
        if self._running:
            await asyncio.to_thread(self.store.renew, self.owner, LEASE_S)
        for batch_id in await asyncio.to_thread(self.store.unfinished):
            try:
                await self._advance(batch_id)
            except self.store.database.unavailable:
                raise
            except Exception:  # one batch's fault stops neither the others nor the frontend
                logger.exception("batch %s", batch_id)

    async def _advance(self, batch_id: str) -> None:
        batch = await asyncio.to_thread(self.store.header, batch_id)
        if batch is None or batch["status"] in TERMINAL:
            return
        status = Status(batch["status"])
        if status is Status.VALIDATING:
            await self._validate(batch)
        elif status is Status.CANCELLING:
            await self._stop(batch_id)
            await self._finalize(batch_id, Status.CANCELLED)
        elif time.time() >= batch["expires_at"]:
            await self._stop(batch_id)
            await self._finalize(batch_id, Status.EXPIRED)
        elif status is Status.FINALIZING:
            await self._finalize(batch_id, Status.COMPLETED)
        else:
            await self._start_lines(batch)

    async def _validate(self, batch: dict[str, Any]) -> None:
        endpoint = batch["endpoint"]
        raw = await asyncio.to_thread(self.store.file_bytes, batch["input_file_id"])
        if raw is None:
            message = f"the input file {batch['input_file_id']} has no content (deleted?)"
            await asyncio.to_thread(self.store.fail_batch, batch["id"], [_error("file_unreadable", message)])
            return
        valid, invalid = await asyncio.to_thread(check_lines, endpoint, (ln for ln in raw.splitlines() if ln.strip()))
        if not valid and not invalid:
            await asyncio.to_thread(
                self.store.fail_batch, batch["id"], [_error("empty_file", "the input file has no line")]
            )
            return
        await asyncio.to_thread(self.store.add_lines, batch["id"], valid, invalid)
        await asyncio.to_thread(
            self.store.set_status, batch["id"], Status.IN_PROGRESS, only_from=frozenset({Status.VALIDATING})
        )
        logger.info("batch %s: %d lines to run, %d refused", batch["id"], len(valid), len(invalid))

    async def _start_lines(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        room = max(1, self._budget() // self._share) - len(self._running)
        if room > 0 and time.monotonic() >= self._held_until:
            running = [no for bid, no in self._running if bid == batch_id]
            for line in await asyncio.to_thread(self.store.claim, batch_id, self.owner, room, LEASE_S, running):
                task = asyncio.create_task(self._run_line(batch_id, batch["endpoint"], batch["expires_at"], line))
                self._running[(batch_id, line.line_no)] = task
        mine = any(bid == batch_id for bid, _ in self._running)
        if not mine and not await asyncio.to_thread(self.store.has_pending, batch_id):
            await asyncio.to_thread(
                self.store.set_status, batch_id, Status.FINALIZING, only_from=frozenset({Status.IN_PROGRESS})
            )
            await self._finalize(batch_id, Status.COMPLETED)

    async def _run_line(self, batch_id: str, endpoint: str, expires_at: float, line: Line) -> None:
        try:
            try:
                result = await self._call(endpoint, line.request, max(expires_at - time.time(), 0.001))
            except RequestError as exc:
                result = refusal(exc)
            if result.status_code in (429, 503) or result.status_code >= 500:
                # overload or a failed worker: the line stays pending and runs again, after a pause
                self._held_until = time.monotonic() + OVERLOAD_PAUSE_S
                await asyncio.to_thread(self.store.release, batch_id, self.owner, [line.line_no])
                return
            await _uncancelled(asyncio.to_thread(self.store.finish_line, batch_id, line.line_no, result, self.owner))
        except Exception:
            logger.exception("batch %s line %d", batch_id, line.line_no)
        finally:
            self._running.pop((batch_id, line.line_no), None)
            self._wake.set()

    async def _stop(self, batch_id: str) -> None:
        """Cancel the batch's lines in flight: they stay pending, and so out of the files."""
        tasks = [task for (bid, _), task in self._running.items() if bid == batch_id]
        for task in tasks:
            task.cancel()
        if tasks:  # not cancel_and_wait: that would swallow a cancellation of the runner itself
            await asyncio.wait(tasks)
        stopped = [no for bid, no in list(self._running) if bid == batch_id]
        await asyncio.to_thread(self.store.release, batch_id, self.owner, stopped)

    async def _finalize(self, batch_id: str, final: Status) -> None:
        """Write the output and error files from the finished lines, then mark the batch `final` (unless another
        runner sharing the database is writing them now). Once this runner holds the batch, no line's result is
        committed any more (store.finish_line): the files and the counts hold the same lines."""
        if not await asyncio.to_thread(self.store.claim_finalizing, batch_id, self.owner, FINALIZE_LEASE_S):
            return
        output_id, error_id = await asyncio.to_thread(self._write_files, batch_id)
        await asyncio.to_thread(self.store.close_batch, batch_id, final, output_id, error_id)
        logger.info("batch %s %s", batch_id, final.value)

    def _write_files(self, batch_id: str) -> tuple[str | None, str | None]:
        suffix = batch_id.removeprefix("batch_")
        ids = {LineState.DONE: f"file-out{suffix}", LineState.FAILED: f"file-err{suffix}"}
        with contextlib.ExitStack() as files:
            spools = {state: files.enter_context(tempfile.TemporaryFile()) for state in ids}
            written = dict.fromkeys(ids, 0)
            for line_no, custom_id, state, status_code, body in self.store.results(batch_id):
                row = {
                    "id": f"batch_req_{suffix}_{line_no}",
                    "custom_id": custom_id,
                    "response": {"status_code": status_code, "request_id": f"{suffix}-{line_no}", "body": body},
                    "error": None,
                }
                spools[LineState(state)].write(json.dumps(row, separators=(",", ":")).encode() + b"\n")
                written[LineState(state)] += 1
            out: dict[LineState, str | None] = dict.fromkeys(ids)
            for state, file_id in ids.items():
                if written[state]:
                    spools[state].seek(0)
                    name = f"{batch_id}_{state.value}.jsonl"
                    self.store.put_file(file_id, "batch_output", name, spools[state], batch_id)
                    out[state] = file_id
        return out[LineState.DONE], out[LineState.FAILED]


async def _uncancelled(work: Awaitable[Any]) -> None:
    """Await `work` to its end even when cancelled meanwhile (then re-raised): a result being committed is in the
    database before the task ends, so files written once the batch's tasks ended hold every committed line."""
    future = asyncio.ensure_future(work)
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        await future
        raise


def _error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": None}


__all__ = ["ENDPOINTS", "BatchRunner", "Call"]
