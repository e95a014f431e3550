"""An engine's KV event publisher, as vLLM 0.32's `ZmqEventPublisher` speaks it, on real ZMQ sockets on loopback:
the PUB side an XPUB (so that a test knows when a subscriber has come), the ROUTER replay side served from a buffer;
and the batches it sends (`stored`, `payload`). The `publisher` fixture is in tests/engines/conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dynamo_cli.kv.events import BlockStored, KvEventBatch

BLOCK = 4
END = (-1).to_bytes(8, "big", signed=True)


def stored(tokens: list[int], parent: int | None = None, block_size: int = BLOCK) -> dict[str, Any]:
    """A vLLM 0.32 BlockStored (a map tagged `type`), its hashes the engine's own (any distinct ints)."""
    hashes = [hash((tuple(tokens), i)) & (1 << 63) - 1 for i in range(len(tokens) // block_size)]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip


def payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


class Publisher:
    """An engine's publisher: PUB and ROUTER sockets on loopback, a replay buffer; `send` numbers the batches."""

    def __init__(self) -> None:
        context = zmq.asyncio.Context.instance()
        self.pub, self.router = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)  # XPUB: a PUB that hears SUBs
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays: list[int] = []

    async def send(self, data: bytes, *, publish: bool = True, seq: int | None = None) -> None:
        """Buffer the next batch and publish it (`publish=False`: lost on the way, as past a high-water mark)."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        self.buffer.append((seq, data))
        if publish:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), data])

    async def serve_replays(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq, data in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([identity, b"", b"kv", seq.to_bytes(8, "big"), data])
            await self.router.send_multipart([identity, b"", b"", END, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def serving() -> AsyncIterator[Publisher]:
    """A publisher answering replays until closed."""
    p = Publisher()
    task = asyncio.get_running_loop().create_task(p.serve_replays())
    yield p
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    p.close()


def first_blocks(batch: KvEventBatch) -> list[int]:
    """Our block hashes of a batch's first (stored) event."""
    event = batch.events[0]
    assert isinstance(event, BlockStored)
    return [block.block_hash for block in event.blocks]
