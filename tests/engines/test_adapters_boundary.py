"""The vllm, sglang and trtllm adapters at the library boundary.

Each test injects a small fake of the LIBRARY's objects (vLLM's AsyncLLM and its argument classes,
`sglang.Engine`, `tensorrt_llm.LLM`) through the adapter's constructor hook, never a fake of our code,
and checks what crosses the boundary: sampling parameters, token streaming into GenerateChunks, abort
when the stream is closed, and KV events re-hashed with our hashes (vLLM's wire format over real ZMQ).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq
from dyn_engines.hf_export import export_path, hf_model_dir
from dyn_engines.sglang.engine import SglangEngine
from dyn_engines.trtllm.engine import ContextState, TrtllmEngine, TrtllmLibrary
from dyn_engines.vllm import engine as vllm_engine_module
from dyn_engines.vllm.engine import VllmEngine, VllmLibrary
from dyn_engines.vllm.kv_events import KvEventRehasher, tier_of

from dynamo_cli.engine import EngineArgs, KvTierConfig, Role, load_engine
from dynamo_cli.errors import ConfigError, EngineNotInstalled, RequestError
from dynamo_cli.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, StoredBlock
from dynamo_cli.kv.handles import MAX_PARAMS_BYTES, KvHandle, SglangKv, TrtllmKv, VllmKv
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.kv.images import routed_tokens
from dynamo_cli.wire import GenerateChunk, GenerateRequest, ImageInput, SamplingParams

PROMPT = list(range(1000, 1040))
TOKENS = list(range(64))


def request(
    max_tokens: int = 4, token_ids: list[int] = PROMPT, kv_transfer: KvHandle | None = None, **sampling: Any
) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r-{time.monotonic_ns()}",
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(**sampling),
        kv_transfer=kv_transfer,
    )


async def collect(stream: AsyncIterator[GenerateChunk]) -> list[GenerateChunk]:
    async with asyncio.timeout(5):
        return [chunk async for chunk in stream]


async def first_then_close(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    async with asyncio.timeout(5):
        chunk = await anext(stream)  # type: ignore[call-overload]
    await stream.aclose()  # type: ignore[attr-defined]
    return chunk


##### A fake of vLLM #####


@dataclass
class FakeAsyncEngineArgs:
    """Stands for vllm.engine.arg_utils.AsyncEngineArgs (a dataclass of engine flags)."""

    model: str
    served_model_name: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    kv_events_config: Any = None
    kv_transfer_config: Any = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:  # as vLLM's get_model_path: a path not on disk is taken for a hub name
        if self.model.startswith("/") and not Path(self.model).is_dir():
            raise ValueError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{self.model}'")


@dataclass
class FakeKVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def vllm_output(
    token_ids: list[int], finish_reason: str | None, num_cached: int = 0, kv_transfer_params: Any = None
) -> SimpleNamespace:
    completion = SimpleNamespace(token_ids=token_ids, finish_reason=finish_reason)
    return SimpleNamespace(
        outputs=[completion],
        finished=finish_reason is not None,
        num_cached_tokens=num_cached,
        kv_transfer_params=kv_transfer_params,
    )


NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "engine-p",
    "remote_request_id": "r-p",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 40,
}
"""What vLLM 0.32's NixlConnector returns from a prefill request (request_finished), abridged."""


