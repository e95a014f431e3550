"""The reaper: a SIGKILLed worker's children (vLLM's EngineCore and the like) do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dynamo_cli.runtime.reaper import descendants
from tests.conftest import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

WORKER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from dynamo_cli.runtime.reaper import guard_descendants
    guard_descendants(grace=float(sys.argv[1]))
    # a child in a session of its own, as an engine's process might be: a process-group kill misses it
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2]], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(300)
    """
)
POLITE = "import time; time.sleep(300)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _start_worker(grace: float, child_code: str) -> tuple[subprocess.Popen[str], int]:
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(grace), child_code], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    child = int(worker.stdout.readline())
    # the watchdog snapshots every second: let it see the child before the worker dies
    assert wait_until(lambda: child in descendants(worker.pid), timeout=5)
    time.sleep(1.5)
    return worker, child


@pytest.mark.parametrize(("code", "grace", "within"), [(POLITE, 5.0, 3.0), (STUBBORN, 0.5, 3.0)],
                         ids=["sigterm", "sigkill-after-grace"])  # fmt: skip
def test_a_sigkilled_workers_children_are_stopped(code: str, grace: float, within: float) -> None:
    worker, child = _start_worker(grace, code)
    try:
        assert not _gone(child)
        worker.kill()
        worker.wait()
        assert wait_until(lambda: _gone(child), timeout=within), "the child outlived its worker"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_descendants_are_found_through_every_generation() -> None:
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    middle = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert wait_until(lambda: len(descendants(middle.pid)) == 1, timeout=5)
        (grandchild,) = descendants(middle.pid)
        assert middle.pid in descendants(os.getpid()) and grandchild in descendants(os.getpid())
    finally:
        for pid in descendants(middle.pid):
            os.kill(pid, signal.SIGKILL)
        middle.kill()
        middle.wait()
