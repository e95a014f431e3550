"""SGLang behind the Engine contract: its offline `Engine` in-process, token ids in and out.

`dyn worker --engine sglang --model DIR` builds `sglang.Engine(**server_args)`; `EngineArgs.extra`
passes straight through to SGLang's `ServerArgs` (`tp_size`, `mem_fraction_static`, `dtype`, ...).
The adapter forces `skip_tokenizer_init` (token ids only) and `stream_output` (each streamed output
carries only the new tokens, as Dynamo's SGLang worker does), sets `page_size` to our block size, and
asks SGLang's ZMQ publisher (`kv_events_config`) for KV events, re-hashed by `engines.vllm.kv_events`
(SGLang's events are vLLM's wire format).

Disaggregation is SGLang's own: `--role prefill|decode` set `disaggregation_mode`, the transfer backend
(`nixl` unless `disaggregation_transfer_backend` says otherwise) and, for a prefill engine, a free
`disaggregation_bootstrap_port`, published as `EngineInfo.extra["bootstrap"]` ("host:port"; the host is
`bootstrap_host` from the options, else the host of `dist_init_addr`, else the worker's `--host`). Unlike vLLM and
TRT-LLM, the two halves run CONCURRENTLY: the frontend creates an `SglangKv` up front (this prefill
engine's bootstrap host and port, a random `bootstrap_room`, `num_tokens` = len(prompt), `first_token` -1
meaning "the decode side emits it") and sends the same bare prompt with it to both engines at once; they
meet in the prefill engine's bootstrap server. The prefill stream carries no tokens (its one token travels
with the KV) and ends with the handle; the decode stream carries every output token, the first included.
An SGLang decode engine cannot prefill, so a decode request without a handle is refused; a `--role both`
engine ignores a handle and serves the prompt itself.

LoRA (`--max-loras` > 0): `enable_lora`, `max_loras_per_batch`, and, unless the options give `lora_paths` or
their own, `max_lora_rank` 16 (vLLM's default) and `lora_target_modules` ["all"] (SGLang sizes its adapter
buffers at start). `load_lora` checks the PEFT folder (`engines.lora_book`), then
`Engine.async_load_lora_adapter(name, path)`; a request names its adapter in `lora_path`. NOTE: SGLang's KV
events name no adapter (its radix cache sends `lora_id` None, and its block hashes leave the adapter out), so
an adapter's blocks are published under the base model's hashes: with adapters in use, routers see an
SGLang worker's prefixes approximately (a base request may be credited an adapter's prefix; adapter requests
find none), and the events cannot be keyed by request (they name none).

Data-parallel ranks (`data_parallel_size=N`: SGLang's attention DP, engines.sglang.args) are the worker's routing
targets: a request's `dp_rank` goes to `async_generate(routed_dp_rank=...)`, the relay reads each rank's publisher
(port + rank, batches stamped `attn_dp_rank`), the load reports each rank's KV capacity (SGLang keeps its per-rank
counts in its scheduler processes: the counts are sums). A group of nodes (`dyn worker --nnodes`) maps to `nnodes`,
`node_rank`, `dist_init_addr`; the followers run engines.sglang.headless.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynamo_cli.engine import EngineArgs, EngineInfo, FinishReason, Role
from dynamo_cli.errors import DynError, EngineNotInstalled, RequestError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.handles import SglangKv
from dynamo_cli.wire import GenerateChunk, GenerateRequest, LoadMetrics

from ..adapter import RequestBook, free_port, split_deterministic
from ..lora_book import LoadedLora, LoraBook
from ..vllm.kv_events import ZmqKvRelay
from .args import num_ranks
from .args import server_args as sglang_server_args

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv-events"
FINISH_REASONS = {"stop": FinishReason.STOP.value, "length": FinishReason.LENGTH.value}
"""SGLang's `finish_reason.type` mapped to ours; "abort" and anything else mean cancelled."""
MAX_ROOM = 2**63 - 1
"""SGLang's bootstrap rooms are non-negative int64s."""
UNKNOWN_FIRST_TOKEN = -1
"""`SglangKv.first_token` when the decode engine emits the first token (always, with SGLang)."""


def load_engine_class() -> Any:
    """`sglang.Engine`, or EngineNotInstalled naming `pip install 'dynamo-cli[sglang]'`."""
    try:
        import sglang
    except ImportError as exc:
        raise EngineNotInstalled("sglang", "sglang", exc) from exc
    return sglang.Engine


