"""SGLang behind the Engine contract: its offline `Engine` in-process, token ids in and out.

`dyn worker --engine sglang --model DIR` builds `sglang.Engine(**server_args)`; `EngineArgs.extra`
passes straight through to SGLang's `ServerArgs` (`tp_size`, `mem_fraction_static`, `dtype`, ...).
The adapter forces `skip_tokenizer_init` (token ids only) and `stream_output` (each streamed output
carries only the new tokens, as Dynamo's SGLang worker does), sets `page_size` to our block size, and
asks SGLang's ZMQ publisher (`kv_events_config`) for KV events, re-hashed by `engines.vllm.kv_events`
(SGLang's events are vLLM's wire format).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynamo_cli.engine import EngineArgs, EngineInfo, FinishReason, GenerateChunk, GenerateRequest, LoadMetrics
from dynamo_cli.errors import EngineNotInstalled, RequestError
from dynamo_cli.kv.events import KvEventBatch
from engines.adapter import RequestBook, local_or_hub, require_role_both, split_deterministic
from engines.vllm.kv_events import ZmqKvRelay

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
KV_EVENTS_TOPIC = "kv-events"
FINISH_REASONS = {"stop": FinishReason.STOP.value, "length": FinishReason.LENGTH.value}
"""SGLang's `finish_reason.type` mapped to ours; "abort" and anything else mean cancelled."""


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
        require_role_both("sglang", args.role, "disaggregation needs SGLang's bootstrap server, not wired yet")
        self.args, self.deterministic = split_deterministic(args)
        self._relay: ZmqKvRelay | None = None
        self.server_args = self._server_args()
        self._engine: Any = None
        self._info: EngineInfo | None = None
        self._book = RequestBook("sglang")
        self._stopped = asyncio.Event()

    def _server_args(self) -> dict[str, Any]:
        args = self.args
        model = local_or_hub(args.model)
        server_args: dict[str, Any] = {"model_path": model, "page_size": args.block_size or DEFAULT_BLOCK_SIZE}
        if args.served_model_name:
            server_args["served_model_name"] = args.served_model_name
        if args.context_length:
            server_args["context_length"] = args.context_length
        server_args.update(args.extra)
        if self.deterministic:
            server_args["enable_deterministic_inference"] = True  # SGLang's batch-invariant ops
        server_args.update(skip_tokenizer_init=True, stream_output=True)
        server_args["kv_events_config"] = self._kv_events_config(server_args)
        return server_args

    def _kv_events_config(self, server_args: dict[str, Any]) -> str | None:
        # SGLang's publisher is vLLM's: it binds `tcp://*:port` and connects to `tcp://host:port`.
        config = server_args.get("kv_events_config")
        if config:  # the user's publisher binds its endpoint: subscribe to it
            parsed = json.loads(config) if isinstance(config, str) else dict(config)
            if parsed.get("publisher") == "zmq":
                self._relay = ZmqKvRelay(parsed.get("topic", ""))
                self._relay.connect(parsed.get("endpoint", "tcp://*:5557"))
            return json.dumps(parsed)
        if server_args.get("disable_radix_cache"):
            return None  # no prefix cache, no KV events
        self._relay = ZmqKvRelay(KV_EVENTS_TOPIC)
        return json.dumps({"publisher": "zmq", "endpoint": self._relay.bind(), "topic": KV_EVENTS_TOPIC})

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
        """Stream SGLang's outputs; closing or cancelling the iterator aborts the SGLang request."""
        engine = self._admit(request)
        rid = request.request_id
        self._book.in_flight.add(rid)
        is_finished = False
        try:
            stream = await engine.async_generate(
                input_ids=list(request.token_ids), sampling_params=self.sampling_params(request), stream=True, rid=rid
            )
            is_first = True
            async for output in stream:
                chunk = self._chunk(request, output, is_first)
                is_finished = chunk.finish_reason is not None
                if chunk.token_ids or is_finished:
                    if is_first:
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
        """Requests in flight and prompt-token counters (SGLang's queues live in its scheduler process)."""
        return self._book.load(self._info)

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

    ##### Mapping to and from SGLang #####

    def sampling_params(self, request: GenerateRequest) -> dict[str, Any]:
        """Our sampling fields as SGLang's sampling-params dict."""
        if request.min_tokens > 0:  # SGLang needs its tokenizer (for the EOS id) to hold EOS back
            raise RequestError(
                "min_tokens is not supported by the sglang engine: it runs with skip_tokenizer_init, and SGLang "
                "then rejects min_new_tokens",
                param="min_tokens",
            )
        params: dict[str, Any] = {
            "max_new_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k if request.top_k > 0 else -1,
            "ignore_eos": request.ignore_eos,
            "stop_token_ids": list(request.stop_token_ids),
            "skip_special_tokens": False,
        }
        if request.seed is not None:
            params["sampling_seed"] = request.seed
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
            total_kv_blocks=max_total_tokens // page_size,
            max_num_seqs=int(getattr(server_args, "max_running_requests", None) or 256),
            max_num_batched_tokens=int(getattr(server_args, "chunked_prefill_size", None) or 8192),
            vocab_size=int(getattr(manager.model_config, "vocab_size", 0) or 0),
            extra={"engine": "sglang"},
        )

    async def _no_events(self) -> AsyncIterator[KvEventBatch]:
        await self._stopped.wait()
        return
        yield  # an async generator that ends at stop()
