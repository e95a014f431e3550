"""The real `dyn` on etcd and NATS with authentication on: credentials in the URLs serve requests;
wrong ones end the command at start with one red line that hides the secret, and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ETCD_USER, NATS_USER, DynProcess, descendants, open_planes_for_test
from tests.planes import with_credentials

pytestmark = [pytest.mark.etcd, pytest.mark.nats]


@pytest.fixture
def auth_planes(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(etcd URL, NATS URL), both servers requiring the credentials these URLs carry."""
    (discovery, events), servers = open_planes_for_test("etcd-nats", tmp_path)
    assert discovery is not None
    yield discovery, events
    for server in servers:
        server.stop()  # type: ignore[attr-defined]


def _dyn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=60
    )


def test_dyn_serve_with_credentials_for_both_planes_answers_a_request(dyn_serve, auth_planes) -> None:  # type: ignore[no-untyped-def]
    discovery, events = auth_planes
    d: DynProcess = dyn_serve("--engine", "mocker", "--workers", "1", discovery=discovery, events=events)
    reply = httpx.post(
        f"{d.url}/v1/chat/completions",
        timeout=30,
        headers=d.auth,
        json={"model": "smollm2", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert all(ETCD_USER[1] not in line and NATS_USER[1] not in line for line in d.lines)
    for pid in descendants(d.proc.pid):  # the URLs reach the workers by environment, not by `ps`
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert ETCD_USER[1] not in cmdline and NATS_USER[1] not in cmdline


@pytest.mark.parametrize(
    ("plane", "flag"), [pytest.param("etcd", "--discovery", id="etcd"), pytest.param("nats", "--events", id="nats")]
)
def test_dyn_worker_with_a_wrong_password_prints_one_red_line_and_exits_non_zero(
    auth_planes: tuple[str, str], plane: str, flag: str
) -> None:
    discovery, events = auth_planes
    if plane == "etcd":
        discovery = discovery.replace(f":{ETCD_USER[1]}@", ":not-the-pw@")
    else:
        events = events.replace(f":{NATS_USER[1]}@", ":not-the-pw@")
    done = _dyn("worker", "--engine", "mocker", "--discovery", discovery, "--events", events)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"{plane} at " in lines[0] and "authentication failed: check the user/password/token in" in lines[0]
    assert flag in lines[0] and "not-the-pw" not in lines[0] and ":***@" in lines[0]
    assert "Traceback" not in done.stdout + done.stderr


def test_dyn_ls_without_credentials_is_refused_by_etcd(auth_planes: tuple[str, str]) -> None:
    discovery, _ = auth_planes
    plain = "etcd://" + discovery.rpartition("@")[2]
    done = _dyn("ls", "--discovery", plain)
    assert done.returncode != 0
    assert f"etcd at {plain}: authentication failed" in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1, done.stderr


def test_a_password_file_keeps_the_secret_out_of_the_command_line(auth_planes: tuple[str, str], tmp_path: Path) -> None:
    discovery, _ = auth_planes
    (tmp_path / "etcd-pw").write_text(ETCD_USER[1] + "\n")
    host = discovery.rpartition("@")[2]
    url = with_credentials(f"etcd://{host}", ETCD_USER[0]) + f"?password-file={tmp_path / 'etcd-pw'}"
    done = _dyn("ls", "--json", "--discovery", url)
    assert done.returncode == 0, done.stderr


def test_dyn_ls_shows_the_discovery_url_with_the_password_hidden(auth_planes: tuple[str, str]) -> None:
    discovery, _ = auth_planes
    done = _dyn("ls", "--discovery", discovery)
    assert done.returncode == 0, done.stderr
    assert ETCD_USER[1] not in done.stdout and f"{ETCD_USER[0]}:***@" in done.stdout


def test_dyn_serve_without_nats_credentials_stops_at_start_with_one_line(auth_planes: tuple[str, str]) -> None:
    discovery, events = auth_planes
    plain = "nats://" + events.rpartition("@")[2]
    done = _dyn(
        "serve", "--engine", "mocker", "--workers", "1", "--port", "0", "--discovery", discovery, "--events", plain
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: nats at {plain}: authentication failed: check the user/password/token in --events "
        "(the server requires them)"
    ], done.stderr