class FakeAsyncLLM:
    """Stands for vllm.v1.engine.async_llm.AsyncLLM: one token per step, DELTA outputs."""

    def __init__(self, engine_args: FakeAsyncEngineArgs) -> None:
        self.engine_args = engine_args
        self.calls: list[tuple[Any, Any, str]] = []
        self.aborted: list[str] = []
        self.is_shut_down = False
        self.lora_requests: list[Any] = []
        """The `lora_request` of each generate call (None: the base model)."""
        self.loras: list[Any] = []
        self.removed_loras: list[int] = []
        self.add_lora_answer: bool | Exception = True
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=engine_args.block_size or 16, num_gpu_blocks=100),
            model_config=SimpleNamespace(
                max_model_len=2048, hf_config=SimpleNamespace(eos_token_id=2), get_vocab_size=lambda: 49152
            ),
            scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=512),
        )

    @classmethod
    def from_engine_args(cls, engine_args: FakeAsyncEngineArgs) -> FakeAsyncLLM:
        return cls(engine_args)

    async def generate(
        self, prompt: Any, sampling_params: FakeSamplingParams, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        self.calls.append((prompt, sampling_params, request_id))
        self.lora_requests.append(lora_request)
        max_tokens = sampling_params.kwargs["max_tokens"]
        connector = (sampling_params.kwargs.get("extra_args") or {}).get("kv_transfer_params") or {}
        for i in range(max_tokens):
            await asyncio.sleep(0)
            is_last = i == max_tokens - 1
            params = NIXL_PARAMS if is_last and connector.get("do_remote_decode") else None
            yield vllm_output([TOKENS[i]], "length" if is_last else None, num_cached=16, kv_transfer_params=params)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def add_lora(self, lora_request: Any) -> bool:
        if isinstance(self.add_lora_answer, Exception):
            raise self.add_lora_answer
        if self.add_lora_answer:
            self.loras.append(lora_request)
        return self.add_lora_answer

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed_loras.append(lora_id)
        return True

    def shutdown(self) -> None:
        self.is_shut_down = True


@dataclass
class FakeKVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_buffer_device: str = "cuda"


DELTA = object()
FAKE_VLLM = VllmLibrary(
    FakeAsyncLLM, FakeAsyncEngineArgs, FakeSamplingParams, dict, DELTA, FakeKVEventsConfig, False, FakeKVTransferConfig
)
FAKE_VLLM_CPU = dataclasses.replace(FAKE_VLLM, is_cpu=True)


def test_vllm_engine_args_pass_extra_through_with_prefix_caching_and_zmq_kv_events() -> None:
    args = EngineArgs(model="org/m", block_size=32, context_length=1024, extra={"tensor_parallel_size": 2})
    engine_args = VllmEngine(args, library=FAKE_VLLM).engine_kwargs
    assert (engine_args["model"], engine_args["block_size"], engine_args["max_model_len"]) == ("org/m", 32, 1024)
    assert engine_args["tensor_parallel_size"] == 2 and engine_args["enable_prefix_caching"] is True
    events = engine_args["kv_events_config"]
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert events.endpoint.startswith("tcp://127.0.0.1:")


async def test_vllm_gguf_model_is_exported_before_vllm_sees_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh cache the export directory does not exist until start(): vLLM must not be given it before."""
    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("DYN_CACHE_DIR", str(tmp_path / "cache"))
    exported: list[str] = []

    def fake_export(model: str) -> str:  # stands for the transformers export (tested in test_hf_export.py)
        target = export_path(gguf)
        target.mkdir(parents=True)
        exported.append(model)
        return str(target)

    monkeypatch.setattr(vllm_engine_module, "hf_model_dir", fake_export)
    engine = VllmEngine(EngineArgs(model=str(gguf)), library=FAKE_VLLM)
    assert not export_path(gguf).exists() and engine.engine_args is None
    info = await engine.start()
    assert exported == [str(gguf)] and engine.engine_args.model == str(export_path(gguf))
    assert info.model_name == "tiny.Q4_1"
    await engine.stop()


def test_vllm_deterministic_sets_batch_invariance_before_vllm_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first, so monkeypatch records the variable's original state (absent) and restores it: the
    # engine sets it directly, and a leaked "1" would turn on vLLM's GPU-only kernels in later tests.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "unset")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    seen: list[str | None] = []

    def load_library() -> VllmLibrary:  # stands for importing vLLM: it reads the variable then
        seen.append(os.environ.get("VLLM_BATCH_INVARIANT"))
        return FAKE_VLLM

    monkeypatch.setattr(vllm_engine_module, "load_library", load_library)
    engine = VllmEngine(EngineArgs(model="m", extra={"deterministic": True, "enforce_eager": True}))
    assert seen == ["1"]
    assert "deterministic" not in engine.engine_kwargs and engine.engine_kwargs["enforce_eager"] is True
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    VllmEngine(EngineArgs(model="m"))
    assert seen == ["1", None]


async def test_vllm_reports_its_vocabulary_and_refuses_ids_outside_it() -> None:
    engine = VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM)
    info = await engine.start()
    assert info.vocab_size == 49152
    bad = GenerateRequest(request_id="r-bad", token_ids=[*PROMPT, 49152], max_tokens=2)
    with pytest.raises(RequestError, match=r"0\.\.49151") as refused:
        await collect(engine.generate(bad))
    assert refused.value.param == "prompt" and engine._engine.calls == []
    await engine.stop()


def test_vllm_unknown_engine_argument_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="no_such_flag"):
        VllmEngine(EngineArgs(model="m", extra={"no_such_flag": 1}), library=FAKE_VLLM)


def test_vllm_sampling_params_map_every_field_and_ask_for_deltas_without_detokenizing() -> None:
    engine = VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM)
    req = request(max_tokens=9, temperature=0.5, top_p=0.9, seed=7, stop_token_ids=[5], ignore_eos=True, min_tokens=2)
    assert engine.sampling_params(req).kwargs == {
        "n": 1,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,
        "seed": 7,
        "max_tokens": 9,
        "min_tokens": 2,
        "stop_token_ids": [5],
        "ignore_eos": True,
        "detokenize": False,
        "output_kind": DELTA,
    }


def test_vllm_sampling_params_map_penalties_logit_bias_min_p_and_logprobs_when_set() -> None:
    engine = VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM)
    req = request(
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.3,
        logit_bias={7: -100.0},
        min_p=0.2,
        logprobs=3,
    )
    kwargs = engine.sampling_params(req).kwargs
    assert {
        k: kwargs[k]
        for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "logprobs")
    } == {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.3,
        "logit_bias": {7: -100.0},
        "min_p": 0.2,
        "logprobs": 3,
    }


async def test_vllm_streams_delta_outputs_as_chunks_and_reports_engine_info() -> None:
    engine = VllmEngine(EngineArgs(model="m", block_size=16), library=FAKE_VLLM)
    info = await engine.start()
    assert (info.block_size, info.context_length, info.total_kv_blocks, info.eos_token_ids) == (16, 2048, 100, (2,))
    req = request(max_tokens=3)
    chunks = await collect(engine.generate(req))
    assert [c.token_ids for c in chunks] == [[0], [1], [2]]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[0].num_cached_tokens == 16
    prompt, _, request_id = engine._engine.calls[0]
    assert prompt == {"prompt_token_ids": PROMPT} and request_id == req.request_id
    assert engine.load_metrics().num_prefill_tokens_cached == 16
    await engine.stop()
    assert engine._engine is None


async def test_vllm_closing_the_stream_aborts_the_vllm_request() -> None:
    engine = VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM)
    await engine.start()
    fake = engine._engine
    req = request(max_tokens=50)
    await first_then_close(engine.generate(req))
    assert fake.aborted == [req.request_id]
    assert engine.load_metrics().num_running == 0
    await engine.stop()
    assert fake.is_shut_down


async def test_vllm_prefill_role_asks_the_nixl_connector_to_keep_the_blocks_and_returns_its_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.setenv(variable, "unset")  # restored after the test: the engine sets them for vLLM
    args = EngineArgs(model="m", role=Role.PREFILL, extra={"nixl_side_channel_port": 5601})
    engine = VllmEngine(args, library=FAKE_VLLM_CPU)
    assert engine.engine_kwargs["kv_transfer_config"] == FakeKVTransferConfig("NixlConnector", "kv_both", "cpu")
    await engine.start()
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    chunks = await collect(engine.generate(request(max_tokens=50, min_tokens=3, temperature=0.0)))
    assert [c.token_ids for c in chunks] == [[0]] and chunks[-1].finish_reason == "length"
    assert chunks[-1].kv_transfer == VllmKv(num_tokens=len(PROMPT), first_token=0, params=NIXL_PARAMS)
    prompt, params, _ = engine._engine.calls[0]
    assert prompt == {"prompt_token_ids": PROMPT}
    assert (params.kwargs["max_tokens"], params.kwargs["min_tokens"]) == (1, 1)
    assert params.kwargs["extra_args"] == {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    await engine.stop()


def test_vllm_roles_without_nixl_are_a_config_error_naming_the_extra() -> None:
    no_nixl = dataclasses.replace(FAKE_VLLM, has_nixl=False)
    with pytest.raises(ConfigError, match=r"pip install 'nixl>=1.5.1,<1.6'"):
        VllmEngine(EngineArgs(model="m", role=Role.DECODE), library=no_nixl)
    assert VllmEngine(EngineArgs(model="m"), library=no_nixl).engine_kwargs["kv_transfer_config"] is None


def test_vllm_roles_use_the_users_kv_connector_and_both_has_none() -> None:
    assert VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM).engine_kwargs["kv_transfer_config"] is None
    own = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    engine = VllmEngine(EngineArgs(model="m", role=Role.DECODE, extra={"kv_transfer_config": own}), library=FAKE_VLLM)
    assert engine.engine_kwargs["kv_transfer_config"] == FakeKVTransferConfig("LMCacheConnectorV1", "kv_both")


HOST_GB = KvTierConfig(host_bytes=1 << 30)


def test_vllm_host_tier_is_vllms_own_cpu_offloading_and_what_it_cannot_do_is_a_config_error() -> None:
    kwargs = VllmEngine(EngineArgs(model="m", kv_tiers=HOST_GB), library=FAKE_VLLM).engine_kwargs
    assert (kwargs["kv_offloading_size"], kwargs["kv_offloading_backend"]) == (1.0, "native")
    assert "kv_offloading_size" not in VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM).engine_kwargs
    refused = [
        (EngineArgs(model="m", kv_tiers=HOST_GB), FAKE_VLLM_CPU, "not on its CPU build"),
        (EngineArgs(model="m", kv_tiers=KvTierConfig(host_bytes=1, disk_bytes=1)), FAKE_VLLM, "host memory only"),
        (EngineArgs(model="m", role=Role.PREFILL, kv_tiers=HOST_GB), FAKE_VLLM, "--role both"),
    ]
    for args, library, why in refused:
        with pytest.raises(ConfigError, match=why):
            VllmEngine(args, library=library)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: pip install 'dynamo-cli[vllm]'")
def test_vllm_itself_turns_the_host_tier_into_its_offloading_connector() -> None:
    # the real library's config (no engine: its CPU build refuses to offload at worker start, so the
    # adapter refuses earlier; on a GPU build this is the connector vLLM runs)
    from vllm.engine.arg_utils import AsyncEngineArgs

    gpu = dataclasses.replace(vllm_engine_module.load_library(), is_cpu=False)
    kwargs = VllmEngine(EngineArgs(model="m", kv_tiers=HOST_GB), library=gpu).engine_kwargs
    model = str(hf_model_dir("smollm2"))  # the built-in GGUF, exported once
    offload = {key: kwargs[key] for key in ("kv_offloading_size", "kv_offloading_backend")}
    config = AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True, **offload).create_engine_config()

    transfer = config.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 1 << 30


def decode_request(first_token: int, max_tokens: int = 3, last: int | None = None, **handle: Any) -> GenerateRequest:
    """prompt + [first_token] with a VllmKv covering the prompt; `last` puts another token at the end."""
    fields: dict[str, Any] = {"num_tokens": len(PROMPT), "first_token": first_token, "params": NIXL_PARAMS}
    fields.update(handle)
    kv = VllmKv(**fields)
    last = first_token if last is None else last
    return request(max_tokens=max_tokens, token_ids=[*PROMPT, last], kv_transfer=kv)


async def test_vllm_decode_sends_the_prompt_with_the_params_and_drops_the_first_token_it_samples_again() -> None:
    engine = VllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_VLLM)
    await engine.start()
    req = decode_request(first_token=0, max_tokens=3)
    chunks = await collect(engine.generate(req))
    assert [c.token_ids for c in chunks] == [[], [1], [2], [3]] and chunks[-1].finish_reason == "length"
    prompt, params, request_id = engine._engine.calls[0]
    assert prompt == {"prompt_token_ids": PROMPT} and request_id == req.request_id
    assert params.kwargs["max_tokens"] == 4  # the first token again, then the 3 asked for
    assert params.kwargs["extra_args"]["kv_transfer_params"] == NIXL_PARAMS
    assert engine.load_metrics().num_prefill_tokens_computed == 0
    await engine.stop()


async def test_vllm_decode_that_samples_another_first_token_aborts_it_and_prefills_the_first_token_here() -> None:
    engine = VllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_VLLM)
    await engine.start()
    req = decode_request(first_token=7, max_tokens=2)
    chunks = await collect(engine.generate(req))
    assert [c.token_ids for c in chunks] == [[0], [1]]
    fake = engine._engine
    assert fake.aborted == [req.request_id] and engine.num_first_token_mismatches == 1
    prompt, params, request_id = fake.calls[1]
    assert prompt == {"prompt_token_ids": [*PROMPT, 7]} and request_id == f"{req.request_id}-local"
    assert "extra_args" not in params.kwargs and params.kwargs["max_tokens"] == 2
    await engine.stop()


async def test_vllm_both_role_prefills_a_request_with_a_handle_itself_as_after_a_failed_pull() -> None:
    engine = VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM)
    await engine.start()
    chunks = await collect(engine.generate(decode_request(first_token=0, max_tokens=2)))
    assert [c.token_ids for c in chunks] == [[0], [1]]
    prompt, params, _ = engine._engine.calls[0]
    assert prompt == {"prompt_token_ids": [*PROMPT, 0]} and "extra_args" not in params.kwargs
    await engine.stop()


async def test_vllm_closing_a_decode_stream_aborts_the_vllm_request() -> None:
    engine = VllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_VLLM)
    await engine.start()
    req = decode_request(first_token=0, max_tokens=50)
    await first_then_close(engine.generate(req))
    assert engine._engine.aborted == [req.request_id] and engine.load_metrics().num_running == 0
    await engine.stop()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        pytest.param(
            GenerateRequest(
                request_id="r-kind",
                token_ids=[*PROMPT, 0],
                max_tokens=2,
                kv_transfer=TrtllmKv(num_tokens=len(PROMPT), first_token=0, opaque_state=b"x"),
            ),
            "TrtllmKv",
            id="wrong-kind",
        ),
        pytest.param(
            decode_request(0, params={**NIXL_PARAMS, "pad": "x" * MAX_PARAMS_BYTES}), "too large", id="oversized"
        ),
        pytest.param(decode_request(0, num_tokens=len(PROMPT) + 1), "covers", id="num-tokens-past-the-prompt"),
        pytest.param(decode_request(0, num_tokens=5), "whole prompt", id="num-tokens-short"),
        pytest.param(decode_request(0, last=3), "first token", id="first-token-not-last"),
        pytest.param(decode_request(0, params={**NIXL_PARAMS, "remote_port": "80"}), "NIXL", id="port-not-int"),
        pytest.param(decode_request(0, params={"remote_host": "h"}), "NIXL", id="missing-fields"),
        pytest.param(
            decode_request(0, params={**NIXL_PARAMS, "remote_block_ids": [list(range(41))]}), "more KV", id="blocks"
        ),
    ],
)
async def test_vllm_decode_refuses_a_bad_handle_naming_kv_transfer_before_vllm_sees_it(
    bad: GenerateRequest, match: str
) -> None:
    engine = VllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_VLLM)
    await engine.start()
    with pytest.raises(RequestError, match=match) as refused:
        await collect(engine.generate(bad))
    assert refused.value.param == "kv_transfer" and engine._engine.calls == []
    await engine.stop()


async def test_vllm_decode_passes_no_private_connector_flags_from_the_network() -> None:
    engine = VllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_VLLM)
    await engine.start()
    sneaky = {**NIXL_PARAMS, "_remote_blocks_processed": True, "do_remote_decode": True, "do_remote_prefill": False}
    await collect(engine.generate(decode_request(0, params=sneaky)))
    sent = engine._engine.calls[0][1].kwargs["extra_args"]["kv_transfer_params"]
    assert "_remote_blocks_processed" not in sent and (sent["do_remote_prefill"], sent["do_remote_decode"]) == (
        True,
        False,
    )
    await engine.stop()


def vllm_batch(*events: list[Any]) -> bytes:
    """A payload as vLLM's ZmqEventPublisher sends it: msgpack [ts, [tagged array events], dp_rank]."""
    return msgspec.msgpack.encode([time.time(), list(events), 0])


async def test_vllm_kv_events_over_zmq_are_re_hashed_with_our_sequence_hashes() -> None:
    engine = VllmEngine(EngineArgs(model="m", block_size=16), library=FAKE_VLLM)
    await engine.start()
    publisher = zmq.Context.instance().socket(zmq.PUB)  # stands for vLLM's ZmqEventPublisher
    publisher.connect(engine.engine_args.kv_events_config.endpoint)  # tcp://host:port: vLLM connects
    ours = sequence_hashes(TOKENS[:48], 16)
    stored = ["BlockStored", [b"v1", b"v2"], None, TOKENS[:32], 16, None, "GPU"]
    events = engine.kv_events()
    try:
        async with asyncio.timeout(5):
            first = asyncio.ensure_future(anext(events))  # type: ignore[call-overload]
            while not first.done():  # a SUB socket joins late: publish until it hears
                publisher.send_multipart([b"kv-events", (0).to_bytes(8, "big"), vllm_batch(stored)])
                await asyncio.sleep(0.02)
            batch: KvEventBatch = first.result()
        local = block_hashes(TOKENS[:32], 16)
        assert batch.events == [
            BlockStored(parent_hash=None, blocks=[StoredBlock(ours[0], local[0]), StoredBlock(ours[1], local[1])])
        ]
        chained = ["BlockStored", [b"v3"], b"v2", TOKENS[32:48], 16]
        publisher.send_multipart([b"kv-events", (1).to_bytes(8, "big"), vllm_batch(chained, ["BlockRemoved", [b"v1"]])])
        async with asyncio.timeout(5):
            second = await anext(events)  # type: ignore[call-overload]
        assert second.event_id == 1
        assert second.events[0] == BlockStored(
            parent_hash=ours[1], blocks=[StoredBlock(ours[2], block_hashes(TOKENS[32:48], 16)[0])]
        )
        assert second.events[1] == BlockRemoved(block_hashes=[ours[0]])
    finally:
        publisher.close(linger=0)
        await engine.stop()


def test_the_rehasher_maps_media_to_tiers_and_keeps_a_block_until_its_last_tier_drops_it() -> None:
    rehasher = KvEventRehasher()
    ours = sequence_hashes(TOKENS[:32], 16)
    stored = rehasher.convert([["BlockStored", [1, 2], None, TOKENS[:32], 16, None, "GPU"]])
    assert [e.tier for e in stored] == ["device"]  # type: ignore[union-attr]
    # vLLM's offloading connector: the blocks are stored on CPU, then leave the GPU
    moved = rehasher.convert(
        [["BlockStored", [1, 2], None, TOKENS[:32], 16, None, "CPU"], ["BlockRemoved", [1, 2], "GPU"]]
    )
    assert moved[0] == BlockStored(
        parent_hash=None,
        blocks=[
            StoredBlock(ours[0], block_hashes(TOKENS[:32], 16)[0]),
            StoredBlock(ours[1], block_hashes(TOKENS[:32], 16)[1]),
        ],
        tier="host",
    )
    assert moved[1] == BlockRemoved(block_hashes=ours, tier="device")
    assert rehasher.convert([["BlockRemoved", [1], "GPU"]]) == []  # no longer on device: nothing to say
    chained = rehasher.convert([["BlockStored", [3], 2, TOKENS[32:48], 16, None, "disk"]])  # parent known via host
    assert chained[0].tier == "disk" and chained[0].parent_hash == ours[1]  # type: ignore[union-attr]
    assert rehasher.convert([["BlockRemoved", [1, 2], "CPU"]]) == [BlockRemoved(block_hashes=ours, tier="host")]
    assert len(rehasher) == 1  # only the disk block is still translated
    assert rehasher.convert([["AllBlocksCleared"]]) == [AllBlocksCleared()] and len(rehasher) == 1  # GPU only
    assert rehasher.convert([["BlockStored", [9], None, TOKENS[:16], 16, None, "TAPE"]]) == []  # unknown medium
    assert (tier_of(None), tier_of("cpu"), tier_of("SSD"), tier_of("NVRAM")) == ("device", "host", "disk", None)


def test_the_rehasher_ignores_unknown_parents_and_clears() -> None:
    rehasher = KvEventRehasher()
    assert rehasher.convert([["BlockStored", [2], 999, TOKENS[:16], 16]]) == [] and rehasher.num_orphans == 1
    assert (
        len(
            rehasher.convert(
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [3],
                        "parent_block_hash": None,
                        "token_ids": TOKENS[:16],
                        "block_size": 16,
                    }
                ]
            )
        )
        == 1
    )
    assert rehasher.convert([["AllBlocksCleared"]]) == [AllBlocksCleared()] and len(rehasher) == 0
    assert rehasher.convert([["BlockRemoved", [3]]]) == []


