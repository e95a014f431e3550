"""The CLI surface: errors are one red line and a non-zero exit; the public API is explicit."""

from __future__ import annotations

import subprocess
import sys

import dynamo_cli


def dyn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=60
    )


def test_an_unknown_engine_is_one_line_listing_the_known_ones() -> None:
    result = dyn("worker", "--engine", "nope")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown engine 'nope'" in lines[0] and "mocker" in lines[0]


def test_a_missing_model_path_is_one_clear_line() -> None:
    result = dyn(
        "worker", "--engine", "mocker", "--model", "/no/such/model.gguf", "--discovery", "file:///tmp/dyn-cli-test"
    )
    assert result.returncode != 0
    assert "neither a built-in alias" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_router_mode_is_rejected() -> None:
    result = dyn("serve", "--engine", "mocker", "--router", "best", "--port", "0", "--workers", "0",
                 "--discovery", "file:///tmp/dyn-cli-test")  # fmt: skip
    assert result.returncode == 2 and "--router 'best'" in result.stderr


def test_help_lists_the_engines_and_whether_they_are_installed() -> None:
    result = dyn("worker", "--help")
    assert result.returncode == 0 and "mocker (installed)" in " ".join(result.stdout.split())


def test_the_public_api_is_sorted_and_importable() -> None:
    assert dynamo_cli.__all__ == sorted(dynamo_cli.__all__)
    for name in dynamo_cli.__all__:
        assert hasattr(dynamo_cli, name)
