"""Data-parallel ranks and node groups at the library boundary: vLLM, SGLang and TensorRT-LLM over fakes.

Each engine maps `data_parallel_size` (and `dyn worker --nnodes`) to its library's settings, pins a request to the
rank it names, and reads each rank's KV events into one stream numbered per worker, each batch stamped with its rank.
The fakes stand for the libraries as tests/engines/test_adapters_boundary.py's do; the relay runs over real ZMQ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq
from dyn_engines.sglang import headless as sglang_headless
from dyn_engines.sglang.engine import SglangEngine
from dyn_engines.trtllm.engine import TrtllmEngine
from dyn_engines.vllm.args import engine_kwargs
from dyn_engines.vllm.engine import VllmEngine
from dyn_engines.vllm.headless import HeadlessLibrary, run_headless
from dyn_engines.vllm.kv_events import ZmqKvRelay, rank_endpoint

from dynamo_cli.engine import EngineArgs, NodeGroup, load_headless
from dynamo_cli.errors import ConfigError, DynError, RequestError
from dynamo_cli.kv.events import BlockRemoved, BlockStored, KvEventBatch
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.wire import GenerateRequest, RankLoad, SamplingParams
from tests.engines.test_adapters_boundary import (
    FAKE_TRTLLM,
    FAKE_VLLM,
    TOKENS,
    FakeAsyncEngineArgs,
    FakeAsyncLLM,
    FakeLLM,
    FakeSglangEngine,
    collect,
)

PROMPT = list(range(1000, 1040))
LEADER = NodeGroup(nnodes=2, node_rank=0, leader_host="10.0.0.1")
FOLLOWER = dataclasses.replace(LEADER, node_rank=1)


def ranked(request_id: str, dp_rank: int | None, max_tokens: int = 2) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, token_ids=PROMPT, max_tokens=max_tokens, sampling=SamplingParams(), dp_rank=dp_rank
    )


##### vLLM: ranks #####


@dataclass
class DpEngineArgs(FakeAsyncEngineArgs):
    """`AsyncEngineArgs` with vLLM's parallel fields."""

    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_external_lb: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    distributed_executor_backend: str | None = None

    def create_engine_config(self, usage_context: Any = None, headless: bool = False) -> Any:
        return SimpleNamespace(args=self, usage_context=usage_context, headless=headless)


class DpAsyncLLM(FakeAsyncLLM):
    """`AsyncLLM` of several engine cores: `generate(data_parallel_rank=)`, the DP coordinator's counts per rank."""

    def __init__(self, engine_args: DpEngineArgs) -> None:
        super().__init__(engine_args)
        self.ranks: list[int | None] = []
        self.engine_core = SimpleNamespace(lb_engines=[[0, 0, 0.0] for _ in range(engine_args.data_parallel_size)])

    async def generate(  # type: ignore[override]
        self, prompt: Any, sampling_params: Any, request_id: str, lora_request: Any = None, **rank: int
    ) -> AsyncIterator[Any]:
        self.ranks.append(rank.get("data_parallel_rank"))
        async for output in super().generate(prompt, sampling_params, request_id, lora_request):
            yield output


DP_VLLM = dataclasses.replace(FAKE_VLLM, engine_cls=DpAsyncLLM, engine_args_cls=DpEngineArgs)


def dp_engine(size: int = 2, **extra: Any) -> VllmEngine:
    args = EngineArgs(model="m", block_size=16, extra={"data_parallel_size": size, **extra})
    return VllmEngine(args, library=DP_VLLM)


async def test_vllm_data_parallel_size_is_vllms_own_and_the_engine_advertises_its_ranks() -> None:
    engine = dp_engine(2)
    assert engine.engine_kwargs["data_parallel_size"] == 2
    info = await engine.start()
    try:
        assert (info.extra["dp_start"], info.extra["dp_size"]) == (0, 2)
        assert info.total_kv_blocks == 100  # vLLM sums its ranks' blocks
        assert info.max_num_seqs == 16  # each rank runs max_num_seqs
    finally:
        await engine.stop()
    blind = VllmEngine(EngineArgs(model="m"), library=DP_VLLM)
    info = await blind.start()
    assert "dp_size" not in info.extra and info.max_num_seqs == 8
    await blind.stop()


