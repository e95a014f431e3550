"""LoRA adapters in the vllm, sglang and trtllm adapters, at the library boundary.

As in test_adapters_boundary.py (whose fakes of the LIBRARY objects these tests reuse and extend), what is
checked is what crosses into the library: the LoRA engine arguments only when the worker serves adapters, the
adapter a load hands over (an HF PEFT folder, checked first), a library's refusal as the caller's error, the
adapter each request carries, and KV events of an adapter's blocks re-hashed with its seed (over real ZMQ).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq
from dyn_engines.sglang.engine import SglangEngine
from dyn_engines.trtllm.engine import TrtllmEngine
from dyn_engines.vllm.engine import VllmEngine
from dyn_engines.vllm.kv_events import KvEventRehasher

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ConfigError, DynError, RequestError
from dynamo_cli.kv.events import BlockStored, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import hash_blocks, lora_seed, sequence_hashes
from dynamo_cli.wire import GenerateRequest
from tests.engines.test_adapters_boundary import (
    FAKE_TRTLLM,
    FAKE_VLLM,
    PROMPT,
    TOKENS,
    FakeSglangEngine,
    collect,
    request,
    vllm_batch,
)


@dataclass
class FakeLoRARequest:
    """Stands for vllm.lora.request.LoRARequest (and TensorRT-LLM's, which checks the path exists)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    lora_ckpt_source: str = "hf"

    def __post_init__(self) -> None:
        if not Path(self.lora_path).exists():
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")


VLLM = dataclasses.replace(FAKE_VLLM, lora_request_cls=FakeLoRARequest)


def peft_folder(root: Path, name: str = "adapter", rank: Any = 8, **config: Any) -> Path:
    """An HF PEFT LoRA folder as `save_pretrained` writes it (the weights' bytes are never read here)."""
    folder = root / name
    folder.mkdir(parents=True)
    fields = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    fields.update(config)
    (folder / "adapter_config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return folder


def with_lora(lora: str, max_tokens: int = 2) -> GenerateRequest:
    return msgspec.structs.replace(request(max_tokens=max_tokens), lora=lora)


def seeded(tokens: list[int], lora: str, parent: int | None = None) -> list[StoredBlock]:
    """Our blocks of `tokens` computed under adapter `lora` (block size 16)."""
    pairs = hash_blocks(tokens, 16, parent=parent, seed=lora_seed(lora))
    return [StoredBlock(seq, local) for seq, local in pairs]


##### What a load checks, for every library #####


def spoil(folder: Path, how: str) -> None:
    config = folder / "adapter_config.json"
    if how == "no-config":
        config.unlink()
    elif how == "not-json":
        config.write_text("{r: 8")
    elif how == "no-weights":
        (folder / "adapter_model.safetensors").unlink()


@pytest.mark.parametrize(
    ("fields", "how", "match"),
    [
        pytest.param({}, "no-folder", "is not an HF PEFT adapter folder", id="no-folder"),
        pytest.param({}, "no-config", "has no adapter_config.json", id="no-config"),
        pytest.param({}, "not-json", "not JSON", id="config-not-json"),
        pytest.param({"rank": None}, "", "rank `r`", id="no-rank"),
        pytest.param({"rank": "8"}, "", "rank `r`", id="rank-not-int"),
        pytest.param({"rank": 32}, "", "above the engine's max_lora_rank 16", id="rank-above-max"),
        pytest.param({"target_modules": []}, "", "target_modules", id="no-target-modules"),
        pytest.param({"target_modules": [1]}, "", "target_modules", id="target-modules-not-names"),
        pytest.param({"peft_type": "PREFIX_TUNING"}, "", "not a LoRA one", id="not-lora"),
        pytest.param({}, "no-weights", "holds no weights", id="no-weights"),
    ],
)
async def test_vllm_refuses_what_is_not_a_peft_lora_folder_naming_lora_path_before_vllm_sees_it(
    tmp_path: Path, fields: dict[str, Any], how: str, match: str
) -> None:
    engine = VllmEngine(EngineArgs(model="m", max_loras=2), library=VLLM)
    await engine.start()
    folder = tmp_path / "missing" if how == "no-folder" else peft_folder(tmp_path, **fields)
    spoil(folder, how)
    with pytest.raises(RequestError, match=match) as refused:
        await engine.load_lora("a", str(folder))
    assert refused.value.param == "lora_path" and engine._engine.loras == []
    await engine.stop()


##### vLLM #####


def test_vllm_turns_lora_on_only_when_the_worker_serves_adapters_and_the_options_win() -> None:
    assert "enable_lora" not in VllmEngine(EngineArgs(model="m"), library=VLLM).engine_kwargs
    kwargs = VllmEngine(EngineArgs(model="m", max_loras=4), library=VLLM).engine_kwargs
    assert (kwargs["enable_lora"], kwargs["max_loras"]) == (True, 4)
    extra = {"max_lora_rank": 64, "max_cpu_loras": 8, "max_loras": 2}
    kwargs = VllmEngine(EngineArgs(model="m", max_loras=4, extra=extra), library=VLLM).engine_kwargs
    assert {key: kwargs[key] for key in ("enable_lora", *extra)} == {"enable_lora": True, **extra}
    with pytest.raises(ConfigError, match="no LoRA support"):  # a vLLM without vllm.lora.request
        VllmEngine(EngineArgs(model="m", max_loras=4), library=FAKE_VLLM)


async def test_vllm_loads_each_adapter_under_a_fresh_id_runs_its_requests_with_it_and_removes_it(
    tmp_path: Path,
) -> None:
    engine = VllmEngine(EngineArgs(model="m", max_loras=2), library=VLLM)
    with pytest.raises(DynError, match="not running"):
        await engine.load_lora("a", str(peft_folder(tmp_path, "a")))
    await engine.start()
    fake = engine._engine
    await engine.load_lora("a", str(tmp_path / "a"))
    await engine.load_lora("b", str(peft_folder(tmp_path, "b")))
    await engine.load_lora("a", str(tmp_path / "a"))  # the same adapter again: nothing
    assert fake.loras == [FakeLoRARequest("a", 1, str(tmp_path / "a")), FakeLoRARequest("b", 2, str(tmp_path / "b"))]
    chunks = await collect(engine.generate(with_lora("a")))
    assert [c.token_ids for c in chunks] == [[0], [1]]
    await collect(engine.generate(request(max_tokens=1)))
    assert fake.lora_requests == [FakeLoRARequest("a", 1, str(tmp_path / "a")), None]
    await engine.unload_lora("a")
    await engine.unload_lora("a")  # idempotent
    assert fake.removed_loras == [1]
    with pytest.raises(RequestError, match="'a' is not loaded") as refused:
        await collect(engine.generate(with_lora("a")))
    assert refused.value.param == "model" and len(fake.calls) == 2
    await engine.load_lora("a", str(tmp_path / "a"))  # loaded again: a new id, never the old one's cache
    assert fake.loras[-1].lora_int_id == 3
    await engine.load_lora("a", str(peft_folder(tmp_path, "a2")))  # from another folder: the old one out first
    assert fake.removed_loras == [1, 3] and fake.loras[-1] == FakeLoRARequest("a", 4, str(tmp_path / "a2"))
    await engine.stop()


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        pytest.param(False, "answered False", id="false"),
        pytest.param(ValueError("LoRA rank 8 is greater than max_lora_rank 4"), "max_lora_rank 4", id="raises"),
    ],
)
async def test_vllm_refusing_an_adapter_is_a_request_error_naming_lora_path_and_leaves_it_unloaded(
    tmp_path: Path, answer: bool | Exception, match: str
) -> None:
    engine = VllmEngine(EngineArgs(model="m", max_loras=2), library=VLLM)
    await engine.start()
    engine._engine.add_lora_answer = answer
    with pytest.raises(RequestError, match=match) as refused:
        await engine.load_lora("a", str(peft_folder(tmp_path)))
    assert refused.value.param == "lora_path"
    with pytest.raises(RequestError, match="not loaded"):
        await collect(engine.generate(with_lora("a")))
    await engine.stop()