##### A fake of SGLang #####


class FakeSglangEngine:
    """Stands for sglang.Engine: `async_generate(..., stream=True)` yields disjoint output_ids."""

    def __init__(self, **server_args: Any) -> None:
        self.server_args = server_args
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.is_shut_down = False
        self.loras: list[tuple[str, str]] = []
        self.unloaded_loras: list[str] = []
        self.load_answer = SimpleNamespace(success=True, error_message=None)
        self.scheduler_info = {"max_total_num_tokens": 1600}
        self.tokenizer_manager = SimpleNamespace(
            server_args=SimpleNamespace(page_size=server_args["page_size"], max_running_requests=8),
            model_config=SimpleNamespace(context_len=2048, vocab_size=49152),
            abort_request=lambda rid, abort_all=False: self.aborted.append(rid),
        )

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(kwargs)
        return self._stream(kwargs["rid"], kwargs["sampling_params"]["max_new_tokens"])

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str) -> Any:
        if self.load_answer.success:
            self.loras.append((lora_name, lora_path))
        return self.load_answer

    async def async_unload_lora_adapter(self, lora_name: str) -> Any:
        self.unloaded_loras.append(lora_name)
        return SimpleNamespace(success=True, error_message=None)

    async def _stream(self, rid: str, max_new_tokens: int) -> AsyncIterator[dict[str, Any]]:
        yield {"output_ids": [], "meta_info": {"id": rid, "finish_reason": None, "cached_tokens": 32}}
        for i in range(max_new_tokens):
            await asyncio.sleep(0)
            finish = {"type": "length", "length": max_new_tokens} if i == max_new_tokens - 1 else None
            yield {"output_ids": [TOKENS[i]], "meta_info": {"id": rid, "finish_reason": finish, "cached_tokens": 32}}

    def shutdown(self) -> None:
        self.is_shut_down = True


