"""The CLI surface: errors are one red line and a non-zero exit; the public API is explicit."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import dynamo_cli
from dynamo_cli.kv.tiers import KvTierConfig


def dyn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=60
    )


def test_an_unknown_engine_is_one_line_listing_the_known_ones() -> None:
    result = dyn("worker", "--engine", "nope")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown engine 'nope'" in lines[0] and "mocker" in lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["worker", "--system-port", "70000"], "--system-port must be 0..65535"),
        (["serve", "--stall-timeout", "-1"], "--stall-timeout -1.0"),
        (["worker", "--log-format", "xml"], "--log-format 'xml' is invalid"),
        (["router", "--trace-sample-ratio", "2"], "--trace-sample-ratio must be between 0 and 1"),
        (["serve", "--otlp-endpoint", "collector:4318"], "must be an http:// or https:// URL"),
        (["serve", "--frontends", "0"], "--frontends must be between 1 and 256, got 0"),
        (["serve", "--frontends", "100000"], "--frontends must be between 1 and 256"),
        (["serve", "--lora", "sql"], "--lora 'sql' is invalid; write NAME=PATH"),
        (["worker", "--lora", "../x=/a.gguf"], "adapter name '../x' is invalid"),
        (["serve", "--lora", "a=/x", "--lora", "a=/y"], "adapter 'a' is given twice"),
        (["worker", "--max-loras", "0"], "--max-loras must be between 1 and 1024, got 0"),
        (["serve", "--lora-replicas", "-1"], "--lora-replicas must be >= 0"),
        (["serve", "--batch-max-inflight", "-1"], "--batch-max-inflight must be >= 0"),
        (["serve", "--batch-max-lines", "0"], "--batch-max-lines > 0"),
        (
            ["serve", "--engine", "mocker", "--workers", "0", "--port", "0", "--batch-db", "/proc/no/b.db"],
            "--batch-db '/proc/no/b.db'",
        ),
        (["bench", "--model", "a,b", "--model-mix", "zipf:x"], "--model-mix 'zipf:x' is invalid"),
    ],
)
def test_a_bad_observability_setting_is_one_line_naming_it(args: list[str], expected: str) -> None:
    result = dyn(*args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_a_missing_model_path_is_one_clear_line() -> None:
    result = dyn(
        "worker", "--engine", "mocker", "--model", "/no/such/model.gguf", "--discovery", "file:///tmp/dyn-cli-test"
    )
    assert result.returncode != 0
    assert "neither a built-in alias" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_router_mode_is_rejected() -> None:
    result = dyn(
        "serve",
        "--engine",
        "mocker",
        "--router",
        "best",
        "--port",
        "0",
        "--workers",
        "0",
        "--discovery",
        "file:///tmp/dyn-cli-test",
    )
    assert result.returncode == 2 and "--router 'best'" in result.stderr


def test_help_lists_the_engines_and_whether_they_are_installed() -> None:
    result = dyn("worker", "--help")
    text = " ".join(word for word in result.stdout.split() if word != "│")  # the help box wraps the list anywhere
    assert result.returncode == 0 and "mocker (installed)" in text and "http (installed)" in text


def test_the_public_api_is_sorted_and_importable() -> None:
    assert dynamo_cli.__all__ == sorted(dynamo_cli.__all__)
    for name in dynamo_cli.__all__:
        assert hasattr(dynamo_cli, name)


def installed_dyn(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the `dyn` console script pip installed next to this Python (what a user types)."""
    exe = Path(sys.executable).parent / "dyn"
    path = str(exe) if exe.exists() else shutil.which("dyn")
    assert path, "the dyn console script is not installed; run `make setup`"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--prot", "8000"], "--prot"),  # an unknown option
        (["serve", "--workers", "abc"], "--workers"),  # a bad value
        (["serve", "--router"], "--router"),  # an option missing its value
        (["nosuchcommand"], "nosuchcommand"),  # an unknown command
    ],
)
def test_a_usage_error_is_one_red_line_with_the_usage_hint(args: list[str], expected: str) -> None:
    result = installed_dyn(*args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and expected in lines[0] and "--help" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python")
@pytest.mark.parametrize("how", ["flag", "env"])
def test_deterministic_reaches_the_engine_by_flag_or_environment(how: str, tmp_path: Path) -> None:
    args = [
        "worker",
        "--engine",
        "llamacpp",
        "--context-length",
        "8192",
        "--max-num-seqs",
        "4096",
        "--discovery",
        f"file://{tmp_path}",
    ]
    env = None
    if how == "flag":
        args.append("--deterministic")
    else:
        env = {**os.environ, "DYN_DETERMINISTIC": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=60, env=env
    )
    # Deterministic mode gives each of the 4100 sequence ids its own 8192-token KV stream: far too big.
    assert result.returncode != 0 and "GiB of KV cache" in result.stderr


def parsed_config(module: Any, argv: list[str], command: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The config a CLI command `module` builds from the `dyn` command line `argv` (nothing is started)."""
    import typer
    from typer.testing import CliRunner

    seen: list[Any] = []
    monkeypatch.setattr(module, "run", lambda coro: (seen.append(coro.cr_frame.f_locals["config"]), coro.close()))
    monkeypatch.setattr(module, "die_with_parent", lambda: None, raising=False)
    app = typer.Typer()
    app.command()(module.command)
    result = CliRunner().invoke(app, argv[argv.index(command) + 1 :])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_kv_tier_flags_reach_dyn_serves_workers_in_their_config_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dyn serve` flags → each worker's config (a subdirectory per worker) → the document `dyn worker` reads."""
    from dynamo_cli.cli import serve as serve_cli
    from dynamo_cli.cli import worker as worker_cli
    from dynamo_cli.config import child_command, config_document
    from dynamo_cli.launcher import _own_disk_dir

    flags = ["--kv-host-cache-gb", "1.5", "--kv-disk-cache-gb", "2", "--kv-disk-cache-dir", "/tmp/kv"]
    served = parsed_config(
        serve_cli, ["serve", "--engine", "mocker", *flags, "--no-kv-disk-offload-filter"], "serve", monkeypatch
    )
    command = child_command(_own_disk_dir(served.worker, "worker-1"))
    assert command.argv[-1] == "worker" and not any("kv" in arg for arg in command.argv)
    monkeypatch.setattr(worker_cli, "config_document", lambda kind: config_document(kind, command.env))
    config = parsed_config(worker_cli, ["worker"], "worker", monkeypatch)
    assert config.kv_tiers == KvTierConfig(1_500_000_000, 2_000_000_000, "/tmp/kv/worker-1", False)
    assert config == _own_disk_dir(served.worker, "worker-1")


def test_a_negative_kv_tier_size_is_one_line() -> None:
    result = dyn("worker", "--kv-host-cache-gb", "-1")
    assert result.returncode != 0 and "--kv-host-cache-gb -1.0" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_router_queue_policy_on_dyn_router_is_one_red_line() -> None:
    result = dyn("router", "--router-queue-policy", "bogus", "--discovery", "file:///tmp/dyn-cli-test")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(lines) == 1 and "--router-queue-policy 'bogus' is not one of fcfs | sjf | deadline" in lines[0]


def test_queue_and_busy_flags_reach_dyn_serves_routers_in_their_config_document(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dyn serve --routers N` → each router's config document → what `dyn router` runs: the same queue, busy
    thresholds and routing settings."""
    from dynamo_cli.cli import router as router_cli
    from dynamo_cli.cli import serve as serve_cli
    from dynamo_cli.config import BusyThresholds, QueueConfig, QueuePolicy, child_command, config_document

    flags = ["--router", "remote", "--routers", "2", "--router-queue-size", "7", "--router-queue-timeout", "2.5"]
    flags += ["--router-queue-policy", "sjf", "--max-inflight-per-worker", "3", "--active-decode-blocks-threshold"]
    flags += ["0.75", "--router-temperature", "0.5", "--router-tier-weights", "host=0.5"]
    served = parsed_config(serve_cli, ["serve", "--engine", "mocker", *flags], "serve", monkeypatch)
    command = child_command(served.router_config())
    monkeypatch.setattr(router_cli, "config_document", lambda kind: config_document(kind, command.env))
    config = parsed_config(router_cli, ["router"], "router", monkeypatch)
    assert (config.queue, config.busy) == (QueueConfig(7, 2.5, QueuePolicy.SJF), BusyThresholds(3, 0.75))
    assert (config.kv_router.temperature, config.kv_router.tier_weights) == (0.5, (("host", 0.5),))
    assert config == served.router_config()


def test_dyn_serve_and_dyn_worker_run_the_same_engine_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_cli.cli import serve as serve_cli
    from dynamo_cli.cli import worker as worker_cli

    served = parsed_config(serve_cli, ["serve"], "serve", monkeypatch)
    monkeypatch.setattr(worker_cli, "config_document", lambda kind: None)
    alone = parsed_config(worker_cli, ["worker"], "worker", monkeypatch)
    assert served.worker.engine == alone.engine == "llamacpp"


def test_every_command_declares_each_flag_once() -> None:
    """Each command's options come from its configs' settings; two settings with one flag would be refused."""
    from dynamo_cli.cli import router, serve, worker

    for module in (serve, worker, router):
        flags = [flag for knob in module.KNOBS for flag in knob.setting.flags]
        assert len(flags) == len(set(flags)), module.__name__
