"""Connectors: how a planner decision becomes running workers. A narrow Protocol, so a Kubernetes
connector can follow the two here.

`virtual` (Dynamo's VirtualConnector): the planner writes each decision under discovery,
`v1/planner/{namespace}/decision` = {decision_id, num_prefill_workers, num_decode_workers}, and waits
(polling, with a timeout) until an external orchestrator writes `v1/planner/{namespace}/ack` =
{scaled_decision_id >= decision_id}. Decision ids keep rising across planner restarts: a new planner
continues from the stored decision.

`local`: starts and stops `dyn worker` processes on this host (command lines built by the CLI, the same
ones `dyn serve` runs). Scale-down drains: SIGTERM makes a worker deregister first, so routers stop
choosing it, then finish its in-flight streams (`--graceful-shutdown`), then exit; the newest worker of
the pool goes first. Only one scale action is in flight at a time (the planner awaits `apply`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from dynamo_cli.config import ChildCommand
from dynamo_cli.runtime.discovery import Discovery

logger = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ScaleTarget:
    """Worker counts a decision asks for."""

    decision_id: int
    """Rises by one per decision."""
    num_prefill: int
    """Prefill workers (0 in agg mode)."""
    num_decode: int
    """Decode workers (agg mode: the one pool)."""


class Connector(Protocol):
    """Applies scale targets to some orchestrator."""

    async def next_decision_id(self) -> int:
        """The id the next decision should carry."""
        ...

    async def apply(self, target: ScaleTarget) -> bool:
        """Make the deployment match `target`; False when it could not be confirmed in time."""
        ...

    async def close(self) -> None:
        """Release what the connector holds (local: stop its workers). Idempotent."""
        ...


class VirtualDecision(msgspec.Struct, frozen=True, kw_only=True):
    """The decision record an external orchestrator reads."""

    decision_id: int
    num_prefill_workers: int
    num_decode_workers: int


class VirtualAck(msgspec.Struct, frozen=True, kw_only=True):
    """What the orchestrator writes once it has scaled."""

    scaled_decision_id: int


def decision_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/decision"


def ack_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/ack"


class VirtualConnector:
    """Writes decisions under discovery and waits for the orchestrator's acknowledgement."""

    def __init__(
        self, discovery: Discovery, namespace: str, *, ack_timeout_s: float = 1800.0, poll_s: float = 1.0
    ) -> None:
        self.discovery = discovery
        self.namespace = namespace
        self.ack_timeout_s = ack_timeout_s
        """Longest wait for an ack (Dynamo: SCALING_MAX_WAIT_TIME, 1800 s)."""
        self.poll_s = poll_s
        """Ack polling period (Dynamo: SCALING_CHECK_INTERVAL, 10 s)."""

    async def _read(self, key: str, kind: type[msgspec.Struct]) -> msgspec.Struct | None:
        async with asyncio.timeout(DISCOVERY_TIMEOUT_S):
            found = await self.discovery.get_prefix(key)
        raw = found.get(key)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("ignoring a malformed %s", key)
            return None

    async def next_decision_id(self) -> int:
        stored = await self._read(decision_key(self.namespace), VirtualDecision)
        return stored.decision_id + 1 if isinstance(stored, VirtualDecision) else 1

    async def apply(self, target: ScaleTarget) -> bool:
        record = VirtualDecision(
            decision_id=target.decision_id, num_prefill_workers=target.num_prefill, num_decode_workers=target.num_decode
        )
        async with asyncio.timeout(DISCOVERY_TIMEOUT_S):
            # not leased: the last decision outlives this planner, for the orchestrator and the next planner
            await self.discovery.put(decision_key(self.namespace), msgspec.json.encode(record), leased=False)
        deadline = time.monotonic() + self.ack_timeout_s
        while time.monotonic() < deadline:
            ack = await self._read(ack_key(self.namespace), VirtualAck)
            if isinstance(ack, VirtualAck) and ack.scaled_decision_id >= target.decision_id:
                return True
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        logger.warning(
            "decision %d (prefill %d, decode %d) not acknowledged within %.0f s",
            target.decision_id,
            target.num_prefill,
            target.num_decode,
            self.ack_timeout_s,
        )
        return False

    async def close(self) -> None:
        return None


@dataclass(slots=True)
class _Pool:
    command: ChildCommand | None
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)


class LocalConnector:
    """Starts and drains `dyn worker` processes on this host, one pool per role."""

    def __init__(
        self, decode: ChildCommand, prefill: ChildCommand | None, env: dict[str, str], *, grace_s: float = 5.0
    ) -> None:
        self._pools = {"decode": _Pool(decode), "prefill": _Pool(prefill)}
        self.env = dict(env)
        """Added to every worker's environment (the planes' URLs, the cluster secret, the parent pid)."""
        self.grace_s = grace_s
        """The workers' `--graceful-shutdown`: how long a drain may take before SIGKILL (plus 5 s)."""
        self._next_id = 1

    def counts(self) -> tuple[int, int]:
        """(prefill, decode) processes alive."""
        return tuple(len(self._alive(role)) for role in ("prefill", "decode"))  # type: ignore[return-value]

    def processes(self) -> list[asyncio.subprocess.Process]:
        """Every worker process started and not yet reaped from the pools (dead ones included)."""
        return [proc for pool in self._pools.values() for proc in pool.procs]

    def pids(self, role: str) -> list[int]:
        return [p.pid for p in self._alive(role)]

    def _alive(self, role: str) -> list[asyncio.subprocess.Process]:
        pool = self._pools[role]
        pool.procs = [p for p in pool.procs if p.returncode is None]
        return pool.procs

    async def next_decision_id(self) -> int:
        return self._next_id

    async def apply(self, target: ScaleTarget) -> bool:
        self._next_id = target.decision_id + 1
        for role, wanted in (("prefill", target.num_prefill), ("decode", target.num_decode)):
            await self._scale(role, wanted)
        return True

    async def _scale(self, role: str, wanted: int) -> None:
        pool = self._pools[role]
        if wanted > 0 and pool.command is None:
            raise ValueError(f"no command for {role} workers")
        while len(self._alive(role)) < wanted:
            assert pool.command is not None
            proc = await asyncio.create_subprocess_exec(
                *pool.command.argv,
                env={**os.environ, **self.env, **pool.command.env},
                stdin=asyncio.subprocess.DEVNULL,
            )
            pool.procs.append(proc)
            logger.info("started %s worker pid %d", role, proc.pid)
        surplus = self._alive(role)[wanted:]
        del pool.procs[wanted:]
        await asyncio.gather(*(self._drain(role, proc) for proc in reversed(surplus)))

    async def _drain(self, role: str, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM: the worker deregisters, finishes its streams, exits; SIGKILL if it overstays."""
        logger.info("draining %s worker pid %d", role, proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(self.grace_s + 5.0):
                await proc.wait()
        except TimeoutError:
            logger.warning("%s worker pid %d did not drain in %.0f s; killing it", role, proc.pid, self.grace_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        for role in ("prefill", "decode"):
            await self._scale(role, 0)
