"""The llamacpp engine's LoRA adapter check (`adapters.check_adapter`) on small hand-made files, and its
grouping of a step's sequences by adapter; no model is loaded.

Whole pairs of F32/F16 matrices that fit the model's weights pass (token_embd's the other way round), and
each thing llama.cpp would choke on (or abort the process on) is refused naming lora_path and the problem.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dynamo_cli.errors import RequestError

TINY = {"blk.0.attn_q.weight": (8, 8), "blk.0.attn_v.weight": (8, 4), "token_embd.weight": (8, 32)}
"""A model's tensor shapes in gguf's ne order; numpy's shapes below are ne reversed."""


def zeros(*shape: int, dtype: Any = np.float32) -> Any:
    return np.zeros(shape, dtype=dtype)


def q_pair(rank: int = 2) -> dict[str, Any]:
    return {"blk.0.attn_q.weight.lora_a": zeros(rank, 8), "blk.0.attn_q.weight.lora_b": zeros(8, rank)}


def hand_made(path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> str:
    """An adapter file of `tensors` whose metadata is a LoRA adapter's for llama, `metadata` on top."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": 16.0,
        **metadata,
    }.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_whole_pairs_that_fit_the_models_weights_pass_the_check_f16_and_token_embd_included(tmp_path: Path) -> None:
    from dyn_engines.llamacpp.adapters import BaseTensors, check_adapter

    tensors = {
        **q_pair(),
        "blk.0.attn_v.weight.lora_a": zeros(4, 8, dtype=np.float16),
        "blk.0.attn_v.weight.lora_b": zeros(4, 4, dtype=np.float16),
        "token_embd.weight.lora_a": zeros(32, 2),  # [rank, n_vocab]: its rows are looked up by token id
        "token_embd.weight.lora_b": zeros(8, 2),
    }
    check_adapter(hand_made(tmp_path / "good.gguf", tensors, {}), BaseTensors("llama", TINY))


@pytest.mark.parametrize(
    ("tensors", "metadata", "words"),
    [
        pytest.param(
            {"blk.0.attn_q.weight.lora_a": zeros(2, 8)}, {}, "half a pair: blk.0.attn_q.weight.lora_b", id="half-a-pair"
        ),
        pytest.param(
            {**q_pair(), "blk.0.attn_q.weight": zeros(8, 8)}, {}, "neither a .lora_a nor a .lora_b", id="not-lora"
        ),
        pytest.param({**q_pair(), "blk.0.attn_q.weight.lora_b": zeros(8, 2, dtype=np.int32)}, {}, "as I32", id="i32"),
        pytest.param(
            {"blk.9.attn_q.weight.lora_a": zeros(2, 8), "blk.9.attn_q.weight.lora_b": zeros(8, 2)},
            {},
            "adapts blk.9.attn_q.weight, which the model does not have",
            id="unknown-weight",
        ),
        pytest.param(
            {"blk.0.attn_q.weight.lora_a": zeros(8, 2), "blk.0.attn_q.weight.lora_b": zeros(2, 8)},
            {},
            "lora_a [2, 8] and .lora_b [8, 2], which do not fit",
            id="transposed",
        ),
        pytest.param(
            {"blk.0.attn_v.weight.lora_a": zeros(5, 8), "blk.0.attn_v.weight.lora_b": zeros(4, 5)},
            {},
            "rank at most 4",
            id="rank-over-the-weight",
        ),
        pytest.param(
            {"token_embd.weight.lora_a": zeros(32, 2), "token_embd.weight.lora_b": zeros(8, 3)},
            {},
            "token_embd.weight.lora_a [2, 32] and .lora_b [3, 8]",
            id="token-embd-ranks-differ",
        ),
        pytest.param(q_pair(), {"general.type": 7}, "is not an adapter", id="general-type-not-a-string"),
        pytest.param(q_pair(), {"adapter.type": "ia3"}, "is not a LoRA adapter", id="not-lora-type"),
        pytest.param(q_pair(), {"adapter.lora.alpha": "16"}, "adapter.lora.alpha that is not", id="alpha-a-string"),
        pytest.param(q_pair(), {"adapter.alora.invocation_tokens": [1, 2]}, "activated LoRA", id="alora"),
    ],
)
def test_the_check_refuses_what_llama_cpp_would_choke_on_naming_the_problem(
    tmp_path: Path, tensors: dict[str, Any], metadata: dict[str, Any], words: str
) -> None:
    from dyn_engines.llamacpp.adapters import BaseTensors, check_adapter

    path = hand_made(tmp_path / "bad.gguf", tensors, metadata)
    with pytest.raises(RequestError, match=re.escape(words)) as caught:
        check_adapter(path, BaseTensors("llama", TINY))
    assert caught.value.param == "lora_path"


def test_a_step_decodes_one_group_per_adapter_the_one_on_the_context_first_then_the_base_model_and_by_name() -> None:
    pytest.importorskip("llama_cpp", reason="needs llama_cpp: pip install 'dynamo-cli[llamacpp]'")
    from dyn_engines.llamacpp.runner import lora_groups

    loras = {1: "b", 2: "a", 4: "b"}
    assert lora_groups(loras, [0, 1, 2, 3, 4], "") == [("", [0, 3]), ("a", [2]), ("b", [1, 4])]
    assert lora_groups(loras, [0, 1, 2, 3, 4], "b") == [("b", [1, 4]), ("", [0, 3]), ("a", [2])]
    assert lora_groups({}, [5, 6], "a") == [("", [5, 6])]