async def test_vllm_pins_a_request_to_the_rank_it_names_and_leaves_one_that_names_none_to_vllm() -> None:
    engine = dp_engine(2)
    await engine.start()
    try:
        await collect(engine.generate(ranked("a", 1)))
        await collect(engine.generate(ranked("b", None)))
        await collect(engine.generate(ranked("c", 0)))
        assert engine._engine.ranks == [1, None, 0]
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("size", "dp_rank"),
    [
        pytest.param(2, 2, id="past-the-last-rank"),
        pytest.param(2, -1, id="negative"),
        pytest.param(1, 1, id="rank-blind-engine"),
    ],
)
async def test_vllm_refuses_a_rank_it_does_not_serve_naming_dp_rank(size: int, dp_rank: int) -> None:
    engine = dp_engine(size)
    await engine.start()
    try:
        with pytest.raises(RequestError, match=f"dp_rank {dp_rank}") as caught:
            await collect(engine.generate(ranked("x", dp_rank)))
        assert caught.value.param == "dp_rank" and engine._engine.calls == []
    finally:
        await engine.stop()


async def test_vllm_reports_each_ranks_load_from_the_dp_coordinators_counts() -> None:
    engine = dp_engine(2)
    await engine.start()
    try:
        engine._engine.engine_core.lb_engines = [[1, 2, 0.5], [0, 1, 0.25]]  # [waiting, running, KV usage]
        load = engine.load_metrics()
        assert load.ranks == [
            RankLoad(dp_rank=0, num_running=2, num_waiting=1, active_blocks=25, total_blocks=50),
            RankLoad(dp_rank=1, num_running=1, num_waiting=0, active_blocks=12, total_blocks=50),
        ]
        assert (load.num_waiting, load.active_blocks, load.total_blocks) == (1, 37, 100)
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        pytest.param({"data_parallel_size": 0}, "positive integer", id="zero-ranks"),
        pytest.param({"data_parallel_size": 2, "data_parallel_rank": 1}, "internal load balancing", id="external-lb"),
        pytest.param({"data_parallel_size": 2, "nnodes": 2}, "--nnodes", id="nnodes-as-an-engine-arg"),
    ],
)
def test_vllm_data_parallel_settings_it_cannot_map_are_config_errors(extra: dict[str, Any], match: str) -> None:
    group = LEADER if "nnodes" in extra else NodeGroup()
    with pytest.raises(ConfigError, match=match):
        VllmEngine(EngineArgs(model="m", extra=extra, group=group), library=DP_VLLM)


##### The relay: every rank's publisher, one stream #####


def payload(events: list[Any], dp_rank: int | None) -> bytes:
    """What vLLM's publisher of rank `dp_rank` sends (`EventBatch` omits a rank of None)."""
    return msgspec.msgpack.encode([1.0, events] + ([] if dp_rank is None else [dp_rank]))


async def test_the_relay_reads_each_ranks_publisher_into_one_stream_numbered_per_worker_and_stamped() -> None:
    relay = ZmqKvRelay("kv", num_ranks=2)
    endpoint = relay.bind()
    publishers = [zmq.Context.instance().socket(zmq.PUB) for _ in range(2)]
    for rank, publisher in enumerate(publishers):  # vLLM's rank r connects to the endpoint's port + r
        publisher.connect(rank_endpoint(endpoint, rank))
    relay.start()
    stored = ["BlockStored", [7, 8], None, TOKENS[:32], 16, None, "GPU"]  # the same blocks on both ranks
    batches, numbers = relay.batches(), [itertools.count(), itertools.count()]

    def seq(rank: int) -> bytes:  # each publisher numbers its batches from 0 (a number seen again is a repeat)
        return next(numbers[rank]).to_bytes(8, "big")

    try:
        async with asyncio.timeout(5):
            first = asyncio.ensure_future(anext(batches))  # type: ignore[call-overload]
            while not first.done():  # a SUB socket joins late: publish until it hears
                publishers[1].send_multipart([b"kv", seq(1), payload([stored], 1)])
                await asyncio.sleep(0.02)
            got = [first.result()]
            await asyncio.sleep(0.1)  # the repeats still in flight
            while not relay._queue.empty():
                got.append(await anext(batches))  # type: ignore[call-overload]
            publishers[0].send_multipart([b"kv", seq(0), payload([stored], None)])  # no rank: the socket's
            publishers[1].send_multipart([b"kv", seq(1), payload([["BlockRemoved", [7]]], 1)])
            rank0 = await anext(batches)  # type: ignore[call-overload]
            removed = await anext(batches)  # type: ignore[call-overload]
    finally:
        for publisher in publishers:
            publisher.close(linger=0)
        await relay.close()
    ours = sequence_hashes(TOKENS[:32], 16)
    assert got[0].dp_rank == 1 and [b.block_hash for b in got[0].events[0].blocks] == ours
    assert [b.event_id for b in [*got, rank0, removed]] == list(range(len(got) + 2))  # one numbering, no gaps
    assert rank0.dp_rank == 0 and isinstance(rank0.events[0], BlockStored)  # rank 0's own translation
    assert removed.dp_rank == 1 and removed.events == [BlockRemoved(block_hashes=[ours[0]])]
    assert len(relay.rehashers[0]) == 2 and len(relay.rehashers[1]) == 1  # rank 1's removal left rank 0's alone


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        pytest.param("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557", id="rank-0"),
        pytest.param("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560", id="port-plus-rank"),
        pytest.param("tcp://*:0", 1, "tcp://*:0", id="port-0-left-to-the-os"),
        pytest.param("inproc://kv", 2, "inproc://kv_dp2", id="inproc"),
    ],
)
def test_a_ranks_endpoint_is_derived_as_vllm_and_sglang_derive_it(endpoint: str, rank: int, expected: str) -> None:
    assert rank_endpoint(endpoint, rank) == expected


