"""The two databases a batch store runs on: SQLite beside the frontend (one host), or PostgreSQL (frontends on
several hosts sharing batches). The store writes one SQL both understand (`?` marks, `ON CONFLICT` upserts); what
differs is here: how to connect, the column types, the order rows were added in, how a claim locks its rows,
and where the bytes of files live (a directory beside the SQLite file; a table in PostgreSQL, so that every host
reads them).

PostgreSQL is reached through psycopg 3 (the `postgres` extra), one connection per thread (the store is called
through `asyncio.to_thread`), each with a connect timeout, TCP keepalives and a statement timeout: a database
that stops answering fails the call, never hangs it. The password is never in the URL a manifest holds: libpq
reads `PGPASSWORD` (or `~/.pgpass`).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from dynamo_cli.config.batch import is_postgres

CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_MS = 30_000
PING_AFTER_S = 1.0
"""A connection idle longer is checked (`SELECT 1`, one round trip) before use, and replaced if it broke."""
CHUNK = 1 << 20
"""A file's bytes are kept in PostgreSQL in rows of this size (a row is read whole)."""

TABLES = """
CREATE TABLE IF NOT EXISTS files (
    {seq}id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL, batch_id TEXT
);
CREATE TABLE IF NOT EXISTS batches (
    {seq}id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
    in_progress_at BIGINT, finalizing_at BIGINT, completed_at BIGINT, failed_at BIGINT, expired_at BIGINT,
    cancelling_at BIGINT, cancelled_at BIGINT, output_file_id TEXT, error_file_id TEXT,
    metadata TEXT, errors TEXT, finalizer TEXT, finalizer_until {real},
    lines_pending BIGINT, lines_done BIGINT, lines_failed BIGINT, tokens_prompt BIGINT, tokens_completion BIGINT
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no BIGINT NOT NULL, custom_id TEXT, request {blob},
    state TEXT NOT NULL, status_code BIGINT, body TEXT, prompt_tokens BIGINT, completion_tokens BIGINT,
    owner TEXT, lease_until {real},
    PRIMARY KEY (batch_id, line_no)
);
CREATE TABLE IF NOT EXISTS runners (owner TEXT PRIMARY KEY, seen_at {real} NOT NULL);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, line_no);
CREATE INDEX IF NOT EXISTS lines_held ON lines (owner) WHERE owner IS NOT NULL
"""
TALLIES = ("lines_pending", "lines_done", "lines_failed", "tokens_prompt", "tokens_completion")
"""A closed batch's figures, kept in its row when it closes (its lines change no more): /metrics sums these
instead of scanning every line ever run."""
ADDED_COLUMNS = (
    ("batches", "finalizer", "TEXT"),
    ("batches", "finalizer_until", "{real}"),
    *(("batches", tally, "BIGINT") for tally in TALLIES),
)
"""Columns a database made by an earlier version lacks: added when it is opened."""
FILE_DATA = "CREATE TABLE IF NOT EXISTS file_data (file_id TEXT NOT NULL, chunk BIGINT NOT NULL, data BYTEA NOT NULL,"
FILE_DATA += " PRIMARY KEY (file_id, chunk))"


class Cursor(Protocol):
    rowcount: int

    @property
    def description(self) -> Sequence[Any] | None: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Conn:
    """One connection, in the store's SQL (`?` marks), whichever database is behind it."""

    def __init__(self, raw: Any, marks: str) -> None:
        self.raw = raw
        self._marks = marks

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        cursor: Cursor = self.raw.execute(self._sql(sql), args)
        return cursor

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            self.raw.cursor().executemany(self._sql(sql), rows)

    def one(self, sql: str, args: Sequence[Any] = ()) -> dict[str, Any] | None:
        cursor = self.execute(sql, args)
        row = cursor.fetchone()
        return None if row is None else dict(zip([d[0] for d in cursor.description or ()], row, strict=True))

    def _sql(self, sql: str) -> str:
        return sql if self._marks == "?" else sql.replace("?", self._marks)


class Database(Protocol):
    """What differs between SQLite and PostgreSQL, as the store uses it."""

    name: str
    """Where the batches are, for logs and errors (a URL without its password)."""
    order: str
    """The column rows of `files` and `batches` were added in (newest first when listed)."""
    lock_claimed: str
    """Appended to the claim's SELECT: the rows it takes stay its own until it commits."""
    held_index: str
    """How the query of held lines names the partial index over them (SQLite's planner needs telling)."""
    share_lock: str
    """Appended to the read of a batch's row before a line's result is committed: a finalizer's claim waits for
    the commit, and the commit for the claim (SQLite: BEGIN IMMEDIATE serializes every writer already)."""
    unavailable: tuple[type[Exception], ...]
    """What a call raises when the database is out of reach (not a mistake of the caller's)."""

    def connection(self) -> contextlib.AbstractContextManager[Conn]: ...
    def transaction(self, db: Conn) -> contextlib.AbstractContextManager[None]: ...
    def put_bytes(self, file_id: str, source: IO[bytes]) -> int: ...
    def get_bytes(self, file_id: str) -> bytes | None: ...
    def drop_bytes(self, file_id: str) -> None: ...


def open_database(where: str) -> Database:
    """A `postgresql://` or `postgres://` URL, or a SQLite file's path."""
    if is_postgres(where):
        return Postgres(where)
    return Sqlite(Path(where).expanduser())


