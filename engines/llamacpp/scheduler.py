"""Which sequences run in the next step, what they feed, and which KV blocks they hold.

Pure bookkeeping over llama.cpp sequence ids: no ctypes, no asyncio. The engine asks for a `StepPlan`,
runs it, and reports back how many tokens each sequence computed and what it sampled.

A sequence is the list `tokens` (prompt, then output) of which the first `num_computed` are in the KV
cache. Each step feeds `tokens[num_computed:]` (one token when decoding, a chunk when prefilling) and
samples when that reaches the end. Finished sequences keep their full blocks as a cached prefix (LRU,
evictable, those a waiting prompt will share last); a new prompt sharing full blocks with a running or
cached sequence gets them by `seq_cp`, which in llama.cpp's unified cache shares cells instead of
copying. Blocks are refcounted by
sequence hash, so `BlockStored` fires when a hash first enters the cache and `BlockRemoved` when the
last sequence holding it lets go. A sequence's blocks are hashed with its LoRA adapter's seed
(`Sequence.hash_seed`), so prefixes are shared within one adapter only; the plan names each sequence's
adapter (`StepPlan.loras`).

KV tiers (`offload=True`): evicting a cached prefix first exports its state (an `export` op before its
`rm`) and records a `PendingOffload` under that op's key; the engine cuts the state into blocks for the
tiered store off the step loop. A sequence may arrive with `kv_state` and `num_onboarded`: its prefix
came back from the store, is imported at admission and counts as cached prefill.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Any

from dynamo_cli.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, StoredBlock
from dynamo_cli.kv.hashing import blocks_needed, hash_blocks, lora_seed, sequence_hashes
from dynamo_cli.wire import GenerateRequest

from .kv_state import CheckedState
from .plan import MemoryOp, StepPlan


@dataclass(slots=True)
class Sequence:
    """One request's state inside the engine."""

    request: GenerateRequest
    tokens: list[int]
    """Prompt, then every sampled token."""
    num_prompt_tokens: int
    seq_id: int = -1
    """llama.cpp sequence id while running; -1 while waiting."""
    num_computed: int = 0
    """Leading tokens whose KV is in the cache."""
    num_cached_tokens: int = 0
    """Prompt tokens reused from the prefix cache at admission."""
    hashes: list[int] = field(default_factory=list)
    """Sequence hashes of the full blocks among the computed tokens."""
    sampler: Any = None
    kv_state: CheckedState | None = None
    """Disaggregation: the prefill worker's state for the first `num_imported` tokens, imported at admission."""
    num_imported: int = 0
    """Tokens whose KV came from a prefill worker (the prompt; the last token, the first the prefill
    sampled, is decoded here): neither computed nor cached prefill. 0 again after a preemption."""
    num_onboarded: int = 0
    """Leading prompt tokens whose KV `kv_state` brings back from the KV tiers (whole blocks); 0 again
    after a preemption or a second refused import (then recomputed)."""
    onboard_state: CheckedState | None = None
    """The onboarded state while its import is not yet confirmed (a refused one is tried once more)."""
    is_onboard_retried: bool = False
    token_hashes: list[int] = field(default_factory=list)
    """Sequence hashes of the full blocks of `tokens` when it had `num_hashed` tokens (a memo)."""
    num_hashed: int = -1

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def hash_seed(self) -> int:
        """The seed of its blocks' token-local hashes: its LoRA adapter's (`lora_seed`), so no prefix, cached
        block or KV event is shared across adapters, and the base model's hashes stay unseeded (1337)."""
        return lora_seed(self.request.lora)

    @property
    def num_prefill_left(self) -> int:
        """Prompt tokens still to compute here (none for an imported prompt)."""
        return 0 if self.num_imported else max(0, self.num_prompt_tokens - self.num_computed)


@dataclass(slots=True)
class CachedPrefix:
    """A finished sequence's full blocks, kept under its seq id for reuse."""

    num_tokens: int
    hashes: list[int]


