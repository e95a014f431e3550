"""Relay of an engine's vLLM-format ZMQ KV event stream, re-hashed with our own block hashes.

vLLM's `ZmqEventPublisher` (and SGLang's copy of it) sends multipart `[topic, seq, payload]`, the
payload a msgpack `[ts, [event, ...], dp_rank?]` whose events are tagged arrays:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, lora_name?, extra_keys?,
...]` (vLLM 0.32 sends maps with those keys),
`["BlockRemoved", block_hashes, medium?]`, `["AllBlocksCleared"]`. `medium` names where the blocks sit
("GPU", or "CPU" once vLLM's offloading connector moves them; absent = GPU): it becomes our tier (`TIER_OF`),
and blocks on a medium we do not know are dropped. The engine's own hashes depend on
its hash function and seed, so routers would never match them: every stored block is re-hashed from its
token ids with `dynamo_cli.kv.hashing`, and a map engine hash -> our hash translates removals.
A block computed under a LoRA adapter is hashed with that adapter's seed (`lora_seed`): its name is the
event's `lora_name` (vLLM 0.32 sends it), else the name the engine gave the event's `lora_id` (`lora_name_of`);
a block with an id nobody can name is dropped (counted in `num_unnamed`), never published as the base model's.
An engine of several data-parallel ranks publishes from each rank at the endpoint's port + rank; the relay reads
them all into one stream, each batch stamped with its rank (`KvEventBatch.dp_rank`).
Given the engine's replay endpoint (vLLM's `replay_endpoint`, a ROUTER socket), the relay asks it for every batch
it still buffers when it starts (a worker started after its engine learns what is cached already) and for the
batches a gap in the publisher's sequence numbers lost; a sequence number that goes back means the engine started
again, with an empty cache.
This module imports no inference library; the sglang and trtllm adapters use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import msgspec

from dynamo_cli.kv.events import (
    DEVICE,
    DISK,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    StoredBlock,
    Tier,
)
from dynamo_cli.kv.hashing import HASH_SEED, hash_blocks, lora_seed
from dynamo_cli.kv.images import pad_value

logger = logging.getLogger(__name__)

TIER_OF: dict[str | None, Tier] = {
    None: DEVICE,
    "GPU": DEVICE,
    "DEVICE": DEVICE,
    "CUDA": DEVICE,
    "CPU": HOST,
    "HOST": HOST,
    "DISK": DISK,
    "SSD": DISK,
    "LOCAL_DISK": DISK,
}
"""An engine's storage medium (upper-cased) -> our tier; None = the engine sent no medium (its own cache)."""
_QUEUE_SIZE = 4096
_BIND_TRIES = 20
"""Tries at binding consecutive free ports for a relay of several ranks before giving up."""
MAX_BATCH_BYTES = 64 << 20
"""The largest engine batch read (a bigger message drops its sender's connection)."""
REPLAY_TIMEOUT_S = 2.0
"""The longest wait for the next frame of a replay; past it the replay is given up (its blocks are orphans)."""
MAX_REPLAYED = 1 << 17
"""The most batches one replay relays (vLLM buffers 10,000 by default)."""
_MAX_RANKS = 1024
"""The widest data-parallel engine a batch may name a rank of."""
_END = -1
"""The sequence number of a replay's last frame (vLLM and SGLang: 8 bytes, signed)."""


def parse_event(raw: Any) -> tuple[str, list[Any]]:
    """Split one decoded event into its tag and its positional fields (array or map form)."""
    if isinstance(raw, dict):
        fields = dict(raw)
        tag = str(fields.pop("type", ""))
        order: tuple[str, ...] = (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
        )
        if tag == "BlockRemoved":
            order = ("block_hashes", "medium")
        return tag, [fields.get(name) for name in order]
    return str(raw[0]), list(raw[1:])


def tier_of(medium: Any) -> Tier | None:
    """Our tier for an engine's medium ("GPU", "cpu", None ...); None for a medium we do not know."""
    return TIER_OF.get(medium.upper() if isinstance(medium, str) else medium)


