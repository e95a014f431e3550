"""The mocker engine: Dynamo's GPU-free simulated engine behind the `Engine` contract.

A step loop runs scheduler passes and sleeps each pass's simulated time, so tokens arrive with the
latency a real GPU worker would show (divided by the speedup ratio), KV blocks fill and evict as in a
paged cache, and the router sees the same KV events. It lets routing, planning and disaggregation be
measured at scale on one laptop.

It has no logits. Its card lists Feature.LOGPROBS and Feature.SCORE, both deterministic fakes: logprobs a
function of the token id, the chosen token always the most likely (`fake_logprobs`); a text pair's score the
share of its second half's distinct tokens that its first half has too (`overlap_score`), so a document that
repeats the query's words ranks above one that does not. Clients and the frontend's formatting are tested
without a model. Penalties, logit_bias and min_p it does not
fake: its card leaves them out and the frontend refuses them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator

from dynamo_cli.engine import EngineArgs, EngineInfo, Feature, FinishReason, Role, check_request, check_score_request
from dynamo_cli.errors import ConfigError, DynError, RequestError, RequestFailed
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.handles import KvHandle, SglangKv
from dynamo_cli.kv.hashing import blocks_needed, lora_seed
from dynamo_cli.kv.images import routed_tokens
from dynamo_cli.model.paths import model_display_name, model_vocab_size, resolve_model_path
from dynamo_cli.timing import TimingModel
from dynamo_cli.wire import (
    GenerateChunk,
    GenerateRequest,
    ImageInput,
    LoadMetrics,
    ScorePair,
    ScoreRequest,
    ScoreResponse,
    TokenLogprob,
)

from .config import MockerConfig
from .events import EventPacer, EventRing, EventSink
from .handoff import Handoff, bootstrap_address, pulled_handle, read_handle
from .images import ImageEncoder, image_spec
from .kv_manager import KvManager
from .scheduler import MockRequest, PassResult, Scheduler, SchedulerConfig
from .tiers import MockerTiers

logger = logging.getLogger(__name__)

WORK_COUNTERS = {
    "forward_passes": "passes run",
    "decode_only_passes": "passes that computed no prompt token",
    "prefill_tokens": "prompt tokens computed (prefix-cache hits and transferred KV excluded)",
    "first_tokens": "requests that got their first token here (a prompt computed on this worker)",
    "pass_seconds": "the passes' modelled time, after the speedup ratio",
    "pass_wall_seconds": "the passes' wall time, from scheduling to delivery: minus pass_seconds, the lateness",
    "preemptions": "running requests preempted",
    "lora_loads": "LoRA adapters loaded (at start, at run time, again after an eviction)",
    "images_encoded": "images the vision encoder ran on (images.py)",
    "image_cache_hits": "images found in the embedding cache (the encoder skipped)",
    "image_embeds_received": "images whose embeddings came from an encode worker (E/P/D; the encoder skipped)",
}
"""`work_counters()`: name -> meaning; docs/guides/mocker.md says how they tell prompts arriving in waves from
spread."""
MAX_CATCH_UP_S = 0.005
"""A busy loop that wakes this late starts the next pass at its nominal time, so the simulated clock
does not drift by the event loop's oversleep; later than that (a starved CPU) it starts afresh."""


class EngineState(enum.Enum):
    """Lifecycle of a MockerEngine."""

    CREATED = "created"  # configured; start() not called yet
    RUNNING = "running"  # the step loop runs passes
    STOPPED = "stopped"  # stop() called, or the step loop failed; no new requests


