"""ProcessPool: real child processes restarted on unexpected exit, with backoff and a budget."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from dynamo_cli.process_pool import ProcessPool, RestartPolicy, SlotState

FAST = RestartPolicy(max_restarts=2, window_s=60.0, backoff_initial_s=0.05, backoff_max_s=0.2)
EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


async def _until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_a_process_that_keeps_dying_is_restarted_within_its_budget_then_given_up() -> None:
    restarts: list[tuple[int, int | None]] = []
    pool = ProcessPool(FAST, {}, on_restart=lambda index, code: restarts.append((index, code)))
    await pool.spawn(EXIT_3)
    await pool.spawn(SLEEP)
    task = asyncio.get_running_loop().create_task(pool.supervise())
    try:
        await _until(lambda: pool.slots[0].state is SlotState.GAVE_UP)
        assert restarts == [(0, 3), (0, 3)]  # the budget: 2 restarts, then the third exit is final
        assert pool.slots[1].state is SlotState.RUNNING and pool.is_live()
    finally:
        await pool.stop(grace=1.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert all(p.returncode is not None for p in pool.procs)


async def test_a_killed_process_is_replaced_and_retry_after_counts_down_the_backoff() -> None:
    policy = RestartPolicy(max_restarts=3, backoff_initial_s=0.5)
    pool = ProcessPool(policy, {})
    slot = await pool.spawn(SLEEP)
    task = asyncio.get_running_loop().create_task(pool.supervise())
    try:
        first = slot.proc
        assert first is not None and pool.retry_after() is None
        first.kill()
        await _until(lambda: slot.state is SlotState.RESTARTING)
        wait = pool.retry_after()
        assert wait is not None and 0.0 < wait <= 0.5
        await _until(lambda: slot.proc is not first and slot.state is SlotState.RUNNING)
        assert slot.proc is not None and slot.proc.returncode is None
    finally:
        await pool.stop(grace=1.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_stop_ends_everything_and_nothing_is_restarted_after_it() -> None:
    pool = ProcessPool(FAST, {})
    for _ in range(3):
        await pool.spawn(SLEEP)
    task = asyncio.get_running_loop().create_task(pool.supervise())
    procs = list(pool.procs)
    await pool.stop(grace=1.0)
    await asyncio.wait_for(task, 5.0)  # every slot task ends by itself once the pool stops
    assert all(p.returncode is not None for p in procs) and pool.procs == procs
    assert not pool.is_live()