def test_sglang_server_args_force_token_ids_disjoint_streams_page_size_and_kv_events() -> None:
    engine = SglangEngine(EngineArgs(model="org/m", block_size=32, extra={"tp_size": 2}), engine_cls=FakeSglangEngine)
    args = engine.server_args
    assert (args["model_path"], args["page_size"], args["tp_size"]) == ("org/m", 32, 2)
    assert args["skip_tokenizer_init"] is True and args["stream_output"] is True
    assert json.loads(args["kv_events_config"])["endpoint"].startswith("tcp://127.0.0.1:")


async def test_sglang_deterministic_asks_for_its_deterministic_inference_and_reports_the_vocabulary() -> None:
    engine = SglangEngine(EngineArgs(model="m", extra={"deterministic": "true"}), engine_cls=FakeSglangEngine)
    assert engine.server_args["enable_deterministic_inference"] is True
    assert "deterministic" not in engine.server_args
    plain = SglangEngine(EngineArgs(model="m"), engine_cls=FakeSglangEngine)
    assert "enable_deterministic_inference" not in plain.server_args
    assert (await engine.start()).vocab_size == 49152
    await engine.stop()


async def test_sglang_streams_output_ids_maps_sampling_and_aborts_on_close() -> None:
    engine = SglangEngine(EngineArgs(model="m", block_size=16), engine_cls=FakeSglangEngine)
    info = await engine.start()
    assert (info.block_size, info.context_length, info.total_kv_blocks) == (16, 2048, 100)
    req = request(max_tokens=3, top_k=5, seed=3, stop_token_ids=[9])
    chunks = await collect(engine.generate(req))
    assert [c.token_ids for c in chunks] == [[0], [1], [2]] and chunks[-1].finish_reason == "length"
    assert chunks[0].num_cached_tokens == 32
    fake = engine._engine
    call = fake.calls[0]
    assert (call["input_ids"], call["stream"], call["rid"]) == (PROMPT, True, req.request_id)
    assert call["sampling_params"] == {
        "max_new_tokens": 3,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "ignore_eos": False,
        "stop_token_ids": [9],
        "skip_special_tokens": False,
        "sampling_seed": 3,
    }
    long = request(max_tokens=50)
    await first_then_close(engine.generate(long))
    assert fake.aborted == [long.request_id] and engine.load_metrics().num_running == 0
    with pytest.raises(RequestError, match="min_tokens"):  # SGLang rejects it without its tokenizer
        await collect(engine.generate(request(max_tokens=3, min_tokens=2)))
    await engine.stop()
    assert fake.is_shut_down