class KvEventRehasher:
    """Pure translation of engine KV events into ours; remembers engine hash -> our sequence hash while
    the block is held on some tier. `lora_name_of`: the served name of an engine's LoRA id (None: unknown)."""

    def __init__(self, lora_name_of: Callable[[int], str | None] | None = None) -> None:
        self._lora_name_of = lora_name_of
        self._ours: dict[Hashable, int] = {}
        self._lower: dict[Hashable, set[Tier]] = {}
        """Engine hash -> every tier holding it, for blocks ever offloaded (others are on device only)."""
        self.num_orphans = 0
        """Stored events whose parent block was never seen (lost events): skipped, counted."""
        self.num_unnamed = 0
        """Stored events of a LoRA id no name is known for: skipped, counted."""
        self.block_size: int | None = None
        """The block size the router hashes with, where the engine's could differ (a server dyn did not start):
        events of another size are dropped, and the first named in an error; None: the engine's is ours."""
        self.num_wrong_size = 0
        self.image_tokens = 0
        """Tokens of one image (the card's `ImageSpec.tokens_per_image`): a block's `("mm", id, offset)` extra keys
        then put the image's pad values over its run (kv/images.py), as the router's view has them; 0: none."""

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
                self._clear_device()
                event = AllBlocksCleared()
            if event is not None:
                out.append(event)
        return out

    def _stored(self, fields: list[Any]) -> BlockStored | None:
        engine_hashes = [_key(h) for h in fields[0]]
        parent, token_ids, block_size = fields[1], list(fields[2]), int(fields[3])
        if not self._right_size(block_size):
            return None
        if self.image_tokens:
            token_ids = with_image_pads(token_ids, block_size, _optional(fields, 7), self.image_tokens)
        tier = tier_of(_optional(fields, 5))
        seed = self._seed(fields) if tier is not None else None
        if tier is None or seed is None:
            return None
        our_parent: int | None = None
        if parent is not None:
            our_parent = self._ours.get(_key(parent))
            if our_parent is None:
                self.num_orphans += 1
                logger.debug("kv events: parent block %r unknown; skipping %d blocks", parent, len(engine_hashes))
                return None
        pairs = list(hash_blocks(token_ids, block_size, parent=our_parent, seed=seed))
        ours = [seq_hash for seq_hash, _ in pairs]
        if len(ours) != len(engine_hashes):
            logger.warning(
                "kv events: %d block hashes for %d tokens at block size %d; event skipped",
                len(engine_hashes),
                len(token_ids),
                block_size,
            )
            return None
        for engine_hash in engine_hashes:
            tiers = self._lower.get(engine_hash)
            if tiers is not None:
                tiers.add(tier)
            elif tier != DEVICE:  # first offload: a hash we already know is held on device
                self._lower[engine_hash] = {tier, DEVICE} if engine_hash in self._ours else {tier}
        self._ours.update(zip(engine_hashes, ours, strict=True))
        blocks = [StoredBlock(seq_hash, local) for seq_hash, local in pairs]
        return BlockStored(parent_hash=our_parent, blocks=blocks, tier=tier)

    def _right_size(self, block_size: int) -> bool:
        """False for a block size the router does not hash with (the first named in an error)."""
        if self.block_size is None or block_size == self.block_size:
            return True
        if self.num_wrong_size == 0:
            logger.error(
                "kv events: the engine stores blocks of %d tokens and this worker's router hashes %d-token "
                "blocks: no event can match; start the worker with --block-size %d",
                block_size,
                self.block_size,
                block_size,
            )
        self.num_wrong_size += 1
        return False

    def _seed(self, fields: list[Any]) -> int | None:
        """The seed of a stored event's token-local hashes: its adapter's, by name or id; None: unnamed."""
        lora_name, lora_id = _optional(fields, 6), _optional(fields, 4)
        if isinstance(lora_name, str) and lora_name:
            return lora_seed(lora_name)
        if lora_id is None:
            return HASH_SEED
        name = self._lora_name_of(int(lora_id)) if self._lora_name_of is not None else None
        if name is None:
            self.num_unnamed += 1
            logger.debug("kv events: LoRA id %r has no name here; block skipped", lora_id)
            return None
        return lora_seed(name)

    def _removed(self, fields: list[Any]) -> BlockRemoved | None:
        tier = tier_of(_optional(fields, 1))
        if tier is None:
            return None
        ours = [h for h in (self._forget(_key(engine_hash), tier) for engine_hash in fields[0]) if h is not None]
        return BlockRemoved(block_hashes=ours, tier=tier) if ours else None

    def _clear_device(self) -> None:
        """The engine's own cache was reset: keep the translations of blocks still held on a lower tier."""
        for tiers in self._lower.values():
            tiers.discard(DEVICE)
        self._lower = {k: tiers for k, tiers in self._lower.items() if tiers}
        self._ours = {k: ours for k, ours in self._ours.items() if k in self._lower}

    def _forget(self, engine_hash: Hashable, tier: Tier) -> int | None:
        """Our hash of a block leaving `tier` (None: not held there); kept while another tier holds it."""
        tiers = self._lower.get(engine_hash)
        if tiers is None:  # never offloaded: held on device only
            return self._ours.pop(engine_hash, None) if tier == DEVICE else None
        if tier not in tiers:
            return None
        tiers.discard(tier)
        if tiers:
            return self._ours.get(engine_hash)
        del self._lower[engine_hash]
        return self._ours.pop(engine_hash, None)