def test_a_users_binding_publisher_is_connected_to_at_each_ranks_port() -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "t"}
    engine = dp_engine(2, kv_events_config=config)
    assert engine._relay is not None and len(engine._relay.rehashers) == 2


##### vLLM: a group of nodes #####


def test_vllm_a_node_group_maps_to_nnodes_node_rank_master_addr_and_the_mp_executor() -> None:
    kwargs = VllmEngine(EngineArgs(model="m", group=LEADER), library=DP_VLLM).engine_kwargs
    assert {key: kwargs[key] for key in ("nnodes", "node_rank", "master_addr", "distributed_executor_backend")} == {
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "10.0.0.1",
        "distributed_executor_backend": "mp",
    }
    assert "master_port" not in kwargs  # vLLM's 29501 unless the options give one, the same on every node
    assert "nnodes" not in VllmEngine(EngineArgs(model="m"), library=DP_VLLM).engine_kwargs


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        pytest.param({"data_parallel_size": 2}, "across nodes", id="data-parallel-across-nodes"),
        pytest.param({"distributed_executor_backend": "ray"}, "mp executor", id="ray"),
    ],
)
def test_vllm_node_group_settings_it_cannot_map_are_config_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        VllmEngine(EngineArgs(model="m", extra=extra, group=LEADER), library=DP_VLLM)


class FakeExecutor:
    """Stands for vLLM's MultiprocExecutor: `start_worker_monitor(inline=True)` blocks until its workers end."""

    made: list[FakeExecutor] = []

    def __init__(self, vllm_config: Any, monitor_workers: bool) -> None:
        self.vllm_config = vllm_config
        self.monitor_workers = monitor_workers
        self.workers_ended = threading.Event()
        self.is_shut_down = False
        self.killed: list[str] = []
        self.workers = [SimpleNamespace(proc=SimpleNamespace(kill=lambda: self.killed.append("worker")))]
        FakeExecutor.made.append(self)

    def start_worker_monitor(self, inline: bool = False) -> None:
        assert inline
        self.workers_ended.wait(10)

    def shutdown(self) -> None:
        self.is_shut_down = True
        self.workers_ended.set()


HEADLESS = HeadlessLibrary(DpEngineArgs, FakeExecutor, usage_context="api-server", is_cpu=True)


async def follower_executor(task: asyncio.Task[None]) -> FakeExecutor:
    FakeExecutor.made.clear()
    async with asyncio.timeout(5):
        while not FakeExecutor.made:
            assert not task.done(), task
            await asyncio.sleep(0.01)
    return FakeExecutor.made[0]


