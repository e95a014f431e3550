"""Batches, their files and their lines in a database: what survives a SIGKILL of the frontend.

SQLite by default (`--batch-db PATH`, files' bytes in a directory beside it), or PostgreSQL (`--batch-db
postgresql://...`, files' bytes in a table) for frontends on several hosts sharing batches: batch/sql.py holds
what differs. Every state change is one transaction, and a line's result is committed when it is known, so a
restart finds each line either finished (its result kept, never run again) or not (run again): the output then
holds each `custom_id` exactly once. SQLite in WAL mode with `synchronous=NORMAL` loses no committed transaction
when the process dies; only a power cut can take the last ones back, and then those lines simply run again.

Several runners may share one database (frontends on several hosts): a line is run by the runner holding its
lease, a batch's files are written by the runner holding its finalizing lease, and the runners split the
budget of lines in flight between them (`runners`).

The store is synchronous and does no I/O beyond its database (and files directory): the API and the runner
call it through `asyncio.to_thread` (batch/service.py).

NOTE: a batch's life, as OpenAI's Batch API defines it:

    validating -> in_progress -> finalizing -> completed
         |             |-> cancelling -> cancelled
         |             |-> expired (the completion window passed; finished lines are kept)
         '-> failed (the input file as a whole is unusable: no valid line, wrong endpoint for every line)
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import secrets
import socket
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dynamo_cli.batch.sql import TALLIES, Conn, open_database


class Status(enum.StrEnum):
    """A batch's status, OpenAI's names."""

    VALIDATING = "validating"  # its input file being read and each line checked
    IN_PROGRESS = "in_progress"  # lines running
    FINALIZING = "finalizing"  # every line done: the output and error files being written
    COMPLETED = "completed"  # both files written
    FAILED = "failed"  # the input as a whole unusable (`errors` says why)
    EXPIRED = "expired"  # the window passed first; finished lines are in the files
    CANCELLING = "cancelling"  # no new line starts; running ones finish
    CANCELLED = "cancelled"  # and the files of what finished are written


class LineState(enum.StrEnum):
    """One input line's state."""

    PENDING = "pending"  # valid, not run yet (or running when the process died: run again)
    DONE = "done"  # a 200 reply, in the output file
    FAILED = "failed"  # invalid, or its request failed: in the error file


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED})
"""No line of these runs any more."""

