"""One vLLM engine over two processes ("nodes") on this host: tensor parallelism 2 across `dyn worker --nnodes 2`.

`dyn serve --nodes-per-worker 2` starts the leader (vLLM's engine, tensor-parallel rank 0) and a follower that runs
vLLM's headless part (engines/vllm/headless.py, rank 1); their workers meet at `master_addr:master_port` over
torch.distributed (gloo). SmolLM2-135M has 9 attention heads, which 2 ranks cannot split, so the model is a tiny
random Llama (4 heads of 64, 2 layers) built here with transformers, with SmolLM2's tokenizer. It must serve the
same greedy text as a one-process worker of the same model, and stopping the deployment must leave no vLLM
process of either node behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import DynProcess, descendants

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: pip install 'dynamo-cli[vllm]'"),
    pytest.mark.timeout(600),
]

ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}
"""Each process ("node") has one tensor-parallel rank: no binding (vLLM's `auto` would put both on one core)."""
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 28, "max_num_seqs": 4}
PROMPT = "The capital of France is"


def tiny_llama(folder: Path) -> Path:
    """A random 2-layer Llama whose 4 heads (2 KV heads) split over 2 ranks, with SmolLM2's tokenizer."""
    import torch
    from dyn_engines.hf_export import hf_model_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    smollm2 = Path(hf_model_dir("smollm2"))
    base = json.loads((smollm2 / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for file in smollm2.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation")) or file.suffix == ".jinja":
            shutil.copy(file, folder / file.name)
    return folder


def complete(d: DynProcess) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{d.url}/v1/completions", json=body, headers=d.auth, timeout=120)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def alive(pids: set[int]) -> set[int]:
    """The processes of `pids` still running (zombies count as gone)."""
    running = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                running.add(pid)
        except OSError:
            pass
    return running


def test_a_vllm_engine_over_two_nodes_serves_the_same_greedy_text_as_one(dyn_serve: Any, tmp_path: Path) -> None:
    model = str(tiny_llama(tmp_path / "tiny-llama"))
    common = ["--engine", "vllm", "--model", model, "--block-size", "32", "--context-length", "1024"]
    env = {**os.environ, **ENV}
    group = dyn_serve(
        *common,
        "--nodes-per-worker",
        "2",
        "--extra-engine-args",
        json.dumps({**ENGINE, "tensor_parallel_size": 2}),
        timeout=400,
        env=env,
    )
    spread = complete(group)
    members = descendants(group.proc.pid)
    group.stop(timeout=60)
    deadline = time.monotonic() + 30
    while alive(members) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(members) == set(), "a node's vLLM processes outlived the deployment"
    one = dyn_serve(*common, "--extra-engine-args", json.dumps(ENGINE), timeout=400, env=env)
    alone = complete(one)
    assert spread["text"] == alone["text"] and spread["finish_reason"] == "length"