async def test_vllm_without_lora_refuses_a_load_and_an_adapters_request(tmp_path: Path) -> None:
    engine = VllmEngine(EngineArgs(model="m"), library=VLLM)
    await engine.start()
    with pytest.raises(RequestError, match="--lora or --lora-dir") as refused:
        await engine.load_lora("a", str(peft_folder(tmp_path)))
    assert refused.value.param == "lora_path" and engine._engine.loras == []
    with pytest.raises(RequestError, match="'a' is not loaded") as unknown:
        await collect(engine.generate(with_lora("a")))
    assert unknown.value.param == "model" and engine._engine.calls == []
    await engine.stop()


async def test_vllm_kv_events_of_an_adapter_are_re_hashed_with_its_seed_by_name_or_by_id(tmp_path: Path) -> None:
    engine = VllmEngine(EngineArgs(model="m", block_size=16, max_loras=2), library=VLLM)
    await engine.start()
    await engine.load_lora("a", str(peft_folder(tmp_path)))  # lora_int_id 1
    publisher = zmq.Context.instance().socket(zmq.PUB)  # stands for vLLM's ZmqEventPublisher
    publisher.connect(engine.engine_args.kv_events_config.endpoint)
    # vLLM 0.32: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys
    named = ["BlockStored", [b"a1", b"a2"], None, TOKENS[:32], 16, 1, "GPU", "a", [["a"], ["a"]]]
    events = engine.kv_events()
    try:
        async with asyncio.timeout(5):
            first = asyncio.ensure_future(anext(events))  # type: ignore[call-overload]
            while not first.done():  # a SUB socket joins late: publish until it hears
                publisher.send_multipart([b"kv-events", (0).to_bytes(8, "big"), vllm_batch(named)])
                await asyncio.sleep(0.02)
            batch: KvEventBatch = first.result()
        assert batch.events == [BlockStored(parent_hash=None, blocks=seeded(TOKENS[:32], "a"))]
        assert batch.events[0].blocks[0].block_hash != sequence_hashes(TOKENS[:16], 16)[0]  # type: ignore[union-attr]
        by_id = ["BlockStored", [b"a3"], None, TOKENS[32:48], 16, 1]  # an older vLLM: the id only
        unknown = ["BlockStored", [b"z1"], None, TOKENS[48:64], 16, 7]  # an id this engine never gave
        publisher.send_multipart([b"kv-events", (1).to_bytes(8, "big"), vllm_batch(by_id, unknown)])
        async with asyncio.timeout(5):
            second = await anext(events)  # type: ignore[call-overload]
        assert second.events == [BlockStored(parent_hash=None, blocks=seeded(TOKENS[32:48], "a"))]
        assert engine._relay is not None and engine._relay.rehasher.num_unnamed == 1
    finally:
        publisher.close(linger=0)
        await engine.stop()