def room(first_token: int = -1, num_tokens: int = len(PROMPT), **fields: Any) -> SglangKv:
    """The handle a frontend makes up front for SGLang: the prefill's bootstrap server, a random room."""
    address: dict[str, Any] = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 2**62 + 7}
    address.update(fields)
    return SglangKv(num_tokens=num_tokens, first_token=first_token, **address)


async def test_sglang_prefill_role_publishes_its_bootstrap_and_runs_the_room_without_emitting_the_token() -> None:
    args = EngineArgs(model="m", block_size=16, role=Role.PREFILL, extra={"bootstrap_host": "10.0.0.5"})
    engine = SglangEngine(args, engine_cls=FakeSglangEngine)
    server_args = engine.server_args
    assert (server_args["disaggregation_mode"], server_args["disaggregation_transfer_backend"]) == ("prefill", "nixl")
    port = server_args["disaggregation_bootstrap_port"]
    assert isinstance(port, int) and port > 0 and "bootstrap_host" not in server_args
    info = await engine.start()
    assert info.extra["bootstrap"] == f"10.0.0.5:{port}"
    handle = room(bootstrap_port=port)
    chunks = await collect(engine.generate(request(max_tokens=20, kv_transfer=handle)))
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([], "length")]
    assert chunks[-1].kv_transfer == handle
    call = engine._engine.calls[0]
    assert (call["input_ids"], call["sampling_params"]["max_new_tokens"]) == (PROMPT, 1)
    assert (call["bootstrap_host"], call["bootstrap_port"], call["bootstrap_room"]) == ("10.0.0.5", port, 2**62 + 7)
    assert engine.load_metrics().num_prefill_tokens_computed == len(PROMPT) - 32  # the fake's cached_tokens
    await engine.stop()


