"""A worker's AdapterSet over the real mocker engine: what it serves, what it loads, in what order it evicts,
and that a request's adapter never leaves under it; and the adapter seed of the block hashes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import xxhash
from dyn_engines.mocker.engine import MockerEngine

from dynamo_cli.config.lora import LoraConfig, parse_loras
from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ConfigError, ModelNotFound, Overloaded, RequestError
from dynamo_cli.kv.events import BlockStored
from dynamo_cli.kv.hashing import HASH_SEED, hash_blocks, lora_seed, sequence_hashes
from dynamo_cli.lora import adapters as adapters_module
from dynamo_cli.lora.adapters import AdapterSet
from dynamo_cli.wire import GenerateRequest, SamplingParams

PROMPT = list(range(100, 164))  # 4 blocks of 16


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[MockerEngine]:
    model = tmp_path / "base-model"
    model.mkdir()
    engine = MockerEngine(EngineArgs(model=str(model), block_size=16, extra={"speedup_ratio": 1e4}))
    await engine.start()
    yield engine
    await engine.stop()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    folder = tmp_path / "adapters"
    folder.mkdir()
    names = {}
    for name in ("a", "b", "c", "d"):
        (folder / f"{name}.gguf").write_bytes(b"adapter")
        names[name] = str(folder / f"{name}.gguf")
    return names


async def started(engine: MockerEngine, files: dict[str, str], max_loras: int, *names: str) -> AdapterSet:
    adapters = AdapterSet(engine, "mocker", max_loras, [])
    await adapters.start("base-model", {name: files[name] for name in names})
    return adapters


def test_the_seed_is_dynamos_and_the_base_models_hashes_do_not_change() -> None:
    assert lora_seed("") == HASH_SEED == 1337
    assert lora_seed("sql-lora") == (1337 + xxhash.xxh3_64_intdigest(b"sql-lora")) % 2**64
    base = sequence_hashes(PROMPT, 16)
    assert sequence_hashes(PROMPT, 16, seed=lora_seed("")) == base
    a, b = sequence_hashes(PROMPT, 16, seed=lora_seed("a")), sequence_hashes(PROMPT, 16, seed=lora_seed("b"))
    assert len(set(a) | set(b) | set(base)) == 12  # three disjoint sets of 4
    # the chain is seeded as before: only the token-local hashes take the adapter's seed
    local = [h for _, h in hash_blocks(PROMPT, 16, seed=lora_seed("a"))]
    assert local[0] == xxhash.xxh3_64_intdigest(
        bytes(b"".join(t.to_bytes(4, "little") for t in PROMPT[:16])), seed=lora_seed("a")
    )
    assert a[0] == local[0]


async def test_the_last_max_loras_of_the_start_adapters_stay_loaded_and_each_load_counts(
    engine: MockerEngine, files: dict[str, str]
) -> None:
    adapters = await started(engine, files, 2, "a", "b", "c")
    assert sorted(adapters.served) == ["a", "b", "c"]
    assert list(adapters.resident) == ["b", "c"] and adapters.loads == 3 and adapters.evictions == 1
    async with adapters.using("a"):  # evicted at start: loaded again, evicting the least recent (b)
        assert list(adapters.resident) == ["c", "a"]
    async with adapters.using("c"):
        assert list(adapters.resident) == ["a", "c"]
    assert adapters.loads == 4 and engine.work_counters()["lora_loads"] == 4


async def test_an_adapter_in_use_is_never_evicted_and_a_request_waits_for_one_to_fall_idle(
    engine: MockerEngine, files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapters = await started(engine, files, 1, "a", "b")
    async with adapters.using("b"):
        monkeypatch.setattr(adapters_module, "LOAD_WAIT_S", 0.05)
        with pytest.raises(Overloaded, match="in use"):
            async with adapters.using("a"):
                pass
        assert list(adapters.resident) == ["b"]
        monkeypatch.setattr(adapters_module, "LOAD_WAIT_S", 5.0)
        waiting = asyncio.create_task(_use(adapters, "a"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # b still runs
    await asyncio.wait_for(waiting, 2)
    assert list(adapters.resident) == ["a"]


async def _use(adapters: AdapterSet, name: str) -> None:
    async with adapters.using(name):
        pass


async def test_unloading_an_adapter_in_use_stops_new_requests_and_frees_it_when_the_last_one_ends(
    engine: MockerEngine, files: dict[str, str]
) -> None:
    adapters = await started(engine, files, 2, "a")
    async with adapters.using("a"):
        await adapters.remove("a")
        assert "a" not in adapters.served and "a" in adapters.resident  # still running
        with pytest.raises(RequestError, match="being unloaded"):  # its old file still runs: no second copy
            await adapters.add("a", files["a"])
        with pytest.raises(ModelNotFound):
            async with adapters.using("a"):
                pass
    assert "a" not in adapters.resident
    with pytest.raises(ModelNotFound):
        await adapters.remove("a")


async def test_run_time_loads_read_only_inside_the_allowed_folders_and_names_are_checked(
    engine: MockerEngine, files: dict[str, str], tmp_path: Path
) -> None:
    adapters = await started(engine, files, 2, "a")  # a's folder is allowed from now on
    await adapters.add("b", files["b"])
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(b"x")
    for name, path, match in [
        ("x", str(outside), "outside the folders"),
        ("x", "/etc/passwd", "outside the folders"),
        ("x", str(Path(files["a"]).parent / ".." / "elsewhere.gguf"), "outside the folders"),
        ("x", str(Path(files["a"]).parent / "missing.gguf"), "does not exist"),
        ("b", files["c"], "already served"),
        ("base-model", files["c"], "already served"),
        ("../evil", files["c"], "invalid"),
        ("", files["c"], "invalid"),
    ]:
        with pytest.raises(RequestError, match=match) as caught:
            await adapters.add(name, path)
        assert caught.value.param in ("lora_path", "lora_name")
    assert sorted(adapters.served) == ["a", "b"]


async def test_an_engine_without_adapters_refuses_them(files: dict[str, str]) -> None:
    adapters = AdapterSet(None, "trtllm", 4, [])
    with pytest.raises(ConfigError, match="serves no LoRA adapters"):
        await adapters.start("m", {"a": files["a"]})
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        await adapters.add("a", files["a"])


def test_lora_flags_are_checked_at_the_edge() -> None:
    assert parse_loras(["a=/x.gguf", "b:v2=/y"]) == ("a=/x.gguf", "b:v2=/y")
    for bad, match in [
        (["a"], "NAME=PATH"),
        (["a="], "NAME=PATH"),
        (["a=/x", "a=/y"], "twice"),
        (["-a=/x"], "invalid"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_loras(bad)
    with pytest.raises(ConfigError, match="--max-loras"):
        LoraConfig(max_loras=0)
    assert LoraConfig(adapters=("a=/x.gguf=y",)).named() == {"a": "/x.gguf=y"}


async def test_the_mocker_hashes_an_adapters_blocks_with_its_seed_and_refuses_one_not_loaded(
    engine: MockerEngine,
) -> None:
    events = engine.kv_events()
    await engine.load_lora("a", "/unused")
    stored: dict[str, list[int]] = {}
    for lora in ("", "a"):
        request = GenerateRequest(
            request_id=f"r{lora}", token_ids=PROMPT, max_tokens=1, sampling=SamplingParams(), lora=lora
        )
        [_ async for _ in engine.generate(request)]
        async with asyncio.timeout(2):
            while len(stored.get(lora, [])) < 4:
                batch = await anext(events)  # type: ignore[call-overload]
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        stored.setdefault(lora, []).extend(b.block_hash for b in event.blocks)
    assert stored[""] == sequence_hashes(PROMPT, 16)
    assert stored["a"] == sequence_hashes(PROMPT, 16, seed=lora_seed("a"))
    with pytest.raises(RequestError, match="not loaded") as caught:
        request = GenerateRequest(request_id="rb", token_ids=PROMPT, max_tokens=1, lora="b")
        [_ async for _ in engine.generate(request)]
    assert caught.value.param == "model"


async def test_a_name_stands_for_one_file_for_the_workers_lifetime(engine: MockerEngine, files: dict[str, str]) -> None:
    adapters = await started(engine, files, 2, "a")
    await adapters.remove("a")
    await adapters.add("a", files["a"])  # the same file again: its cached KV is still right
    await adapters.remove("a")
    with pytest.raises(RequestError, match="another file") as caught:
        await adapters.add("a", files["b"])
    assert caught.value.param == "lora_name"
    Path(files["a"]).write_bytes(b"retrained weights")
    with pytest.raises(RequestError, match="another file"):
        await adapters.add("a", files["a"])
    await adapters.add("a-v2", files["a"])