async def test_vllm_headless_starts_this_nodes_workers_with_the_leaders_configuration_until_cancelled() -> None:
    args = EngineArgs(model="m", block_size=32, extra={"tensor_parallel_size": 2, "master_port": 4000}, group=FOLLOWER)
    task = asyncio.ensure_future(run_headless(args, library=HEADLESS))
    executor = await follower_executor(task)
    config = executor.vllm_config
    assert (config.headless, config.usage_context, executor.monitor_workers) == (True, "api-server", False)
    leader = engine_kwargs(dataclasses.replace(args, group=LEADER), DpEngineArgs, is_cpu=True, has_lora=True)
    assert dataclasses.asdict(config.args) == dataclasses.asdict(DpEngineArgs(**{**leader, "node_rank": 1}))
    assert (config.args.dtype, config.args.master_port, config.args.kv_events_config) == ("float32", 4000, None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert executor.killed == ["worker"] and executor.is_shut_down  # killed: they ignore SIGTERM in a collective


async def test_vllm_headless_ends_with_an_error_when_its_workers_end() -> None:
    task = asyncio.ensure_future(run_headless(EngineArgs(model="m", group=FOLLOWER), library=HEADLESS))
    executor = await follower_executor(task)
    executor.workers_ended.set()  # a worker died, or the leader's engine stopped
    with pytest.raises(DynError, match="node 1's workers ended"):
        async with asyncio.timeout(5):
            await task


@pytest.mark.parametrize("name", ["vllm", "sglang"])
async def test_a_headless_part_refuses_the_leader_and_is_registered(name: str) -> None:
    with pytest.raises(ConfigError, match="follower's"):
        await load_headless(name)(EngineArgs(model="m", group=LEADER))


##### SGLang #####


class RankedSglangEngine(FakeSglangEngine):
    """`sglang.Engine` of a recent SGLang: `async_generate(..., routed_dp_rank=)`."""

    async def async_generate(self, routed_dp_rank: int | None = None, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        return await super().async_generate(**kwargs, **({} if routed_dp_rank is None else {"rank": routed_dp_rank}))


class OldSglangEngine(FakeSglangEngine):
    """`sglang.Engine` before the rename: `async_generate(..., data_parallel_rank=)`."""

    async def async_generate(  # type: ignore[override]
        self, data_parallel_rank: int | None = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        return await super().async_generate(
            **kwargs, **({} if data_parallel_rank is None else {"old": data_parallel_rank})
        )


async def test_sglang_data_parallel_size_is_attention_dp_over_the_tensor_parallel_ranks() -> None:
    engine = SglangEngine(EngineArgs(model="m", extra={"data_parallel_size": 2}), engine_cls=RankedSglangEngine)
    args = engine.server_args
    assert (args["dp_size"], args["enable_dp_attention"], args["tp_size"]) == (2, True, 2)
    assert "data_parallel_size" not in args
    assert engine._relay is not None and len(engine._relay.rehashers) == 2
    info = await engine.start()
    try:
        assert (info.extra["dp_start"], info.extra["dp_size"], info.total_kv_blocks) == (0, 2, 200)
        assert [rank.total_blocks for rank in engine.load_metrics().ranks] == [100, 100]
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("extra", "num_ranks"),
    [
        pytest.param({"dp_size": 2, "enable_dp_attention": True, "tp_size": 4}, 2, id="sglangs-own-attention-dp"),
        pytest.param({"dp_size": 2}, 1, id="replicas-publish-as-rank-0"),
    ],
)
def test_sglang_counts_attention_dp_ranks_only(extra: dict[str, Any], num_ranks: int) -> None:
    assert SglangEngine(EngineArgs(model="m", extra=extra), engine_cls=RankedSglangEngine).num_ranks == num_ranks


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        pytest.param({"data_parallel_size": 2, "tp_size": 3}, "must divide", id="tp-not-divisible"),
        pytest.param({"data_parallel_size": 2, "dp_size": 2}, "not both", id="given-twice"),
    ],
)
def test_sglang_data_parallel_settings_it_cannot_take_are_config_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SglangEngine(EngineArgs(model="m", extra=extra), engine_cls=RankedSglangEngine)


@pytest.mark.parametrize(
    ("engine_cls", "key"),
    [
        pytest.param(RankedSglangEngine, "rank", id="routed_dp_rank"),
        pytest.param(OldSglangEngine, "old", id="data_parallel_rank"),
    ],
)
async def test_sglang_pins_a_request_with_the_keyword_its_version_takes(engine_cls: Any, key: str) -> None:
    engine = SglangEngine(EngineArgs(model="m", extra={"data_parallel_size": 2}), engine_cls=engine_cls)
    await engine.start()
    try:
        await collect(engine.generate(ranked("a", 1)))
        await collect(engine.generate(ranked("b", None)))
        calls = engine._engine.calls
        assert calls[0][key] == 1 and key not in calls[1]
        with pytest.raises(RequestError, match="dp_rank 2") as caught:
            await collect(engine.generate(ranked("c", 2)))
        assert caught.value.param == "dp_rank"
    finally:
        await engine.stop()


def test_sglang_a_node_group_maps_to_nnodes_node_rank_and_dist_init_addr() -> None:
    args = SglangEngine(EngineArgs(model="m", group=LEADER), engine_cls=RankedSglangEngine).server_args
    assert (args["nnodes"], args["node_rank"], args["dist_init_addr"]) == (2, 0, "10.0.0.1:29500")
    own = EngineArgs(model="m", group=LEADER, extra={"dist_init_addr": "10.0.0.1:7000"})
    assert SglangEngine(own, engine_cls=RankedSglangEngine).server_args["dist_init_addr"] == "10.0.0.1:7000"


