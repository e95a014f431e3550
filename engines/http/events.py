"""The backend's own KV events (vLLM's ZMQ publisher, `--kv-events-config`), relayed as this worker's, re-hashed with
our block hashes (`engines.vllm.kv_events`), and checked against the prompts this worker sent.

NOTE: the backend binds its publisher (`"endpoint": "tcp://*:5557"`) and the worker connects to it at
`--engine-arg kv_events=tcp://HOST:5557`; with `kv_replay=` (its `replay_endpoint`) the worker first asks for every
batch the backend still buffers, so a worker started after its backend knows what is cached already, and asks again
for the batches a gap in the sequence numbers lost. Events of another block size than the router's are dropped and
named in an error. The self-check: of the first CHECK_EVENTS stored runs that arrive after this worker sent a prompt of
a full block, at least one must be a prefix of a prompt it sent; none means the events come from another engine, or
the backend's tokens are not ours (the text dialect), and a warning says so once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator

from dynamo_cli.kv.events import BlockStored, KvEventBatch
from dynamo_cli.kv.hashing import sequence_hashes

from ..vllm.kv_events import ZmqKvRelay

logger = logging.getLogger(__name__)

CHECK_EVENTS = 16
"""Stored runs looked at by the self-check."""
SENT_HASHES = 4096
"""Block hashes of the latest prompts sent, kept for the self-check."""


class BackendEvents:
    """The relay of one backend's KV events, and the check that they are of this worker's prompts."""

    def __init__(self, endpoint: str, replay: str | None, topic: str, block_size: int, backend: str) -> None:
        self.endpoint, self.backend, self.block_size = endpoint, backend, block_size
        self.relay = ZmqKvRelay(topic)
        self.relay.expect_block_size(block_size)
        self.relay.connect(endpoint, replay)
        self._sent: deque[int] = deque(maxlen=SENT_HASHES)
        self._sent_set: set[int] = set()
        self.num_checked = 0
        self.num_matched = 0

    def start(self) -> None:
        self.relay.start()

    def sent(self, token_ids: list[int]) -> None:
        """A prompt went to the backend: its blocks should come back as stored events."""
        if self.num_checked >= CHECK_EVENTS:
            return
        for block_hash in sequence_hashes(token_ids, self.block_size):
            if len(self._sent) == self._sent.maxlen:
                self._sent_set.discard(self._sent[0])
            self._sent.append(block_hash)
            self._sent_set.add(block_hash)

    async def batches(self) -> AsyncIterator[KvEventBatch]:
        """Our batches until close(), each looked at by the self-check while it runs."""
        async for batch in self.relay.batches():
            if self.num_checked < CHECK_EVENTS and self._sent_set:
                self._check(batch)
            yield batch

    def _check(self, batch: KvEventBatch) -> None:
        for event in batch.events:
            if type(event) is not BlockStored or self.num_checked >= CHECK_EVENTS:
                continue
            self.num_checked += 1
            self.num_matched += any(block.block_hash in self._sent_set for block in event.blocks)
        if self.num_checked >= CHECK_EVENTS:
            if self.num_matched == 0:
                logger.warning(
                    "the KV events at %s match none of the prompts this worker sent to %s (%d stored runs): they "
                    "come from another engine, or it tokenizes prompts otherwise (the text dialect); the router's "
                    "view of it is wrong: check --engine-arg kv_events=",
                    self.endpoint,
                    self.backend,
                    self.num_checked,
                )
            else:
                logger.info("the KV events at %s match the prompts sent to %s", self.endpoint, self.backend)
            self._sent.clear()
            self._sent_set.clear()

    async def close(self) -> None:
        await self.relay.close()
