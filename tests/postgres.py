"""A real PostgreSQL server for the tests that need one: initdb into a fresh directory, `postgres` on a free
loopback port with password authentication, stopped by its PID. Skipped where no server binaries are installed
(Debian's postgresql package puts them in /usr/lib/postgresql/N/bin; `.ci/run` installs it).

PostgreSQL refuses to run as root: under root the server runs as `nobody` (setpriv, which execs the server, so
the PID we hold is the server's own)."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.planes import free_port

USER = "dyn"
NOBODY = 65534
START_TIMEOUT_S = 30.0


def find_postgres() -> str | None:
    """The directory holding `initdb` and `postgres`, or None."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("postgres"):
        return str(Path(os.path.realpath(on_path)).parent)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return str(Path(found[0]).parent) if found else None


@dataclass
class PostgresServer:
    """One server; `url(db)` reaches database `db` as USER (the password in PGPASSWORD or the URL)."""

    bindir: str
    root: Path
    port: int
    password: str
    as_user: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres", *, with_password: bool = True) -> str:
        secret = f":{self.password}" if with_password else ""
        return f"postgresql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database's URL (each test its own)."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def start(self) -> None:
        """Start the server (again, on the same data and port) and wait until it takes connections."""
        import psycopg

        server = [f"{self.bindir}/postgres", "-D", str(self.root / "data"), "-p", str(self.port)]
        server += ["-h", "127.0.0.1", "-k", str(self.root), "-c", "fsync=off", "-c", "max_connections=200"]
        with (self.root / "log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.as_user, *server], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log_tail = (self.root / "log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"postgres did not start: {log_tail}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGINT (a fast shutdown) to the PID we started, SIGKILL after 10 s. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def remove(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)


def start_postgres(bindir: str) -> PostgresServer:
    """A new server in a fresh directory, started."""
    root = Path(tempfile.mkdtemp(prefix="dyn-pg-"))  # not pytest's tmp_path: `nobody` cannot enter that
    password = secrets.token_hex(12)
    (root / "pw").write_text(password)
    as_user: list[str] = []
    if os.geteuid() == 0:
        os.chown(root, NOBODY, NOBODY)
        os.chown(root / "pw", NOBODY, NOBODY)
        as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    initdb = [f"{bindir}/initdb", "-D", str(root / "data"), "-U", USER, "--auth=scram-sha-256", "--no-sync"]
    with (root / "log").open("wb") as log:
        initdb.append(f"--pwfile={root / 'pw'}")
        subprocess.run([*as_user, *initdb], stdout=log, stderr=subprocess.STDOUT, check=True, timeout=120)
    pg = PostgresServer(bindir, root, free_port(), password, as_user)
    pg.start()
    return pg


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One server for the run (each test takes a database of its own); skipped without the binaries."""
    bindir = find_postgres()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (Debian: apt-get install postgresql)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'dynamo-cli[postgres]')")
    pg = start_postgres(bindir)
    try:
        yield pg
    finally:
        pg.remove()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A fresh database on the run's server, its URL with the password."""
    return postgres_server.new_database()
