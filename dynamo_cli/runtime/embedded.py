"""Embedded planes for one host with no server: file-backed discovery and a ZMQ event bus.

Discovery: every key is a file under `{root}/kv/` naming its lease; a lease is a file under
`{root}/leases/` that its process touches every TTL/3. A lease is dead when its file is stale (older
than the TTL), missing, or its process is gone (checked by pid, so a SIGKILLed worker disappears at
the next poll rather than after the TTL). Watchers poll the directory and diff snapshots. The
directory is private to the user (0700, checked at start: `secure_root`), since whoever can write
it can register a worker.

Events: each process binds a ZMQ PUB socket on loopback and advertises it in discovery under
`v1/event_channels/{lease:x}`; subscribers watch that prefix and connect to every publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote, unquote

import msgspec
import zmq
import zmq.asyncio

from dynamo_cli.errors import PlaneUnavailable
from dynamo_cli.runtime.discovery import DEFAULT_TTL_S, Discovery, WatchEvent, WatchKind
from dynamo_cli.runtime.events import SUBSCRIBER_QUEUE, subject_matches
from dynamo_cli.runtime.private_dir import ensure_private_dir
from dynamo_cli.runtime.supervisor import pid_alive

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often watchers rescan the directory."""

MAX_LEASES = 4096
"""Lease records kept between scans (the table starts afresh when fuller)."""

_HOST = socket.gethostname()


def embedded_root(url: str) -> Path:
    """Directory behind `embedded`, `embedded:///DIR` or `file:///DIR` (default: `default_base()/embedded`)."""
    for scheme in ("file://", "embedded://"):
        if url.startswith(scheme) and len(url) > len(scheme):
            return Path(url[len(scheme) :]).expanduser()
    return default_base()[0] / "embedded"


def default_base() -> tuple[Path, bool]:
    """The per-user directory of `embedded`, and whether dyn chose it (then it must be 0700 and ours).

    `DYN_HOME` if set (the operator's choice); else `$XDG_RUNTIME_DIR/dyn` when that runtime directory
    is this user's (`su`/`sudo` may leave another user's one in the environment); else `/tmp/dyn-UID`.
    """
    home = os.environ.get("DYN_HOME")
    if home:
        return Path(home), False
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    with contextlib.suppress(OSError):
        if runtime and os.path.isabs(runtime) and os.stat(runtime).st_uid == os.getuid():
            return Path(runtime) / "dyn", True
    return Path(f"/tmp/dyn-{os.getuid()}"), True


def secure_root(root: Path) -> None:
    """Create `root` and its `kv/` and `leases/` private to this user, or refuse one a stranger could write.

    The default root (`default_base()/embedded`) and its base are held to 0700 and this user's
    ownership; an explicit `file:///DIR` to "nobody else may write" (see private_dir.py).
    """
    base, chosen = default_base()
    is_default = root == base / "embedded"
    if is_default:
        ensure_private_dir(base, strict=chosen)
    ensure_private_dir(root, strict=is_default)
    for sub in ("kv", "leases"):
        ensure_private_dir(root / sub, strict=is_default)


class _LeaseRecord(msgspec.Struct, frozen=True):
    pid: int
    host: str
    ttl: float


class _KeyRecord(msgspec.Struct, frozen=True, array_like=True):
    lease: int
    value: bytes


