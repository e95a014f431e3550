"""TensorRT-LLM behind the Engine contract: its `LLM` API in-process, token ids in and out.

`dyn worker --engine trtllm --model DIR` builds `tensorrt_llm.LLM(model=DIR, **extra)`; `EngineArgs.extra`
passes straight through (`tensor_parallel_size`, `max_batch_size`, `max_num_tokens`, `max_seq_len`,
`backend`, ...). KV block reuse and the KV event buffer are switched on in `KvCacheConfig`; the events,
read with `LLM.get_kv_cache_events_async`, are re-hashed from their token ids with our block hashes.

Disaggregation is TensorRT-LLM's own (`DisaggregatedParams`, its cache transceiver; `--role prefill|decode`
turn on `cache_transceiver_config` backend DEFAULT unless given). Prefill: the prompt as a `context_only`
request, one token; TRT-LLM's `disaggregated_params` come back on the output, and everything its
generation side needs (ctx_request_id, opaque_state, draft tokens, dp rank, info endpoint) travels, packed
with msgpack, as the `TrtllmKv.opaque_state`: opaque to everyone but this adapter. Decode (prompt +
[first_token], the frontend has streamed the token): the prompt as a `generation_only` request with
`first_gen_tokens` [first_token]; TRT-LLM's generation side answers with that token first (the
context's first-token response), counted in its max_tokens, so the adapter asks for one more token and
drops it. A `--role both` engine treats a handle as a failed pull: it prefills prompt + [first_token].

LoRA (`--max-loras` > 0): `LLM(enable_lora=True, lora_config=LoraConfig(max_loras=N, max_cpu_loras=N))`, a
`lora_config` dict in the options merged over that. TensorRT-LLM loads an adapter at its first request, so
`load_lora` only checks the file (an HF PEFT folder, or a NeMo `.nemo` archive: `engines.lora_book`) and
registers its `LoRARequest(name, id, path)`, which each request of it then carries. NOTE: TensorRT-LLM's
serialized KV events leave out the blocks' `lora_id` (a TODO in its serializer), so an adapter's blocks are
published under the base model's hashes, as with SGLang; a version that sends `lora_id` (or `lora_name`) gets
them re-hashed with the adapter's seed.

Data-parallel ranks: `data_parallel_size=N` is TensorRT-LLM's attention DP (`enable_attention_dp` over N
tensor-parallel ranks, each with a KV cache of its own; `attention_dp`). A request's `dp_rank` is pinned with
`generate_async(scheduling_params=SchedulingParams(attention_dp_rank=r, attention_dp_relax=False))`; each KV
event names its `attention_dp_rank`, so each poll becomes a batch per rank. The load is sums only (TensorRT-LLM
reports no pool size here). Multi-node TensorRT-LLM runs under MPI (`mpirun` / `trtllm-llmapi-launch`): ranks
above 0 are MPI workers of the one `LLM`, not a process dyn starts, so the trtllm engine has no `dyn.headless` part.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dynamo_cli.engine import EngineArgs, EngineInfo, FinishReason, Role, check_request
from dynamo_cli.errors import ConfigError, DynError, EngineNotInstalled, RequestError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.handles import TrtllmKv
from dynamo_cli.wire import GenerateChunk, GenerateRequest, LoadMetrics

from ..adapter import checked_handle, local_or_hub, split_deterministic
from ..lora_book import LoadedLora, LoraBook
from ..vllm.kv_events import KvEventRehasher

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 32
"""TensorRT-LLM's and Dynamo's default `tokens_per_block`."""
EVENT_BUFFER_SIZE = 1024
_QUEUE_SIZE = 4096
FINISH_REASONS = {"stop": FinishReason.STOP.value, "length": FinishReason.LENGTH.value}
SCHEDULING_PARAMS_MODULES = ("tensorrt_llm.scheduling_params", "tensorrt_llm.llmapi")
LORA_CONFIG_MODULES = ("tensorrt_llm._torch.peft.lora.config", "tensorrt_llm.lora_helper", "tensorrt_llm.lora_manager")
"""Where TensorRT-LLM versions keep `LoraConfig`, the class its PyTorch `LlmArgs` names first."""


class ContextState(msgspec.Struct, frozen=True, kw_only=True):
    """TensorRT-LLM's context-phase `DisaggregatedParams` that its generation side needs: `TrtllmKv.opaque_state`."""

    ctx_request_id: int
    """The context request's id in the prefill engine; the generation request names it."""
    opaque_state: bytes | None = None
    """TensorRT-LLM's own opaque state (cache transceiver endpoints and layout)."""
    draft_tokens: list[int] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class TrtllmLibrary:
    """The TensorRT-LLM names this adapter uses; tests pass a fake of them to `TrtllmEngine`."""

    llm_cls: Any
    """`tensorrt_llm.LLM`: `generate_async(..., streaming=True)`, `get_kv_cache_events_async`, `shutdown`."""
    sampling_params_cls: Any
    kv_cache_config_cls: Any
    disaggregated_params_cls: Any = None
    """`DisaggregatedParams(request_type=..., first_gen_tokens=..., ctx_request_id=..., opaque_state=...)`."""
    cache_transceiver_config_cls: Any = None
    """`CacheTransceiverConfig(backend=...)`, the KV sender/receiver of a prefill or decode role; None on
    versions without it (they configure the transceiver from the environment)."""
    lora_config_cls: Any = None
    """`LoraConfig(max_loras=..., max_cpu_loras=..., max_lora_rank=...)`; None: a TensorRT-LLM without LoRA."""
    lora_request_cls: Any = None
    """`LoRARequest(lora_name, lora_int_id, lora_path, lora_ckpt_source=...)`: a request's adapter."""
    scheduling_params_cls: Any = None
    """`SchedulingParams(attention_dp_rank=..., attention_dp_relax=...)`: pins a request to an attention-DP rank;
    None: a TensorRT-LLM without it."""


