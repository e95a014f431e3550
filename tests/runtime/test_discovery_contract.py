"""One contract for every Discovery backend: the embedded one (files on this host) and etcd."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import tests.planes
from dynamo_cli.errors import PlaneUnavailable
from dynamo_cli.runtime.discovery import Discovery, WatchEvent, WatchKind
from dynamo_cli.runtime.etcd import EtcdDiscovery, diff_snapshots, parse_etcd_url
from dynamo_cli.runtime.planes import open_discovery

# The plane fixtures; tests/conftest.py may register tests.planes too, which is harmless.
etcd_process = tests.planes.etcd_process
etcd_server = tests.planes.etcd_server

REPO = Path(__file__).resolve().parents[2]
TTL_S = 2.0
PREFIX = "v1/instances/test/backend/generate/"
Opener = Callable[..., Awaitable[Discovery]]

OWNER = """
import asyncio, sys
from dynamo_cli.runtime.planes import open_discovery


async def main():
    discovery = open_discovery(sys.argv[1], ttl=float(sys.argv[2]))
    await discovery.start()
    await discovery.put(sys.argv[3] + format(discovery.lease_id, "x"), b"owner")
    print("ready", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


STALLER = """
import asyncio, sys, time
from dynamo_cli.runtime.planes import open_discovery


async def main():
    discovery = open_discovery(sys.argv[1], ttl=float(sys.argv[2]))
    await discovery.start()
    await discovery.put(sys.argv[3] + "stalled", b"owner")
    print("ready", flush=True)
    time.sleep(3 * float(sys.argv[2]))  # the event loop is blocked: no lease refresh (a long import, a GIL hog)
    print("resumed", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.fixture(
    params=[pytest.param("embedded", id="embedded"), pytest.param("etcd", id="etcd", marks=pytest.mark.etcd)]
)
def discovery_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The `--discovery` URL of a fresh, empty store of each backend."""
    if request.param == "embedded":
        try:
            import dynamo_cli.runtime.embedded  # noqa: F401
        except ImportError as exc:
            pytest.skip(f"dynamo_cli.runtime.embedded is not importable yet ({exc})")
        return f"file://{tmp_path / 'discovery'}"
    return str(request.getfixturevalue("etcd_server"))


@pytest.fixture
async def open_started(discovery_url: str) -> AsyncIterator[Opener]:
    """Start Discovery clients on the store (as many processes would); all closed at the end."""
    opened: list[Discovery] = []

    async def start(ttl: float = TTL_S) -> Discovery:
        discovery = open_discovery(discovery_url, ttl=ttl)
        async with asyncio.timeout(5):
            await discovery.start()
        opened.append(discovery)
        return discovery

    yield start
    for discovery in opened:
        await discovery.close()


async def next_events(events: AsyncIterator[WatchEvent], count: int, timeout: float = 5) -> list[WatchEvent]:
    async with asyncio.timeout(timeout):
        return [await anext(events) for _ in range(count)]


def _start_script(script: str, discovery_url: str) -> subprocess.Popen[bytes]:
    """Another process on the store, running `script` with (url, ttl, prefix) as its arguments."""
    return subprocess.Popen(
        [sys.executable, "-c", script, discovery_url, str(TTL_S), PREFIX],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def put(key: str, value: bytes) -> WatchEvent:
    return WatchEvent(kind=WatchKind.PUT, key=key, value=value)


def delete(key: str) -> WatchEvent:
    return WatchEvent(kind=WatchKind.DELETE, key=key)


##### The contract, on every backend #####


async def test_get_prefix_returns_exactly_the_keys_under_the_prefix(open_started: Opener) -> None:
    discovery = await open_started()
    await discovery.put(PREFIX + "a", b"1")
    await discovery.put(PREFIX + "b", b"2", leased=False)
    await discovery.put("v1/mdc/test/backend/generate/a", b"card")

    assert await discovery.get_prefix(PREFIX) == {PREFIX + "a": b"1", PREFIX + "b": b"2"}
    await discovery.delete(PREFIX + "b")
    await discovery.delete(PREFIX + "never-written")
    assert await discovery.get_prefix(PREFIX) == {PREFIX + "a": b"1"}


async def test_watch_yields_existing_keys_then_puts_and_deletes(open_started: Opener) -> None:
    writer, watcher = await open_started(), await open_started()
    await writer.put(PREFIX + "a", b"1")
    events = aiter(watcher.watch(PREFIX))
    try:
        assert await next_events(events, 1) == [put(PREFIX + "a", b"1")]
        await writer.put("v1/elsewhere/x", b"not watched")
        # One change at a time: a polling backend may merge changes that fall within one poll.
        await writer.put(PREFIX + "b", b"2")
        assert await next_events(events, 1) == [put(PREFIX + "b", b"2")]
        await writer.put(PREFIX + "a", b"1-changed")
        assert await next_events(events, 1) == [put(PREFIX + "a", b"1-changed")]
        await writer.delete(PREFIX + "b")
        assert await next_events(events, 1) == [delete(PREFIX + "b")]
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def test_a_leased_key_vanishes_within_ttl_plus_2s_when_its_process_is_killed(
    open_started: Opener, discovery_url: str
) -> None:
    watcher = await open_started()
    owner = _start_script(OWNER, discovery_url)
    events = aiter(watcher.watch(PREFIX))
    try:
        assert owner.stdout is not None
        assert await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 10) == b"ready\n"
        [registered] = await next_events(events, 1)
        assert registered.kind is WatchKind.PUT and registered.value == b"owner"

        os.kill(owner.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert await next_events(events, 1, timeout=TTL_S + 4) == [delete(registered.key)]
        assert time.monotonic() - killed_at <= TTL_S + 2
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        owner.kill()
        owner.wait()


async def test_a_process_that_stalls_past_its_ttl_is_registered_again_when_it_resumes(
    open_started: Opener, discovery_url: str
) -> None:
    reader = await open_started()
    owner = _start_script(STALLER, discovery_url)

    async def wait_for(expected: dict[str, bytes], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while await reader.get_prefix(PREFIX) != expected:
                await asyncio.sleep(0.1)

    try:
        assert owner.stdout is not None
        assert await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 10) == b"ready\n"
        await wait_for({PREFIX + "stalled": b"owner"}, 5)
        await wait_for({}, TTL_S + 3)  # expired while stalled: readers stop seeing it
        assert await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 10) == b"resumed\n"
        await wait_for({PREFIX + "stalled": b"owner"}, TTL_S + 3)  # and it is back once the process runs again
    finally:
        owner.kill()
        owner.wait()


async def test_close_revokes_the_lease_at_once_and_is_idempotent(open_started: Opener) -> None:
    owner, watcher = await open_started(ttl=10.0), await open_started()
    await owner.put(PREFIX + "leased", b"1")
    await owner.put(PREFIX + "kept", b"2", leased=False)
    events = aiter(watcher.watch(PREFIX))
    try:
        assert len(await next_events(events, 2)) == 2
        closed_at = time.monotonic()
        await owner.close()
        await owner.close()
        assert await next_events(events, 1, timeout=5) == [delete(PREFIX + "leased")]
        assert time.monotonic() - closed_at < 1.5  # far below the 10 s TTL: revoked, not expired
        assert await watcher.get_prefix(PREFIX) == {PREFIX + "kept": b"2"}
    finally:
        await events.aclose()  # type: ignore[attr-defined]


##### etcd only: outages #####


@pytest.mark.etcd
@pytest.mark.parametrize("is_wiped", [pytest.param(False, id="same-data"), pytest.param(True, id="empty")])
async def test_a_process_is_registered_again_after_etcd_restarts(
    etcd_process: tests.planes.EtcdProcess, is_wiped: bool
) -> None:
    owner = EtcdDiscovery(etcd_process.url, ttl=TTL_S)
    await owner.start()
    lease_id = owner.lease_id
    try:
        await owner.put(PREFIX + "w", b"worker")
        await asyncio.to_thread(etcd_process.restart, wipe=is_wiped)
        reader = EtcdDiscovery(etcd_process.url, ttl=TTL_S)
        await reader.start()
        try:
            async with asyncio.timeout(TTL_S + 3):
                while await reader.get_prefix(PREFIX) != {PREFIX + "w": b"worker"}:
                    await asyncio.sleep(0.1)
        finally:
            await reader.close()
        assert owner.lease_id == lease_id  # re-granted under the same id: the instance id is stable
    finally:
        await owner.close()


@pytest.mark.etcd
async def test_a_put_after_etcd_lost_the_lease_regrants_it_at_once(
    etcd_process: tests.planes.EtcdProcess,
) -> None:
    owner = EtcdDiscovery(etcd_process.url, ttl=10.0)  # keepalive every 3.3 s: the put comes first
    await owner.start()
    try:
        await owner.put(PREFIX + "old", b"1")
        await asyncio.to_thread(etcd_process.restart, wipe=True)
        async with asyncio.timeout(5):
            while True:  # until the client's channel has reconnected
                try:
                    await owner.put(PREFIX + "new", b"2")
                    break
                except PlaneUnavailable:
                    await asyncio.sleep(0.1)
        assert await owner.get_prefix(PREFIX) == {PREFIX + "old": b"1", PREFIX + "new": b"2"}
    finally:
        await owner.close()


@pytest.mark.etcd
async def test_a_watch_resumes_after_etcd_restarts_and_reports_what_changed(
    etcd_process: tests.planes.EtcdProcess,
) -> None:
    watcher = EtcdDiscovery(etcd_process.url, ttl=TTL_S)
    await watcher.start()
    events = aiter(watcher.watch(PREFIX))
    try:
        writer = EtcdDiscovery(etcd_process.url, ttl=TTL_S)
        await writer.start()
        await writer.put(PREFIX + "old", b"1", leased=False)
        await writer.close()
        assert await next_events(events, 1) == [put(PREFIX + "old", b"1")]

        await asyncio.to_thread(etcd_process.restart, wipe=True)  # "old" is gone, no DELETE was sent
        writer = EtcdDiscovery(etcd_process.url, ttl=TTL_S)
        await writer.start()
        await writer.put(PREFIX + "new", b"2", leased=False)
        await writer.close()

        seen = await next_events(events, 2, timeout=10)
        assert sorted(seen, key=lambda e: e.key) == [put(PREFIX + "new", b"2"), delete(PREFIX + "old")]
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        await watcher.close()


@pytest.mark.etcd
async def test_etcd_unreachable_at_start_raises_plane_unavailable_naming_the_address() -> None:
    port = tests.planes.free_port()
    discovery = EtcdDiscovery(f"etcd://127.0.0.1:{port}")
    started_at = time.monotonic()
    with pytest.raises(PlaneUnavailable, match=f"etcd unreachable at 127.0.0.1:{port}"):
        await discovery.start()
    assert time.monotonic() - started_at < 3.5
    await discovery.close()


##### Pure helpers #####


@pytest.mark.parametrize(
    ("url", "endpoints"),
    [
        pytest.param("etcd://10.0.0.5:2379", [("10.0.0.5", 2379)], id="one"),
        pytest.param("etcd://a:1,b:2", [("a", 1), ("b", 2)], id="two"),
        pytest.param("etcd://host", [("host", 2379)], id="default-port"),
    ],
)
def test_etcd_urls_parse_to_endpoints(url: str, endpoints: list[tuple[str, int]]) -> None:
    assert parse_etcd_url(url) == endpoints


def test_a_snapshot_diff_deletes_what_vanished_and_puts_what_is_new_or_changed() -> None:
    old = {"a": b"1", "b": b"2", "c": b"3"}
    new = {"b": b"2", "c": b"3-changed", "d": b"4"}
    assert diff_snapshots(old, new) == [delete("a"), put("c", b"3-changed"), put("d", b"4")]