class Sqlite:
    """A SQLite file in WAL mode, and a directory of files beside it; a new connection per call."""

    order = "rowid"
    lock_claimed = ""  # BEGIN IMMEDIATE took the database's write lock
    held_index = " INDEXED BY lines_held"
    share_lock = ""
    unavailable: tuple[type[Exception], ...] = (sqlite3.OperationalError, OSError)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self.files_dir = path.parent / (path.stem + "-files")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.files_dir.mkdir(exist_ok=True, mode=0o700)
        with self.connection() as db:
            db.execute("PRAGMA journal_mode=WAL")
            for statement in TABLES.format(seq="", real="REAL", blob="BLOB").split(";"):
                db.execute(statement)
            _add_columns(db, "REAL")

    @contextlib.contextmanager
    def connection(self) -> Iterator[Conn]:
        raw = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            raw.execute("PRAGMA synchronous=NORMAL")
            raw.execute("PRAGMA busy_timeout=30000")
            yield Conn(raw, "?")
        finally:
            raw.close()

    @contextlib.contextmanager
    def transaction(self, db: Conn) -> Iterator[None]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def put_bytes(self, file_id: str, source: IO[bytes]) -> int:
        """Write the file whole, then move it in place: a reader sees the old bytes or the new, never a part."""
        final = self.files_dir / file_id
        part = final.with_suffix(".part")
        size = 0
        with part.open("wb") as out:
            while chunk := source.read(CHUNK):
                out.write(chunk)
                size += len(chunk)
        part.replace(final)
        return size

    def get_bytes(self, file_id: str) -> bytes | None:
        try:
            return (self.files_dir / file_id).read_bytes()
        except FileNotFoundError:
            return None

    def drop_bytes(self, file_id: str) -> None:
        (self.files_dir / file_id).unlink(missing_ok=True)


class Postgres:
    """A PostgreSQL database: one connection per thread, reopened when it broke; files' bytes in `file_data`."""

    order = "seq"
    lock_claimed = " FOR UPDATE SKIP LOCKED"  # another frontend's claim skips these rows instead of waiting
    held_index = ""
    share_lock = " FOR SHARE"

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise RuntimeError("PostgreSQL needs psycopg: pip install 'dynamo-cli[postgres]'") from None
        self._psycopg = psycopg
        self.unavailable: tuple[type[Exception], ...] = (psycopg.OperationalError,)
        self.url = url
        self.name = without_password(url)
        self._local = threading.local()
        with self.connection() as db, self.transaction(db):
            db.execute("SELECT pg_advisory_xact_lock(?)", (0x62617463,))  # two frontends starting at once
            seq = "seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE, "
            for statement in TABLES.format(seq=seq, real="DOUBLE PRECISION", blob="BYTEA").split(";"):
                db.execute(statement)
            db.execute(FILE_DATA)
            _add_columns(db, "DOUBLE PRECISION")

    @contextlib.contextmanager
    def connection(self) -> Iterator[Conn]:
        raw = getattr(self._local, "raw", None)
        if raw is not None and not raw.closed and time.monotonic() - self._local.used > PING_AFTER_S:
            try:  # idle a while: the server may have restarted since (a stale connection fails its next call)
                raw.execute("SELECT 1")
            except self._psycopg.OperationalError:
                raw.close()
        if raw is None or raw.closed or raw.broken:
            raw = self._psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                keepalives=1,
                keepalives_idle=30,
                keepalives_interval=10,
                keepalives_count=3,
                tcp_user_timeout=STATEMENT_TIMEOUT_MS,  # a server gone without a word: sends fail, not hang
                options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
            )
            self._local.raw = raw
        try:
            yield Conn(raw, "%s")
        finally:
            self._local.used = time.monotonic()

    @contextlib.contextmanager
    def transaction(self, db: Conn) -> Iterator[None]:
        with db.raw.transaction():
            yield

    def put_bytes(self, file_id: str, source: IO[bytes]) -> int:
        """Every chunk in one transaction: a reader sees the old bytes or the new, never a part."""
        size = 0
        with self.connection() as db, self.transaction(db):
            db.execute("DELETE FROM file_data WHERE file_id = ?", (file_id,))
            number, chunk = 0, source.read(CHUNK)
            while number == 0 or chunk:  # an empty file is one empty chunk: there, with no bytes
                db.execute("INSERT INTO file_data (file_id, chunk, data) VALUES (?, ?, ?)", (file_id, number, chunk))
                number, size, chunk = number + 1, size + len(chunk), source.read(CHUNK)
        return size

    def get_bytes(self, file_id: str) -> bytes | None:
        with self.connection() as db:
            rows = db.execute("SELECT data FROM file_data WHERE file_id = ? ORDER BY chunk", (file_id,)).fetchall()
        return b"".join(bytes(row[0]) for row in rows) if rows else None

    def drop_bytes(self, file_id: str) -> None:
        with self.connection() as db:
            db.execute("DELETE FROM file_data WHERE file_id = ?", (file_id,))


def _add_columns(db: Conn, real: str) -> None:
    for table, column, kind in ADDED_COLUMNS:
        described = db.execute(f"SELECT * FROM {table} WHERE 1 = 0")
        if column not in [d[0] for d in described.description or ()]:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind.format(real=real)}")


def without_password(url: str) -> str:
    """`url` with its password, if it names one, starred out (for logs and errors)."""
    if not is_postgres(url):
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