async def test_sglang_decode_role_meets_the_room_and_emits_every_token_from_the_first() -> None:
    engine = SglangEngine(EngineArgs(model="m", block_size=16, role=Role.DECODE), engine_cls=FakeSglangEngine)
    assert engine.server_args["disaggregation_mode"] == "decode"
    assert "disaggregation_bootstrap_port" not in engine.server_args
    info = await engine.start()
    assert "bootstrap" not in info.extra
    req = request(max_tokens=3, kv_transfer=room())
    chunks = await collect(engine.generate(req))
    assert [c.token_ids for c in chunks] == [[0], [1], [2]]
    call = engine._engine.calls[0]
    assert call["input_ids"] == PROMPT and call["sampling_params"]["max_new_tokens"] == 3
    assert (call["bootstrap_host"], call["bootstrap_port"], call["bootstrap_room"]) == ("10.0.0.5", 8998, 2**62 + 7)
    assert engine.load_metrics().num_prefill_tokens_computed == 0
    long = request(max_tokens=50, kv_transfer=room())
    await first_then_close(engine.generate(long))
    assert engine._engine.aborted == [long.request_id] and engine.load_metrics().num_running == 0
    await engine.stop()


async def test_sglang_both_role_serves_a_request_with_a_handle_itself() -> None:
    engine = SglangEngine(EngineArgs(model="m"), engine_cls=FakeSglangEngine)
    assert "disaggregation_mode" not in engine.server_args
    await engine.start()
    await collect(engine.generate(request(max_tokens=2, kv_transfer=room())))
    assert "bootstrap_room" not in engine._engine.calls[0]
    await engine.stop()


@pytest.mark.parametrize(
    ("role", "handle", "match"),
    [
        pytest.param(Role.DECODE, None, "cannot decode without a prefill", id="decode-without-handle"),
        pytest.param(Role.PREFILL, None, "cannot prefill without a bootstrap room", id="prefill-without-handle"),
        pytest.param(Role.DECODE, VllmKv(num_tokens=len(PROMPT), first_token=-1, params={}), "VllmKv", id="wrong-kind"),
        pytest.param(Role.DECODE, room(first_token=5), "emits it", id="first-token-named"),
        pytest.param(Role.DECODE, room(num_tokens=len(PROMPT) - 1), "not all", id="num-tokens-short"),
        pytest.param(Role.DECODE, room(bootstrap_room=-1), "bootstrap_room", id="room-negative"),
        pytest.param(Role.DECODE, room(bootstrap_room=2**63), "bootstrap_room", id="room-past-int64"),
        pytest.param(Role.PREFILL, room(bootstrap_port=0), "host:port", id="port-zero"),
        pytest.param(Role.DECODE, room(bootstrap_host=""), "host:port", id="host-empty"),
    ],
)
async def test_sglang_roles_refuse_a_missing_or_bad_handle_naming_kv_transfer(
    role: Role, handle: SglangKv | None, match: str
) -> None:
    engine = SglangEngine(EngineArgs(model="m", role=role), engine_cls=FakeSglangEngine)
    await engine.start()
    with pytest.raises(RequestError, match=match) as refused:
        await collect(engine.generate(request(max_tokens=3, kv_transfer=handle)))
    assert refused.value.param == "kv_transfer" and engine._engine.calls == []
    await engine.stop()


##### A fake of TensorRT-LLM #####


@dataclass
class FakeKvCacheConfig:
    enable_block_reuse: bool = False
    event_buffer_max_size: int = 0
    tokens_per_block: int = 32


@dataclass
class FakeDisaggregatedParams:
    """Stands for tensorrt_llm.disaggregated_params.DisaggregatedParams."""

    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None


@dataclass
class FakeCacheTransceiverConfig:
    backend: str


CONTEXT_PARAMS = FakeDisaggregatedParams(
    request_type="context_only", first_gen_tokens=[TOKENS[0]], ctx_request_id=77, opaque_state=b"trt-state"
)
"""What a context_only request's output carries (the prefill engine's id for it, the transceiver's state)."""


class FakeResult:
    """Stands for tensorrt_llm's streaming RequestOutput: async-iterable, `abort()`; a context_only
    request's output carries disaggregated_params, a generation_only one answers with first_gen_tokens first."""

    def __init__(self, tokens: list[int], disaggregated: FakeDisaggregatedParams | None = None) -> None:
        self.tokens = tokens
        self.disaggregated = disaggregated
        self.is_aborted = False

    async def __aiter__(self) -> AsyncIterator[Any]:
        is_context = self.disaggregated is not None and self.disaggregated.request_type == "context_only"
        for i, token in enumerate(self.tokens):
            await asyncio.sleep(0)
            reason = "length" if i == len(self.tokens) - 1 else None
            params = CONTEXT_PARAMS if is_context and reason else None
            completion = SimpleNamespace(
                token_ids_diff=[token],
                token_ids=self.tokens[: i + 1],
                finish_reason=reason,
                disaggregated_params=params,
            )
            yield SimpleNamespace(outputs=[completion], finished=reason is not None)

    def abort(self) -> None:
        self.is_aborted = True


