"""The KV transfer plane's NIXL backend: a decode worker READs a payload straight from the prefill worker's memory.

One NIXL agent per process side, made once (about 0.5–3 s) and reused: the server's `NixlSource` registers
each offered payload's bytes and describes them in a `NixlOffer` (its agent's partial metadata, that is
the connection info plus this one region, and the region's address and size; msgspec, never pickle); the
client's `NixlSink` loads that metadata (the connection to a remote agent is made once and reused; each
load adds the new region), registers a fresh local buffer of exactly `nbytes`, issues one READ and polls it to the end.

NOTE: NIXL moves the bytes; the TCP connection of `kv_transfer.py` still claims the payload (after the
cluster-secret handshake) and acknowledges the READ, so each payload is pulled once and freed as soon
as it is, deterministically. Trust: UCX gives no per-region capability. A peer that loaded this agent's
metadata can READ any region it names while that memory stays mapped (measured: a READ of a region
after `deregister` still completed over UCX TCP), so NIXL is for a network whose hosts are all this
deployment's, as NIXL itself assumes; the TCP backend is the default for that reason.

UCX reads its own environment (`UCX_TLS`, `UCX_NET_DEVICES`); tests set `UCX_TLS=tcp,self UCX_NET_DEVICES=lo`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import secrets
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0005
"""How often a READ in progress is checked (NIXL's progress thread moves it meanwhile)."""
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
"""Where the agent class lives: the `nixl` meta package, or one CUDA flavour's wheel alone (`nixl-cu12`)."""


class NixlOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What a decode worker needs to READ one payload with NIXL (`Offer.nixl`, encoded)."""

    agent: str
    """The prefill side's NIXL agent name."""
    metadata: bytes
    """That agent's partial metadata: its connection info and this payload's registered region."""
    address: int
    """Where the payload starts in the prefill process."""
    nbytes: int
    """Its size."""


_DECODER = msgspec.msgpack.Decoder(NixlOffer)


def load_agent_class() -> Any | None:
    """NIXL's `nixl_agent` class, or None when no NIXL wheel imports here (then TCP only)."""
    for name in _MODULES:
        try:
            return importlib.import_module(name).nixl_agent
        except ImportError:
            continue
    return None


def _new_agent(agent_class: Any) -> Any:
    name = f"dyn-kv-{secrets.token_hex(6)}"
    # No progress thread: NIXL's polls without pause (pthrDelay 0), a fifth of a core per idle agent on
    # this CPU. The puller progresses its own reads (check_xfer_state); the source progresses only while
    # a read of its memory is in flight (NixlSource.progress, between the claim and the ack).
    config = importlib.import_module(agent_class.__module__).nixl_agent_config(
        enable_prog_thread=False, backends=["UCX"]
    )
    return agent_class(name, config)


def _address(view: memoryview) -> int:
    import numpy as np  # here, with NIXL: ~0.17 s of every worker's start otherwise

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlSource:
    """The server side: registers payloads for remote READs and describes them; `close()` frees all."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._regions: dict[str, Any] = {}
        """transfer id -> its registration (the payload itself is kept alive by the server)."""

    @classmethod
    async def create(cls) -> NixlSource | None:
        """A source with a fresh agent (made off the event loop), or None when NIXL does not import or start."""
        agent_class = load_agent_class()
        if agent_class is None:
            return None
        try:
            return cls(await asyncio.to_thread(_new_agent, agent_class))
        except Exception as exc:  # a UCX that finds no usable transport, say
            logger.warning("KV transfer: NIXL agent could not start (%s); serving over TCP only", exc)
            return None

    def register(self, transfer_id: str, payload: bytes | bytearray | memoryview) -> bytes | None:
        """Register `payload` (non-empty; the caller keeps it alive) and return its encoded NixlOffer; None
        if NIXL refused (the payload is then offered over TCP only)."""
        view = memoryview(payload)
        address = _address(view)
        try:
            region = self._agent.register_memory([(address, view.nbytes, 0, "")], "DRAM")
            self._regions[transfer_id] = region
            metadata = self._agent.get_partial_agent_metadata(region, True, ["UCX"])
        except Exception as exc:  # NIXL's binding errors derive from Exception only
            logger.warning("KV transfer: NIXL did not register %d bytes (%s); offering them over TCP", view.nbytes, exc)
            self.deregister(transfer_id)
            return None
        offer = NixlOffer(agent=self._agent.name, metadata=metadata, address=address, nbytes=view.nbytes)
        return msgspec.msgpack.encode(offer)

    def progress(self) -> None:
        """Drive the agent's UCX workers once (serves a peer's READ in flight over TCP transports)."""
        self._agent.get_new_notifs()

    def deregister(self, transfer_id: str) -> None:
        """Forget a payload's region (before the server drops the payload). Idempotent."""
        region = self._regions.pop(transfer_id, None)
        if region is not None:
            self._agent.deregister_memory(region)

    def close(self) -> None:
        """Deregister every region. Idempotent."""
        for transfer_id in list(self._regions):
            self.deregister(transfer_id)


class NixlSink:
    """The client side: READs offered payloads into fresh buffers; its agent is made on first use."""

    def __init__(self) -> None:
        self._agent_class: Any = None
        self._loaded = False
        self._agent: Any = None
        self._creating = asyncio.Lock()

    async def is_available(self) -> bool:
        """Whether NIXL imports here: imported off the loop on the first ask (~0.2 s), not at every worker's
        start (a decode worker asks as it starts, KvMover.start; an aggregated one when it first pulls)."""
        if not self._loaded:
            async with self._creating:
                if not self._loaded:
                    self._agent_class = await asyncio.to_thread(load_agent_class)
                    self._loaded = True
        return self._agent_class is not None

    async def _ensure_agent(self) -> Any:
        async with self._creating:
            if self._agent is None:
                self._agent = await asyncio.to_thread(_new_agent, self._agent_class)
        return self._agent

    async def read(self, encoded_offer: bytes, nbytes: int) -> bytearray:
        """READ the offered payload into a new buffer of `nbytes`; the caller bounds it with a timeout.

        ValueError if the offer is malformed or names another size; RuntimeError if NIXL fails the READ.
        """
        offer = _DECODER.decode(encoded_offer)
        if offer.nbytes != nbytes:
            raise ValueError(f"the NIXL offer describes {offer.nbytes} bytes, not {nbytes}")
        try:
            return await self._read(await self._ensure_agent(), offer)
        except (ValueError, RuntimeError):
            raise
        except Exception as exc:  # NIXL's binding errors derive from Exception only
            raise RuntimeError(f"NIXL failed: {type(exc).__name__}: {exc}") from exc

    async def _read(self, agent: Any, offer: NixlOffer) -> bytearray:
        nbytes = offer.nbytes
        remote = agent.add_remote_agent(offer.metadata)
        buffer = bytearray(nbytes)
        address = _address(memoryview(buffer))
        region = agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        try:
            local = agent.get_xfer_descs([(address, nbytes, 0)], "DRAM")
            source = agent.get_xfer_descs([(offer.address, nbytes, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, source, remote)
            try:
                await self._complete(agent, handle)
            finally:
                agent.release_xfer_handle(handle)  # cancels a READ still in flight (a timeout)
        finally:
            agent.deregister_memory(region)
        return buffer

    @staticmethod
    async def _complete(agent: Any, handle: Any) -> None:
        state = agent.transfer(handle)
        while state == "PROC":
            await asyncio.sleep(POLL_INTERVAL_S)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended in state {state}")

    def close(self) -> None:
        """Drop the agent (NIXL frees it with the object). Idempotent."""
        self._agent = None