def load_library() -> TrtllmLibrary:
    """Import TensorRT-LLM, or raise EngineNotInstalled naming `pip install 'dynamo-cli[trtllm]'`."""
    try:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.disaggregated_params import DisaggregatedParams
        from tensorrt_llm.llmapi import KvCacheConfig
    except ImportError as exc:
        raise EngineNotInstalled("trtllm", "tensorrt_llm", exc) from exc
    try:
        from tensorrt_llm.llmapi import CacheTransceiverConfig
    except ImportError:  # before 0.20
        CacheTransceiverConfig = None
    return TrtllmLibrary(
        LLM,
        SamplingParams,
        KvCacheConfig,
        DisaggregatedParams,
        CacheTransceiverConfig,
        lora_config_cls=_first_found(LORA_CONFIG_MODULES, "LoraConfig"),
        lora_request_cls=_first_found(("tensorrt_llm.executor.request", "tensorrt_llm.executor"), "LoRARequest"),
        scheduling_params_cls=_first_found(SCHEDULING_PARAMS_MODULES, "SchedulingParams"),
    )


def _first_found(modules: tuple[str, ...], name: str) -> Any:
    """`name` from the first of `modules` that has it; None when none does."""
    for module in modules:
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), name, None)
            if found is not None:
                return found
    return None


def trtllm_event_as_vllm(event: dict[str, Any], block_size: int) -> list[Any] | None:
    """One serialized TensorRT-LLM KV event in vLLM's positional form, for `KvEventRehasher`."""
    data = event.get("data", {})
    kind = data.get("type")
    if kind == "stored":
        blocks = data.get("blocks", [])
        hashes = [block["block_hash"] for block in blocks]
        tokens = [token["token_id"] for block in blocks for token in block["tokens"]]
        first = blocks[0] if blocks else {}  # one event's blocks are one request's: one adapter
        lora = [first.get("lora_id"), None, first.get("lora_name")]  # medium None: the device
        return ["BlockStored", hashes, data.get("parent_hash"), tokens, block_size, *lora]
    if kind == "removed":
        return ["BlockRemoved", list(data.get("block_hashes", []))]
    return None  # "created" and "updated" carry nothing the router indexes