def test_the_rehasher_names_an_unloaded_adapters_id_and_keeps_the_base_seed_without_one() -> None:
    names = {5: "b"}
    rehasher = KvEventRehasher(names.get)
    base, by_id = rehasher.convert(
        [["BlockStored", [1], None, TOKENS[:16], 16], ["BlockStored", [2], None, TOKENS[16:32], 16, 5, None]]
    )
    assert base == BlockStored(parent_hash=None, blocks=[StoredBlock(*hash_blocks(TOKENS[:16], 16)[0])])
    assert by_id == BlockStored(parent_hash=None, blocks=seeded(TOKENS[16:32], "b"))
    as_map = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 2, "token_ids": TOKENS[32:48]}
    chained = rehasher.convert([as_map | {"block_size": 16, "lora_id": 5, "lora_name": "b"}])
    parent = by_id.blocks[0].block_hash  # type: ignore[union-attr]
    assert chained == [BlockStored(parent_hash=parent, blocks=seeded(TOKENS[32:48], "b", parent))]


##### SGLang #####


def test_sglang_server_args_turn_lora_on_only_when_the_worker_serves_adapters_and_the_options_win() -> None:
    assert "enable_lora" not in SglangEngine(EngineArgs(model="m"), engine_cls=FakeSglangEngine).server_args
    args = SglangEngine(EngineArgs(model="m", max_loras=3), engine_cls=FakeSglangEngine).server_args
    assert {
        key: args[key] for key in ("enable_lora", "max_loras_per_batch", "max_lora_rank", "lora_target_modules")
    } == {
        "enable_lora": True,
        "max_loras_per_batch": 3,
        "max_lora_rank": 16,
        "lora_target_modules": ["all"],
    }
    own = SglangEngine(EngineArgs(model="m", max_loras=3, extra={"max_lora_rank": 64}), engine_cls=FakeSglangEngine)
    assert own.server_args["max_lora_rank"] == 64
    paths = {"lora_paths": ["a=/adapters/a"]}  # SGLang infers the rank and modules from them
    inferred = SglangEngine(EngineArgs(model="m", max_loras=3, extra=paths), engine_cls=FakeSglangEngine).server_args
    assert "max_lora_rank" not in inferred and inferred["lora_paths"] == ["a=/adapters/a"]