class SglangEngine:
    """SGLang's offline engine in this process; `engine_cls` lets tests inject a fake of `sglang.Engine`."""

    spawns_processes = True
    """The library runs the model in child processes: the worker's reaper stops them if it dies."""

    def __init__(self, args: EngineArgs, *, engine_cls: Any = None) -> None:
        self.engine_cls = engine_cls or load_engine_class()
        self.rank_param = _rank_param(self.engine_cls)
        self.role = args.role
        self.bootstrap_host = str(args.extra.get("bootstrap_host") or "")
        self.advertise_host = args.host
        args = replace(args, extra={key: value for key, value in args.extra.items() if key != "bootstrap_host"})
        self.args, self.deterministic = split_deterministic(args)
        self._relay: ZmqKvRelay | None = None
        self._loras = LoraBook("sglang", args.max_loras, self._add_lora, self._remove_lora)
        self.server_args = self._server_args()
        self._engine: Any = None
        self._info: EngineInfo | None = None
        self._book = RequestBook("sglang")
        self._stopped = asyncio.Event()

    def _server_args(self) -> dict[str, Any]:
        server_args = sglang_server_args(self.args, deterministic=self.deterministic)
        self.num_ranks = num_ranks(server_args)
        server_args["kv_events_config"] = self._kv_events_config(server_args)
        if self.role is Role.PREFILL:
            server_args.setdefault("disaggregation_bootstrap_port", free_port())
            dist_host = str(server_args.get("dist_init_addr") or "").rpartition(":")[0].strip("[]")
            self.bootstrap_host = self.bootstrap_host or dist_host or self.advertise_host
        return server_args

    @property
    def bootstrap(self) -> tuple[str, int] | None:
        """A prefill engine's bootstrap server (host, port), where decode engines fetch its KV."""
        if self.role is not Role.PREFILL:
            return None
        return self.bootstrap_host, int(self.server_args["disaggregation_bootstrap_port"])

    def _kv_events_config(self, server_args: dict[str, Any]) -> str | None:
        # SGLang's publisher is vLLM's: it binds `tcp://*:port` and connects to `tcp://host:port`.
        config = server_args.get("kv_events_config")
        if config:  # the user's publisher binds its endpoint: subscribe to it
            parsed = json.loads(config) if isinstance(config, str) else dict(config)
            if parsed.get("publisher") == "zmq":
                self._relay = ZmqKvRelay(parsed.get("topic", ""), num_ranks=self.num_ranks)
                self._relay.connect(parsed.get("endpoint", "tcp://*:5557"))
            return json.dumps(parsed)
        if server_args.get("disable_radix_cache"):
            return None  # no prefix cache, no KV events
        self._relay = ZmqKvRelay(KV_EVENTS_TOPIC, num_ranks=self.num_ranks)
        endpoint = self._relay.bind(self.advertise_host if self.args.group.nnodes > 1 else "127.0.0.1")
        return json.dumps({"publisher": "zmq", "endpoint": endpoint, "topic": KV_EVENTS_TOPIC})

    ##### The Engine contract #####

    async def start(self) -> EngineInfo:
        """Start the KV event relay, then launch SGLang (scheduler subprocesses, model load) in a thread."""
        if self._info is not None:
            return self._info
        if self._relay is not None:
            self._relay.start()  # before the engine: its publisher connects while it starts
        self._engine = await asyncio.to_thread(lambda: self.engine_cls(**self.server_args))
        self._info = self._engine_info()
        logger.info("sglang: %s ready; page size %d", self._info.model_name, self._info.block_size)
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream SGLang's outputs; closing or cancelling the iterator aborts the SGLang request.
        With a handle, prefill and decode roles meet at its bootstrap room (see the module)."""
        engine = self._admit(request)
        handle = self._checked_handle(request)
        lora = self._loras.of(request)
        adapter = {} if lora is None else {"lora_path": lora.name}  # SGLang names a loaded adapter's lora_path
        rid = request.request_id
        self._book.in_flight.add(rid)
        is_finished = False
        try:
            stream = await engine.async_generate(
                input_ids=list(request.token_ids),
                sampling_params=self.sampling_params(request),
                stream=True,
                rid=rid,
                **self._request_kwargs(request, handle),
                **adapter,
            )
            is_first = True
            async for output in stream:
                chunk = self._chunk(request, output, is_first)
                is_finished = chunk.finish_reason is not None
                if self.role is Role.PREFILL and handle is not None:
                    chunk.token_ids = []  # the decode engine emits this token
                    chunk.kv_transfer = handle if is_finished else None
                if chunk.token_ids or is_finished:
                    if is_first and self.role is not Role.DECODE:  # a decode computes none of the prompt
                        self._book.count_prefill(request, chunk.num_cached_tokens or 0)
                    yield chunk
                    is_first = False
                if is_finished:
                    return
            is_finished = True
            yield GenerateChunk(token_ids=[], finish_reason=FinishReason.CANCELLED.value)
        except (asyncio.CancelledError, GeneratorExit):
            if not is_finished:
                engine.tokenizer_manager.abort_request(rid=rid)
            raise
        finally:
            self._book.in_flight.discard(rid)

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """SGLang's KV events with our hashes; nothing when the radix cache is disabled."""
        if self._relay is None:
            return self._no_events()
        return self._relay.batches()

    def load_metrics(self) -> LoadMetrics:
        """Requests in flight and prompt-token counters, and each rank's KV capacity (SGLang's queues live in its
        scheduler processes: no per-rank counts)."""
        return self._book.load(self._info, self.num_ranks)

    async def stop(self) -> None:
        """Abort every request, shut SGLang down and close the event relay. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        engine, self._engine = self._engine, None
        if engine is not None:
            for rid in list(self._book.in_flight):
                engine.tokenizer_manager.abort_request(rid=rid)
            await asyncio.to_thread(engine.shutdown)
        if self._relay is not None:
            await self._relay.close()

    ##### LoRA adapters #####

    async def load_lora(self, name: str, path: str) -> None:
        """Check the PEFT folder at `path`, then load it into SGLang under `name` (`async_load_lora_adapter`;
        the blocking `load_lora_adapter` in a thread on versions without it); RequestError (param "lora_path")
        naming what is wrong, SGLang's refusal included."""
        if self._engine is None or self._stopped.is_set():
            raise DynError("the sglang engine is not running; call start() before load_lora()")
        max_rank = self.server_args.get("max_lora_rank")
        await self._loras.load(name, path, max_rank if isinstance(max_rank, int) else None)

    async def unload_lora(self, name: str) -> None:
        """Free adapter `name` in SGLang (`async_unload_lora_adapter`; no request of it is in flight). Idempotent."""
        await self._loras.unload(name)

    async def _add_lora(self, lora: LoadedLora) -> object:
        engine = self._engine
        if getattr(engine, "async_load_lora_adapter", None) is not None:
            return await engine.async_load_lora_adapter(lora_name=lora.name, lora_path=lora.path)
        return await asyncio.to_thread(engine.load_lora_adapter, lora.name, lora.path)

    async def _remove_lora(self, lora: LoadedLora) -> object:
        engine = self._engine
        if engine is None:
            return None
        if getattr(engine, "async_unload_lora_adapter", None) is not None:
            return await engine.async_unload_lora_adapter(lora_name=lora.name)
        return await asyncio.to_thread(engine.unload_lora_adapter, lora.name)

    ##### Disaggregation #####

    def _checked_handle(self, request: GenerateRequest) -> SglangKv | None:
        """The request's bootstrap handle for a prefill or decode role (required there), else None."""
        if self.role is Role.BOTH:
            return None  # aggregated: the prompt is served here whatever came with it
        handle = request.kv_transfer
        if handle is None:
            doing = "prefill without a bootstrap room" if self.role is Role.PREFILL else "decode without a prefill"
            raise RequestError(
                f"the sglang {self.role.value} role cannot {doing}: SGLang's prefill and decode engines meet at a "
                "bootstrap room; send the request with an SglangKv handle, or to a --role both worker",
                param="kv_transfer",
            )
        if not isinstance(handle, SglangKv):
            raise RequestError(
                f"kv_transfer is a {type(handle).__name__} handle; the sglang engine takes only SglangKv",
                param="kv_transfer",
            )
        problem = _sglang_problem(handle, len(request.token_ids))
        if problem is not None:
            raise RequestError(problem, param="kv_transfer")
        if self.bootstrap is not None:  # a prefill engine serves the room at its own bootstrap server
            host, port = self.bootstrap
            handle = SglangKv(
                num_tokens=handle.num_tokens,
                first_token=UNKNOWN_FIRST_TOKEN,
                bootstrap_host=host,
                bootstrap_port=port,
                bootstrap_room=handle.bootstrap_room,
            )
        return handle

    def _request_kwargs(self, request: GenerateRequest, handle: SglangKv | None) -> dict[str, Any]:
        """`async_generate`'s rank (`routed_dp_rank`; `data_parallel_rank` before SGLang renamed it) and bootstrap."""
        rank = {} if request.dp_rank is None else {self.rank_param: self._checked_rank(request.dp_rank)}
        if handle is None:
            return rank
        return rank | {
            "bootstrap_host": handle.bootstrap_host,
            "bootstrap_port": handle.bootstrap_port,
            "bootstrap_room": handle.bootstrap_room,
        }

    ##### Mapping to and from SGLang #####

    def sampling_params(self, request: GenerateRequest) -> dict[str, Any]:
        """Our sampling fields as SGLang's sampling-params dict."""
        s = request.sampling
        if s.min_tokens > 0:  # SGLang needs its tokenizer (for the EOS id) to hold EOS back
            raise RequestError(
                "min_tokens is not supported by the sglang engine: it runs with skip_tokenizer_init, and SGLang "
                "then rejects min_new_tokens",
                param="min_tokens",
            )
        params: dict[str, Any] = {
            "max_new_tokens": 1 if self.role is Role.PREFILL else request.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "ignore_eos": s.ignore_eos,
            "stop_token_ids": list(s.stop_token_ids),
            "skip_special_tokens": False,
        }
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        return params

    def _chunk(self, request: GenerateRequest, output: dict[str, Any], is_first: bool) -> GenerateChunk:
        meta = output.get("meta_info", {})
        finish = meta.get("finish_reason")
        finish_reason = None
        if finish:
            kind = finish.get("type") if isinstance(finish, dict) else str(finish)
            finish_reason = FINISH_REASONS.get(str(kind), FinishReason.CANCELLED.value)
        num_cached = int(meta.get("cached_tokens") or 0) if is_first else None
        return GenerateChunk(
            token_ids=list(output.get("output_ids") or []), finish_reason=finish_reason, num_cached_tokens=num_cached
        )

    def _checked_rank(self, dp_rank: int) -> int:
        if not 0 <= dp_rank < self.num_ranks:
            raise RequestError(
                f"dp_rank {dp_rank} is not served by this worker (ranks 0..{self.num_ranks - 1}); send one of those, "
                "or none to let SGLang pick",
                param="dp_rank",
            )
        return dp_rank

    def _admit(self, request: GenerateRequest) -> Any:
        engine = self._engine
        self._book.admit(request, self._info, engine is not None and not self._stopped.is_set())
        return engine

    def _engine_info(self) -> EngineInfo:
        manager = self._engine.tokenizer_manager
        server_args = manager.server_args
        scheduler_info = getattr(self._engine, "scheduler_info", None) or {}
        page_size = int(server_args.page_size)
        max_total_tokens = int(scheduler_info.get("max_total_num_tokens") or 0)
        model_path = str(self.server_args["model_path"])
        return EngineInfo(
            model_name=self.args.served_model_name or Path(model_path).name,
            tokenizer_source=str(self.args.extra.get("tokenizer_path") or model_path),
            block_size=page_size,
            context_length=int(manager.model_config.context_len),
            total_kv_blocks=max_total_tokens // page_size * self.num_ranks,  # each rank's pool, the same size
            max_num_seqs=int(getattr(server_args, "max_running_requests", None) or 256),
            max_num_batched_tokens=int(getattr(server_args, "chunked_prefill_size", None) or 8192),
            vocab_size=int(getattr(manager.model_config, "vocab_size", 0) or 0),
            extra=self._info_extra(),
        )

    def _info_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"engine": "sglang"}
        if self.num_ranks > 1:
            extra.update(dp_start=0, dp_size=self.num_ranks)
        if self.bootstrap is not None:
            host, port = self.bootstrap
            extra["bootstrap"] = f"{host}:{port}"
        return extra

    async def _no_events(self) -> AsyncIterator[KvEventBatch]:
        await self._stopped.wait()
        return
        yield  # an async generator that ends at stop()


