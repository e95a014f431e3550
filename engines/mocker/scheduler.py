"""A vLLM-style continuous-batching pass over simulated requests, as Dynamo's mocker runs it.

Each pass has a token budget. Running requests are served first (a decoding request needs 1 token, a
prefilling one the rest of its prompt, chunked to the budget), then waiting requests are admitted in
arrival order. A prefix found in the KV cache counts as computed when a request is first scheduled;
a request whose KV came from a prefill worker joins with its prompt computed, taking none of the budget.
When a running request cannot get a block, the newest running request is preempted (LIFO, as vLLM
v1; `preemption_mode` fifo: the oldest): its blocks are freed and it goes back to the front of the queue
to be recomputed. Every request whose tokens are all computed emits one token at the end of the pass;
the decode term of the pass's time counts only the requests decoding (a prompt finished this pass emits
its first token for free), as Dynamo 1.6.1's core does. Pure and deterministic: token ids come from a
per-request RNG, time from `TimingModel`. The options that keep dyn's earlier rules: docs/guides/mocker.md.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dynamo_cli.kv.hashing import HASH_SEED, hash_blocks
from dynamo_cli.timing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, TimingModel

from .kv_manager import KvManager

TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 2000
_TOKEN_ID_SPAN = TOKEN_ID_HIGH - TOKEN_ID_LOW


class MockRequest:
    """One simulated sequence: prompt plus the tokens generated so far."""

    __slots__ = (
        "request_id",
        "token_ids",
        "prompt_len",
        "max_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "num_cached_tokens",
        "is_prefilled",
        "seq_hashes",
        "local_hashes",
        "hash_seed",
        "encode_ms",
        "retain_s",
        "retain_key",
        "_rng",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        block_size: int,
        seed: int | None = None,
        is_prefilled: bool = False,
        hash_seed: int = HASH_SEED,
        num_generated: int = 0,
    ) -> None:
        """`num_generated`: tokens an earlier hop of the request drew (a migration, a pause, a remote prefill):
        a seeded request draws on from where it stopped, so its output is the same however it was cut."""
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.prompt_len = len(self.token_ids)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None  # set at first schedule
        self.is_prefilled = is_prefilled  # disagg: the prompt's KV came from a prefill worker
        self.seq_hashes: list[int] = []
        self.local_hashes: list[int] = []
        self.hash_seed = hash_seed
        """Its blocks' token-local hash seed: its LoRA adapter's (`lora_seed`), else the base model's."""
        self.encode_ms = 0.0
        """Vision encoder time its images still owe (images.py): added to the pass that first schedules it."""
        self.retain_s = 0.0
        self.retain_key = ""
        """Its blocks stay pinned `retain_s` after it ends, for `retain_key`'s next request (agent sessions)."""
        self._rng = random.Random(seed)
        for _ in range(num_generated if seed is not None else 0):
            self._rng.random()
        self.extend_hashes(block_size)

    @property
    def is_finished(self) -> bool:
        """All `max_tokens` tokens were emitted."""
        return self.num_output_tokens >= self.max_tokens

    def extend_hashes(self, block_size: int) -> None:
        """Hash every full block not hashed yet (prompt blocks at creation, then generated ones)."""
        seq, local = self.seq_hashes, self.local_hashes
        for seq_hash, local_hash in hash_blocks(
            self.token_ids, block_size, start=len(seq), parent=seq[-1] if seq else None, seed=self.hash_seed
        ):
            seq.append(seq_hash)
            local.append(local_hash)

    def emit_token(self, block_size: int) -> int:
        """Draw the next output token, append it to the sequence and return it."""
        token = TOKEN_ID_LOW + int(self._rng.random() * _TOKEN_ID_SPAN)  # randrange's checks cost 3x: once a token
        self.token_ids.append(token)
        self.num_output_tokens += 1
        if len(self.token_ids) % block_size == 0:
            self.extend_hashes(block_size)
        return token