@dataclass
class FakeLLM:
    """Stands for tensorrt_llm.LLM."""

    model: str
    kv_cache_config: FakeKvCacheConfig
    max_seq_len: int | None = None
    max_batch_size: int = 8
    cache_transceiver_config: FakeCacheTransceiverConfig | None = None
    enable_lora: bool = False
    lora_config: Any = None
    results: list[tuple[list[int], Any, FakeResult]] = field(default_factory=list)
    lora_requests: list[Any] = field(default_factory=list)
    disaggregated: list[FakeDisaggregatedParams | None] = field(default_factory=list)
    kv_events: list[dict[str, Any]] = field(default_factory=list)
    is_shut_down: bool = False

    @property
    def args(self) -> Any:
        return SimpleNamespace(max_seq_len=self.max_seq_len or 2048, max_batch_size=self.max_batch_size)

    def generate_async(
        self,
        token_ids: list[int],
        sampling_params: Any,
        streaming: bool,
        disaggregated_params: FakeDisaggregatedParams | None = None,
        lora_request: Any = None,
    ) -> FakeResult:
        assert streaming
        self.lora_requests.append(lora_request)
        max_tokens = sampling_params.kwargs["max_tokens"]
        tokens = TOKENS[:max_tokens]
        if disaggregated_params is not None and disaggregated_params.request_type == "generation_only":
            tokens = [*(disaggregated_params.first_gen_tokens or []), *TOKENS[1:max_tokens]]
        result = FakeResult(tokens, disaggregated_params)
        self.results.append((token_ids, sampling_params, result))
        self.disaggregated.append(disaggregated_params)
        return result

    async def get_kv_cache_events_async(self, timeout: float) -> AsyncIterator[dict[str, Any]]:
        events, self.kv_events = self.kv_events, []
        for event in events:
            yield event
        await asyncio.sleep(0.01)

    def shutdown(self) -> None:
        self.is_shut_down = True


FAKE_TRTLLM = TrtllmLibrary(
    FakeLLM, FakeSamplingParams, FakeKvCacheConfig, FakeDisaggregatedParams, FakeCacheTransceiverConfig
)


async def test_trtllm_streams_diffs_maps_sampling_aborts_on_close_and_re_hashes_kv_events() -> None:
    engine = TrtllmEngine(EngineArgs(model="m", block_size=16, context_length=1024), library=FAKE_TRTLLM)
    info = await engine.start()
    fake = engine._llm
    assert fake.kv_cache_config == FakeKvCacheConfig(True, 1024, 16) and info.context_length == 1024
    chunks = await collect(engine.generate(request(max_tokens=3, top_k=4, ignore_eos=True)))
    assert [c.token_ids for c in chunks] == [[0], [1], [2]] and chunks[-1].finish_reason == "length"
    token_ids, params, _ = fake.results[0]
    assert token_ids == PROMPT
    assert params.kwargs == {
        "max_tokens": 3,
        "min_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 4,
        "seed": None,
        "stop_token_ids": None,
        "ignore_eos": True,
        "detokenize": False,
    }
    await first_then_close(engine.generate(request(max_tokens=50)))
    assert fake.results[1][2].is_aborted and engine.load_metrics().num_running == 0
    blocks = [
        {"block_hash": 11 + i, "tokens": [{"token_id": t} for t in TOKENS[16 * i : 16 * i + 16]]} for i in range(2)
    ]
    fake.kv_events.append({"event_id": 0, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}})
    async with asyncio.timeout(5):
        batch = await anext(engine.kv_events())  # type: ignore[call-overload]
    assert [b.block_hash for b in batch.events[0].blocks] == sequence_hashes(TOKENS[:32], 16)
    await engine.stop()
    assert fake.is_shut_down


async def trtllm_prefill() -> TrtllmKv:
    """A handle from a prefill-role engine over the fake (context_only, one token)."""
    engine = TrtllmEngine(EngineArgs(model="m", role=Role.PREFILL), library=FAKE_TRTLLM)
    await engine.start()
    chunks = await collect(engine.generate(request(max_tokens=20)))
    await engine.stop()
    handle = chunks[-1].kv_transfer
    assert isinstance(handle, TrtllmKv)
    return handle


async def test_trtllm_prefill_role_runs_context_only_and_packs_what_the_generation_side_needs() -> None:
    engine = TrtllmEngine(EngineArgs(model="m", role=Role.PREFILL), library=FAKE_TRTLLM)
    assert engine.llm_kwargs()["cache_transceiver_config"] == FakeCacheTransceiverConfig("DEFAULT")
    await engine.start()
    chunks = await collect(engine.generate(request(max_tokens=20)))
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([0], "length")]
    handle = chunks[-1].kv_transfer
    assert isinstance(handle, TrtllmKv) and (handle.num_tokens, handle.first_token) == (len(PROMPT), 0)
    state = msgspec.msgpack.decode(handle.opaque_state, type=ContextState)
    assert (state.ctx_request_id, state.opaque_state) == (77, b"trt-state")
    token_ids, params, _ = engine._llm.results[0]
    assert token_ids == PROMPT and params.kwargs["max_tokens"] == 1
    assert engine._llm.disaggregated == [FakeDisaggregatedParams(request_type="context_only")]
    await engine.stop()
    assert "cache_transceiver_config" not in TrtllmEngine(EngineArgs(model="m"), library=FAKE_TRTLLM).llm_kwargs()


async def test_trtllm_decode_runs_generation_only_and_does_not_emit_the_first_token_again() -> None:
    handle = await trtllm_prefill()
    engine = TrtllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_TRTLLM)
    await engine.start()
    chunks = await collect(engine.generate(request(max_tokens=3, token_ids=[*PROMPT, 0], kv_transfer=handle)))
    assert [c.token_ids for c in chunks] == [[1], [2], [3]] and chunks[-1].finish_reason == "length"
    fake = engine._llm
    token_ids, params, _ = fake.results[0]
    assert token_ids == PROMPT and params.kwargs["max_tokens"] == 4  # TRT-LLM counts the first token
    assert fake.disaggregated[0] == FakeDisaggregatedParams(
        request_type="generation_only", first_gen_tokens=[0], ctx_request_id=77, opaque_state=b"trt-state"
    )
    await first_then_close(engine.generate(request(max_tokens=50, token_ids=[*PROMPT, 0], kv_transfer=handle)))
    assert fake.results[1][2].is_aborted and engine.load_metrics().num_running == 0
    await engine.stop()