def with_image_pads(token_ids: list[int], block_size: int, extra_keys: Any, image_tokens: int) -> list[int]:
    """A stored run's tokens with each image's pad value over its positions: vLLM names an image in every block it
    touches by an `(identifier, offset from the block's start)` pair (the identifier is the digest the engine
    passed as the image's uuid), and an image takes `image_tokens` positions from there."""
    if not isinstance(extra_keys, list | tuple):
        return token_ids
    out = list(token_ids)
    for index, keys in enumerate(extra_keys):
        start = index * block_size
        for key in keys if isinstance(keys, list | tuple) else ():
            if not (isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str)):
                continue  # a LoRA name, a cache salt, a prompt-embedding digest
            identifier, offset = key
            if not (isinstance(offset, int) and len(identifier) >= 16 and _is_hex(identifier[:16])):
                continue  # an identifier we did not give (vLLM's own hash of an image not from us)
            first, end = max(start, start + offset), min(start + block_size, start + offset + image_tokens, len(out))
            out[first:end] = [pad_value(identifier)] * max(0, end - first)
    return out


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _key(engine_hash: Any) -> Hashable:
    # vLLM >= 0.10 sends bytes hashes, older versions and SGLang ints; msgpack may give lists for tuples.
    return tuple(engine_hash) if isinstance(engine_hash, list) else engine_hash


def _optional(fields: list[Any], index: int) -> Any:
    return fields[index] if len(fields) > index else None


