"""Process start: seconds from exec to the ready line of `dyn worker --engine mocker` and of `dyn serve --engine
mocker --workers 2` (embedded planes, idle machine). What a planner's scale-up, a restarted worker and every
process-spawning test wait for.

    python benchmarks/startup.py [--rounds 5] [--json benchmarks/out/startup.json]

`--ab DIR` compares this checkout with another (DIR: a checkout of an earlier commit, with a `dyn_engines` link to
its `engines/`, as for overhead.py): each round starts each process from DIR, from this checkout and from this
checkout again (the A/A pair), alternating, each side's code on PYTHONPATH (PYTHONSAFEPATH); the table gives
medians and main/base, main/main.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

PROCESSES = {
    "worker": ["worker", "--engine", "mocker"],
    "serve-2": ["serve", "--engine", "mocker", "--workers", "2", "--port", "0"],
}
"""What is started, and (after `--discovery`) its flags."""
READY = {"worker": "dyn worker ready", "serve-2": "dyn serve ready"}


def time_to_ready(argv: list[str], ready: str, env: dict[str, str], cwd: Path, timeout_s: float = 60.0) -> float:
    """Seconds from exec to the line starting `ready` on stdout; the process (group) is stopped after."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "dynamo_cli.cli.main", *argv[:1], "--discovery", f"file://{tmp}", *argv[1:]]
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=cwd)
        killer = threading.Timer(timeout_s, proc.kill)  # a process that hangs silently ends the read below too
        killer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(ready):
                    return time.perf_counter() - started
            raise RuntimeError(f"{' '.join(argv)}: no ready line within {timeout_s:.0f} s")
        finally:
            killer.cancel()
            harness.stop_process(proc)


def side_env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ab", default=None, help="another checkout to compare with, alternating (see above)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    sides = {"base": Path(args.ab).resolve(), "main": here, "main2": here} if args.ab else {"main": here}
    load_start = harness.loadavg()
    rows: list[dict[str, object]] = []
    for round_ in range(1, args.rounds + 1):
        for name, argv in PROCESSES.items():
            for side, root in sides.items():
                seconds = time_to_ready(argv, READY[name], side_env(root), root)
                rows.append({"round": round_, "process": name, "side": side, "seconds": seconds})
    table = []
    for name in PROCESSES:
        medians = {
            side: statistics.median(float(r["seconds"]) for r in rows if r["process"] == name and r["side"] == side)
            for side in sides
        }
        row: dict[str, object] = {"process": name, **{f"{side}_s": round(v, 3) for side, v in medians.items()}}
        if "base" in medians:
            row["main/base"] = round(medians["main"] / medians["base"], 3)
            row["main/main2"] = round(medians["main"] / medians["main2"], 3)
        table.append(row)
    harness.print_table(table)
    harness.write_results(
        "startup",
        {"sides": {k: str(v) for k, v in sides.items()}, "rows": rows, "table": table},
        args.json,
        loadavg_start=load_start,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