async def test_sglang_headless_starts_a_non_blocking_engine_and_shuts_it_down_with_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(sglang_headless.NON_BLOCKING_ENV, "1")  # restored after the test
    made: list[FakeSglangEngine] = []

    def build(**server_args: Any) -> FakeSglangEngine:
        assert sglang_headless.os.environ[sglang_headless.NON_BLOCKING_ENV] == "0"
        made.append(FakeSglangEngine(**server_args))
        return made[-1]

    args = EngineArgs(model="m", extra={"tp_size": 2, "bootstrap_host": "h"}, group=FOLLOWER)
    task = asyncio.ensure_future(sglang_headless.run_headless(args, engine_cls=build))
    async with asyncio.timeout(5):
        while not made:
            await asyncio.sleep(0.01)
    server_args = made[0].server_args
    assert (server_args["node_rank"], server_args["nnodes"], server_args["tp_size"]) == (1, 2, 2)
    assert "kv_events_config" not in server_args and "bootstrap_host" not in server_args
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made[0].is_shut_down


##### TensorRT-LLM #####


@dataclass
class FakeSchedulingParams:
    attention_dp_rank: int | None = None
    attention_dp_relax: bool | None = None


@dataclass
class DpLLM(FakeLLM):
    """`tensorrt_llm.LLM` with attention DP: `generate_async(scheduling_params=)`."""

    tensor_parallel_size: int = 1
    enable_attention_dp: bool = False
    scheduling: list[Any] = field(default_factory=list)

    def generate_async(self, *args: Any, scheduling_params: Any = None, **kwargs: Any) -> Any:
        self.scheduling.append(scheduling_params)
        return super().generate_async(*args, **kwargs)


DP_TRTLLM = dataclasses.replace(FAKE_TRTLLM, llm_cls=DpLLM, scheduling_params_cls=FakeSchedulingParams)


def stored_event(rank: int, event_id: int, tokens: list[int], block_hash: int) -> dict[str, Any]:
    block = {"block_hash": block_hash, "tokens": [{"token_id": t} for t in tokens]}
    data = {"type": "stored", "parent_hash": None, "blocks": [block]}
    return {"event_id": event_id, "attention_dp_rank": rank, "data": data}


async def test_trtllm_attention_dp_pins_with_scheduling_params_and_stamps_each_ranks_kv_events() -> None:
    args = EngineArgs(model="m", block_size=16, extra={"data_parallel_size": 2})
    engine = TrtllmEngine(args, library=DP_TRTLLM)
    assert (engine.llm_kwargs()["enable_attention_dp"], engine.llm_kwargs()["tensor_parallel_size"]) == (True, 2)
    assert "data_parallel_size" not in engine.llm_kwargs()
    info = await engine.start()
    try:
        assert (info.extra["dp_start"], info.extra["dp_size"]) == (0, 2)
        fake = engine._llm
        await collect(engine.generate(ranked("a", 1)))
        await collect(engine.generate(ranked("b", None)))
        assert fake.scheduling == [FakeSchedulingParams(attention_dp_rank=1, attention_dp_relax=False), None]
        with pytest.raises(RequestError, match="dp_rank 5"):
            await collect(engine.generate(ranked("c", 5)))
        # each rank numbers its own events; ours are one sequence, a batch per rank, stamped
        fake.kv_events += [stored_event(1, 0, TOKENS[:16], 9), stored_event(0, 0, TOKENS[:16], 9)]
        events = engine.kv_events()
        async with asyncio.timeout(5):
            batches: list[KvEventBatch] = [await anext(events), await anext(events)]  # type: ignore[call-overload]
    finally:
        await engine.stop()
    assert [(b.event_id, b.dp_rank) for b in batches] == [(0, 0), (1, 1)]
    assert all(b.events[0].blocks[0].block_hash == sequence_hashes(TOKENS[:16], 16)[0] for b in batches)


def test_trtllm_attention_dp_over_other_tensor_parallel_ranks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="one rank per tensor-parallel rank"):
        TrtllmEngine(
            EngineArgs(model="m", extra={"data_parallel_size": 2, "tensor_parallel_size": 4}), library=DP_TRTLLM
        )
    own = TrtllmEngine(
        EngineArgs(model="m", extra={"enable_attention_dp": True, "tensor_parallel_size": 4}), library=DP_TRTLLM
    )
    assert own.num_ranks == 4
