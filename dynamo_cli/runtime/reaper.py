"""A worker's descendants die with it, even when it is SIGKILLed.

Engines such as vLLM run their model in processes of their own (EngineCore, one worker per GPU) that do
not notice their parent's death: `kill -9` of a `dyn worker` would leave them running, holding the GPU
memory and the CPU. `guard_descendants()` starts a small watchdog process (`python -m
dynamo_cli.runtime.reaper PID`). Every second it records the worker's descendants with their start times;
once the worker is gone (its parent pid changes) it sends SIGTERM to each recorded descendant still alive,
and SIGKILL to those left after the grace period. The start time guards against a recycled pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SNAPSHOT_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.1
DEFAULT_GRACE_S = 5.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    if fields[0] == "Z":
        return None  # a zombie holds nothing
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid → start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
            starts[int(entry.name)] = stat[1]
    found: dict[int, int] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in found:
            found[pid] = starts[pid]
            todo.extend(children.get(pid, ()))
    return found


def _alive(pid: int, start: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == start


def _signal_all(recorded: dict[int, int], sig: signal.Signals) -> int:
    sent = 0
    for pid, start in recorded.items():
        if _alive(pid, start):
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
    return sent


def watch(target: int, grace: float) -> None:
    """Record `target`'s descendants until it dies, then stop the ones still running."""
    me = os.getpid()
    recorded: dict[int, int] = {}
    next_snapshot = 0.0
    while os.getppid() == target:
        now = time.monotonic()
        if now >= next_snapshot:
            # Keep every pid ever seen: a child reparented mid-run is still the worker's to clean up.
            recorded.update({pid: start for pid, start in descendants(target).items() if pid != me})
            next_snapshot = now + SNAPSHOT_INTERVAL_S
        time.sleep(POLL_INTERVAL_S)
    if not _signal_all(recorded, signal.SIGTERM):
        return
    print(f"dyn reaper: worker {target} is gone; stopping its {len(recorded)} leftover processes", file=sys.stderr)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in recorded.items()):
        time.sleep(POLL_INTERVAL_S)
    _signal_all(recorded, signal.SIGKILL)


def guard_descendants(grace: float = DEFAULT_GRACE_S) -> subprocess.Popen[bytes] | None:
    """Start the watchdog for this process (Linux only; elsewhere None). Call it from the main thread."""
    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "dynamo_cli.runtime.reaper", str(os.getpid()), str(grace)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the worker's process group must not kill the watchdog first
    )


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it leaves on its own once the worker is gone
    watch(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_GRACE_S)