class _Stream:
    """Tokens of one request waiting for its consumer; several pile into one chunk if it lags."""

    __slots__ = ("request", "rendezvous", "token_ids", "finish_reason", "error", "waiter", "logprobs")

    def __init__(self, request: MockRequest, rendezvous: SglangKv | None, logprobs: int | None = None) -> None:
        self.request = request
        self.logprobs = logprobs
        """SamplingParams.logprobs: None, or the alternatives each (fake) logprob comes with."""
        self.rendezvous = rendezvous
        """A rendezvous prefill: its token travels with the KV, the stream ends with this handle alone."""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: DynError | None = None
        """Set when the engine failed this request alone: the consumer gets it raised."""
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def end(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason.value
        self.wake()

    def fail(self, error: DynError) -> None:
        self.error = error
        self.end(FinishReason.ERROR)


class MockerEngine:
    """Simulated engine; `EngineArgs.extra` keys are those of `MockerConfig` (speedup_ratio, …)."""

    def __init__(self, args: EngineArgs, config: MockerConfig | None = None, events: EventSink | None = None) -> None:
        """`config`: `args` read (`MockerConfig.from_args`); `events`: its KV batches' sink (a RankedMocker's)."""
        self.config = config = config if config is not None else MockerConfig.from_args(args)
        _check_one_rank(config)
        self.state = EngineState.CREATED
        self._kv = KvManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self._timing = TimingModel(config.speedup_ratio, config.decode_speedup_ratio)
        self._scheduler = Scheduler(
            self._kv,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                is_prefill_only=config.role is Role.PREFILL,
                preemption_mode=config.preemption_mode,
                decode_kv_input=config.decode_kv_input,
                prefilled_admission=config.prefilled_admission,
                retain_blocks=retain_blocks(config),
            ),
            self._timing,
        )
        self._tiers = (
            MockerTiers.for_mocker(config, args.kv_tiers, self._kv)
            if args.kv_tiers.enabled and config.enable_prefix_caching
            else None
        )
        self._streams: dict[str, _Stream] = {}
        self._events: EventSink = events if events is not None else EventRing()
        self._pacer = EventPacer(self._kv, self._events)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deadline: float | None = None  # when the current pass ends, in loop time
        self._info: EngineInfo | None = None
        self._counts = dict.fromkeys(WORK_COUNTERS, 0.0)
        self._images = ImageEncoder(config, self._counts)
        self._image_spec = image_spec(config)
        self._loras: set[str] = set()
        """LoRA adapters loaded (names only: an adapter changes no simulated token, only the block hashes)."""

    ##### The Engine contract #####

    async def start(self) -> EngineInfo:
        """Start the step loop; the model is only a tokenizer source, nothing is loaded."""
        if self._info is None:
            await asyncio.sleep(self.config.startup_time)
            self._info = engine_info(self.config)
        if self.state is EngineState.CREATED:
            # The engine owns its one loop task and cancels it in stop().
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mocker-step-loop")
            self.state = EngineState.RUNNING
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream exactly `max_tokens` random tokens (a prefill: see handoff.py); closing the iterator aborts it."""
        mock, handoff = self._admit(request)
        stream = _Stream(mock, handoff.rendezvous, request.sampling.logprobs)
        self._streams[request.request_id] = stream
        try:
            if handoff.wait_s > 0:  # the modelled KV transfer; closing the stream here ends it
                await asyncio.sleep(handoff.wait_s)
            if request.images and not mock.is_prefilled:  # the encoder's time goes into its first pass
                mock.encode_ms = await self._images.prepare(request.images)
            if self._tiers is not None and not mock.is_prefilled:
                await self._onboard(mock)
            if stream.finish_reason is None:  # stop() may have come during the transfer
                self._scheduler.add(mock)
                self._wakeup.set()
            async for chunk in self._chunks(stream):
                yield chunk
        finally:
            if self._streams.get(request.request_id) is stream:
                del self._streams[request.request_id]
            if stream.finish_reason is None:  # closed early: free the blocks now, not at the next pass
                self._scheduler.abort(request.request_id)

    async def encode_images(self, images: list[ImageInput]) -> tuple[list[bytes], int]:
        """`--role encode` (`EncodesImages`): each image's embeddings, and how many its embedding cache held."""
        if self.state is not EngineState.RUNNING:
            raise DynError(f"the mocker engine is {self.state.value}; call start() before encode_images()")
        return await self._images.encode_images(images)

    async def clear_kv_blocks(self) -> int:
        """`ClearsKv`: the cached blocks evicted, their BlockRemoved events published at once."""
        return self._pacer.clear_cache()

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """Each pair's `overlap_score` (`Scores`), at once: scoring takes no simulated time."""
        check_score_request(request, self.config.context_length, self._vocab_size())
        return ScoreResponse(scores=[overlap_score(pair) for pair in request.pairs])

    async def load_lora(self, name: str, path: str) -> None:
        """Load adapter `name` (`ServesLoras`): `lora_load_ms` over the speedup; any file stands for an adapter."""
        await asyncio.sleep(self.config.lora_load_ms / 1e3 / self.config.speedup_ratio)
        self._loras.add(name)
        self._counts["lora_loads"] += 1

    async def unload_lora(self, name: str) -> None:
        self._loras.discard(name)

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """Every KV cache change in event-id order, from the oldest batch kept, until stop()."""
        return self._events.subscribe()

    def load_metrics(self) -> LoadMetrics:
        """Queue lengths, KV blocks in use and prompt-token counters, as of now."""
        scheduler = self._scheduler
        return LoadMetrics(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            active_blocks=self._kv.num_active_blocks,
            total_blocks=self._kv.num_blocks,
            active_prefill_tokens=scheduler.num_prompt_tokens_left(),
            num_prefill_tokens_computed=scheduler.num_prefill_tokens_computed,
            num_prefill_tokens_cached=scheduler.num_prefill_tokens_cached,
            kv_tiers=self._tiers.stats if self._tiers is not None else None,
        )

    async def stop(self) -> None:
        """Cancel the step loop and end every open stream as cancelled. Idempotent."""
        self.state = EngineState.STOPPED
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._end_all(FinishReason.CANCELLED)
        self._pacer.flush()  # what short passes kept back
        self._events.close()

    ##### The step loop #####

    async def _run(self) -> None:
        # NOTE: one pass = schedule + compute + emit, as in Dynamo's mocker. The scheduler decides the
        # whole pass up front (pure); its KV events are published when the pass starts (or ends:
        # `kv_event_visibility`), its tokens are delivered when the pass's simulated time (polynomial
        # timing model) has elapsed. With nothing queued the loop waits on an event instead of spinning.
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wait_for_work()
                started = loop.time()
                result = self._scheduler.step()
                if self._tiers is not None:
                    self._tiers.after_pass()
                self._publish_events("pass_start", result.duration_ms)
                await self._sleep_pass(result.duration_ms)
                self._publish_events("pass_end", result.duration_ms)
                self._deliver(result)
                self._count_pass(result, loop.time() - started)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("mocker step loop failed; ending every stream with an error")
            self.state = EngineState.STOPPED
            self._end_all(FinishReason.ERROR)
            self._events.close()

    def _count_pass(self, result: PassResult, wall_s: float) -> None:
        counts = self._counts
        counts["forward_passes"] += 1
        counts["decode_only_passes"] += result.num_prefill_tokens == 0
        counts["prefill_tokens"] += result.num_prefill_tokens
        counts["first_tokens"] += sum(r.num_output_tokens == 1 and not r.is_prefilled for r in result.emitted)
        counts["pass_seconds"] += result.duration_ms / 1e3  # the timing model has divided by the speedup
        counts["pass_wall_seconds"] += wall_s
        counts["preemptions"] += result.num_preempted

    def work_counters(self) -> dict[str, float]:
        """`WORK_COUNTERS` since start (`CountsWork`)."""
        return dict(self._counts)

    async def _wait_for_work(self) -> None:
        if self._scheduler.has_work:
            return
        self._pacer.flush()  # what short passes left for later: nothing comes later while idle
        self._deadline = None  # idle: the next pass starts whenever work arrives
        self._wakeup.clear()
        while not self._scheduler.has_work:
            await self._wakeup.wait()
            self._wakeup.clear()

    def _publish_events(self, moment: str, pass_ms: float) -> None:
        if moment != self.config.kv_event_visibility:
            return
        self._pacer.after_pass(pass_ms)

    async def _sleep_pass(self, duration_ms: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = self._deadline
        if start is None or now - start > MAX_CATCH_UP_S:
            start = now
        self._deadline = deadline = start + duration_ms / 1000.0
        delay = deadline - now
        # sleep(0) still yields, so consumers run between passes even at a huge speedup ratio.
        await asyncio.sleep(delay if delay > 0 else 0)

    def _deliver(self, result: PassResult) -> None:
        streams = self._streams
        for request in result.emitted:
            stream = streams.get(request.request_id)
            if stream is None or stream.request is not request:
                continue  # aborted during the pass
            if stream.rendezvous is None:
                stream.token_ids.append(request.token_ids[-1])
            if request.num_output_tokens >= request.max_tokens:
                stream.finish_reason = FinishReason.LENGTH.value
            stream.wake()
        for request, reason in result.failed:
            logger.error("mocker: request %s failed alone: %s", request.request_id, reason)
            stream = streams.get(request.request_id)
            if stream is not None and stream.request is request:
                stream.fail(RequestFailed(request.request_id, reason))

    ##### Tiers #####

    async def _onboard(self, mock: MockRequest) -> None:
        """Bring the prompt's prefix up from host or disk (simulated time) before it is queued; a stream closed
        meanwhile leaves nothing behind."""
        assert self._tiers is not None
        start, below, seconds = self._tiers.plan(mock.seq_hashes)  # the prompt's full blocks, as admitted
        if below:
            await asyncio.sleep(seconds)
            await self._tiers.onboard(mock.seq_hashes, mock.local_hashes, start, len(below), seconds)

    ##### Requests #####

    def _admit(self, request: GenerateRequest) -> tuple[MockRequest, Handoff]:
        if self.state is not EngineState.RUNNING:
            raise DynError(f"the mocker engine is {self.state.value}; call start() before generate()")
        self._check_request(request)
        handoff = read_handle(self.config, self._timing, request)
        max_tokens = 1 if self.config.role is Role.PREFILL else request.max_tokens
        mock = MockRequest(
            request.request_id,
            routed_tokens(request.token_ids, request.images),  # its blocks hashed as the router hashes them
            max_tokens,
            self.config.block_size,
            seed=request.sampling.seed,
            is_prefilled=handoff.is_prefilled,
            hash_seed=lora_seed(request.lora),
            num_generated=request.num_generated,
        )
        mock.retain_s, mock.retain_key = request.retain_s, request.retain_key or request.request_id
        return mock, handoff

    def _check_request(self, request: GenerateRequest) -> None:
        check_request(request, self.config.context_length, self._streams, self._vocab_size(), self._image_spec)
        if request.lora and request.lora not in self._loras:
            raise RequestError(f"the LoRA adapter '{request.lora}' is not loaded on this worker", param="model")
        num_prompt = len(request.token_ids)
        num_blocks = blocks_needed(num_prompt + request.max_tokens, self.config.block_size)
        if num_blocks > self.config.num_gpu_blocks:
            raise RequestError(
                f"prompt ({num_prompt}) + max_tokens ({request.max_tokens}) needs {num_blocks} KV blocks "
                f"but the engine has {self.config.num_gpu_blocks}; lower max_tokens or shorten the prompt",
                param="max_tokens",
            )

    async def _chunks(self, stream: _Stream) -> AsyncIterator[GenerateChunk]:
        loop = asyncio.get_running_loop()
        is_first = True
        while True:
            if not stream.token_ids and stream.finish_reason is None:
                stream.waiter = loop.create_future()
                await stream.waiter
            token_ids, stream.token_ids = stream.token_ids, []
            if stream.error is not None:
                raise stream.error
            finish_reason = stream.finish_reason
            yield GenerateChunk(
                token_ids=token_ids,
                finish_reason=finish_reason,
                num_cached_tokens=stream.request.num_cached_tokens if is_first else None,
                kv_transfer=self._kv_handle(stream) if finish_reason == "length" else None,
                logprobs=None if stream.logprobs is None else [fake_logprobs(t, stream.logprobs) for t in token_ids],
            )
            if finish_reason is not None:
                return
            is_first = False

    def _kv_handle(self, stream: _Stream) -> KvHandle | None:
        if stream.rendezvous is not None:
            return stream.rendezvous
        if self.config.role is not Role.PREFILL:
            return None
        return pulled_handle(self.config, stream.request)

    def _end_all(self, reason: FinishReason) -> None:
        for request_id, stream in list(self._streams.items()):
            if stream.finish_reason is None:
                self._scheduler.abort(request_id)
            stream.end(reason)

    def _vocab_size(self) -> int:
        return self._info.vocab_size if self._info is not None else self.config.vocab_size


def overlap_score(pair: ScorePair) -> float:
    """The mocker's relevance of a pair: the share of the second half's distinct token ids found in the first."""
    second = set(pair.second)
    return len(second & set(pair.first)) / len(second)


def _check_one_rank(config: MockerConfig) -> None:
    if config.is_ranked:
        raise ConfigError(
            f"a MockerEngine is one rank, not data_parallel_size={config.data_parallel_size} from rank "
            f"{config.data_parallel_start_rank}; build the mocker with its entry point (load_engine('mocker'))"
        )


def engine_info(config: MockerConfig) -> EngineInfo:
    """What a mocker with these settings tells the worker (and through its card, the frontend) of itself."""
    tokenizer_source = resolve_model_path(config.model)
    return EngineInfo(
        model_name=config.served_model_name or model_display_name(config.model),
        tokenizer_source=tokenizer_source,
        block_size=config.block_size,
        context_length=config.context_length,
        total_kv_blocks=config.num_gpu_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        vocab_size=config.vocab_size or model_vocab_size(tokenizer_source),
        extra=_info_extra(config),
        # logprobs are fakes (see the module docstring); kv_retain pins a session's blocks for its next call
        features=frozenset({Feature.LOGPROBS, Feature.SCORE})
        | ({Feature.KV_RETAIN} if retain_blocks(config) else set()),
        images=image_spec(config),
    )


def retain_blocks(config: MockerConfig) -> int:
    """Blocks finished calls may keep pinned for their sessions (none without prefix caching)."""
    return int(config.kv_retain_fraction * config.num_gpu_blocks) if config.enable_prefix_caching else 0


def _info_extra(config: MockerConfig) -> dict[str, object]:
    extra: dict[str, object] = {"engine": "mocker", "speedup_ratio": config.speedup_ratio}
    extra["role"] = config.role.value
    extra["kv_bytes_per_block"] = config.kv_bytes_per_token * config.block_size  # the router's tier costs
    bootstrap = bootstrap_address(config)
    if bootstrap is not None:  # a rendezvous prefill: the frontend makes the SglangKv up front
        extra["bootstrap"] = bootstrap
    return extra


def fake_logprobs(token: int, top_n: int) -> TokenLogprob:
    """A made-up but consistent logprob for `token` (the mocker has no logits): -0.1 to -0.8 by token id,
    with `top_n` alternatives, the token itself first and the others (its neighbours' ids) one nat apart."""
    logprob = -0.1 * (1 + token % 8)
    top = [(token + i, logprob - i) for i in range(top_n)]
    return TokenLogprob(logprob=logprob, top=top)
