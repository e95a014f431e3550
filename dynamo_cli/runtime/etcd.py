"""etcd discovery: the multi-node control plane, one lease per process, prefix watches that outlive outages.

The client is `aetcd` (asyncio gRPC). It was chosen over `etcd3aio`, which did as well on put/get,
leases and watches, because `etcd3aio` puts its generated protobuf tree on `sys.path` at import,
shadowing any installed `google.api` and adding a top-level `etcd` package to every process.
Credentials and TLS come from the URL (urls.py); etcd_client.py logs in, dials TLS and sorts a
refusal (PlaneAuthFailed at start) from an outage (PlaneUnavailable).

    start() ──► lease granted ──► keepalive every ttl/3 ──► close(): revoke (keys vanish at once)
                     ▲                   │ etcd forgot the lease (restarted empty, or we were cut off)
                     └─ re-grant the same id, re-put every leased key ◄┘
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aetcd

from dynamo_cli.errors import PlaneAuthFailed, PlaneUnavailable
from dynamo_cli.runtime.discovery import DEFAULT_TTL_S, WatchEvent, WatchKind
from dynamo_cli.runtime.etcd_client import is_auth_failure, is_stale_token, new_client
from dynamo_cli.runtime.urls import parse_etcd_target

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 3.0
"""How long start() waits for etcd before raising PlaneUnavailable."""
CALL_TIMEOUT_S = 3.0
"""Deadline of every other call to etcd."""
RETRY_MAX_S = 1.0
"""Longest pause between two attempts to reach etcd again (watch re-list, gRPC reconnect)."""

# gRPC's default reconnect backoff grows to 120 s; a registry wants to be back within a second.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": int(RETRY_MAX_S * 1000),
}
_UNREACHABLE = (aetcd.ClientError, TimeoutError, OSError)  # OSError: name resolution


class _State(enum.Enum):
    IDLE = "idle"  # built, start() not called yet
    RUNNING = "running"  # lease granted, keepalive running
    CLOSED = "closed"  # lease revoked, client closed; terminal


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """`etcd://h1:p1,h2:p2` → [(h1, p1), (h2, p2)]; the port defaults to 2379 (urls.py has the rest)."""
    return list(parse_etcd_target(url).endpoints)


def diff_snapshots(old: Mapping[str, bytes], new: Mapping[str, bytes]) -> list[WatchEvent]:
    """The events that turn `old` into `new`: DELETE for keys gone, PUT for keys new or changed."""
    events = [WatchEvent(kind=WatchKind.DELETE, key=key) for key in sorted(old.keys() - new.keys())]
    events += [
        WatchEvent(kind=WatchKind.PUT, key=key, value=value)
        for key, value in sorted(new.items())
        if old.get(key) != value
    ]
    return events


class EtcdDiscovery:
    """`Discovery` on an etcd cluster: one lease per process, kept alive, re-granted if etcd loses it."""

    def __init__(self, url: str, *, ttl: float = DEFAULT_TTL_S) -> None:
        self._target = parse_etcd_target(url)
        self._endpoints = self._target.endpoints
        self._ttl = max(1, round(ttl))  # etcd leases are whole seconds
        self._state = _State.IDLE
        self._client: aetcd.Client | None = None
        self._lease_id = 0
        self._leased: dict[str, bytes] = {}  # what to re-put if the lease must be re-granted
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()

    @property
    def address(self) -> str:
        """The endpoints, as `h:p,h:p`, for messages."""
        return ",".join(f"{host}:{port}" for host, port in self._endpoints)

    @property
    def lease_id(self) -> int:
        """This process's lease id; also its instance id on every plane."""
        return self._lease_id

    async def start(self) -> None:
        """Connect and grant the process lease; PlaneUnavailable names the address if etcd is unreachable."""
        if self._state is not _State.IDLE:
            return
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                host, port, options = await self._grpc_target()
                self._client = new_client(self._target, host, port, timeout=int(CALL_TIMEOUT_S), options=options)
                # A read under dyn's keys first: an etcd with auth on refuses it without a valid login,
                # whereas it grants leases to anyone.
                await self._client.get(b"v1/instances/")
                lease = await self._client.lease(self._ttl)
        except _UNREACHABLE as exc:
            if self._client is not None:
                await self._client.close()
            self._client = None
            if is_auth_failure(exc):
                raise PlaneAuthFailed("etcd", self._target.redacted, "--discovery", _describe(exc)) from None
            raise PlaneUnavailable("etcd", self.address, _describe(exc)) from None
        self._lease_id = int(lease.id)
        self._state = _State.RUNNING
        # Owned by this object and cancelled in close(): the Protocol's start() has no TaskGroup to hand.
        self._keepalive = asyncio.create_task(self._keep_lease_alive(), name=f"etcd-lease-{self._lease_id:x}")
        logger.info("etcd at %s: lease %x granted (ttl %d s)", self.address, self._lease_id, self._ttl)

    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        """Write `key`; leased keys vanish with the process's lease (and come back if it is re-granted)."""
        client = self._running_client()
        if not leased:
            self._leased.pop(key, None)
            await self._call(client.put(key.encode(), value))
            return
        self._leased[key] = value
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await client.put(key.encode(), value, lease=self._lease_id)
        except aetcd.ClientError as exc:
            if "lease not found" not in str(exc):
                await self._log_in_again_if_forgotten(exc)
                raise PlaneUnavailable("etcd", self.address, _describe(exc)) from None
            # etcd lost the lease before the keepalive noticed: re-grant now (it re-puts this key too).
            await self._call(self._regrant_lease(found_by="a put"))
        except TimeoutError as exc:
            raise PlaneUnavailable("etcd", self.address, _describe(exc)) from None

    async def delete(self, key: str) -> None:
        """Remove `key` (no error when absent)."""
        client = self._running_client()
        self._leased.pop(key, None)
        await self._call(client.delete(key.encode()))

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every live key under `prefix` with its value."""
        snapshot, _ = await self._snapshot(prefix)
        return snapshot

    async def watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """Yield a PUT for every key under `prefix`, then every change, until close().

        NOTE: the watch stream is opened first and the prefix listed second, so no change falls
        between them; events the listing already holds (revision <= the listing's) are skipped.
        When the stream drops (etcd restarted, even empty; revisions compacted) the cycle starts
        again and only the difference from what was already reported is yielded: nothing is lost.
        """
        known: dict[str, bytes] = {}
        pause = 0.1
        while not self._closed.is_set():
            try:
                stream, snapshot, revision = await self._watch_and_list(prefix)
            except PlaneUnavailable as exc:
                logger.debug("etcd watch %r: %s; retrying in %.1f s", prefix, exc, pause)
                await self._sleep_unless_closed(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = 0.1
            try:
                for event in diff_snapshots(known, snapshot):
                    yield event
                known = snapshot
                async for event in self._follow(stream, prefix, after=revision):
                    _apply(known, event)
                    yield event
            finally:
                if not self._closed.is_set():
                    await _cancel_quietly(stream)

    async def close(self) -> None:
        """Revoke the lease (its keys vanish at once) and disconnect. Idempotent."""
        if self._state is _State.CLOSED:
            return
        was_running = self._state is _State.RUNNING
        self._state = _State.CLOSED
        self._closed.set()
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        if self._client is None:
            return
        if was_running:
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await self._client.revoke_lease(self._lease_id)
            except _UNREACHABLE as exc:
                logger.warning(
                    "etcd at %s: could not revoke lease %x (%s); its keys expire in %d s",
                    self.address,
                    self._lease_id,
                    _describe(exc),
                    self._ttl,
                )
        await self._client.close()

    ##### Internals #####

    async def _keep_lease_alive(self) -> None:
        # NOTE: one keepalive every ttl/3. When etcd answers that it no longer knows the lease (it
        # restarted empty, or we were cut off longer than the TTL), re-grant the same id so the
        # instance id stays, then re-put every leased key: the process registers again by itself.
        is_connected = True
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                ttl_left = await self._refresh_lease()
                if ttl_left <= 0:
                    await self._regrant_lease(found_by="the keepalive")
            except (*_UNREACHABLE, PlaneUnavailable) as exc:
                if is_connected:
                    logger.warning(
                        "etcd at %s unreachable (%s); keeping lease %x alive when it is back",
                        self.address,
                        _describe(exc),
                        self._lease_id,
                    )
                is_connected = False
                continue
            if not is_connected:
                logger.info("etcd at %s reachable again; lease %x held", self.address, self._lease_id)
            is_connected = True

    async def _refresh_lease(self) -> int:
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                reply = await self._running_client().refresh_lease(self._lease_id)
        except aetcd.ClientError as exc:
            await self._log_in_again_if_forgotten(exc)
            raise
        return int(reply.TTL) if reply is not None else 0

    async def _log_in_again_if_forgotten(self, exc: BaseException) -> None:
        # etcd keeps login tokens in memory: after a restart it answers "invalid auth token". Closing
        # the client makes its next call reconnect and log in again (watch streams re-list meanwhile).
        if is_stale_token(exc) and self._client is not None:
            logger.info("etcd at %s forgot our login (it restarted?); logging in again", self.address)
            await self._client.close()

    async def _regrant_lease(self, *, found_by: str) -> None:
        client = self._running_client()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            try:
                await client.lease(self._ttl, lease_id=self._lease_id)
            except aetcd.DuplicateLeaseError:
                pass  # another call re-granted it already
            for key, value in list(self._leased.items()):
                await client.put(key.encode(), value, lease=self._lease_id)
        logger.warning(
            "etcd at %s had lost lease %x (found by %s); re-granted it and re-put %d keys",
            self.address,
            self._lease_id,
            found_by,
            len(self._leased),
        )

    async def _snapshot(self, prefix: str) -> tuple[dict[str, bytes], int]:
        reply = await self._call(self._running_client().get_prefix(prefix.encode()))
        snapshot = {bytes(kv.key).decode(): bytes(kv.value) for kv in reply.kvs}
        return snapshot, int(reply.header.revision)

    async def _watch_and_list(self, prefix: str) -> tuple[Any, dict[str, bytes], int]:
        stream = await self._call(self._running_client().watch_prefix(prefix.encode()))
        try:
            snapshot, revision = await self._snapshot(prefix)
        except PlaneUnavailable:
            await _cancel_quietly(stream)
            raise
        return stream, snapshot, revision

    async def _follow(self, stream: Any, prefix: str, *, after: int) -> AsyncIterator[WatchEvent]:
        """The stream's events newer than revision `after`; ends quietly when the stream breaks."""
        try:
            async for event in stream:
                if event.kv.mod_revision > after:
                    yield _to_watch_event(event)
        except _UNREACHABLE as exc:  # includes RevisionCompactedError: the re-list covers the gap
            logger.info("etcd watch %r interrupted (%s); re-listing", prefix, _describe(exc))

    async def _call(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                return await awaitable
        except _UNREACHABLE as exc:
            await self._log_in_again_if_forgotten(exc)
            raise PlaneUnavailable("etcd", self.address, _describe(exc)) from None

    async def _sleep_unless_closed(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._closed.wait()
        except TimeoutError:
            pass

    def _running_client(self) -> aetcd.Client:
        if self._client is None or self._state is not _State.RUNNING:
            state = self._state.value
            raise PlaneUnavailable("etcd", self.address, f"discovery is {state}; call start() first")
        return self._client

    async def _grpc_target(self) -> tuple[str, int, dict[str, Any]]:
        options: dict[str, Any] = dict(_CHANNEL_OPTIONS)
        if len(self._endpoints) == 1:
            return *self._endpoints[0], options
        # aetcd dials f"{host}:{port}", so a gRPC multi-address target fits in those two fields;
        # round_robin then fails over between the members (each forwards writes to the leader).
        # The `ipv4:` scheme takes addresses only, so names are resolved here, once.
        loop = asyncio.get_running_loop()
        addresses = []
        for host, port in self._endpoints:
            infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
            addresses.append(f"{infos[0][4][0]}:{port}")
        options["grpc.lb_policy_name"] = "round_robin"
        head, _, last_port = ",".join(addresses).rpartition(":")
        return f"ipv4:{head}", int(last_port), options


def _to_watch_event(event: Any) -> WatchEvent:
    key = bytes(event.kv.key).decode()
    if event.kind == "DELETE":
        return WatchEvent(kind=WatchKind.DELETE, key=key)
    return WatchEvent(kind=WatchKind.PUT, key=key, value=bytes(event.kv.value))


def _apply(known: dict[str, bytes], event: WatchEvent) -> None:
    if event.kind is WatchKind.DELETE:
        known.pop(event.key, None)
    else:
        known[event.key] = event.value


async def _cancel_quietly(stream: Any) -> None:
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            await stream.cancel()
    except (*_UNREACHABLE, RuntimeError):
        pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {CALL_TIMEOUT_S:g} s"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text