async def test_sglang_loads_an_adapter_by_name_runs_requests_with_its_lora_path_and_unloads_it(tmp_path: Path) -> None:
    engine = SglangEngine(EngineArgs(model="m", block_size=16, max_loras=2), engine_cls=FakeSglangEngine)
    await engine.start()
    fake = engine._engine
    await engine.load_lora("a", str(peft_folder(tmp_path)))
    assert fake.loras == [("a", str(tmp_path / "adapter"))]
    chunks = await collect(engine.generate(with_lora("a")))
    assert [c.token_ids for c in chunks] == [[0], [1]] and fake.calls[0]["lora_path"] == "a"
    await collect(engine.generate(request(max_tokens=1)))
    assert "lora_path" not in fake.calls[1]
    await engine.unload_lora("a")
    await engine.unload_lora("a")
    assert fake.unloaded_loras == ["a"]
    with pytest.raises(RequestError, match="not loaded") as refused:
        await collect(engine.generate(with_lora("a")))
    assert refused.value.param == "model" and len(fake.calls) == 2
    await engine.stop()


async def test_sglang_refusals_are_request_errors_naming_lora_path(tmp_path: Path) -> None:
    engine = SglangEngine(EngineArgs(model="m", max_loras=2), engine_cls=FakeSglangEngine)
    await engine.start()
    fake = engine._engine
    with pytest.raises(RequestError, match="above the engine's max_lora_rank 16") as refused:
        await engine.load_lora("a", str(peft_folder(tmp_path, "big", rank=64)))
    assert refused.value.param == "lora_path" and fake.loras == []
    fake.load_answer = SimpleNamespace(success=False, error_message="LoRA adapter a targets modules not in the pool")
    with pytest.raises(RequestError, match="not in the pool") as failed:
        await engine.load_lora("a", str(peft_folder(tmp_path)))
    assert failed.value.param == "lora_path"
    with pytest.raises(RequestError, match="not loaded"):
        await collect(engine.generate(with_lora("a")))
    await engine.stop()


class FakeOlderSglangEngine(FakeSglangEngine):
    """A `sglang.Engine` with the blocking adapter calls only (they run the engine's own loop)."""

    async_load_lora_adapter = None  # type: ignore[assignment]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> Any:
        self.loras.append((lora_name, lora_path))
        return SimpleNamespace(success=True, error_message=None)


async def test_sglang_without_the_async_adapter_calls_loads_in_a_thread(tmp_path: Path) -> None:
    engine = SglangEngine(EngineArgs(model="m", max_loras=1), engine_cls=FakeOlderSglangEngine)
    await engine.start()
    await engine.load_lora("a", str(peft_folder(tmp_path)))
    assert engine._engine.loras == [("a", str(tmp_path / "adapter"))]
    await engine.stop()


##### TensorRT-LLM #####


@dataclass
class FakeLoraConfig:
    """Stands for TensorRT-LLM's LoraConfig."""

    max_loras: int = 4
    max_cpu_loras: int = 4
    max_lora_rank: int = 64
    lora_dir: list[str] = field(default_factory=list)


TRTLLM = dataclasses.replace(FAKE_TRTLLM, lora_config_cls=FakeLoraConfig, lora_request_cls=FakeLoRARequest)


def test_trtllm_turns_lora_on_only_when_the_worker_serves_adapters_and_merges_the_options() -> None:
    kwargs = TrtllmEngine(EngineArgs(model="m"), library=TRTLLM).llm_kwargs()
    assert "enable_lora" not in kwargs and "lora_config" not in kwargs
    kwargs = TrtllmEngine(EngineArgs(model="m", max_loras=2), library=TRTLLM).llm_kwargs()
    assert (kwargs["enable_lora"], kwargs["lora_config"]) == (True, FakeLoraConfig(max_loras=2, max_cpu_loras=2))
    extra = {"lora_config": {"max_lora_rank": 32, "max_cpu_loras": 8}}
    kwargs = TrtllmEngine(EngineArgs(model="m", max_loras=2, extra=extra), library=TRTLLM).llm_kwargs()
    assert kwargs["lora_config"] == FakeLoraConfig(max_loras=2, max_cpu_loras=8, max_lora_rank=32)
    with pytest.raises(ConfigError, match="no LoraConfig"):
        TrtllmEngine(EngineArgs(model="m", max_loras=2), library=FAKE_TRTLLM)


async def test_trtllm_registers_an_adapter_and_each_of_its_requests_carries_it(tmp_path: Path) -> None:
    engine = TrtllmEngine(EngineArgs(model="m", block_size=16, max_loras=2), library=TRTLLM)
    await engine.start()
    fake = engine._llm
    await engine.load_lora("a", str(peft_folder(tmp_path)))
    nemo = tmp_path / "b.nemo"
    with tarfile.open(nemo, "w"):
        pass
    await engine.load_lora("b", str(nemo))
    chunks = await collect(engine.generate(with_lora("a", max_tokens=3)))
    assert [c.token_ids for c in chunks] == [[0], [1], [2]]
    await collect(engine.generate(with_lora("b", max_tokens=1)))
    await collect(engine.generate(request(max_tokens=1)))
    assert fake.lora_requests == [
        FakeLoRARequest("a", 1, str(tmp_path / "adapter")),
        FakeLoRARequest("b", 2, str(nemo), lora_ckpt_source="nemo"),
        None,
    ]
    await engine.unload_lora("a")
    await engine.unload_lora("a")
    with pytest.raises(RequestError, match="not loaded") as refused:
        await collect(engine.generate(with_lora("a")))
    assert refused.value.param == "model" and len(fake.results) == 3
    await engine.stop()


