"""`dyn top`'s screen drawn headless (rich's recording console) from a pair of snapshots."""

from __future__ import annotations

import io
import re

from rich.console import Console

from dynamo_cli.cli.top import render
from dynamo_cli.engine import Role
from dynamo_cli.top.frame import frame_between
from dynamo_cli.wire import LoadMetrics
from tests.top.exposition import Frontend

URL = "http://127.0.0.1:8000/metrics"


def drawn(renderable: object, width: int = 100) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


async def test_the_screen_shows_each_worker_and_the_models_figures_over_the_interval() -> None:
    frontend = Frontend()
    frontend.add_worker(
        0xD1, Role.DECODE, LoadMetrics(num_running=5, num_waiting=2, active_blocks=50, total_blocks=200)
    )
    frontend.add_worker(0xE2, Role.PREFILL, LoadMetrics(total_blocks=100), num_inflight=1)
    frontend.metrics.queued.labels("m").set(3)
    before = frontend.snapshot(at=0.0)
    frontend.serve(0xD1, ttft=0.04, itl=0.004, num_requests=8)
    frontend.serve(0xE2, ttft=0.04, itl=0.004, num_requests=4)
    frontend.metrics.count_disagg("m", "remote")
    frontend.transfer(nbytes=3 * 10**9, seconds=1.0)
    text = drawn(render(frame_between(before, frontend.snapshot(at=2.0)), URL, 2.0))
    assert URL in text
    decode = re.search(r"^d1\s+decode\s+5\s+2\s+25%\s+0\s+8\s+4\.0\s+-$", text, re.MULTILINE)
    prefill = re.search(r"^e2\s+prefill\s+0\s+0\s+0%\s+1\s+4\s+2\.0\s+-$", text, re.MULTILINE)
    assert decode and prefill, text
    assert text.index("d1 ") < text.index("e2 ")  # prefill workers last
    assert "req/s 6.0" in text and "queued 3" in text, text
    assert "TTFT p50 37.5 ms  p99 49.8 ms" in text, text  # 12 in (0.025, 0.05]: 25 + 25 * 6/12, 25 + 25 * 11.88/12
    assert "disaggregation remote 1" in text and "KV transfer GB/s 3.00" in text, text
    assert "since start" not in text


async def test_the_first_frame_has_no_rates_and_an_error_is_shown_above_the_last_frame() -> None:
    frontend = Frontend()
    frontend.add_worker(0xD1, Role.BOTH)
    frontend.serve(0xD1, ttft=0.04, itl=0.004)
    first = frame_between(None, frontend.snapshot(at=0.0))
    text = drawn(render(first, URL, 2.0, error="cannot read the frontend: ConnectError"))
    assert re.search(r"^error: cannot read the frontend: ConnectError \(retrying\)$", text, re.MULTILINE), text
    assert "req/s -" in text and "(since start)" in text
    assert re.search(r"^d1\s+both\s+0\s+0\s+-\s+0\s+1\s+-\s+-$", text, re.MULTILINE), text


async def test_each_workers_kv_routing_and_the_routers_prefix_hits_against_the_reachable_are_shown() -> None:
    frontend = Frontend()
    frontend.add_worker(0xA1, Role.BOTH)
    frontend.add_worker(0xB2, Role.BOTH)
    frontend.precise = frozenset({0xA1})  # its KV events reach the router; b2's do not
    frontend.route(request_blocks=200, hit_blocks=82, reachable_blocks=110)
    text = drawn(render(frame_between(None, frontend.snapshot(at=0.0)), URL, 2.0), width=120)
    assert re.search(r"^a1\s+both\s.*\sevents$", text, re.MULTILINE), text
    assert re.search(r"^b2\s+both\s.*\sapproximate$", text, re.MULTILINE), text
    assert "prefix hits 41% (reachable 55%)" in text, text


def test_before_any_reading_only_the_error_is_shown() -> None:
    text = drawn(render(None, URL, 2.0, error="cannot read it"))
    assert "error: cannot read it" in text and "req/s" not in text


async def test_the_tenants_panel_shows_each_tenants_rates_queue_wait_and_429s() -> None:
    frontend = Frontend()
    frontend.add_worker(0xD1, Role.BOTH)
    series = frontend.metrics.tenants
    series.count(series.rejections, "team-a", "max_inflight")  # before the interval: counted since start
    before = frontend.snapshot(at=0.0)
    for _ in range(6):
        series.count(series.requests, "team-a", "success")
        series.count(series.tokens, "team-a", "prompt", 100)
        series.observe_wait("team-a", 0.04)
    series.count(series.requests, "team-b", "rejected")
    series.count(series.rejections, "team-b", "tokens_per_minute")
    text = drawn(render(frame_between(before, frontend.snapshot(at=2.0)), URL, 2.0))
    assert re.search(r"^tenant\s+req/s\s+tokens/s\s+queue wait\s+429s$", text, re.MULTILINE), text
    assert re.search(r"^team-a\s+3\.0\s+300\.0\s+p50 37\.5 ms  p99 49\.8 ms\s+1$", text, re.MULTILINE), text
    assert re.search(r"^team-b\s+0\.5\s+0\.0\s+p50 -\s+p99 -\s+1$", text, re.MULTILINE), text
