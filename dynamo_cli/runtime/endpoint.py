"""Endpoints on the planes: serve one (register it in discovery), or watch instances and connect to them.

NOTE: after Dynamo's `component.endpoint(name).serve_endpoint(handler)`; the client side is `InstanceWatch`
(which instances are live) and `Connections` (one request-plane connection per address), which the routers' registry
and the replicas' sync compose. An
instance is two leased keys: its record `v1/instances/{ns}/{comp}/{ep}/{id:x}` (where to reach it)
and its card `v1/mdc/{ns}/{comp}/{ep}/{id:x}` (what it serves: a msgspec Struct the runtime does not
read). Serving writes the card, then the record; stopping removes the record first (no new request
arrives), then drains the streams in flight. A watcher counts an instance once both keys are known.
The runtime knows nothing of models: the card type is the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from dynamo_cli.runtime.discovery import Discovery, WatchKind
from dynamo_cli.runtime.names import EndpointName, parse_instance_key
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.supervisor import cancel_and_wait
from dynamo_cli.runtime.transport import Handler, RequestServer, Spec

logger = logging.getLogger(__name__)

CardT = TypeVar("CardT")

RETIRE_GRACE_S = 30.0
"""How long a departed instance's connection stays open for its in-flight streams."""


class InstanceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """`v1/instances/{ns}/{comp}/{ep}/{id:x}`: where an instance is reachable."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    transport: dict[str, str]
    """`{"tcp": "host:port"}`."""
    role: str = "both"
    """What the instance does for its component, as its owner names it (opaque to the runtime)."""
    pid: int = 0
    hostname: str = ""

    @property
    def address(self) -> str:
        return self.transport["tcp"]


@dataclass(frozen=True, slots=True)
class Instance(Generic[CardT]):
    """One live instance: both its keys are in discovery."""

    instance_id: int
    """The serving process's lease id."""
    record: InstanceRecord
    """Where it is reachable."""
    card: CardT
    """What it serves (decoded as the watcher's card type)."""


##### Serving #####


@dataclass(frozen=True, slots=True)
class Endpoint:
    """`ns/comp/ep` on this process's planes."""

    name: EndpointName
    """The endpoint."""
    discovery: Discovery
    """This process's discovery; its lease id is the instance id."""

    @property
    def instance_id(self) -> int:
        return self.discovery.lease_id

    @contextlib.asynccontextmanager
    async def serve_endpoint(
        self,
        server: RequestServer,
        spec: Spec[Any, Any],
        handler: Handler,
        card: msgspec.Struct,
        *,
        role: str,
        grace_s: float,
    ) -> AsyncIterator[InstanceRecord]:
        """Serve `handler` for `spec`'s requests on `server` (started), under this endpoint's name, and register this
        instance with `card` for the body; when the body returns, deregister first, then drain in-flight streams for
        up to `grace_s`. If the body raises, nothing is waited for: the lease takes the keys when the process closes
        it."""
        server.add_endpoint(spec, handler, name=self.name.endpoint)
        record = InstanceRecord(
            namespace=self.name.namespace,
            component=self.name.component,
            endpoint=self.name.endpoint,
            instance_id=self.instance_id,
            transport={"tcp": server.address},
            role=role,
            pid=os.getpid(),
            hostname=socket.gethostname(),
        )
        await self.discovery.put(self.name.card_key(self.instance_id), msgspec.json.encode(card))
        await self.discovery.put(self.name.instance_key(self.instance_id), msgspec.json.encode(record))
        yield record
        await self.deregister()
        if not await server.drain(grace_s):
            logger.warning("grace period over with %d streams in flight; aborting them", server.num_inflight)

    async def update_card(self, card: msgspec.Struct) -> None:
        """Publish a new card for this serving instance (what it serves changed); watchers see `on_update`."""
        await self.discovery.put(self.name.card_key(self.instance_id), msgspec.json.encode(card))

    async def deregister(self) -> None:
        """Remove this instance's record, then its card, so callers stop sending here."""
        await self.discovery.delete(self.name.instance_key(self.instance_id))
        await self.discovery.delete(self.name.card_key(self.instance_id))


##### Watching #####


class InstanceWatch(Generic[CardT]):
    """Follows the instances under a discovery scope (`ns/`, `ns/comp/` or `ns/comp/ep/`).

    `on_join` runs when an instance's record and card are both known, `on_update` when a live instance
    publishes a new card, `on_leave` when one of its keys goes; `changed` is set after every event. Run
    `loops()` as tasks of the owner.
    """

    def __init__(
        self,
        discovery: Discovery,
        scope: str,
        card_type: type[CardT],
        accept: Callable[[EndpointName], bool] | None = None,
    ) -> None:
        self.instances: dict[int, Instance[CardT]] = {}
        """The live instances by id."""
        self.changed = asyncio.Event()
        self.on_join: Callable[[Instance[CardT]], None] = lambda instance: None
        self.on_leave: Callable[[Instance[CardT]], None] = lambda instance: None
        self.on_update: Callable[[Instance[CardT]], None] = lambda instance: None
        self._discovery = discovery
        self._scope = scope
        self._card_type = card_type
        self._accept = accept or (lambda name: True)
        self._records: dict[int, InstanceRecord] = {}
        self._cards: dict[int, CardT] = {}

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """The two watch loops (records, cards); each runs until cancelled."""
        return [
            self._follow("v1/instances", InstanceRecord, self._records),
            self._follow("v1/mdc", self._card_type, self._cards),
        ]

    async def _follow(self, root: str, kind: type[Any], store: dict[int, Any]) -> None:
        decode = msgspec.json.Decoder(kind).decode
        async for event in self._discovery.watch(f"{root}/{self._scope}"):
            name, instance_id = parse_instance_key(event.key)
            if not self._accept(name):
                continue
            if event.kind is WatchKind.PUT:
                store[instance_id] = decode(event.value)
            else:
                store.pop(instance_id, None)
            self._reconcile(instance_id)

    def _reconcile(self, instance_id: int) -> None:
        record, card = self._records.get(instance_id), self._cards.get(instance_id)
        live = self.instances.get(instance_id)
        if record is not None and card is not None:
            if live is None:
                instance = self.instances[instance_id] = Instance(instance_id, record, card)
                self.on_join(instance)
            elif live.card is not card or live.record is not record:
                instance = self.instances[instance_id] = Instance(instance_id, record, card)
                self.on_update(instance)
        elif live is not None:
            del self.instances[instance_id]
            self.on_leave(live)
        self.changed.set()


class Connections:
    """One request-plane connection per instance address, shared by the instances there.

    A departed address's connection is closed once its streams finish (a draining instance
    completes them) or after RETIRE_GRACE_S (one cut off without closing its socket): those fail
    with WorkerDisconnected, which callers may retry elsewhere. This object owns the closing tasks.
    """

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        """The cluster secret each connection authenticates with (None: none, loopback only)."""
        self._clients: dict[str, RequestClient] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> RequestClient:
        """The connection to `address`, created (lazily connecting) if new."""
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RequestClient(address, secret=self._secret)
        return client

    def retire(self, address: str) -> None:
        """No instance is left at `address`: close its connection once idle."""
        client = self._clients.pop(address, None)
        if client is not None:
            task = asyncio.get_running_loop().create_task(_close_when_idle(client))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        """Close every connection now. Idempotent."""
        await cancel_and_wait(*self._retiring)
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()


async def _close_when_idle(client: RequestClient) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETIRE_GRACE_S
    while client.num_streams and loop.time() < deadline:
        await asyncio.sleep(0.1)
    await client.close()
