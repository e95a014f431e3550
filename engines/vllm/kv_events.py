"""Relay of an engine's vLLM-format ZMQ KV event stream, re-hashed with our own block hashes.

vLLM's `ZmqEventPublisher` (and SGLang's copy of it) sends multipart `[topic, seq, payload]`, the
payload a msgpack `[ts, [event, ...], dp_rank?]` whose events are tagged arrays:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, ...]`,
`["BlockRemoved", block_hashes, medium?]`, `["AllBlocksCleared"]`. The engine's own hashes depend on
its hash function and seed, so routers would never match them: every stored block is re-hashed from its
token ids with `dynamo_cli.kv.hashing`, and a map engine hash -> our hash translates removals.
This module imports no inference library; the sglang adapter uses it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Hashable
from typing import Any

import msgspec

from dynamo_cli.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import hash_blocks

logger = logging.getLogger(__name__)

DEVICE_MEDIA = (None, "GPU", "DEVICE", "gpu", "device")
"""Cache tiers the router indexes; blocks offloaded to CPU or disk are not routable KV."""
_QUEUE_SIZE = 4096


def parse_event(raw: Any) -> tuple[str, list[Any]]:
    """Split one decoded event into its tag and its positional fields (array or map form)."""
    if isinstance(raw, dict):
        fields = dict(raw)
        tag = str(fields.pop("type", ""))
        order: tuple[str, ...] = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
        if tag == "BlockRemoved":
            order = ("block_hashes", "medium")
        return tag, [fields.get(name) for name in order]
    return str(raw[0]), list(raw[1:])


class KvEventRehasher:
    """Pure translation of engine KV events into ours; remembers engine hash -> our sequence hash."""

    def __init__(self) -> None:
        self._ours: dict[Hashable, int] = {}
        self.num_orphans = 0
        """Stored events whose parent block was never seen (lost events): skipped, counted."""

    def __len__(self) -> int:
        return len(self._ours)

    def convert(self, raw_events: list[Any]) -> list[KvEvent]:
        """Our events for one engine batch; events of other tiers or with unknown parents are dropped."""
        out: list[KvEvent] = []
        for raw in raw_events:
            tag, fields = parse_event(raw)
            event: KvEvent | None = None
            if tag == "BlockStored":
                event = self._stored(fields)
            elif tag == "BlockRemoved":
                event = self._removed(fields)
            elif tag == "AllBlocksCleared":
                self._ours.clear()
                event = AllBlocksCleared()
            if event is not None:
                out.append(event)
        return out

    def _stored(self, fields: list[Any]) -> BlockStored | None:
        engine_hashes = [_key(h) for h in fields[0]]
        parent, token_ids, block_size = fields[1], list(fields[2]), int(fields[3])
        if _medium(fields, 5) not in DEVICE_MEDIA:
            return None
        our_parent: int | None = None
        if parent is not None:
            our_parent = self._ours.get(_key(parent))
            if our_parent is None:
                self.num_orphans += 1
                logger.debug("kv events: parent block %r unknown; skipping %d blocks", parent, len(engine_hashes))
                return None
        pairs = list(hash_blocks(token_ids, block_size, parent=our_parent))
        ours = [seq_hash for seq_hash, _ in pairs]
        if len(ours) != len(engine_hashes):
            logger.warning(
                "kv events: %d block hashes for %d tokens at block size %d; event skipped",
                len(engine_hashes),
                len(token_ids),
                block_size,
            )
            return None
        self._ours.update(zip(engine_hashes, ours, strict=True))
        blocks = [StoredBlock(seq_hash, local) for seq_hash, local in pairs]
        return BlockStored(parent_hash=our_parent, blocks=blocks)

    def _removed(self, fields: list[Any]) -> BlockRemoved | None:
        if _medium(fields, 1) not in DEVICE_MEDIA:
            return None
        ours = [h for h in (self._ours.pop(_key(engine_hash), None) for engine_hash in fields[0]) if h is not None]
        return BlockRemoved(block_hashes=ours) if ours else None


def _key(engine_hash: Any) -> Hashable:
    # vLLM >= 0.10 sends bytes hashes, older versions and SGLang ints; msgpack may give lists for tuples.
    return tuple(engine_hash) if isinstance(engine_hash, list) else engine_hash


def _medium(fields: list[Any], index: int) -> Any:
    return fields[index] if len(fields) > index else None


class ZmqKvRelay:
    """Subscribes to an engine's ZMQ KV event publisher and queues our `KvEventBatch`es.

    By default our SUB socket binds a free loopback port and the engine's publisher connects to it
    (vLLM documents `tcp://host:port` as "connect", `tcp://*:port` as "bind"), so there is no port
    race, and the publisher connects at engine start, long before the first request. An endpoint the
    user configured to bind is connected to instead. Overflow policy: a full queue drops new batches,
    counts them and warns once, so a router that stops reading never stalls the engine.
    """

    def __init__(self, topic: str = "") -> None:
        import zmq
        import zmq.asyncio

        self.topic = topic
        self.rehasher = KvEventRehasher()
        self._queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue(_QUEUE_SIZE)
        self._next_event_id = 0
        self.num_dropped = 0
        self._task: asyncio.Task[None] | None = None
        self._socket: Any = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())

    def bind(self) -> str:
        """Bind a free loopback port; returns the endpoint the engine's publisher should connect to."""
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    def connect(self, endpoint: str) -> None:
        """Connect to a publisher that binds `endpoint` (a `*` host means this host)."""
        self._socket.connect(endpoint.replace("*", "127.0.0.1"))

    def start(self) -> None:
        """Start the pump task (owned here, cancelled in close())."""
        if self._task is None and self._socket is not None:
            self._task = asyncio.get_running_loop().create_task(self._pump(), name="kv-event-relay")

    async def _pump(self) -> None:
        # NOTE: one engine message = one of our batches; the engine's own sequence number is ignored
        # because re-hashing already needs every event, and a lost one shows up as an orphan parent.
        while True:
            frames = await self._socket.recv_multipart()
            self.handle_payload(frames[-1])

    def handle_payload(self, payload: bytes) -> None:
        """Decode one engine batch, re-hash it and queue it (pure apart from the queue)."""
        batch = msgspec.msgpack.decode(payload)
        events = self.rehasher.convert(batch[1])
        if events:
            self.put(events, timestamp=float(batch[0]) if batch[0] else time.time())

    def put(self, events: list[KvEvent], timestamp: float) -> None:
        """Queue our events as the next numbered batch."""
        batch = KvEventBatch(event_id=self._next_event_id, events=events, timestamp=timestamp)
        try:
            self._queue.put_nowait(batch)
        except asyncio.QueueFull:
            if self.num_dropped == 0:
                logger.warning("kv events: queue full (no consumer?); dropping batches")
            self.num_dropped += 1
            return
        self._next_event_id += 1

    async def batches(self) -> AsyncIterator[KvEventBatch]:
        """Our batches in event-id order until close()."""
        while (batch := await self._queue.get()) is not None:
            yield batch

    async def close(self) -> None:
        """Stop the pump and close the socket; ends `batches()`. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)