class FileDiscovery:
    """The `Discovery` Protocol over a directory shared by the processes of one host."""

    def __init__(self, root: Path, *, ttl: float = DEFAULT_TTL_S) -> None:
        self._root = root
        self._ttl = ttl
        self._lease_id = random.getrandbits(63) | 1
        self._owned: dict[str, bytes] = {}
        """Leased keys this process put: re-put if its lease was lost (a stall longer than the TTL)."""
        self._heartbeat: asyncio.Task[None] | None = None
        self._closed = False
        self._files: dict[str, tuple[int, int, bytes]] = {}
        """Key files read: name -> (lease, change stamp, value), re-read only when a file changes."""
        self._leases: dict[int, _LeaseRecord] = {}
        """Lease files read (a lease's record never changes; its age and process are checked at every scan)."""
        self._snapshot: tuple[float, dict[str, tuple[int, bytes]]] | None = None
        """The last scan of every live key (quoted name -> (stamp, value)) and when: every watcher of this process
        takes it while it is younger than half a poll, so the directory is read once a poll, not once a watcher."""

    @property
    def lease_id(self) -> int:
        return self._lease_id

    @property
    def root(self) -> Path:
        return self._root

    ##### Lifecycle #####

    async def start(self) -> None:
        secure_root(self._root)
        try:
            self._touch_lease()
        except OSError as exc:
            raise PlaneUnavailable("embedded discovery", str(self._root), str(exc)) from exc
        # NOTE: owned by this object; close() cancels it. A dead process stops touching its lease.
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for key in list(self._owned):
            self._unlink(self._key_path(key))
        self._owned.clear()
        self._unlink(self._lease_path(self._lease_id))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                self._touch_lease()
            except OSError as exc:
                logger.warning("embedded discovery: cannot refresh lease in %s: %s", self._root, exc)

    def _touch_lease(self) -> None:
        path = self._lease_path(self._lease_id)
        try:
            os.utime(path)
            return
        except FileNotFoundError:
            pass
        self._write_atomic(path, msgspec.json.encode(_LeaseRecord(os.getpid(), _HOST, self._ttl)))
        if self._owned:  # another process found the lease stale and removed it with our keys: put them back
            logger.warning(
                "embedded discovery: lease %x expired (this process stalled over %.0f s); re-registering %d keys",
                self._lease_id,
                self._ttl,
                len(self._owned),
            )
            for key, value in self._owned.items():
                self._write_atomic(self._key_path(key), msgspec.msgpack.encode(_KeyRecord(self._lease_id, value)))

    ##### Key-value #####

    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        record = _KeyRecord(self._lease_id if leased else 0, value)
        self._write_atomic(self._key_path(key), msgspec.msgpack.encode(record))
        self._snapshot = None
        if leased:
            self._owned[key] = value

    async def delete(self, key: str) -> None:
        self._unlink(self._key_path(key))
        self._snapshot = None
        self._owned.pop(key, None)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self._snapshot = None
        return {key: value for key, (_, value) in self._scan(prefix).items()}

    async def watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        known: dict[str, tuple[int, bytes]] = {}
        while True:
            current = self._scan(prefix)
            for key, (stamp, value) in current.items():
                if known.get(key, (None,))[0] != stamp:
                    yield WatchEvent(kind=WatchKind.PUT, key=key, value=value)
            for key in known.keys() - current.keys():
                yield WatchEvent(kind=WatchKind.DELETE, key=key)
            known = current
            await asyncio.sleep(POLL_S)

    ##### Files #####

    def _scan(self, prefix: str) -> dict[str, tuple[int, bytes]]:
        """Live keys under `prefix` -> (change stamp, value)."""
        quoted = quote(prefix, safe="")
        return {unquote(name): got for name, got in self._live().items() if name.startswith(quoted)}

    def _live(self) -> dict[str, tuple[int, bytes]]:
        """Every live key (its quoted name) -> (change stamp, value): the snapshot while fresh, else a new scan that
        garbage-collects a dead process's keys."""
        now = time.monotonic()
        if self._snapshot is not None and now - self._snapshot[0] < POLL_S / 2:
            return self._snapshot[1]
        leases: dict[int, bool] = {}
        out: dict[str, tuple[int, bytes]] = {}
        try:
            entries = list(os.scandir(self._root / "kv"))
        except FileNotFoundError:
            entries = []
        files: dict[str, tuple[int, int, bytes]] = {}
        for entry in entries:
            record = self._read_key(entry)
            if record is None:
                continue
            lease, stamp, value = files[entry.name] = record
            if lease and not leases.setdefault(lease, self._lease_alive(lease)):
                self._unlink(Path(entry.path))
                continue
            out[entry.name] = (stamp, value)
        self._files = files
        if len(self._leases) > MAX_LEASES:
            self._leases.clear()
        self._snapshot = (now, out)
        return out

    def _read_key(self, entry: os.DirEntry[str]) -> tuple[int, int, bytes] | None:
        if entry.name.startswith("."):
            return None  # a write in progress (`_write_atomic`)
        try:
            stamp = entry.stat().st_mtime_ns ^ entry.inode()
        except FileNotFoundError:
            return None
        hit = self._files.get(entry.name)
        if hit is not None and hit[1] == stamp:
            return hit
        try:
            record = msgspec.msgpack.decode(Path(entry.path).read_bytes(), type=_KeyRecord)
        except (OSError, msgspec.DecodeError):
            return None
        return record.lease, stamp, record.value

    def _lease_alive(self, lease: int) -> bool:
        path = self._lease_path(lease)
        try:
            age = time.time() - path.stat().st_mtime
            record = self._leases.get(lease)
            if record is None:
                record = self._leases[lease] = msgspec.json.decode(path.read_bytes(), type=_LeaseRecord)
        except (OSError, msgspec.DecodeError):
            return False
        alive = age <= record.ttl and (record.host != _HOST or pid_alive(record.pid))
        if not alive:
            self._leases.pop(lease, None)
            self._unlink(path)
        return alive

    def _key_path(self, key: str) -> Path:
        return self._root / "kv" / quote(key, safe="")

    def _lease_path(self, lease: int) -> Path:
        return self._root / "leases" / f"{lease:x}"

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


##### Events over ZMQ #####

CHANNEL_PREFIX = "v1/event_channels/"


RECEIVE_BATCH = 256
"""Messages a SUB socket takes before letting the event loop run something else."""


def _topic(subject: str) -> bytes:
    """A message's ZMQ topic: the subject's last token, a space, then the subject. ZMQ filters by prefix at the
    publisher, and the patterns subscribed name their last token (`namespace.ns.component.*.kv-metrics`): with
    the kind first, a frontend routing round-robin is not sent every worker's KV events (it dropped them itself)."""
    return f"{subject.rpartition('.')[2]} {subject}".encode()


