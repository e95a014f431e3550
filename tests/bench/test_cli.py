"""`dyn bench` from the command line: reports, files, compare, sweeps and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sse_server import Rhythm
from typer.testing import CliRunner

from dynamo_cli.bench.http import EndpointError, EndpointUnreachable
from dynamo_cli.cli.bench import app
from dynamo_cli.errors import ModelNotFound

FAST = ["--isl", "8", "--osl", "4", "--no-progress", "--tokenizer", "none"]


def test_a_run_prints_the_table_and_definitions_and_writes_json_csv_and_jsonl(serve_in_thread, tmp_path) -> None:
    out = tmp_path / "a.json"
    with serve_in_thread(Rhythm(ttft_s=0.0, gap_s=0.0)) as url:
        result = CliRunner().invoke(
            app,
            [
                "--url",
                url,
                "-c",
                "2",
                "-n",
                "6",
                *FAST,
                "--slo",
                "ttft=1000",
                "--json",
                str(out),
                "--csv",
                str(tmp_path / "a.csv"),
                "--jsonl",
                str(tmp_path / "a.jsonl"),
            ],
        )
    assert result.exit_code == 0, result.output
    assert "ttft (ms)" in result.output and "TTFT: send → first SSE event with non-empty content" in result.output
    assert "output tokens from: usage" in result.output and "approximate" in result.output
    summary = json.loads(out.read_text())["summary"]
    assert (summary["num_completed"], summary["good_fraction"]) == (6, 1.0)
    assert "ttft,ms" in (tmp_path / "a.csv").read_text()
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["output_tokens"] == 4 and len(r["chunk_ms"]) == 4 for r in rows)


def test_compare_prints_the_ratio_of_every_metric(tmp_path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"summary": {"request_throughput": 10.0, "latency": {"ttft": {"p50": 100.0}}}}))
    b.write_text(json.dumps({"summary": {"request_throughput": 15.0, "latency": {"ttft": {"p50": 50.0}}}}))
    result = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") >= 4}
    assert "1.500" in lines["request_throughput"] and "0.500" in lines["ttft.p50"]


def test_a_concurrency_sweep_prints_one_table_with_a_row_per_value(serve_in_thread) -> None:
    with serve_in_thread(Rhythm(ttft_s=0.0, gap_s=0.0)) as url:
        result = CliRunner().invoke(app, ["--url", url, "-n", "4", "--sweep", "concurrency=1,2", *FAST])
    assert result.exit_code == 0, result.output
    assert "sweep over concurrency" in result.output
    first_cells = [line.split("│")[1].strip() for line in result.output.splitlines() if line.startswith("│")]
    assert first_cells == ["1", "2"]


@pytest.mark.parametrize(
    ("rhythm", "args", "error", "message"),
    [
        pytest.param(Rhythm(), ["--model", "nope"], ModelNotFound, "the model 'nope' does not exist", id="wrong-model"),
        pytest.param(Rhythm(not_sse=True), [], EndpointError, "not an SSE stream", id="no-sse"),
    ],
)
def test_a_broken_endpoint_fails_before_the_run_with_the_reason(serve_in_thread, rhythm, args, error, message) -> None:
    with serve_in_thread(rhythm) as url:
        result = CliRunner().invoke(app, ["--url", url, "-n", "2", *FAST, *args])
    assert isinstance(result.exception, error) and message in str(result.exception)


def test_an_unreachable_url_prints_one_red_line_and_exits_non_zero() -> None:
    assert issubclass(EndpointUnreachable, Exception)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from dynamo_cli.cli.main import main; main()",
            "bench",
            "--url",
            "http://127.0.0.1:1",
            "-n",
            "1",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: cannot reach http://127.0.0.1:1: cannot connect to 127.0.0.1:1: "
        "[Errno 111] Connection refused; is the server running, and is --url right?"
    ]


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:1", "--plot", str(tmp_path / "p.png")])
        assert "pip install 'dynamo-cli[plot]'" in str(result.exception)
    else:
        pytest.skip("matplotlib is installed")


def test_plot_writes_a_png_when_matplotlib_is_installed(serve_in_thread, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.png"
    with serve_in_thread(Rhythm(ttft_s=0.0, gap_s=0.0)) as url:
        result = CliRunner().invoke(app, ["--url", url, "-c", "2", "-n", "6", *FAST, "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
