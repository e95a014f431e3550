"""Router replicas share in-flight load: each publishes its routing events and applies the others'.

The replicas are `dyn router` processes and frontends with `--router-replica-sync` (the frontends of `dyn serve
--frontends N`): one topic, one wire, so every router in front of the same workers sees one load.

NOTE: a `dyn router` replica counts the load of its own decisions at once (sequences.py) and tells the
other replicas on `namespace.{ns}.component.router.active-sequences`: request added (worker, prompt
block hashes, uncached prefill tokens), prefill completed (first token back), freed (stream over for
any reason). A replica applies its peers' events to the same `ActiveSequences`, under the key
`{router_id:x}/{request_id}` so two replicas' request ids never collide, and ignores its own echoes.
When a peer leaves discovery (a router's instance, a frontend's record), every request it had in flight is
freed here too. Delivery is at most
once (the event plane's), so a lost `freed` is cleaned up by the stale-request expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import msgspec

from dynamo_cli.core.registry import ROUTER_COMPONENT, Registry
from dynamo_cli.routing.base import ExpiresStale
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.routing.target import Target
from dynamo_cli.runtime.discovery import Discovery, WatchKind
from dynamo_cli.runtime.endpoint import InstanceWatch
from dynamo_cli.runtime.events import EventBus, pump
from dynamo_cli.runtime.names import component_subject, frontends_prefix

logger = logging.getLogger(__name__)

SYNC_TOPIC = "active-sequences"
"""Event-plane topic of the router component that carries the replicas' routing events."""
OUTBOX_SIZE = 65_536
"""Routing events waiting to be published; when full, new ones are dropped and counted."""
MAX_BATCH = 512
"""Events sent in one message at most."""
LINGER_S = 0.002
"""How long the first event of a message waits for more: a message per event cost the frontends of `--frontends N`
a ZMQ send each (a tenth of their CPU at 1,400 requests/s); 2 ms more on a peer's view is within what the replay
of benchmarks/router_replicas.py shows harmless."""
PUBLISH_TIMEOUT_S = 2.0
EXPIRE_INTERVAL_S = 30.0
"""How often requests in flight for over STALE_REQUEST_S (a lost `freed`) are freed."""


class SequenceAdded(msgspec.Struct, frozen=True, kw_only=True, tag="added"):
    """A replica routed a request to rank `dp_rank` of `worker_id`."""

    worker_id: int
    dp_rank: int = 0
    block_hashes: list[int]
    """The prompt's unique sequence hashes (its active blocks)."""
    prefill_tokens: int
    """Prompt tokens the worker must compute (not cached there)."""
    session: str = ""
    """The agent session of the request ("": none): peers bind it to the same target (core/affinity.py)."""


class PrefillCompleted(msgspec.Struct, frozen=True, tag="prefill_completed"):
    """The request's first token came back."""


class SequenceFreed(msgspec.Struct, frozen=True, tag="freed"):
    """The request left its worker (finished, failed or cancelled)."""


SequenceChange = SequenceAdded | PrefillCompleted | SequenceFreed


class ActiveSequenceEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One routing event of one replica, for one model's policy."""

    router_id: int
    """The publishing replica's instance id (a replica drops its own echoes)."""
    model: str
    request_id: str
    data: SequenceChange