def _rank_param(engine_cls: Any) -> str:
    """The keyword `async_generate` pins a rank with: `routed_dp_rank`, else (older SGLang) `data_parallel_rank`."""
    try:
        parameters = inspect.signature(engine_cls.async_generate).parameters
    except (AttributeError, TypeError, ValueError):
        return "data_parallel_rank"
    return "routed_dp_rank" if "routed_dp_rank" in parameters else "data_parallel_rank"


def _sglang_problem(handle: SglangKv, num_request_tokens: int) -> str | None:
    """What is wrong with a bootstrap handle for a bare-prompt request (None: nothing)."""
    if handle.first_token != UNKNOWN_FIRST_TOKEN:
        return "kv_transfer names a first token; SGLang's decode engine emits it: send -1 and the bare prompt"
    if handle.num_tokens != num_request_tokens:
        return f"kv_transfer covers {handle.num_tokens} tokens of a {num_request_tokens}-token prompt, not all"
    if not 0 <= handle.bootstrap_room <= MAX_ROOM:
        return f"kv_transfer bootstrap_room {handle.bootstrap_room} is outside 0..2**63-1"
    if not 0 < handle.bootstrap_port < 65536 or not 0 < len(handle.bootstrap_host) <= 255:
        return f"kv_transfer bootstrap address {handle.bootstrap_host!r}:{handle.bootstrap_port} is not a host:port"
    return None