async def test_trtllm_refusals_are_request_errors_naming_lora_path(tmp_path: Path) -> None:
    @dataclass
    class OlderLoRARequest:  # before NeMo adapters: no lora_ckpt_source
        lora_name: str
        lora_int_id: int
        lora_path: str

    older = dataclasses.replace(TRTLLM, lora_request_cls=OlderLoRARequest)
    engine = TrtllmEngine(EngineArgs(model="m", max_loras=2), library=older)
    await engine.start()
    nemo = tmp_path / "b.nemo"
    nemo.write_bytes(b"not a tar archive")
    with pytest.raises(RequestError, match="not a NeMo archive") as refused:
        await engine.load_lora("b", str(nemo))
    assert refused.value.param == "lora_path"
    nemo.unlink()
    with tarfile.open(nemo, "w"):
        pass
    with pytest.raises(RequestError, match="lora_ckpt_source") as failed:  # the library's own refusal
        await engine.load_lora("b", str(nemo))
    assert failed.value.param == "lora_path"
    with pytest.raises(RequestError, match="above the engine's max_lora_rank 64"):
        await engine.load_lora("a", str(peft_folder(tmp_path, rank=128)))
    await engine.stop()


async def test_trtllm_kv_events_naming_an_adapters_id_are_re_hashed_with_its_seed(tmp_path: Path) -> None:
    engine = TrtllmEngine(EngineArgs(model="m", block_size=16, max_loras=2), library=TRTLLM)
    await engine.start()
    await engine.load_lora("a", str(peft_folder(tmp_path)))
    blocks = [{"block_hash": 11, "lora_id": 1, "tokens": [{"token_id": t} for t in PROMPT[:16]]}]
    engine._llm.kv_events.append({"event_id": 0, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}})
    async with asyncio.timeout(5):
        batch = await anext(engine.kv_events())  # type: ignore[call-overload]
    assert batch.events == [BlockStored(parent_hash=None, blocks=seeded(PROMPT[:16], "a"))]
    await engine.stop()


##### Against the installed vLLM (no engine started) #####


def test_vllm_032s_own_block_stored_events_and_lora_request_take_our_mapping(tmp_path: Path) -> None:
    """vLLM's own event structs, encoded as its publisher does (tagged maps, v0.32), re-hashed with the
    adapter's seed; its LoRARequest built from what the adapter passes."""
    pytest.importorskip("vllm", reason="needs vLLM")
    from dyn_engines.lora_book import LoadedLora
    from dyn_engines.vllm.engine import load_library
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    def stored(hashes: list[bytes], tokens: list[int], lora_id: int | None, name: str | None) -> Any:
        return VllmBlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=16,
            lora_id=lora_id,
            medium="GPU",
            lora_name=name,
        )

    events = [stored([b"a1"], TOKENS[:16], 1, "a"), stored([b"a2"], TOKENS[16:32], 1, None)]
    events.append(stored([b"b1"], TOKENS[32:48], None, None))
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    converted = KvEventRehasher({1: "a"}.get).convert(msgspec.msgpack.decode(payload)[1])
    assert converted == [
        BlockStored(parent_hash=None, blocks=seeded(TOKENS[:16], "a")),
        BlockStored(parent_hash=None, blocks=seeded(TOKENS[16:32], "a")),
        BlockStored(parent_hash=None, blocks=[StoredBlock(*hash_blocks(TOKENS[32:48], 16)[0])]),
    ]
    library = load_library()
    engine = VllmEngine(EngineArgs(model="m", max_loras=2), library=library)
    lora_kwargs = {key: engine.engine_kwargs[key] for key in ("enable_lora", "max_loras")}
    assert lora_kwargs == {"enable_lora": True, "max_loras": 2}
    assert isinstance(library.engine_args_cls(model=str(tmp_path), **lora_kwargs).max_lora_rank, int)  # load checks it
    lora = engine._lora_request(LoadedLora(name="a", lora_id=1, path=str(peft_folder(tmp_path))))
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("a", 1, str(tmp_path / "adapter"))