class ReplicaSync:
    """Publishes this replica's routing events and applies its peers' to the registry's policies."""

    def __init__(
        self, bus: EventBus, namespace: str, router_id: int, registry: Registry[Any], max_sessions: int = 65_536
    ) -> None:
        self.subject = component_subject(namespace, ROUTER_COMPONENT, SYNC_TOPIC)
        self.max_sessions = max_sessions
        """The session table's bound (`--router-session-table-size`): peers' sessions are bound here too."""
        self.router_id = router_id
        self.num_dropped = 0
        """Own events dropped because the outbox was full."""
        self.num_applied = 0
        """Peer events applied."""
        self._bus = bus
        self._namespace = namespace
        self._registry = registry
        self._outbox: asyncio.Queue[ActiveSequenceEvent] = asyncio.Queue(OUTBOX_SIZE)
        self._peers: dict[int, set[tuple[str, str]]] = {}
        """Peer router id -> (model, key) of its requests in flight, freed if the peer leaves."""
        self._encode = msgspec.msgpack.Encoder().encode

    def loops(self, discovery: Discovery) -> list[Coroutine[Any, Any, None]]:
        """Everything the sync runs, for its owner's tasks: publishing, applying, the peers' watches and the
        expiry of requests whose end was lost. Each runs until cancelled."""
        return [self.publish_loop(), self.subscribe_loop(), *self.peer_loops(discovery), self.expire_loop()]

    ##### This replica's decisions -> peers #####

    def added(self, model: str, request_id: str, policy: KvRoutingPolicy, session: str = "") -> None:
        """Announce a request `policy` just counted (reads its worker, blocks and prefill back), of `session`."""
        active = policy.sequences.describe(request_id)
        if active is not None:
            target, hashes, prefill_tokens = active
            added = SequenceAdded(
                worker_id=target.worker,
                dp_rank=target.rank,
                block_hashes=list(hashes),
                prefill_tokens=prefill_tokens,
                session=session,
            )
            self._send(model, request_id, added)

    def prefill_completed(self, model: str, request_id: str) -> None:
        """Announce a request's first token."""
        self._send(model, request_id, PrefillCompleted())

    def freed(self, model: str, request_id: str) -> None:
        """Announce the end of a request's stream."""
        self._send(model, request_id, SequenceFreed())

    def _send(self, model: str, request_id: str, data: SequenceChange) -> None:
        event = ActiveSequenceEvent(router_id=self.router_id, model=model, request_id=request_id, data=data)
        try:
            self._outbox.put_nowait(event)
        except asyncio.QueueFull:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning("replica sync: outbox full (%d events); dropping, peers' load views drift", OUTBOX_SIZE)

    async def publish_loop(self) -> None:
        """Send queued events in order, as batches (a message is a list of events); runs until cancelled."""
        while True:
            batch = [await self._outbox.get()]
            await asyncio.sleep(LINGER_S)
            while len(batch) < MAX_BATCH and not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            try:
                async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                    await self._bus.publish(self.subject, self._encode(batch))
            except TimeoutError:
                self.num_dropped += len(batch)
                logger.warning(
                    "replica sync: publish took over %.0f s; %d events dropped", PUBLISH_TIMEOUT_S, len(batch)
                )

    ##### Peers -> this replica's view #####

    async def subscribe_loop(self) -> None:
        """Apply the peers' events; runs until cancelled."""
        await pump(await self._bus.subscribe(self.subject), self.apply_batch, list[ActiveSequenceEvent])

    def apply_batch(self, events: list[ActiveSequenceEvent]) -> None:
        """Count a peer's message (its events in order)."""
        for event in events:
            self.apply(event)

    def apply(self, event: ActiveSequenceEvent) -> None:
        """Count a peer's routing event in the model's policy; own echoes and unknown models are ignored."""
        if event.router_id == self.router_id:
            return
        entry = self._registry.models.get(event.model)
        policy = entry.policy if entry is not None else None
        if not isinstance(policy, KvRoutingPolicy):
            return
        key = f"{event.router_id:x}/{event.request_id}"
        data = event.data
        in_flight = self._peers.setdefault(event.router_id, set())
        if type(data) is SequenceAdded:
            if data.worker_id not in entry.workers:  # type: ignore[union-attr]
                return  # a worker this replica saw leave (or not yet join): its load is not tracked
            target = Target(data.worker_id, data.dp_rank)
            policy.add_remote(key, target, data.block_hashes, data.prefill_tokens)
            if data.session:
                entry.sessions.bind(data.session, target, self.max_sessions)  # type: ignore[union-attr]
            in_flight.add((event.model, key))
        elif type(data) is PrefillCompleted:
            policy.on_first_token(key)
        else:
            policy.on_finish(key)
            in_flight.discard((event.model, key))
        self.num_applied += 1

    def peer_left(self, router_id: int) -> None:
        """Free every request a departed replica had in flight."""
        for model, key in self._peers.pop(router_id, set()):
            entry = self._registry.models.get(model)
            if entry is not None:
                entry.policy.on_finish(key)

    async def expire_loop(self) -> None:
        """Free what has been in flight too long (a peer's `freed` lost on the event plane); until cancelled."""
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            for entry in list(self._registry.models.values()):
                stale = entry.policy.expire_stale() if isinstance(entry.policy, ExpiresStale) else []
                if stale:
                    logger.warning("freed %d requests in flight for too long on model %s", len(stale), entry.name)

    def peer_loops(self, discovery: Discovery) -> list[Coroutine[Any, Any, None]]:
        """The watches of the peers: the `dyn router` instances (their cards are not read) and the frontends'
        records; a peer that leaves has its load freed. Each runs until cancelled."""
        routers: InstanceWatch[msgspec.Raw] = InstanceWatch(
            discovery, f"{self._namespace}/{ROUTER_COMPONENT}/", msgspec.Raw
        )
        routers.on_leave = lambda peer: self._on_peer_leave("router replica", peer.instance_id)
        return [*routers.loops(), self._follow_frontends(discovery)]

    async def _follow_frontends(self, discovery: Discovery) -> None:
        async for event in discovery.watch(frontends_prefix(self._namespace)):
            if event.kind is WatchKind.DELETE:
                with contextlib.suppress(ValueError):
                    self._on_peer_leave("frontend", int(event.key.rsplit("/", 1)[-1], 16))

    def _on_peer_leave(self, kind: str, peer_id: int) -> None:
        if peer_id != self.router_id:
            logger.info(
                "%s %x left; freeing its %d requests in flight", kind, peer_id, len(self._peers.get(peer_id, ()))
            )
            self.peer_left(peer_id)