_Scheduled = list[tuple[MockRequest, int]]  # (request, tokens computed for it this pass)


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one pass did."""

    emitted: list[MockRequest]
    """Requests that got one token this pass (its id is `token_ids[-1]`), in schedule order."""
    finished: list[MockRequest]
    """Requests that emitted their last token this pass; their blocks are already released."""
    duration_ms: float
    """Simulated wall time of the pass."""
    num_prefill_tokens: int
    """Prompt tokens computed this pass (prefix-cache hits excluded)."""
    num_preempted: int
    """Running requests preempted this pass."""
    failed: list[tuple[MockRequest, str]] = field(default_factory=list)
    """Requests whose own data broke the pass (and why); they are dropped, their blocks freed, and
    every other request goes on."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits of the simulated engine."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most requests running at once."""
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """Token budget of one pass."""
    is_prefill_only: bool = False
    """Prefill role: passes have no decode time."""
    preemption_mode: str = "lifo"
    """Which running request gives its blocks back when one runs out: "lifo" the newest (vLLM v1, Dynamo's
    default), "fifo" the oldest."""
    decode_kv_input: str = "decoding_tokens"
    """The decode term's KV usage. "decoding_tokens" (Dynamo 1.6.1): the tokens of the requests decoding this
    pass over the cache's tokens, and no decode term when none decodes; "active_blocks" (dyn before issue 35):
    the blocks referenced over the cache's blocks, in every pass that emits a token."""
    retain_blocks: int = 0
    """Blocks that finished requests may keep pinned for their sessions' next calls (0: none)."""
    prefilled_admission: str = "materialized"
    """A request whose KV came from a prefill worker. "materialized" (Dynamo 1.6.1): it joins with every token
    computed, takes none of the token budget and emits in its first pass; "prompt" (dyn before issue 35): it
    takes len(prompt) + 1 tokens of the budget, chunked like a prompt, though it computes none."""


