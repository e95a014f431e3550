"""The reaper: a SIGKILLed worker's children (vLLM's EngineCore and the like) do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dynamo_cli.runtime.reaper import TOKEN_ENV, marked
from tests.conftest import descendants, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

WORKER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from dynamo_cli.runtime.reaper import guard_descendants
    guard_descendants(grace=float(sys.argv[1]))
    # a grandchild in a session of its own, as an engine's process might be: a process-group kill misses it,
    # and its parent exits first, so it is reparented away from the worker's tree
    middle = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
              "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    out = subprocess.run([sys.executable, "-c", middle, sys.argv[2]], capture_output=True, text=True).stdout
    print(out.strip(), flush=True)
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


def _start_worker(grace: float, code: str) -> tuple[subprocess.Popen[str], int]:
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(grace), code], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    return worker, int(worker.stdout.readline())


@pytest.mark.parametrize(("code", "grace"), [(POLITE, 5.0), (STUBBORN, 0.5)], ids=["sigterm", "sigkill-after-grace"])
def test_a_sigkilled_workers_processes_are_stopped_even_outside_its_tree(code: str, grace: float) -> None:
    worker, orphan = _start_worker(grace, code)
    try:
        assert not _gone(orphan) and orphan not in descendants(worker.pid)
        worker.kill()
        worker.wait()
        assert wait_until(lambda: _gone(orphan), timeout=3.0), "the process outlived its worker"
    finally:
        if not _gone(orphan):
            os.kill(orphan, signal.SIGKILL)


def test_the_reaper_finds_exactly_the_processes_carrying_its_token() -> None:
    env = {**os.environ, TOKEN_ENV: "feedface"}
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, TOKEN_ENV: "feedfacf"}
    )
    try:
        assert wait_until(lambda: mine.pid in marked("feedface"), timeout=5)
        assert set(marked("feedface")) == {mine.pid}
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()