class ZmqKvRelay:
    """Subscribes to an engine's ZMQ KV event publishers, one per data-parallel rank, and queues our
    `KvEventBatch`es: one stream, numbered from 0 with no gaps across the ranks, each batch stamped with its rank.

    vLLM and SGLang give rank r the endpoint's port + r. By default our SUB sockets bind free consecutive
    loopback ports and each rank's publisher connects to its own (vLLM documents `tcp://host:port` as
    "connect", `tcp://*:port` as "bind"), so there is no port race, and the publishers connect at engine
    start, long before the first request. An endpoint the user configured to bind is connected to instead,
    at its port + r. A batch names its rank (`EventBatch.data_parallel_rank`, SGLang's `attn_dp_rank`); one
    that does not is the rank of the socket it came in on. Each rank's engine hashes are translated by a
    rehasher of its own (the same block on two ranks is two blocks, removed apart). Overflow policy: a full
    queue drops new batches, counts them and warns once, so a router that stops reading never stalls the engine.
    """

    def __init__(
        self, topic: str = "", lora_name_of: Callable[[int], str | None] | None = None, num_ranks: int = 1
    ) -> None:
        import zmq
        import zmq.asyncio

        self.topic = topic
        self._lora_name_of = lora_name_of
        self.rehashers = {rank: KvEventRehasher(lora_name_of) for rank in range(num_ranks)}
        """Rank -> the translation of its engine hashes."""
        self._queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue(_QUEUE_SIZE)
        self._next_event_id = 0
        self.num_dropped = 0
        self._task: asyncio.Task[None] | None = None
        self._replay: str | None = None
        """The engine's replay endpoint (rank r at its port + r); None: lost batches stay lost."""
        self._next_seq: dict[int, int] = {}
        """Rank -> the publisher sequence number expected next."""
        self.num_replayed = 0
        self.num_malformed = 0
        context = zmq.asyncio.Context.instance()
        self._sockets: list[Any] = [context.socket(zmq.SUB) for _ in range(num_ranks)]
        """Rank r's SUB socket at index r."""
        for sock in self._sockets:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)

    @property
    def rehasher(self) -> KvEventRehasher:
        """Rank 0's rehasher (a rank-blind engine's only one)."""
        return self.rehashers[0]

    def read_images(self, tokens_per_image: int) -> None:
        """The engine's images take this many tokens each: their runs hash as their content (`with_image_pads`)."""
        for rehasher in self.rehashers.values():
            rehasher.image_tokens = tokens_per_image

    def expect_block_size(self, block_size: int) -> None:
        """The router hashes blocks of this size: events of another are dropped, the first named in an error."""
        for rehasher in self.rehashers.values():
            rehasher.block_size = block_size

    def _fresh_rehasher(self) -> KvEventRehasher:
        """A rehasher that knows nothing yet, set as rank 0's is."""
        rehasher = KvEventRehasher(self._lora_name_of)
        rehasher.image_tokens, rehasher.block_size = self.rehasher.image_tokens, self.rehasher.block_size
        return rehasher

    def bind(self, host: str = "127.0.0.1") -> str:
        """Bind free consecutive ports on `host`, rank r at the first + r; returns the endpoint rank 0's publisher
        should connect to (the others add their rank to its port)."""
        import zmq

        for _ in range(_BIND_TRIES):
            port = self._sockets[0].bind_to_random_port(f"tcp://{host}")
            bound = [(self._sockets[0], f"tcp://{host}:{port}")]
            try:
                for rank, sock in enumerate(self._sockets[1:], start=1):
                    sock.bind(f"tcp://{host}:{port + rank}")
                    bound.append((sock, f"tcp://{host}:{port + rank}"))
            except zmq.ZMQError:  # a port above the first is taken: let go of these, try others
                for sock, endpoint in bound:
                    sock.unbind(endpoint)
                continue
            return bound[0][1]
        raise OSError(f"no {len(self._sockets)} consecutive free ports on {host} after {_BIND_TRIES} tries")

    def connect(self, endpoint: str, replay: str | None = None) -> None:
        """Connect to publishers that bind `endpoint` (rank r at its port + r; a `*` host means this host), and
        replay what they buffer from `replay`, their ROUTER endpoint, if given."""
        for rank, sock in enumerate(self._sockets):
            sock.connect(rank_endpoint(endpoint.replace("*", "127.0.0.1"), rank))
        self._replay = replay.replace("*", "127.0.0.1") if replay else None

    def start(self) -> None:
        """Start the pump task (owned here, cancelled in close())."""
        if self._task is None and self._sockets:
            self._task = asyncio.get_running_loop().create_task(self._pump(), name="kv-event-relay")

    async def _pump(self) -> None:
        # NOTE: one engine message = one of our batches; the engine's own sequence number is ignored
        # because re-hashing already needs every event, and a lost one shows up as an orphan parent.
        import zmq
        import zmq.asyncio

        poller = zmq.asyncio.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        rank_of = {sock: rank for rank, sock in enumerate(self._sockets)}
        for rank in range(len(self._sockets)) if self._replay else ():
            await self._replay_from(rank, 0)
        while True:
            for sock, _ in await poller.poll():
                frames = await sock.recv_multipart()
                await self._live(frames, rank_of[sock])

    async def _live(self, frames: list[bytes], rank: int) -> None:
        """One published batch: a gap before it is replayed first, one already replayed is skipped."""
        if len(frames) < 3:  # no sequence number: nothing to check
            self.handle_payload(frames[-1], rank)
            return
        seq, expected = int.from_bytes(frames[-2], "big"), self._next_seq.get(rank)
        if expected is not None and seq < expected:
            if seq == 0 and expected > 1:  # a publisher numbering from 0 again: the engine restarted
                logger.info("kv events: rank %d's publisher started again; its cache is empty", rank)
                self.rehashers[rank] = self._fresh_rehasher()
                self.put([AllBlocksCleared()], time.time(), rank)
            else:
                return  # replayed already
        elif expected is not None and seq > expected and self._replay:
            await self._replay_from(rank, expected, seq)
        self._next_seq[rank] = seq + 1
        self.handle_payload(frames[-1], rank)

    async def _replay_from(self, rank: int, start: int, stop: int | None = None) -> None:
        """Ask rank `rank`'s replay socket for its batches from `start` (up to `stop`) and relay them in order;
        a replay that stalls is given up after REPLAY_TIMEOUT_S (its lost blocks then show up as orphans)."""
        import zmq
        import zmq.asyncio

        assert self._replay is not None
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        try:
            dealer.connect(rank_endpoint(self._replay, rank))
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(MAX_REPLAYED):
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    break
                frames = await dealer.recv_multipart()
                if len(frames) < 2:
                    continue  # not a replay frame
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END or (stop is not None and seq >= stop):
                    self._next_seq.setdefault(rank, start)  # an empty buffer: the publisher's next is `start`
                    return
                if seq >= self._next_seq.get(rank, 0):
                    self._next_seq[rank] = seq + 1
                    self.num_replayed += 1
                    self.handle_payload(frames[-1], rank)
            logger.warning(
                "kv events: rank %d's replay from %d did not end in %d batches, %.0f s apart at most",
                rank,
                start,
                MAX_REPLAYED,
                REPLAY_TIMEOUT_S,
            )
        finally:
            dealer.close(linger=0)

    def handle_payload(self, payload: bytes, rank: int = 0) -> None:
        """Decode one engine batch (from the socket of `rank`), re-hash it and queue it (pure apart from the queue);
        a batch that is not one (bytes from anyone who reaches the port) is dropped and counted."""
        try:
            batch = msgspec.msgpack.decode(payload)
            named = batch[2] if len(batch) > 2 else None
            dp_rank = int(named) if isinstance(named, int) and 0 <= named < _MAX_RANKS else rank
            rehasher = self.rehashers.get(dp_rank)
            if rehasher is None:  # a rank this relay was not told of (an engine wider than its card): keep it apart
                rehasher = self.rehashers[dp_rank] = self._fresh_rehasher()
            events = rehasher.convert(batch[1])
            timestamp = float(batch[0]) if batch[0] else time.time()
        except (msgspec.DecodeError, TypeError, ValueError, IndexError, KeyError, AttributeError, OverflowError) as exc:
            if self.num_malformed == 0:
                logger.warning(
                    "kv events: a batch from rank %d is not one (%s: %s); dropped", rank, type(exc).__name__, exc
                )
            self.num_malformed += 1
            return
        if events:
            self.put(events, timestamp=timestamp, dp_rank=dp_rank)

    def put(self, events: list[KvEvent], timestamp: float, dp_rank: int = 0) -> None:
        """Queue our events as the next numbered batch, stamped with the rank whose cache changed."""
        batch = KvEventBatch(event_id=self._next_event_id, events=events, timestamp=timestamp, dp_rank=dp_rank)
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
        """Stop the pump and close the sockets; ends `batches()`. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close(linger=0)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank `rank`'s publisher, as vLLM and SGLang derive it (`offset_endpoint_port`):
    a tcp port + rank (port 0 is left to the OS), an inproc name + `_dp{rank}`; rank 0's is `endpoint` itself."""
    if rank == 0 or "tcp" not in endpoint:
        return f"{endpoint}_dp{rank}" if rank and "inproc" in endpoint else endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