@pytest.mark.parametrize(
    ("handle", "match"),
    [
        pytest.param(VllmKv(num_tokens=len(PROMPT), first_token=0, params={}), "VllmKv", id="wrong-kind"),
        pytest.param(
            TrtllmKv(num_tokens=len(PROMPT), first_token=0, opaque_state=b"\xc1"), "context state", id="garbage"
        ),
        pytest.param(
            TrtllmKv(num_tokens=len(PROMPT), first_token=0, opaque_state=b"x" * (MAX_PARAMS_BYTES + 1)),
            "too large",
            id="oversized",
        ),
        pytest.param(TrtllmKv(num_tokens=0, first_token=0, opaque_state=b""), "covers 0", id="num-tokens-zero"),
    ],
)
async def test_trtllm_decode_refuses_a_bad_handle_naming_kv_transfer(handle: Any, match: str) -> None:
    engine = TrtllmEngine(EngineArgs(model="m", role=Role.DECODE), library=FAKE_TRTLLM)
    await engine.start()
    with pytest.raises(RequestError, match=match) as refused:
        await collect(engine.generate(request(max_tokens=3, token_ids=[*PROMPT, 0], kv_transfer=handle)))
    assert refused.value.param == "kv_transfer" and engine._llm.results == []
    await engine.stop()


##### Without the library #####


@pytest.mark.parametrize(
    ("name", "module"),
    [
        pytest.param("vllm", "vllm", id="vllm"),
        pytest.param("sglang", "sglang", id="sglang"),
        pytest.param("trtllm", "tensorrt_llm", id="trtllm"),
    ],
)
def test_a_missing_library_raises_engine_not_installed_naming_the_extra(name: str, module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    factory = load_engine(name)  # the plugin module itself imports without its library
    with pytest.raises(EngineNotInstalled, match=rf"pip install 'dynamo-cli\[{name}\]'"):
        factory(EngineArgs(model="m"))


def test_trtllm_keeps_our_deterministic_key_out_of_the_llm_arguments() -> None:
    args = EngineArgs(model="m", extra={"deterministic": True, "max_batch_size": 4})
    engine = TrtllmEngine(args, library=FAKE_TRTLLM)
    kwargs = engine.llm_kwargs()
    assert "deterministic" not in kwargs and kwargs["max_batch_size"] == 4


##### vLLM structured outputs (issue 17) #####


@dataclass
class FakeStructuredOutputs:
    json: Any = None
    json_object: bool | None = None


async def test_vllm_maps_guided_json_to_structured_outputs_and_publishes_the_feature() -> None:
    from dynamo_cli.engine import Feature
    from dynamo_cli.wire import Guided

    library = dataclasses.replace(FAKE_VLLM, structured_outputs_cls=FakeStructuredOutputs)
    engine = VllmEngine(EngineArgs(model="m"), library=library)
    assert Feature.GUIDED_JSON in (await engine.start()).features
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = engine.sampling_params(request(guided=Guided(kind="json_schema", schema=json.dumps(schema))))
    assert params.kwargs["structured_outputs"] == FakeStructuredOutputs(json=schema)
    params = engine.sampling_params(request(guided=Guided(kind="json_object")))
    assert params.kwargs["structured_outputs"] == FakeStructuredOutputs(json_object=True)
    migrated = request(guided=Guided(kind="json_object", num_accepted=3, param="tool_choice"))
    with pytest.raises(RequestError, match="resume") as refused:
        engine.sampling_params(migrated)  # vLLM cannot replay output made elsewhere through its grammar
    assert refused.value.param == "tool_choice"
    await engine.stop()
    plain = VllmEngine(EngineArgs(model="m"), library=FAKE_VLLM)  # a vLLM without structured outputs
    assert Feature.GUIDED_JSON not in (await plain.start()).features
    await plain.stop()


def test_vllm_structured_outputs_params_take_our_mapping() -> None:
    """At the library boundary: the installed vLLM builds SamplingParams from what the adapter passes."""
    pytest.importorskip("vllm", reason="needs vLLM")
    from dyn_engines.vllm.engine import load_library

    from dynamo_cli.wire import Guided

    library = load_library()
    assert library.structured_outputs_cls is not None
    engine = VllmEngine(EngineArgs(model="m"), library=library)
    guided = Guided(kind="json_schema", schema='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    params = engine.sampling_params(request(guided=guided))
    assert params.structured_outputs.json == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert engine.sampling_params(request(guided=Guided(kind="json_object"))).structured_outputs.json_object is True


def test_the_rehasher_hashes_an_image_as_the_router_views_it() -> None:
    """vLLM's map-form events name an image in each block it touches by (identifier, offset in the block); with
    the digest as identifier, the stored hashes are those of the router's routing view (kv/images.py)."""
    digest, other = "ab" * 32, "cd" * 32
    tokens = TOKENS[:20] + [7] * 10 + TOKENS[20:22]  # an image of 10 tokens at 20, across blocks 1 and 2
    image = ImageInput(digest=digest, offset=20, length=10, data=b"x")
    view = sequence_hashes(routed_tokens(tokens, [image]), 16)
    rehasher = KvEventRehasher()
    rehasher.image_tokens = 10
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 16,
        "medium": "GPU",
        "extra_keys": [[[digest, 20], ["cache-salt-or-lora"]], [[digest, 4]]],
    }
    (stored,) = rehasher.convert([event])
    assert [b.block_hash for b in stored.blocks] == view  # type: ignore[union-attr]
    elsewhere = {**event, "block_hashes": [3, 4], "extra_keys": [[[other, 20]], [[other, 4]]]}
    (moved,) = rehasher.convert([elsewhere])
    assert [b.block_hash for b in moved.blocks][1] != view[1]  # type: ignore[union-attr]
    blind = KvEventRehasher()  # a text-only engine: the keys are ignored, the placeholders hash as text
    (plain,) = blind.convert([{**event, "block_hashes": [5, 6]}])
    assert [b.block_hash for b in plain.blocks] == sequence_hashes(tokens, 16)  # type: ignore[union-attr]
