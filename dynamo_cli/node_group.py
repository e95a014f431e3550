"""A multi-node group: one engine over several nodes, whose members live and die together.

NOTE: the leader (node rank 0) serves `group_join` on its request plane from the start; each follower opens one
stream there (authenticated with the cluster secret, as every request-plane call) and the leader beats on it every
BEAT_S. The leader registers in discovery only once every follower has joined. From then on the group is one unit:
a follower's stream ends the moment its process dies (its connection closes), and the leader raises GroupBroken,
which ends its serving at once (no drain: its streams fail over to migration, its lease goes), so the frontends
take it out of routing; a follower that hears no beat for LOST_AFTER_S (its leader died or hung) exits the same
way. Under `dyn serve --nodes-per-worker N` the group is restarted as a unit (process_pool.py); on Kubernetes a
LeaderWorkerSet does the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from dynamo_cli.config.group import GroupConfig
from dynamo_cli.errors import DynError, RemoteError, RequestError, TransportError
from dynamo_cli.runtime.request_client import RequestClient, ResponseStream
from dynamo_cli.wire import GROUP_JOIN, GroupBeat, GroupJoin

logger = logging.getLogger(__name__)

BEAT_S = 0.25
"""How often the leader beats on each follower's stream."""
LOST_AFTER_S = 2.0
"""A follower that hears no beat for this long counts its leader lost."""
RETRY_S = 0.5
"""How often a follower tries a leader that is not reachable yet."""


class GroupBroken(DynError):
    """A member of a multi-node group is gone: the group stops as a unit (and is restarted as one)."""


class GroupLeader:
    """The leader's side: who joined, whether the group is whole, and the loss of a member once it was."""

    def __init__(self, config: GroupConfig, engine: str) -> None:
        self.config = config
        self.engine = engine
        self._joined: set[int] = set()
        self._whole = asyncio.Event()
        self._lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.serving = False
        """Registered and serving (the beats say so)."""

    @property
    def joined(self) -> list[int]:
        """The followers' node ranks joined now."""
        return sorted(self._joined)

    async def join(self, request: GroupJoin) -> AsyncIterator[GroupBeat]:
        """The `group_join` endpoint: admit one follower, then beat until its stream ends; once the group was
        whole, that end breaks the group."""
        self._admit(request)
        rank = request.node_rank
        self._joined.add(rank)
        logger.info("group: node %d joined (%d of %d)", rank, len(self._joined) + 1, self.config.nnodes)
        if len(self._joined) == self.config.nnodes - 1:
            self._whole.set()
        try:
            while True:
                yield GroupBeat(joined=self.joined, serving=self.serving)
                await asyncio.sleep(BEAT_S)
        finally:
            self._joined.discard(rank)
            if self._whole.is_set() and not self._lost.done():
                self._lost.set_result(f"node {rank} of the group left")

    def _admit(self, request: GroupJoin) -> None:
        nnodes = self.config.nnodes
        if request.nnodes != nnodes or request.engine != self.engine:
            raise RequestError(
                f"this leader runs --engine {self.engine} over --nnodes {nnodes}; the follower has "
                f"--engine {request.engine} --nnodes {request.nnodes}: start it with the leader's settings",
                param="nnodes",
            )
        if not 1 <= request.node_rank < nnodes:
            raise RequestError(
                f"--node-rank {request.node_rank} is not a follower of 1..{nnodes - 1}", param="node_rank"
            )
        if request.node_rank in self._joined:
            raise RequestError(f"node {request.node_rank} has joined already", param="node_rank")
        if self._whole.is_set():
            raise RequestError("the group formed already; a restarted member restarts the group", param="node_rank")

    async def wait_whole(self) -> None:
        """Return once every follower joined; DynError naming the missing ranks after `--group-join-timeout`."""
        try:
            async with asyncio.timeout(self.config.join_timeout_s):
                await self._whole.wait()
        except TimeoutError:
            missing = sorted(set(range(1, self.config.nnodes)) - self._joined)
            raise DynError(
                f"group: nodes {missing} did not join {self.config.leader_addr} within "
                f"{self.config.join_timeout_s:.0f} s (--group-join-timeout); start them with --leader-addr "
                f"{self.config.leader_addr}"
            ) from None

    async def watch(self) -> None:
        """A serving loop: raise GroupBroken when a member leaves the whole group."""
        raise GroupBroken(f"{await self._lost}: the group stops")

    def health(self) -> dict[str, object]:
        """`/health`'s view of the group."""
        return {"nnodes": self.config.nnodes, "node_rank": 0, "joined": self.joined}


async def follow(config: GroupConfig, engine: str, secret: bytes | None, headless: Awaitable[None]) -> None:
    """A follower's life: join the leader, run the engine's headless part, and raise GroupBroken when the leader is
    gone (or the headless part ended); DynError if no leader answers within `--group-join-timeout`."""
    client = RequestClient(config.leader_addr or "", secret=secret, idle_timeout=LOST_AFTER_S)
    try:
        stream = await _join(client, config, engine)
        logger.info("group: node %d joined the leader at %s", config.node_rank, config.leader_addr)
        part = asyncio.ensure_future(headless)
        try:
            await _heed(stream, part)
        finally:
            part.cancel()
            await asyncio.gather(part, return_exceptions=True)
    finally:
        await client.close()


async def _join(client: RequestClient, config: GroupConfig, engine: str) -> ResponseStream:
    join = GroupJoin(node_rank=config.node_rank, nnodes=config.nnodes, engine=engine)
    deadline = time.monotonic() + config.join_timeout_s
    while True:
        try:
            stream = await client.open(GROUP_JOIN, join)
            await stream.next_batch(LOST_AFTER_S)  # the first beat: admitted
            return stream
        except TransportError as exc:
            if (isinstance(exc, RemoteError) and exc.is_client_error) or time.monotonic() > deadline:
                raise DynError(f"group: cannot join the leader at {config.leader_addr}: {exc}") from None
        await asyncio.sleep(RETRY_S)


async def _heed(stream: ResponseStream, part: asyncio.Future[None]) -> None:
    """Read the leader's beats until they stop; the headless part ending ends the follower too."""
    while not part.done():
        try:
            if not await stream.next_batch(LOST_AFTER_S):
                raise GroupBroken("the leader ended the group")
        except TransportError as exc:
            raise GroupBroken(f"the leader is gone ({exc})") from None
    part.result()
    raise GroupBroken("the engine's headless part ended")