_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def new_id(prefix: str) -> str:
    """`file-…`, `batch_…`: 24 random characters after OpenAI's prefixes."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class Line:
    """One input line as the runner sees it."""

    line_no: int
    """0-based, its place in the input file (the output keeps the input's order)."""
    custom_id: str
    request: bytes
    """The request's body (JSON), already validated at the edge: sent as it is."""


@dataclass(frozen=True, slots=True)
class Result:
    """What one line gave: its status code, the body the endpoint replied with, the tokens it used."""

    status_code: int
    body: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0


class BatchStore:
    """The batches of one deployment, their lines and files, in SQLite or PostgreSQL (batch/sql.py)."""

    def __init__(self, where: Path | str) -> None:
        self.database = open_database(str(where))
        self.name = self.database.name
        """Where the batches are, for logs (a URL without its password)."""
        self._order = self.database.order
        self._backfill()

    def _db(self) -> contextlib.AbstractContextManager[Conn]:
        return self.database.connection()

    # -- files -------------------------------------------------------------------------------------------

    def put_file(
        self, file_id: str, purpose: str, filename: str, source: IO[bytes], batch_id: str | None = None
    ) -> int:
        """Keep `source`'s bytes as the file `file_id` (again: its bytes and row replaced, as when finalizing
        reruns); its size."""
        size = self.database.put_bytes(file_id, source)
        with self._db() as db:
            db.execute(
                "INSERT INTO files (id, purpose, filename, bytes, created_at, batch_id) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET purpose = excluded.purpose, filename = excluded.filename,"
                " bytes = excluded.bytes, created_at = excluded.created_at, batch_id = excluded.batch_id",
                (file_id, purpose, filename, size, int(time.time()), batch_id),
            )
        return size

    def file_bytes(self, file_id: str) -> bytes | None:
        """The file's bytes; None when they are gone."""
        return self.database.get_bytes(file_id)

    def file(self, file_id: str) -> dict[str, Any] | None:
        with self._db() as db:
            return _visible(db.one("SELECT * FROM files WHERE id = ?", (file_id,)))

    def files(self, purpose: str | None, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them."""
        query, args = "SELECT * FROM files WHERE TRUE", []
        if purpose:
            query, args = query + " AND purpose = ?", [purpose]
        if after:
            query += f" AND {self._order} < (SELECT {self._order} FROM files WHERE id = ?)"
            args.append(after)
        with self._db() as db:
            cursor = db.execute(query + f" ORDER BY {self._order} DESC LIMIT ?", (*args, limit))
            names = [d[0] for d in cursor.description or ()]
            return [_visible(dict(zip(names, row, strict=True))) or {} for row in cursor.fetchall()]

    def delete_file(self, file_id: str) -> bool:
        with self._db() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        self.database.drop_bytes(file_id)
        return deleted

    # -- batches -----------------------------------------------------------------------------------------

    def create_batch(self, batch_id: str, endpoint: str, input_file_id: str, window_s: int, metadata: Any) -> None:
        now = int(time.time())
        with self._db() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at,"
                " metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, "24h", Status.VALIDATING, now, now + window_s, _dump(metadata)),
            )

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        with self._db() as db:
            row = db.one("SELECT * FROM batches WHERE id = ?", (batch_id,))
            if row is None:
                return None
            if row["lines_done"] is not None:  # closed: its tallies, no scan of its lines
                counts = _request_counts(row["lines_pending"], row["lines_done"], row["lines_failed"])
            else:
                counts = _counts(db, batch_id)
        return {**(_visible(row) or {}), "request_counts": counts}

    def header(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's row without its line counts (what the runner needs each round: no scan of its lines)."""
        with self._db() as db:
            return _visible(db.one("SELECT * FROM batches WHERE id = ?", (batch_id,)))

    def batches(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        query, args = "SELECT id FROM batches", []
        if after:
            query, args = query + f" WHERE {self._order} < (SELECT {self._order} FROM batches WHERE id = ?)", [after]
        with self._db() as db:
            ids = [row[0] for row in db.execute(query + f" ORDER BY {self._order} DESC LIMIT ?", (*args, limit))]
        return [row for row in map(self.batch, ids) if row is not None]

    def unfinished(self) -> list[str]:
        """Batches a runner must take up (after a restart too): oldest first."""
        with self._db() as db:
            return [row[0] for row in db.execute(f"SELECT id FROM batches WHERE {_OPEN} ORDER BY {self._order}")]

    def set_status(self, batch_id: str, status: Status, *, only_from: frozenset[Status] | None = None) -> bool:
        """Move a batch to `status`, stamping `<status>_at`; with `only_from`, only from one of those (False if not)."""
        stamp = f"{status.value}_at" if status not in (Status.VALIDATING,) else None
        sets = "status = ?" + (f", {stamp} = ?" if stamp else "")
        args: list[Any] = [status.value] + ([int(time.time())] if stamp else [])
        where = "id = ?"
        args.append(batch_id)
        if only_from:
            where += f" AND status IN ({','.join('?' * len(only_from))})"
            args.extend(s.value for s in only_from)
        with self._db() as db:
            return db.execute(f"UPDATE batches SET {sets} WHERE {where}", args).rowcount > 0

    def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        with self._db() as db:
            db.execute(
                "UPDATE batches SET status = ?, failed_at = ?, errors = ? WHERE id = ?",
                (Status.FAILED, int(time.time()), _dump({"object": "list", "data": errors}), batch_id),
            )

    def close_batch(self, batch_id: str, status: Status, output_file_id: str | None, error_file_id: str | None) -> None:
        """Give the batch its files and its final `status`, with its tallies (its lines change no more once a
        finalizer holds it: batch/runner.py), in one transaction."""
        with self._db() as db, self.database.transaction(db):
            tallies = _tallies(db, batch_id)
            db.execute(
                f"UPDATE batches SET status = ?, {status.value}_at = ?, output_file_id = ?, error_file_id = ?,"
                f" {_SET_TALLIES} WHERE id = ?",
                (status.value, int(time.time()), output_file_id, error_file_id, *tallies, batch_id),
            )

    def claim_finalizing(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Whether `owner` may write the batch's files now: no other live runner is writing them (two frontends
        finalizing one batch at once would each write its files)."""
        now = time.time()
        with self._db() as db:
            row = db.one("SELECT finalizer FROM batches WHERE id = ?", (batch_id,))
            holder = None if row is None else row["finalizer"]
            gone = holder if holder is not None and _is_dead(holder) else owner
            return (
                db.execute(
                    "UPDATE batches SET finalizer = ?, finalizer_until = ? WHERE id = ? AND (finalizer IS NULL"
                    " OR finalizer = ? OR finalizer = ? OR finalizer_until < ?)",
                    (owner, now + lease_s, batch_id, owner, gone, now),
                ).rowcount
                > 0
            )

    def runners(self, owner: str, within_s: float) -> int:
        """Say `owner` runs batches now; how many runners said so in the last `within_s` (they share the budget)."""
        now = time.time()
        with self._db() as db:
            db.execute(
                "INSERT INTO runners (owner, seen_at) VALUES (?, ?) ON CONFLICT (owner) DO UPDATE SET"
                " seen_at = excluded.seen_at",
                (owner, now),
            )
            db.execute("DELETE FROM runners WHERE seen_at < ?", (now - 10 * within_s,))
            row = db.execute("SELECT COUNT(*) FROM runners WHERE seen_at >= ?", (now - within_s,)).fetchone()
        return max(1, int(row[0]))

    def leave(self, owner: str) -> None:
        """`owner` runs no batch any more (its share of the budget goes to the others at once)."""
        with self._db() as db:
            db.execute("DELETE FROM runners WHERE owner = ?", (owner,))

    # -- lines -------------------------------------------------------------------------------------------

    def add_lines(self, batch_id: str, valid: list[Line], invalid: list[tuple[int, str | None, Result]]) -> None:
        """Every input line at once, in one transaction: the valid ones pending, the invalid ones failed."""
        with self._db() as db, self.database.transaction(db):
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, request, state) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                [(batch_id, line.line_no, line.custom_id, line.request, LineState.PENDING) for line in valid],
            )
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, state, status_code, body)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [(batch_id, no, cid, LineState.FAILED, r.status_code, _dump(r.body)) for no, cid, r in invalid],
            )

    def claim(self, batch_id: str, owner: str, limit: int, lease_s: float, running: Collection[int] = ()) -> list[Line]:
        """Up to `limit` pending lines no live runner holds, in input order, now held by `owner` for `lease_s`.

        A line is free when nobody holds it, its holder's lease ran out, its holder was a process of this host
        that is gone (a frontend killed and restarted takes its lines back at once, not after the lease), or it
        is `owner`'s own and not among the lines it is `running` (its result could not be committed: the
        database was out of reach).
        """
        now = time.time()
        with self._db() as db, self.database.transaction(db):
            holders = _HOLDERS.format(index=self.database.held_index)
            dead = [o for (o,) in db.execute(holders, (batch_id, LineState.PENDING, now)) if _is_dead(o)]
            marks = ",".join("?" * len(dead)) or "NULL"
            mine = "owner = ?" + (f" AND line_no NOT IN ({','.join('?' * len(running))})" if running else "")
            rows = db.execute(
                "SELECT line_no, custom_id, request FROM lines WHERE batch_id = ? AND state = ? AND (owner IS NULL"
                f" OR lease_until < ? OR owner IN ({marks}) OR ({mine})) ORDER BY line_no LIMIT ?"
                + self.database.lock_claimed,
                (batch_id, LineState.PENDING, now, *dead, owner, *running, limit),
            ).fetchall()
            db.executemany(
                "UPDATE lines SET owner = ?, lease_until = ? WHERE batch_id = ? AND line_no = ?",
                [(owner, now + lease_s, batch_id, row[0]) for row in rows],
            )
        return [Line(int(row[0]), row[1], bytes(row[2])) for row in rows]

    def renew(self, owner: str, lease_s: float) -> None:
        """Extend the lease on every pending line `owner` holds."""
        with self._db() as db:
            db.execute(
                "UPDATE lines SET lease_until = ? WHERE owner = ? AND state = ?",
                (time.time() + lease_s, owner, LineState.PENDING),
            )

    def release(self, batch_id: str, owner: str, line_nos: list[int]) -> None:
        """Let go of lines `owner` stopped running (cancelled): another runner may take them."""
        with self._db() as db:
            db.executemany(
                "UPDATE lines SET owner = NULL, lease_until = NULL WHERE batch_id = ? AND line_no = ? AND owner = ?",
                [(batch_id, no, owner) for no in line_nos],
            )

    def has_pending(self, batch_id: str) -> bool:
        with self._db() as db:
            row = db.execute(
                "SELECT 1 FROM lines WHERE batch_id = ? AND state = ? LIMIT 1", (batch_id, LineState.PENDING)
            )
            return row.fetchone() is not None

    def finish_line(self, batch_id: str, line_no: int, result: Result, owner: str) -> bool:
        """Commit one line's result, if `owner` still holds it and its batch is open with no runner writing its
        files (a result never replaces another, and a batch's files hold every line committed); False if not."""
        state = LineState.DONE if result.status_code == 200 else LineState.FAILED
        values = (state, result.status_code, _dump(result.body), result.prompt_tokens, result.completion_tokens)
        with self._db() as db, self.database.transaction(db):
            batch = db.execute(
                f"SELECT status, finalizer FROM batches WHERE id = ?{self.database.share_lock}", (batch_id,)
            ).fetchone()
            if batch is None or batch[0] in TERMINAL or batch[1] is not None:
                return False
            return db.execute(_FINISH, (*values, batch_id, line_no, LineState.PENDING, owner)).rowcount > 0

    def results(self, batch_id: str) -> Iterator[tuple[int, str | None, str, int, dict[str, Any]]]:
        """The finished lines in input order: line_no, custom_id, state, status code, body (read a page at a
        time: a large batch's bodies are never all in memory)."""
        after = -1
        while True:
            with self._db() as db:
                rows = db.execute(
                    "SELECT line_no, custom_id, state, status_code, body FROM lines WHERE batch_id = ? AND state != ?"
                    " AND line_no > ? ORDER BY line_no LIMIT ?",
                    (batch_id, LineState.PENDING, after, RESULTS_PAGE),
                ).fetchall()
            for row in rows:
                yield int(row[0]), row[1], row[2], int(row[3]), json.loads(row[4])
            if len(rows) < RESULTS_PAGE:
                return
            after = int(rows[-1][0])

    def figures(self) -> tuple[dict[str, int], dict[str, int]]:
        """Lines of every batch by state, and the tokens the finished ones used, for /metrics: the closed
        batches' tallies, and one pass over the open batches' lines."""
        with self._db() as db:
            closed = db.execute(
                "SELECT " + ", ".join(f"COALESCE(SUM({name}), 0)" for name in TALLIES) + " FROM batches"
            ).fetchone()
            rows = db.execute(
                "SELECT state, COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0)"
                f" FROM lines WHERE batch_id IN (SELECT id FROM batches WHERE {_OPEN}) GROUP BY state"
            ).fetchall()
        lines = {state.value: int(n) for state, n in zip(LineState, closed[:3], strict=True)}
        tokens = {"prompt": int(closed[3]), "completion": int(closed[4])}
        for state, n, prompt, completion in rows:
            lines[state] += int(n)
            tokens["prompt"] += int(prompt)
            tokens["completion"] += int(completion)
        return lines, tokens

    def _backfill(self) -> None:
        """Tallies for the batches a version before them closed (once: they are kept from then on)."""
        with self._db() as db:
            ids = [r[0] for r in db.execute(f"SELECT id FROM batches WHERE NOT {_OPEN} AND lines_done IS NULL")]
            for batch_id in ids:
                tallies = _tallies(db, batch_id)
                db.execute(
                    f"UPDATE batches SET {_SET_TALLIES} WHERE id = ? AND lines_done IS NULL", (*tallies, batch_id)
                )


RESULTS_PAGE = 1000
_HIDDEN = ("seq", "finalizer", "finalizer_until", *TALLIES)
"""Bookkeeping columns, not part of what the API shows."""


_CLOSED = ",".join(f"'{status.value}'" for status in sorted(TERMINAL))
_OPEN = f"status NOT IN ({_CLOSED})"
"""A batch whose lines may still change (its figures read from its lines, not its tallies)."""
_SET_TALLIES = ", ".join(f"{name} = ?" for name in TALLIES)
_FINISH = (
    "UPDATE lines SET state = ?, status_code = ?, body = ?, prompt_tokens = ?, completion_tokens = ?, request = NULL,"
    " owner = NULL WHERE batch_id = ? AND line_no = ? AND state = ? AND owner = ?"
)
_HOLDERS = (  # through the partial index of held lines: a few rows, not the batch's pending ones
    "SELECT DISTINCT owner FROM lines{index}"
    " WHERE owner IS NOT NULL AND batch_id = ? AND state = ? AND lease_until >= ?"
)


def runner_name() -> str:
    """This process's name as a holder of lines: host, pid and a nonce (a reused pid is another runner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _is_dead(owner: str) -> bool:
    """Whether `owner` was a process of this host that is gone (another host's: only its lease tells)."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _visible(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {k: v for k, v in row.items() if k not in _HIDDEN}


def _tallies(db: Conn, batch_id: str) -> tuple[int, int, int, int, int]:
    """Lines pending, done and failed, prompt and completion tokens: what a closed batch keeps in its row."""
    rows = db.execute(
        "SELECT state, COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM lines"
        " WHERE batch_id = ? GROUP BY state",
        (batch_id,),
    ).fetchall()
    by_state = {row[0]: int(row[1]) for row in rows}
    prompt, completion = sum(int(row[2]) for row in rows), sum(int(row[3]) for row in rows)
    pending, done, failed = (by_state.get(state.value, 0) for state in LineState)
    return pending, done, failed, prompt, completion


def _counts(db: Conn, batch_id: str) -> dict[str, int]:
    rows = db.execute("SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY state", (batch_id,)).fetchall()
    by_state = {row[0]: int(row[1]) for row in rows}
    return _request_counts(*(by_state.get(state.value, 0) for state in LineState))


def _request_counts(pending: int, done: int, failed: int) -> dict[str, int]:
    """A batch's `request_counts`, as OpenAI shows them."""
    return {"total": int(pending) + int(done) + int(failed), "completed": int(done), "failed": int(failed)}


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))
