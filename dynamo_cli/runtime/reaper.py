"""A worker's descendants die with it, even when it is SIGKILLed.

Engines such as vLLM run their model in processes of their own (EngineCore, one worker per GPU) that do
not notice their parent's death: `kill -9` of a `dyn worker` would leave them running, holding the GPU
memory and the CPU. `guard_descendants()` marks this process's environment with a random token, which
every process it starts from then on inherits, and starts a small watchdog (`python -m
dynamo_cli.runtime.reaper PID TOKEN`). The watchdog sleeps until the worker dies (PR_SET_PDEATHSIG, with a
once-a-second parent check as a fallback), then finds the processes whose environment carries the token
and sends them SIGTERM, and SIGKILL to those left after the grace period. It costs nothing while the
worker lives: no polling of /proc, so no wakeups that would steal a core from the engine. A process
that starts its children with an emptied environment escapes it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

TOKEN_ENV = "DYN_REAPER_TOKEN"
DEFAULT_GRACE_S = 5.0
PARENT_CHECK_S = 1.0
POLL_S = 0.1


def _start_time(pid: int) -> int | None:
    """Start time (clock ticks) of a live, non-zombie `pid`; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def marked(token: str) -> dict[int, int]:
    """Live processes whose environment holds `TOKEN_ENV=token`, but this one: pid → start time."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            start = _start_time(int(entry.name))
            if start is not None:
                found[int(entry.name)] = start
    return found


def _signal_all(victims: dict[int, int], sig: signal.Signals) -> None:
    for pid, start in victims.items():
        if _start_time(pid) == start:  # the same process, not a recycled pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _wait_for_parent_death(target: int) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGUSR1)
    while os.getppid() == target:
        signal.sigtimedwait({signal.SIGUSR1}, PARENT_CHECK_S)


def watch(target: int, token: str, grace: float) -> None:
    """Sleep until `target` dies, then stop every process carrying `token`."""
    _wait_for_parent_death(target)
    victims = marked(token)
    if not victims:
        return
    print(f"dyn reaper: worker {target} is gone; stopping its {len(victims)} leftover processes", file=sys.stderr)
    _signal_all(victims, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_start_time(p) == s for p, s in victims.items()):
        time.sleep(POLL_S)
    _signal_all(victims, signal.SIGKILL)


def guard_descendants(grace: float = DEFAULT_GRACE_S) -> subprocess.Popen[bytes] | None:
    """Mark the processes this one starts from now on, and start their watchdog (Linux only; else None).

    Call it from the main thread, before the engine starts its processes.
    """
    if not sys.platform.startswith("linux"):
        return None
    token = secrets.token_hex(8)
    os.environ[TOKEN_ENV] = token
    return subprocess.Popen(
        [sys.executable, "-m", "dynamo_cli.runtime.reaper", str(os.getpid()), token, str(grace)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the worker's process group must not kill the watchdog first
    )


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it leaves by itself once the worker is gone
    watch(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT_GRACE_S)