@dataclass(frozen=True, slots=True)
class PendingOffload:
    """An evicted cached prefix whose exported state goes to the KV tiers."""

    hashes: list[int]
    """Sequence hashes of its full blocks, in order (block i covers positions i*bs..)."""
    local_hashes: list[int]
    """Each block's tokens-only hash."""


@dataclass(slots=True)
class Scheduled:
    """One sequence's part of a step."""

    seq: Sequence
    num_tokens: int
    is_sampled: bool


class Scheduler:
    """Admission, batch building, prefix cache and KV events of one llama.cpp context."""

    def __init__(
        self,
        *,
        block_size: int,
        capacity: int,
        max_num_seqs: int,
        max_cached: int,
        n_batch: int,
        max_cached_tokens: int | None = None,
        max_prefill_chunk: int | None = None,
        offload: bool = False,
    ):
        self.block_size = block_size
        self.capacity = capacity
        self.max_num_seqs = max_num_seqs
        self.n_batch = n_batch
        # Deterministic mode feeds prompts one token per step (1): every token's attention is then
        # computed as a decode step computes it, whether it was generated here or re-sent after migration.
        self.max_prefill_chunk = n_batch if max_prefill_chunk is None else max_prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cached: OrderedDict[int, CachedPrefix] = OrderedDict()
        self.max_cached = max_cached
        # Cached cells cost every step a little (the attention mask spans all used cells), so the
        # cache is bounded in tokens as well as in sequences.
        self.max_cached_tokens = capacity if max_cached_tokens is None else max_cached_tokens
        self.free_seq_ids = list(range(max_num_seqs + max_cached - 1, -1, -1))
        self.refcounts: dict[int, int] = {}
        self.events: list[KvEvent] = []
        self.pending_ops: list[MemoryOp] = []
        self.num_prefill_tokens_computed = 0
        self.num_prefill_tokens_cached = 0
        self.offload = offload
        """Export evicted cached prefixes for the KV tiers."""
        self.offloads: dict[int, PendingOffload] = {}
        """Export key → what its state holds, until the engine takes it."""
        self._next_key = 0
        self.held_below: Callable[[list[int]], bool] = lambda hashes: False
        """Whether the tiers already hold every block of a prefix (then its eviction exports nothing)."""
        self.local_hashes: dict[int, int] = {}
        """Sequence hash → tokens-only hash, for every block held (with offload on)."""

    ##### Public API #####

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_ops)

    def schedule(self) -> tuple[StepPlan, list[Scheduled]]:
        """Admit what fits, then build one batch: a token per decoding sequence, prefill chunks after."""
        self._admit()
        scheduled = self._build()
        plan = StepPlan(memory_ops=self.pending_ops)
        self.pending_ops = []
        for part in scheduled:
            seq = part.seq
            start = seq.num_computed
            plan.tokens.extend(seq.tokens[start : start + part.num_tokens])
            plan.positions.extend(range(start, start + part.num_tokens))
            plan.seq_ids.extend([seq.seq_id] * part.num_tokens)
            if seq.request.lora:
                plan.loras[seq.seq_id] = seq.request.lora
            if part.is_sampled:
                plan.logits_rows.append(len(plan.tokens) - 1)
                plan.samplers.append(seq.sampler)
                plan.logprobs.append(seq.request.sampling.logprobs)
        return plan, scheduled

    def commit(self, part: Scheduled) -> None:
        """The step computed `part`'s tokens: advance, count prefill work, store new full blocks."""
        seq = part.seq
        seq.onboard_state = None  # its import, if any, went through
        start = seq.num_computed
        seq.num_computed += part.num_tokens
        if not seq.num_imported:  # an imported prompt's last token is a decode step, not prefill
            self.num_prefill_tokens_computed += max(0, min(seq.num_computed, seq.num_prompt_tokens) - start)
        self._store_blocks(seq)

    def mark_imported(self, seq: Sequence) -> None:
        """The first `num_imported` tokens' KV comes with the state import (applied before this step's decode)."""
        seq.num_computed = seq.num_imported
        self._store_blocks(seq)

    def _mark_onboarded(self, seq: Sequence) -> None:
        """The prompt's first `num_onboarded` tokens come back from the KV tiers: cached prefill."""
        seq.num_computed = seq.num_cached_tokens = seq.num_onboarded
        self.num_prefill_tokens_cached += seq.num_onboarded
        self._store_blocks(seq)

    def retry_onboard(self, seq: Sequence) -> None:
        """llama.cpp refused an onboarded prefix: an import needs one contiguous run of free cells, which a
        cache fragmented by cached prefixes may lack although it has room. The first time, evict every
        cached prefix (with tiers on they go below, or are there already) and import it again; the second
        time, recompute it. Either way the sequence is freed and queued first."""
        self.running.remove(seq)
        self.num_prefill_tokens_cached -= seq.num_onboarded
        state = None if seq.is_onboard_retried else seq.onboard_state
        onboarded = seq.num_onboarded
        self._preempt(seq)
        seq.onboard_state = None
        if state is not None:
            seq.kv_state, seq.num_onboarded, seq.is_onboard_retried = state, onboarded, True
            while self.cached:
                self._evict_one()

    def forget_import(self, seq: Sequence) -> None:
        """llama.cpp refused `seq`'s state import: its blocks were never there, so none is kept or shared."""
        self._release(seq.hashes)
        seq.hashes = []

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of the running set now; keep its full blocks as a cached prefix if new."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id < 0:
            return
        seq_id, seq.seq_id = seq.seq_id, -1
        kept = len(seq.hashes) * self.block_size
        if kept == 0 or self._is_covered(seq.hashes) or self.max_cached == 0:
            self._drop(seq_id, seq.hashes)
            return
        self.pending_ops.append(MemoryOp("rm", seq_id, start=kept, end=-1))
        self.cached[seq_id] = CachedPrefix(kept, seq.hashes)
        while len(self.cached) > self.max_cached or self._num_cached_tokens() > self.max_cached_tokens:
            self._evict_one()

    def reset(self) -> list[Sequence]:
        """After a failed step: forget every sequence and cached prefix, clear the whole KV cache."""
        dropped = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        for seq in dropped:
            seq.seq_id, seq.hashes = -1, []
        self.cached.clear()
        self.free_seq_ids = list(range(self.max_num_seqs + self.max_cached - 1, -1, -1))
        self.refcounts.clear()
        self.local_hashes.clear()
        self.offloads.clear()
        self.events = [AllBlocksCleared()]
        self.pending_ops = [MemoryOp("clear", -1)]
        return dropped

    def drain_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    ##### Capacity #####

    def used_tokens(self) -> int:
        """KV cells in use, counted per sequence: an upper bound, since shared prefixes count twice."""
        running = sum(len(s.tokens) for s in self.running)
        return running + self._num_cached_tokens()

    def _num_cached_tokens(self) -> int:
        return sum(c.num_tokens for c in self.cached.values())

    def num_active_blocks(self) -> int:
        return sum(blocks_needed(len(s.tokens), self.block_size) for s in self.running)

    def _fits(self, needed: int) -> bool:
        return self.used_tokens() + needed <= self.capacity

    def _make_room(self, needed: int, spare: Set[int] = frozenset()) -> bool:
        """Evict cached prefixes, least recent first, all but `spare`, until `needed` more cells fit."""
        while not self._fits(needed):
            victim = next((s for s in self.cached if s not in spare), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict_one(self) -> None:
        """Evict the least recent cached prefix no waiting prompt will share (else the least recent)."""
        wanted = self._wanted()
        self._evict(next((s for s in self.cached if s not in wanted), next(iter(self.cached))))

    def _wanted(self) -> set[int]:
        """Cached prefixes that waiting prompts will share: evicted last, since a prompt whose prefix goes
        while it waits recomputes it (with tiers, the blocks are still on their way down)."""
        return {s for s in map(self._cached_source, self.waiting) if s >= 0}

    def _evict(self, seq_id: int) -> None:
        prefix = self.cached.pop(seq_id)
        if self.offload and prefix.hashes and not self.held_below(prefix.hashes):
            key, self._next_key = self._next_key, self._next_key + 1
            self.offloads[key] = PendingOffload(prefix.hashes, [self.local_hashes[h] for h in prefix.hashes])
            self.pending_ops.append(MemoryOp("export", seq_id, end=prefix.num_tokens, key=key))
        self._drop(seq_id, prefix.hashes)

    def is_exporting(self, hashes: set[int]) -> bool:
        """Whether an evicted prefix holding one of `hashes` waits for its export (the next step's)."""
        return any(h in hashes for pending in self.offloads.values() for h in pending.hashes)

    def take_offload(self, key: int) -> PendingOffload | None:
        """The pending offload an `export` op's state belongs to (None: gone in a reset)."""
        return self.offloads.pop(key, None)

    def device_match(self, hashes: list[int]) -> int:
        """Leading blocks of `hashes` a running or cached sequence holds (what `_reuse_prefix` would share)."""
        return self._best_holder(hashes, None)[1]

    def _best_holder(self, hashes: list[int], exclude: Sequence | None) -> tuple[int, int]:
        """(seq id, blocks) of the running or cached sequence sharing the longest prefix of `hashes`; (-1, 0): none."""
        candidates = [(s.seq_id, s.hashes) for s in self.running if s is not exclude]
        candidates += [(seq_id, c.hashes) for seq_id, c in self.cached.items()]
        best_src, best = -1, 0
        for src, held in candidates:
            n = _common_prefix(hashes, held)
            if n > best:
                best_src, best = src, n
        return best_src, best

    def _drop(self, seq_id: int, hashes: list[int]) -> None:
        self.pending_ops.append(MemoryOp("rm", seq_id, start=-1, end=-1))
        self.free_seq_ids.append(seq_id)
        self._release(hashes)

    ##### Admission and batching #####

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            source = self._cached_source(seq)
            needed = len(seq.tokens) + 1
            # NOTE: cells are counted per sequence, so a shared prefix counts twice until its cached
            # holder goes. The prefix this prompt will share is evicted last, and if it must go, only
            # after the prompt has shared it: evicted first, its blocks would be recomputed (or, with
            # tiers, be still on their way down).
            fits = self._fits(needed) or self._make_room(needed, self._wanted()) or self._make_room(needed, {source})
            if not fits and (source < 0 or not self._fits(needed - self.cached[source].num_tokens)):
                return
            if not self._take_seq_id(seq):
                return
            self.waiting.popleft()
            self.running.append(seq)
            if seq.kv_state is not None:
                state, seq.kv_state = seq.kv_state, None
                self.pending_ops.append(MemoryOp("import", seq.seq_id, state=state))
                if seq.num_onboarded:
                    seq.onboard_state = state
                    self._mark_onboarded(seq)
                else:
                    self.mark_imported(seq)
            else:
                self._reuse_prefix(seq)
            if not fits and source in self.cached:
                self._evict(source)

    def _cached_source(self, seq: Sequence) -> int:
        """The cached prefix `seq` would share (-1: none, or a running sequence holds more)."""
        if seq.kv_state is not None:
            return -1
        holder = self._best_holder(self._prompt_hashes(seq), seq)[0]
        return holder if holder in self.cached else -1

    def _take_seq_id(self, seq: Sequence) -> bool:
        if not self.free_seq_ids and self.cached:
            self._evict_one()
        if not self.free_seq_ids:
            return False
        seq.seq_id = self.free_seq_ids.pop()
        return True

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Share the longest run of full blocks a running or cached sequence holds (at least one
        prompt token is always computed, for its logits)."""
        best_src, best = self._best_holder(self._prompt_hashes(seq), seq)
        num_tokens = min(best * self.block_size, len(seq.tokens) - 1)
        if num_tokens <= 0:
            return
        if best_src in self.cached:
            self.cached.move_to_end(best_src)
        self.pending_ops.append(MemoryOp("cp", seq.seq_id, src_seq_id=best_src, end=num_tokens))
        seq.num_computed = num_tokens
        reused = min(num_tokens, seq.num_prompt_tokens)
        seq.num_cached_tokens = reused
        self.num_prefill_tokens_cached += reused
        self._store_blocks(seq)

    def _build(self) -> list[Scheduled]:
        decoding = [s for s in self.running if len(s.tokens) - s.num_computed == 1]
        if not (self._fits(0) or self._make_room(0, self._wanted()) or self._make_room(0)):
            self._preempt_newest()
            return self._build()
        scheduled = [Scheduled(s, 1, True) for s in decoding]
        budget = self.n_batch - len(scheduled)
        for seq in self.running:
            left = len(seq.tokens) - seq.num_computed
            if left <= 1 or budget <= 0:
                continue
            n = min(left, budget, self.max_prefill_chunk)
            scheduled.append(Scheduled(seq, n, n == left))
            budget -= n
        return scheduled

    def _preempt_newest(self) -> None:
        """Out of KV cells with no cached prefix left to evict: recompute the newest sequence later."""
        self._preempt(self.running.pop())

    def _preempt(self, seq: Sequence) -> None:
        self.pending_ops.append(MemoryOp("rm", seq.seq_id, start=-1, end=-1))
        self.free_seq_ids.append(seq.seq_id)
        self._release(seq.hashes)
        seq.seq_id, seq.num_computed, seq.hashes, seq.num_imported = -1, 0, [], 0
        seq.onboard_state = None
        if seq.num_onboarded:  # recomputed when admitted again
            seq.num_onboarded = seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)

    ##### Block hashes and events #####

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        """Its blocks' hashes, computed again only when it has grown (waiting prompts are asked often)."""
        if seq.num_hashed != len(seq.tokens):
            seq.token_hashes = sequence_hashes(seq.tokens, self.block_size, seed=seq.hash_seed)
            seq.num_hashed = len(seq.tokens)
        return seq.token_hashes

    def _store_blocks(self, seq: Sequence) -> None:
        new: list[StoredBlock] = []
        run_parent = seq.hashes[-1] if seq.hashes else None
        for parent, local in hash_blocks(
            seq.tokens,
            self.block_size,
            start=len(seq.hashes),
            parent=run_parent,
            num_tokens=seq.num_computed,
            seed=seq.hash_seed,
        ):
            seq.hashes.append(parent)
            self.refcounts[parent] = self.refcounts.get(parent, 0) + 1
            if self.offload:
                self.local_hashes[parent] = local
            if self.refcounts[parent] == 1:
                new.append(StoredBlock(parent, local))
                continue
            if new:
                self.events.append(BlockStored(parent_hash=run_parent, blocks=new))
                new = []
            run_parent = parent
        if new:
            self.events.append(BlockStored(parent_hash=run_parent, blocks=new))

    def _release(self, hashes: list[int]) -> None:
        removed = []
        for h in hashes:
            self.refcounts[h] -= 1
            if self.refcounts[h] == 0:
                del self.refcounts[h]
                self.local_hashes.pop(h, None)
                removed.append(h)
        if removed:
            self.events.append(BlockRemoved(block_hashes=removed))

    def _is_covered(self, hashes: list[int]) -> bool:
        """Whether another running or cached sequence already holds all of `hashes`."""
        others = [s.hashes for s in self.running] + [c.hashes for c in self.cached.values()]
        return any(_common_prefix(hashes, h) == len(hashes) for h in others)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