def _topic_prefix(pattern: str) -> bytes:
    """The topic prefix every subject matching `pattern` has (`_topic`)."""
    prefix = pattern.split("*", 1)[0].split(">", 1)[0]
    last = pattern.rpartition(".")[2]
    return f"{last} {prefix}".encode() if "*" not in last and ">" not in last else b""


class _ZmqSubscription:
    """One subscription: a bounded queue that the bus's SUB socket feeds the messages matching `pattern`."""

    def __init__(self, bus: ZmqEventBus, pattern: str) -> None:
        self.dropped = 0
        self._pattern = pattern
        self.literal = _topic_prefix(pattern)
        """The SUB socket's prefix filter (`_topic`): the publisher sends only what passes it."""
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._bus = bus

    def offer(self, subject: str, payload: bytes) -> None:
        """Queue a message the socket received, if it matches this subscription."""
        if not subject_matches(self._pattern, subject):
            return
        try:
            self._queue.put_nowait((subject, payload))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                logger.warning("event subscriber on %s is slow: %d messages dropped", self._pattern, self.dropped)

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[str, bytes]]:
        while True:
            yield await self._queue.get()

    async def close(self) -> None:
        self._bus._unsubscribe(self)


class ZmqEventBus:
    """The `EventBus` Protocol on one host: ZMQ PUB per process, SUB connects via discovery.

    NOTE: one SUB socket per bus however many subscriptions it has (a frontend has two, load and KV
    events, and the prefix filters of both pass every component's messages): each message is received
    once and offered to every subscription, and one discovery watch connects the socket to publishers.
    """

    def __init__(self, discovery: Discovery) -> None:
        self._discovery = discovery
        self._context = zmq.asyncio.Context()
        self._pub: zmq.Socket[bytes] | None = None
        """A plain (not asyncio) socket: a PUB send with NOBLOCK never waits, and the asyncio wrapper's futures
        and poller registration cost more than the send itself (a worker publishes a KV batch every pass)."""
        self._sub: zmq.asyncio.Socket | None = None
        self._subs: list[_ZmqSubscription] = []
        self._sub_tasks: list[asyncio.Task[None]] = []
        """The SUB socket's publisher watch and receive loop: started by the first `subscribe`, ended in `close`."""
        self._connected: dict[str, str] = {}
        self._closed = False

    async def start(self) -> None:
        pub: zmq.Socket[bytes] = zmq.Context.shadow(self._context.underlying).socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, SUBSCRIBER_QUEUE)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        self._pub = pub
        await self._discovery.put(f"{CHANNEL_PREFIX}{self._discovery.lease_id:x}", f"tcp://127.0.0.1:{port}".encode())

    async def publish(self, subject: str, payload: bytes) -> None:
        assert self._pub is not None, "start() first"
        try:
            self._pub.send_multipart([_topic(subject), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # PUB drops at its high-water mark: the event plane never blocks a publisher

    async def subscribe(self, subject: str) -> _ZmqSubscription:
        sub = _ZmqSubscription(self, subject)
        if self._sub is None:
            self._sub = self._context.socket(zmq.SUB)
            self._sub.setsockopt(zmq.RCVHWM, SUBSCRIBER_QUEUE)
            loop = asyncio.get_running_loop()
            self._sub_tasks = [loop.create_task(self._follow_publishers()), loop.create_task(self._receive())]
        self._sub.setsockopt(zmq.SUBSCRIBE, sub.literal)  # counted: a prefix subscribed twice needs two unsubscribes
        self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: _ZmqSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
            if self._sub is not None:
                self._sub.setsockopt(zmq.UNSUBSCRIBE, sub.literal)

    async def _follow_publishers(self) -> None:
        assert self._sub is not None
        async for event in self._discovery.watch(CHANNEL_PREFIX):
            if event.kind is WatchKind.PUT:
                address = event.value.decode()
                if self._connected.get(event.key) != address:
                    self._sub.connect(address)
                    self._connected[event.key] = address
            elif event.key in self._connected:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disconnect(self._connected.pop(event.key))

    async def _receive(self) -> None:
        """Offer every message to the subscriptions. After each awaited receive, what is already queued is taken
        without waiting (the loop yielding every RECEIVE_BATCH): one asyncio wake-up per burst, not per message."""
        assert self._sub is not None
        now: zmq.Socket[bytes] = zmq.Socket.shadow(self._sub.underlying)
        while True:
            message = await self._sub.recv_multipart()
            taken = 0
            while True:
                topic, payload = message
                subject = topic.decode().partition(" ")[2]
                for sub in self._subs:
                    sub.offer(subject, payload)
                taken += 1
                if taken % RECEIVE_BATCH == 0:
                    await asyncio.sleep(0)
                try:
                    message = now.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            await sub.close()
        for task in self._sub_tasks:
            task.cancel()
        for task in self._sub_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sub_tasks = []
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._pub is not None:
            self._pub.close(linger=0)
        self._context.term()
