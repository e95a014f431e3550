"""Batches in PostgreSQL, shared by two frontends on etcd and NATS (as on two hosts): a batch created through one
is seen, run and downloaded through the other; both run its lines; SIGKILL of one mid-batch and the other
finishes it with every custom_id once. The password reaches libpq through PGPASSWORD, never the command line.
Skipped where no PostgreSQL server is installed."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DynProcess, wait_until
from tests.e2e.test_batch import FLAGS, client_of, line, rows, submit, until
from tests.postgres import PostgresServer


def batch_inflight(d: DynProcess) -> float:
    scraped = httpx.get(f"{d.url}/metrics", headers=d.auth, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "dynamo_frontend_batch_inflight"
    )


def test_two_frontends_share_batches_and_one_finishes_what_a_killed_one_ran(  # type: ignore[no-untyped-def]
    dyn_serve, etcd_server: str, nats_server: str, postgres_server: PostgresServer
) -> None:
    url = postgres_server.new_database().replace(f":{postgres_server.password}@", "@")  # no password in argv
    env = {"DYN_CLUSTER_SECRET": secrets.token_hex(32), "DYN_BATCH_DB": url, "PGPASSWORD": postgres_server.password}
    serving = dyn_serve(*FLAGS, discovery=etcd_server, events=nats_server, env=env)
    other = dyn_serve("--workers", "0", "--router", "kv", discovery=etcd_server, events=nats_server, env=env)
    here, there = client_of(serving), client_of(other)
    assert wait_until(lambda: len(httpx.get(f"{other.url}/health", timeout=5).json()["instances"]) == 2, 30)

    batch_id = submit(there, [line(i, max_tokens=60) for i in range(300)])
    assert here.batches.retrieve(batch_id).id == batch_id  # one database: either frontend knows the batch
    # both frontends run lines (each its share of the budget) on the one set of workers
    assert wait_until(lambda: batch_inflight(other) > 0 and batch_inflight(serving) > 0, 60, interval=0.1)
    assert wait_until(lambda: here.batches.retrieve(batch_id).request_counts.completed >= 40, 60)
    other.proc.send_signal(signal.SIGKILL)  # its lines in flight: never committed, taken up by the other
    other.proc.wait(10)

    batch = until(here, batch_id, {"completed"}, timeout=180)
    out = rows(here, batch.output_file_id)
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(300)]
    assert batch.request_counts.completed == 300 and batch.error_file_id is None


def test_a_postgres_url_without_a_password_fails_with_one_line(postgres_server: PostgresServer) -> None:
    url = postgres_server.url("postgres", with_password=False)
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "serve", "--engine", "mocker", "--workers", "0"]
    env = {"PATH": "/usr/bin:/bin", "DYN_BATCH_DB": url, "HOME": "/tmp", "PGPASSFILE": "/nonexistent"}
    done = subprocess.run([*argv, "--port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    assert "--batch-db" in done.stderr and "***" not in done.stderr and "password" in done.stderr.lower()