class TrtllmEngine:
    """TensorRT-LLM's `LLM` in this process; one `generate_async` per `generate` call."""

    spawns_processes = True
    """The library runs the model in child processes: the worker's reaper stops them if it dies."""

    def __init__(self, args: EngineArgs, *, library: TrtllmLibrary | None = None) -> None:
        self.lib = library or load_library()
        self.role = args.role
        self.args, deterministic = split_deterministic(args)
        if deterministic:
            logger.warning("trtllm: deterministic=true has no TensorRT-LLM switch here; batching may change output")
        self.block_size = args.block_size or DEFAULT_BLOCK_SIZE
        self.model = local_or_hub(args.model)
        self.parallel, self.num_ranks = attention_dp(self.args.extra)
        if self.num_ranks > 1 and self.lib.scheduling_params_cls is None:
            raise ConfigError("this TensorRT-LLM has no SchedulingParams to pin a rank with; upgrade it, or run no DP")
        self._llm: Any = None
        self._info: EngineInfo | None = None
        self._loras = LoraBook("trtllm", args.max_loras, self._register_lora, self._drop_lora, takes_nemo=True)
        self.lora_config = self._lora_config()
        """`LoraConfig` (None: LoRA off), built here so a TensorRT-LLM without LoRA fails at construction."""
        self._rehashers = {rank: KvEventRehasher(self._loras.name_of) for rank in range(self.num_ranks)}
        """Attention-DP rank -> the translation of its engine hashes."""
        self._events: asyncio.Queue[KvEventBatch | None] = asyncio.Queue(_QUEUE_SIZE)
        self._next_event_id = 0
        self._pump: asyncio.Task[None] | None = None
        self._in_flight: dict[str, Any] = {}
        self._stopped = False

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LLM(...)`: ours, then `extra` verbatim."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "kv_cache_config": self.lib.kv_cache_config_cls(
                enable_block_reuse=True, event_buffer_max_size=EVENT_BUFFER_SIZE, tokens_per_block=self.block_size
            ),
        }
        if self.args.context_length:
            kwargs["max_seq_len"] = self.args.context_length
        if self.role is not Role.BOTH and self.lib.cache_transceiver_config_cls is not None:
            kwargs["cache_transceiver_config"] = self.lib.cache_transceiver_config_cls(backend="DEFAULT")
        kwargs.update({key: value for key, value in self.args.extra.items() if key != "data_parallel_size"})  # ours
        kwargs.update(self.parallel)
        if self.lora_config is not None:
            kwargs.update(enable_lora=True, lora_config=self.lora_config)
        return kwargs

    def _lora_config(self) -> Any:
        """`LoraConfig` holding `max_loras` adapters in GPU and CPU memory, the options' `lora_config` (a dict)
        over it, or theirs as given (an object); None when the worker serves no adapters."""
        if self.args.max_loras <= 0:
            return None
        if self.lib.lora_config_cls is None or self.lib.lora_request_cls is None:
            raise ConfigError("this TensorRT-LLM has no LoraConfig/LoRARequest; upgrade it, or serve no --lora")
        user = self.args.extra.get("lora_config")
        if user is not None and not isinstance(user, dict):
            return user
        fields = {"max_loras": self.args.max_loras, "max_cpu_loras": self.args.max_loras} | (user or {})
        return self.lib.lora_config_cls(**fields)

    ##### The Engine contract #####

    async def start(self) -> EngineInfo:
        """Load the model in a thread (minutes), then start pumping its KV events."""
        if self._info is not None:
            return self._info
        self._llm = await asyncio.to_thread(lambda: self.lib.llm_cls(**self.llm_kwargs()))
        self._info = self._engine_info()
        self._pump = asyncio.get_running_loop().create_task(self._pump_events(), name="trtllm-kv-events")
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream TensorRT-LLM's outputs; closing or cancelling the iterator aborts the request.
        Prefill role: context only, the handle on the last chunk. Decode role: see the module."""
        llm = self._admit(request)
        handle = checked_handle("trtllm", request, TrtllmKv) if self.role is Role.DECODE else None
        token_ids, params, disaggregated = self._request(request, handle)
        options = self._options(request)
        result = llm.generate_async(token_ids, sampling_params=params, streaming=True, **disaggregated, **options)
        self._in_flight[request.request_id] = result
        is_finished = False
        echo = [handle.first_token] if handle is not None else None
        try:
            is_first = True
            async for output in result:
                chunk = self._chunk(output, is_first)
                is_finished = chunk.finish_reason is not None
                if echo is not None and chunk.token_ids:
                    if chunk.token_ids[:1] == echo:
                        del chunk.token_ids[0]  # the generation side's first response is the context's token
                    echo = None
                if self.role is Role.PREFILL and chunk.finish_reason == FinishReason.LENGTH.value:
                    chunk.kv_transfer = self._handle(request, output)
                if chunk.token_ids or is_finished:
                    yield chunk
                    is_first = False
                if is_finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not is_finished:
                result.abort()
            raise
        finally:
            self._in_flight.pop(request.request_id, None)

    async def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """TensorRT-LLM's KV events with our hashes, in event-id order, until stop()."""
        while (batch := await self._events.get()) is not None:
            yield batch

    def load_metrics(self) -> LoadMetrics:
        """Requests in flight; TensorRT-LLM's queues live in its executor."""
        return LoadMetrics(
            num_running=len(self._in_flight), total_blocks=self._info.total_kv_blocks if self._info else 0
        )

    async def stop(self) -> None:
        """Abort every request, stop the event pump and shut the LLM down. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for result in list(self._in_flight.values()):
            result.abort()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        with contextlib.suppress(asyncio.QueueFull):
            self._events.put_nowait(None)

    ##### LoRA adapters #####

    async def load_lora(self, name: str, path: str) -> None:
        """Check the HF PEFT folder or `.nemo` file at `path` and register it under `name` (TensorRT-LLM loads
        it with its first request); RequestError (param "lora_path") naming what is wrong."""
        if self._llm is None or self._stopped:
            raise DynError("the trtllm engine is not running; call start() before load_lora()")
        max_rank = getattr(self.lora_config, "max_lora_rank", None)
        await self._loras.load(name, path, max_rank if isinstance(max_rank, int) else None)

    async def unload_lora(self, name: str) -> None:
        """Drop adapter `name` (TensorRT-LLM's own LoRA cache evicts it, least recently used). Idempotent."""
        await self._loras.unload(name)

    async def _register_lora(self, lora: LoadedLora) -> object:
        return self._lora_request(lora)  # its constructor checks the path exists

    async def _drop_lora(self, lora: LoadedLora) -> object:
        return None

    def _lora_request(self, lora: LoadedLora) -> Any:
        source = {} if lora.source == "hf" else {"lora_ckpt_source": lora.source}
        return self.lib.lora_request_cls(lora.name, lora.lora_id, lora.path, **source)

    def _options(self, request: GenerateRequest) -> dict[str, Any]:
        """`generate_async`'s adapter (`lora_request`) and rank (`scheduling_params`, not relaxed: the router chose)."""
        lora = self._loras.of(request)
        options = {} if lora is None else {"lora_request": self._lora_request(lora)}
        rank = request.dp_rank
        if rank is None or self.num_ranks == 1 and rank == 0:
            return options
        if not 0 <= rank < self.num_ranks:
            raise RequestError(
                f"dp_rank {rank} is not served by this worker (ranks 0..{self.num_ranks - 1}); send one of those, "
                "or none to let TensorRT-LLM pick",
                param="dp_rank",
            )
        pin = self.lib.scheduling_params_cls(attention_dp_rank=rank, attention_dp_relax=False)
        return options | {"scheduling_params": pin}

    ##### Disaggregation #####

    def _request(self, request: GenerateRequest, handle: TrtllmKv | None) -> tuple[list[int], Any, dict[str, Any]]:
        """Prompt ids, sampling params and `disaggregated_params` for this role and request."""
        if self.role is Role.PREFILL:
            sampling = msgspec.structs.replace(request.sampling, min_tokens=min(request.sampling.min_tokens, 1))
            one = msgspec.structs.replace(request, max_tokens=1, sampling=sampling)
            params = self.lib.disaggregated_params_cls(request_type="context_only")
            return list(request.token_ids), self.sampling_params(one), {"disaggregated_params": params}
        if handle is None:
            return list(request.token_ids), self.sampling_params(request), {}
        state = _context_state(handle)
        params = self.lib.disaggregated_params_cls(
            request_type="generation_only",
            first_gen_tokens=[handle.first_token],
            ctx_request_id=state.ctx_request_id,
            opaque_state=state.opaque_state,
            draft_tokens=state.draft_tokens,
            ctx_dp_rank=state.ctx_dp_rank,
            ctx_info_endpoint=state.ctx_info_endpoint,
        )
        min_tokens = request.sampling.min_tokens
        sampling = msgspec.structs.replace(request.sampling, min_tokens=min_tokens + 1 if min_tokens else 0)
        more = msgspec.structs.replace(request, max_tokens=request.max_tokens + 1, sampling=sampling)
        prompt = list(request.token_ids[: handle.num_tokens])
        return prompt, self.sampling_params(more), {"disaggregated_params": params}

    def _handle(self, request: GenerateRequest, output: Any) -> TrtllmKv | None:
        completion = output.outputs[0]
        params = getattr(completion, "disaggregated_params", None)
        first = list(getattr(params, "first_gen_tokens", None) or completion.token_ids[-1:])
        if params is None or params.ctx_request_id is None or not first:
            logger.warning("trtllm: %s: the context request returned no disaggregated_params", request.request_id)
            return None
        state = ContextState(
            ctx_request_id=int(params.ctx_request_id),
            opaque_state=params.opaque_state,
            draft_tokens=params.draft_tokens,
            ctx_dp_rank=getattr(params, "ctx_dp_rank", None),
            ctx_info_endpoint=getattr(params, "ctx_info_endpoint", None),
        )
        packed = msgspec.msgpack.encode(state)
        return TrtllmKv(num_tokens=len(request.token_ids), first_token=int(first[0]), opaque_state=packed)

    ##### Mapping to and from TensorRT-LLM #####

    def sampling_params(self, request: GenerateRequest) -> Any:
        """Our sampling fields as TensorRT-LLM `SamplingParams`, token ids only."""
        s = request.sampling
        return self.lib.sampling_params_cls(
            max_tokens=request.max_tokens,
            min_tokens=s.min_tokens or None,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else None,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            detokenize=False,
        )

    def _chunk(self, output: Any, is_first: bool) -> GenerateChunk:
        completion = output.outputs[0]
        reason = completion.finish_reason
        finish_reason = None
        if output.finished or reason is not None:
            finish_reason = FINISH_REASONS.get(str(reason), FinishReason.CANCELLED.value)
        num_cached = int(getattr(output, "cached_tokens", 0) or 0) if is_first else None
        return GenerateChunk(
            token_ids=list(completion.token_ids_diff), finish_reason=finish_reason, num_cached_tokens=num_cached
        )

    async def _pump_events(self) -> None:
        # NOTE: TensorRT-LLM buffers KV events in its executor; each poll drains what accumulated and
        # becomes one of our batches per attention-DP rank (each event names its `attention_dp_rank`), numbered in
        # one sequence. The poll's timeout ends an idle iteration, so the loop polls again.
        while True:
            raw: dict[int, list[Any]] = {}
            async for event in self._llm.get_kv_cache_events_async(timeout=1.0):
                converted = trtllm_event_as_vllm(event, self.block_size)
                if converted is not None:
                    raw.setdefault(int(event.get("attention_dp_rank") or 0), []).append(converted)
            if not self._put_ranks(raw):
                await asyncio.sleep(0.01)

    def _put_ranks(self, raw: dict[int, list[Any]]) -> int:
        """Queue one batch of our events per rank (`raw`: rank -> its events in vLLM's form); how many were queued."""
        num_put = 0
        for rank, rank_events in sorted(raw.items()):
            rehasher = self._rehashers.setdefault(rank, KvEventRehasher(self._loras.name_of))
            events = rehasher.convert(rank_events)
            if events:
                now = time.time()
                self._put(KvEventBatch(event_id=self._next_event_id, events=events, timestamp=now, dp_rank=rank))
                num_put += 1
        return num_put

    def _put(self, batch: KvEventBatch) -> None:
        try:
            self._events.put_nowait(batch)
        except asyncio.QueueFull:
            logger.warning("trtllm: KV event queue full (no consumer?); batch %d dropped", batch.event_id)
            return
        self._next_event_id += 1

    def _admit(self, request: GenerateRequest) -> Any:
        info, llm = self._info, self._llm
        if info is None or llm is None or self._stopped:
            raise DynError("the trtllm engine is not running; call start() before generate()")
        check_request(request, info.context_length, self._in_flight, info.vocab_size, info.images)
        return llm

    def _engine_info(self) -> EngineInfo:
        llm_args = getattr(self._llm, "args", None)
        max_seq_len = getattr(llm_args, "max_seq_len", None) or self.args.context_length or 4096
        return EngineInfo(
            model_name=self.args.served_model_name or Path(self.model).name,
            tokenizer_source=self.model,
            block_size=self.block_size,
            context_length=int(max_seq_len),
            total_kv_blocks=0,  # TensorRT-LLM sizes its pool from free memory and does not report it here
            max_num_seqs=int(getattr(llm_args, "max_batch_size", None) or 256),
            max_num_batched_tokens=int(getattr(llm_args, "max_num_tokens", None) or 8192),
            extra={"engine": "trtllm"} | ({"dp_start": 0, "dp_size": self.num_ranks} if self.num_ranks > 1 else {}),
        )


def attention_dp(extra: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """`LLM` keywords for TensorRT-LLM's attention DP and the ranks it runs: `data_parallel_size=N` (ours) is
    `enable_attention_dp` over N tensor-parallel ranks, each with a KV cache of its own (attention DP makes every
    tensor-parallel rank a data-parallel rank); the options' own `enable_attention_dp` counts their
    `tensor_parallel_size`. ConfigError for sizes that disagree."""
    size = extra.get("data_parallel_size")
    if size is None:
        tp_size = extra.get("tensor_parallel_size", 1)
        return {}, int(tp_size) if extra.get("enable_attention_dp") and isinstance(tp_size, int) else 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"trtllm option data_parallel_size must be a positive integer, got {size!r}")
    tp_size = extra.get("tensor_parallel_size", size)
    if tp_size != size:
        raise ConfigError(
            f"trtllm: attention DP runs one rank per tensor-parallel rank: tensor_parallel_size ({tp_size}) must be "
            f"data_parallel_size ({size}); drop one"
        )
    return {"tensor_parallel_size": size, "enable_attention_dp": size > 1}, size


def _context_state(handle: TrtllmKv) -> ContextState:
    """The generation side's params out of a handle, or RequestError naming kv_transfer."""
    try:
        return msgspec.msgpack.decode(handle.opaque_state, type=ContextState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        problem = f"kv_transfer opaque_state is not a TensorRT-LLM context state: {exc}"
        raise RequestError(problem, param="kv_transfer") from exc
