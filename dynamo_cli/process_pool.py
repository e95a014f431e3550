"""Child-process supervision for `dyn serve`: worker processes that die unexpectedly are started again.

NOTE: each slot is one long-lived task that starts its process, waits for it to exit, and, unless the
pool is stopping, starts it again after a backoff. A slot may be a multi-node group (a leader and its followers):
the first of them to exit ends the others (SIGTERM, then SIGKILL after GROUP_GRACE_S), and the group starts again
as a unit (doubling from `backoff_initial_s` to
`backoff_max_s`). A slot that exits more than `max_restarts` times within `window_s` is given up on
and logged; the others keep running. The pool's TaskGroup owns the slot tasks; `stop()` terminates
the processes (SIGTERM, grace period, SIGKILL) and ends the tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

GROUP_GRACE_S = 2.0
"""How long the rest of a group that lost a member has to exit on SIGTERM before SIGKILL."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How `dyn serve` restarts a worker that exited on its own."""

    max_restarts: int = 5
    """Restarts allowed per slot within `window_s`; past that the slot stays down (0: never restart)."""
    window_s: float = 300.0
    """The sliding window the restart budget is counted over (seconds)."""
    backoff_initial_s: float = 0.5
    """Wait before the first restart; doubled for each further restart within the window."""
    backoff_max_s: float = 30.0
    """Longest wait before a restart."""

    def backoff(self, recent_restarts: int) -> float:
        return min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** max(0, recent_restarts))


class SlotState(enum.Enum):
    """Where one supervised process is."""

    RUNNING = "running"  # its process is alive
    RESTARTING = "restarting"  # it exited; waiting out the backoff before starting again
    GAVE_UP = "gave_up"  # it exhausted the restart budget and stays down
    STOPPED = "stopped"  # the pool is stopping or stopped


@dataclass(slots=True)
class Slot:
    """One supervised command line and its current process."""

    index: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Added to the pool's environment for this command (its config document)."""
    proc: asyncio.subprocess.Process | None = None
    state: SlotState = SlotState.RUNNING
    restart_at: float = 0.0
    """Monotonic time of the pending restart (state RESTARTING)."""
    exits: deque[float] = field(default_factory=deque)
    """Monotonic times of unexpected exits within the policy window."""
    followers: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)
    """A multi-node group: the other members' command lines and environments, which live and die with `argv`'s."""
    follower_procs: list[asyncio.subprocess.Process] = field(default_factory=list)

    @property
    def members(self) -> list[asyncio.subprocess.Process]:
        """Its processes now: the leader (or only) one, then the followers."""
        return [p for p in (self.proc, *self.follower_procs) if p is not None]


class ProcessPool:
    """N copies of a command (plus any extra command lines), each restarted on unexpected exit."""

    def __init__(
        self, policy: RestartPolicy, env: dict[str, str], on_restart: Callable[[int, int | None], None] | None = None
    ) -> None:
        self.policy = policy
        self.slots: list[Slot] = []
        self.env = dict(env)
        """Added to the environment of every process the pool starts (restarts included)."""
        self.on_restart = on_restart
        """Called as (slot index, exit code) each time a slot's process is started again."""
        self._stopping = False

    @property
    def procs(self) -> list[asyncio.subprocess.Process]:
        return [proc for slot in self.slots for proc in slot.members]

    async def spawn(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        followers: list[tuple[list[str], dict[str, str]]] | None = None,
    ) -> Slot:
        """Start one process now, with `env` added to the pool's, and a group's `followers` beside it (not yet
        supervised: `supervise()` takes over every slot)."""
        slot = Slot(len(self.slots), argv, dict(env or {}), followers=list(followers or []))
        slot.proc = await self._start(slot)
        self.slots.append(slot)
        return slot

    def retry_after(self) -> float | None:
        """Seconds until the next pending restart, or None when no slot is restarting."""
        pending = [s.restart_at for s in self.slots if s.state is SlotState.RESTARTING]
        if not pending:
            return None
        return max(0.0, min(pending) - time.monotonic())

    def is_live(self) -> bool:
        """Some slot runs or will run again (not every one gave up or stopped)."""
        return any(s.state in (SlotState.RUNNING, SlotState.RESTARTING) for s in self.slots)

    async def supervise(self) -> None:
        """Watch every slot until `stop()`; runs as long as the pool lives."""
        async with asyncio.TaskGroup() as group:
            for slot in self.slots:
                group.create_task(self._keep(slot))

    async def _keep(self, slot: Slot) -> None:
        while not self._stopping and slot.proc is not None:
            slot.state = SlotState.RUNNING
            code = await self._first_exit(slot)
            if self._stopping:
                break
            if not self._may_restart(slot, code):
                slot.state = SlotState.GAVE_UP
                return
            delay = self.policy.backoff(len(slot.exits) - 1)
            slot.state, slot.restart_at = SlotState.RESTARTING, time.monotonic() + delay
            await asyncio.sleep(delay)
            if self._stopping:
                break
            slot.proc = await self._start(slot)
            if self.on_restart is not None:
                self.on_restart(slot.index, code)
        slot.state = SlotState.STOPPED

    def _may_restart(self, slot: Slot, code: int | None) -> bool:
        now = time.monotonic()
        slot.exits.append(now)
        while slot.exits and now - slot.exits[0] > self.policy.window_s:
            slot.exits.popleft()
        pid = slot.proc.pid if slot.proc is not None else 0
        if len(slot.exits) > self.policy.max_restarts:
            logger.error(
                "worker %d (pid %d) exited with code %s; restart budget (%d in %.0f s) spent, not restarting it",
                slot.index,
                pid,
                code,
                self.policy.max_restarts,
                self.policy.window_s,
            )
            return False
        logger.warning(
            "worker %d (pid %d) exited with code %s; restarting it (%d/%d in %.0f s)",
            slot.index,
            pid,
            code,
            len(slot.exits),
            self.policy.max_restarts,
            self.policy.window_s,
        )
        return True

    async def _start(self, slot: Slot) -> asyncio.subprocess.Process:
        """Start the slot's process, and a group's followers beside it."""
        slot.follower_procs = [await self._exec(argv, env) for argv, env in slot.followers]
        return await self._exec(slot.argv, slot.env)

    async def _exec(self, argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, **self.env, **env}, stdin=asyncio.subprocess.DEVNULL
        )

    async def _first_exit(self, slot: Slot) -> int | None:
        """The exit code of the slot's process; for a group, of its first member to exit, the others then ended."""
        members = slot.members
        if len(members) == 1:
            return await members[0].wait()
        waits = [asyncio.ensure_future(proc.wait()) for proc in members]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        first = next(iter(done)).result()
        if not self._stopping:
            logger.warning("worker %d: a member of its group exited (code %s); stopping the group", slot.index, first)
            await _end(members, GROUP_GRACE_S)
        return first

    async def stop(self, grace: float) -> None:
        """Terminate every process (SIGTERM, `grace` + 2 s, then SIGKILL); supervision ends. Idempotent."""
        self._stopping = True
        await _end(self.procs, grace + 2)
        for slot in self.slots:
            slot.state = SlotState.STOPPED


async def _end(procs: list[asyncio.subprocess.Process], grace: float) -> None:
    """SIGTERM the processes still running, and SIGKILL those still running `grace` seconds later."""
    procs = [p for p in procs if p.returncode is None]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    try:
        async with asyncio.timeout(grace):
            for proc in procs:
                await proc.wait()
    except TimeoutError:
        for proc in procs:
            if proc.returncode is None:
                logger.warning("worker pid %d ignored SIGTERM; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