class Scheduler:
    """Waiting and running queues over a `KvManager`; `step()` runs one pass."""

    __slots__ = (
        "kv",
        "config",
        "timing",
        "waiting",
        "running",
        "num_prefill_tokens_computed",
        "num_prefill_tokens_cached",
        "clock",
    )

    def __init__(self, kv: KvManager, config: SchedulerConfig, timing: TimingModel) -> None:
        self.clock: Callable[[], float] = time.monotonic
        """When pinned blocks are due (retained requests)."""
        self.kv = kv
        self.config = config
        self.timing = timing
        self.waiting: deque[MockRequest] = deque()
        self.running: list[MockRequest] = []
        self.num_prefill_tokens_computed = 0
        self.num_prefill_tokens_cached = 0

    @property
    def has_work(self) -> bool:
        """Whether a pass would do anything."""
        return bool(self.running or self.waiting)

    def add(self, request: MockRequest) -> None:
        """Queue a request behind those already waiting."""
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks at once; False if unknown."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.kv.free(request_id)
                    return True
        return False

    def num_prompt_tokens_left(self) -> int:
        """Prompt tokens still to compute over every queued request (the router's prefill load)."""
        queued = [r for r in (*self.running, *self.waiting) if not r.is_prefilled]
        return sum(max(0, r.prompt_len - r.num_computed_tokens) for r in queued)

    def step(self) -> PassResult:
        """Run one pass: schedule, compute, emit one token per ready request, release finished ones."""
        budget = self.config.max_num_batched_tokens
        scheduled: _Scheduled = []
        if self.kv.num_pinned_blocks:
            self.kv.expire_pins(self.clock())
        budget, num_preempted = self._schedule_running(budget, scheduled)
        if num_preempted == 0:
            self._schedule_waiting(budget, scheduled)
        decoding, num_prefill_tokens = self._compute(scheduled)
        emitted, finished, failed = self._emit_tokens(scheduled)
        duration = self._duration_ms(num_prefill_tokens, decoding, emitted) + _encoding_ms(scheduled)
        self._release(finished + [request for request, _ in failed])
        return PassResult(emitted, finished, duration, num_prefill_tokens, num_preempted, failed)

    ##### Internals #####

    def _schedule_running(self, budget: int, scheduled: _Scheduled) -> tuple[int, int]:
        running, kv = self.running, self.kv
        num_preempted = 0
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + num_new
            while not kv.allocate(request.request_id, total, request.seq_hashes, request.local_hashes):
                victim_index = 0 if self.config.preemption_mode == "fifo" else len(running) - 1
                victim = running.pop(victim_index)
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
                if victim_index < index:  # fifo: an older request scheduled this pass gives its tokens back
                    index -= 1
                    budget += self._unschedule(victim, scheduled)
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1
        return budget, num_preempted

    def _schedule_waiting(self, budget: int, scheduled: _Scheduled) -> None:
        waiting, running, kv = self.waiting, self.running, self.kv
        max_num_seqs = self.config.max_num_seqs
        is_materialized = self.config.prefilled_admission == "materialized"
        while waiting and len(running) < max_num_seqs:
            request = waiting[0]
            if budget == 0 and not (request.is_prefilled and is_materialized):
                break  # its tokens wait for the next pass's budget; a materialized request needs none
            if request.num_computed_tokens == 0:
                self._apply_prefix_hits(request)
            num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + num_new
            if not kv.allocate(request.request_id, total, request.seq_hashes, request.local_hashes):
                kv.free(request.request_id)  # undo the prefix blocks taken: retry next pass
                request.num_computed_tokens = 0
                break
            waiting.popleft()
            if request.retain_key:  # its session's last call's pin: this request holds those blocks now
                kv.release_pin(request.retain_key)
            running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

    def _apply_prefix_hits(self, request: MockRequest) -> None:
        if request.is_prefilled:  # the prompt's KV was transferred: only the blocks need allocating
            is_materialized = self.config.prefilled_admission == "materialized"
            request.num_computed_tokens = len(request.token_ids) if is_materialized else 0
            if request.num_cached_tokens is None:
                request.num_cached_tokens = 0
            return
        # At least one token is always computed: the last one yields the logits for the next token.
        num_hits = self.kv.num_prefix_hits(request.seq_hashes)
        cached = min(num_hits * self.kv.block_size, len(request.token_ids) - 1)
        request.num_computed_tokens = cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
            self.num_prefill_tokens_cached += cached

    @staticmethod
    def _unschedule(request: MockRequest, scheduled: _Scheduled) -> int:
        for i, (other, num_new) in enumerate(scheduled):
            if other is request:
                del scheduled[i]
                return num_new
        return 0

    def _duration_ms(self, num_prefill_tokens: int, decoding: list[MockRequest], emitted: list[MockRequest]) -> float:
        """The pass's simulated time; `decoding` were told apart before computing, and only those that emitted count
        (a prefilled request chunked like a prompt, or one whose data failed, did not)."""
        kv, config = self.kv, self.config
        if config.is_prefill_only:
            return self.timing.pass_ms(num_prefill_tokens, 0, 0.0)
        if config.decode_kv_input == "active_blocks":
            return self.timing.pass_ms(num_prefill_tokens, len(emitted), kv.usage)
        emitting = {id(request) for request in emitted}
        decoding = [request for request in decoding if id(request) in emitting]
        num_tokens = sum(len(request.token_ids) - 1 for request in decoding)  # as before this pass's token
        return self.timing.pass_ms(num_prefill_tokens, len(decoding), num_tokens / (kv.num_blocks * kv.block_size))

    def _compute(self, scheduled: _Scheduled) -> tuple[list[MockRequest], int]:
        """Count the pass's tokens as computed; the requests that decoded (told apart before computing), and the
        prompt tokens computed."""
        decoding: list[MockRequest] = []
        num_prefill_tokens = 0
        for request, num_new in scheduled:
            if _is_decode(request, num_new):
                decoding.append(request)
            else:
                num_prefill_tokens += num_new
            request.num_computed_tokens += num_new
        self.num_prefill_tokens_computed += num_prefill_tokens
        return decoding, num_prefill_tokens

    def _emit_tokens(
        self, scheduled: _Scheduled
    ) -> tuple[list[MockRequest], list[MockRequest], list[tuple[MockRequest, str]]]:
        block_size = self.kv.block_size
        emitted: list[MockRequest] = []
        finished: list[MockRequest] = []
        failed: list[tuple[MockRequest, str]] = []
        for request, _ in scheduled:
            if request.num_computed_tokens < len(request.token_ids):
                continue  # prompt not fully computed yet (chunked prefill)
            try:
                request.emit_token(block_size)
            except Exception as exc:  # noqa: BLE001 - one request's data fails that request alone
                failed.append((request, f"{type(exc).__name__}: {exc}"))
                continue
            emitted.append(request)
            if request.num_output_tokens >= request.max_tokens:
                finished.append(request)
        return emitted, finished, failed

    def _release(self, finished: list[MockRequest]) -> None:
        if not finished:
            return
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]
        retain, until = self.config.retain_blocks, self.clock()
        for request in finished:
            if request.retain_s and retain:
                self.kv.retain(request.request_id, request.retain_key, until + request.retain_s, retain)
            else:
                self.kv.free(request.request_id)

    def _preempt(self, request: MockRequest) -> None:
        # Recompute: the generated tokens so far become part of the prompt to prefill again.
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.is_prefilled = False
        self.waiting.appendleft(request)


def _is_decode(request: MockRequest, num_new: int) -> bool:
    """Whether `num_new` tokens scheduled for `request` (before they are computed) are a decode step: its last
    token, after output tokens, or anything of a request whose prompt was computed on a prefill worker."""
    if request.is_prefilled:
        return True
    return num_new == 1 and request.num_output_tokens > 0 and request.num_computed_tokens == len(request.token_ids) - 1


def _encoding_ms(scheduled: list[tuple[MockRequest, int]]) -> float:
    """The vision encoder time owed by the requests of a pass (once: it is paid now)."""
    total = 0.0
    for request, _ in scheduled:
        if request.encode_ms:
            total, request.encode_ms = total + request.encode_ms, 0.0
    return total
