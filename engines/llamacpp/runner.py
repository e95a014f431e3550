"""The llama.cpp model and context behind the engine: one batched decode step at a time.

Everything here calls llama.cpp through ctypes, which releases the GIL for the duration of each call,
so a step run in a worker thread leaves the event loop free. The runner is not thread-safe: the engine
calls `execute` from its single step thread and touches nothing else while a step is in flight. LoRA
adapters are loaded here too, and a step runs one llama_decode per adapter among its sequences (see the
NOTE in `engines.llamacpp.engine`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import llama_cpp
import numpy as np

from dynamo_cli.errors import ConfigError, RequestError
from dynamo_cli.wire import GenerateRequest, TokenLogprob

from .errors import LlamaCppError
from .grammar import GrammarDeadEnd, GuidedSampler
from .kv_state import CheckedState, StateLayout, rebased
from .plan import MemoryOp, StepPlan, StepResult
from .side_context import SideContext

C = TypeVar("C", bound=SideContext)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How the model and its context are set up."""

    model_path: str
    """A GGUF file."""
    n_ctx: int
    """KV cache size in tokens, shared by every sequence (one unified cache)."""
    n_batch: int
    """Most tokens one `llama_decode` takes (decode tokens plus prefill chunks)."""
    n_seq_max: int
    """Sequence ids available: running sequences plus cached prefixes."""
    n_threads: int
    """CPU threads for decode and prefill."""
    kv_unified: bool = True
    """One KV cache shared by all sequences (prefix sharing without copies); False: one stream of
    n_ctx / n_seq_max cells per sequence id (attention never spans other sequences' cells)."""
    flash_attn: bool = True
    """llama.cpp's flash-attention kernel; off for deterministic decoding (its CPU kernel picks one of
    three summation orders by batch shape)."""
    context_per_seq: int = 0
    """Non-unified sizing: each sequence id's stream gets this many cells (capped at the model's training
    context) and n_ctx becomes that times n_seq_max; 0: n_ctx as given."""
    max_kv_bytes: int = 0
    """With context_per_seq: refuse (ConfigError) a KV cache larger than this; 0: half the machine's memory."""


class Runner:
    """Owns the llama.cpp model, context and batch; executes step plans."""

    def __init__(self, options: RunnerOptions) -> None:
        self.options = options
        llama_cpp.llama_backend_init()
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load chatter
        model_params = llama_cpp.llama_model_default_params()
        # The AMX "extra buffer type" crashes on CPUs that advertise AMX without working support
        # (seen on cloud VMs); the plain CPU kernels are as fast for a model this size.
        model_params.use_extra_bufts = False
        self._model = llama_cpp.llama_model_load_from_file(options.model_path.encode(), model_params)
        if not self._model:
            raise LlamaCppError(f"cannot load model {options.model_path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        try:
            n_ctx = self._sized_context(options)
        except ConfigError:
            llama_cpp.llama_model_free(self._model)
            raise
        self._ctx = llama_cpp.llama_init_from_model(self._model, self._context_params(options, n_ctx))
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise LlamaCppError(f"cannot create a context of {n_ctx} tokens")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(options.n_batch, 0, 1)
        self._loras: dict[str, Any] = {}
        """Adapter name -> its llama_adapter_lora_p (`load_lora`)."""
        self._lora_on = ""
        """The adapter set on the context now ("": none, the base model)."""
        self._closed = False
        self.state_layout = self._learn_state_layout()
        """How this context's sequence states look (None: imports are refused)."""

    def _sized_context(self, options: RunnerOptions) -> int:
        """n_ctx for llama.cpp: as given, or context_per_seq cells for every sequence id (checked
        against the memory limit)."""
        if options.context_per_seq <= 0:
            return options.n_ctx
        per_seq = min(options.context_per_seq, self.n_ctx_train)
        per_seq = -(-per_seq // 256) * 256  # llama.cpp pads each stream to 256 cells
        n_ctx = per_seq * options.n_seq_max
        needed = n_ctx * self.kv_bytes_per_cell()
        limit = options.max_kv_bytes or _half_of_memory()
        if needed > limit:
            raise ConfigError(
                f"a KV stream of {per_seq} tokens for each of {options.n_seq_max} sequence ids needs "
                f"{needed / 2**30:.1f} GiB of KV cache, over the {limit / 2**30:.1f} GiB allowed; lower "
                "--context-length, max_num_seqs or max_cached_seqs"
            )
        return n_ctx

    def kv_bytes_per_cell(self) -> int:
        """Bytes of K and V (f16) one token takes over every layer."""
        model = self._model
        n_head = max(1, int(llama_cpp.llama_model_n_head(model)))
        head_dim = int(llama_cpp.llama_model_n_embd(model)) // n_head
        n_kv = int(llama_cpp.llama_model_n_head_kv(model)) * head_dim
        return 2 * 2 * n_kv * int(llama_cpp.llama_model_n_layer(model))

    @staticmethod
    def _context_params(options: RunnerOptions, n_ctx: int) -> Any:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = options.n_batch
        params.n_ubatch = options.n_batch
        params.n_seq_max = options.n_seq_max
        params.n_threads = params.n_threads_batch = options.n_threads
        # One cache for all sequences: seq_cp then shares cells (prefix reuse without a copy) and
        # every sequence may grow to the whole context.
        params.kv_unified = options.kv_unified
        # The CPU flash-attention kernel skips masked cells, so a token attends only to its own
        # sequence's cells rather than to every cell in the shared cache.
        enabled = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.flash_attn_type = enabled if options.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        return params

    ##### Model facts #####

    @property
    def n_ctx_train(self) -> int:
        return int(llama_cpp.llama_model_n_ctx_train(self._model))

    @property
    def n_ctx(self) -> int:
        """KV cells of the context, over every stream."""
        return int(llama_cpp.llama_n_ctx(self._ctx))

    @property
    def n_ctx_seq(self) -> int:
        """KV cells one sequence may use: n_ctx unified, one stream's otherwise."""
        return int(llama_cpp.llama_n_ctx_seq(self._ctx))

    @property
    def n_vocab(self) -> int:
        return int(llama_cpp.llama_vocab_n_tokens(self._vocab))

    def side_context(self, kind: type[C], n_ctx: int) -> C:
        """A second context over this model: an Embedder or a Scorer (engines.llamacpp.embedder, .scorer)."""
        return kind(self._model, n_ctx, self.options.n_threads)

    def eos_token_ids(self) -> tuple[int, ...]:
        ids = {llama_cpp.llama_vocab_eos(self._vocab), llama_cpp.llama_vocab_eot(self._vocab)}
        return tuple(sorted(i for i in ids if i >= 0))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    ##### Samplers #####

    def new_sampler(self, request: GenerateRequest, grammar: str | None = None, param: str = "response_format") -> Any:
        """A sampler for one request (`_new_chain`); behind `grammar` when given (a GuidedSampler; a grammar
        llama.cpp refuses is the request's RequestError)."""
        chain = self._new_chain(request)
        if grammar is None:
            return chain
        try:
            return GuidedSampler(self._vocab, self.n_vocab, grammar, chain, param)
        except RequestError:
            llama_cpp.llama_sampler_free(chain)
            raise

    def _new_chain(self, request: GenerateRequest) -> Any:
        """A sampler chain for one request, in llama.cpp's usual order: logit bias, penalties (over the
        request's output: the tokens this chain samples and the `num_generated` it came with), then greedy
        at temperature 0, else top-k, top-p, min-p, temperature and a seeded draw."""
        s = request.sampling
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

        def add(sampler: Any) -> None:
            llama_cpp.llama_sampler_chain_add(chain, sampler)

        if s.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(s.logit_bias))(
                *(llama_cpp.llama_logit_bias(token, bias) for token, bias in s.logit_bias.items())
            )
            add(llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(s.logit_bias), biases))
        if s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
            generated = request.token_ids[len(request.token_ids) - request.num_generated :]
            penalties = llama_cpp.llama_sampler_init_penalties(
                self.n_vocab,
                request.max_tokens + len(generated),
                s.repetition_penalty,
                s.frequency_penalty,
                s.presence_penalty,
            )
            for token in generated:  # an earlier hop's output counts too (migration, remote prefill)
                llama_cpp.llama_sampler_accept(penalties, token)
            add(penalties)
        if s.temperature <= 0.0:
            add(llama_cpp.llama_sampler_init_greedy())
            return chain
        if s.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            add(llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            add(llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(s.temperature))
        seed = s.seed
        add(llama_cpp.llama_sampler_init_dist(llama_cpp.LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF))
        return chain

    @staticmethod
    def free_sampler(sampler: Any) -> None:
        if isinstance(sampler, GuidedSampler):
            sampler.free()
        else:
            llama_cpp.llama_sampler_free(sampler)

    ##### The step #####

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the memory ops, decode the batch, sample, export: one engine step."""
        result = StepResult()
        result.failed_imports = self._apply_memory_ops(plan.memory_ops, result)
        seq_ids = [s for s in dict.fromkeys(plan.seq_ids) if s not in result.failed_imports]
        for lora, group in lora_groups(plan.loras, seq_ids, self._lora_on):
            if self._use_lora(lora):
                self._decode_isolating(plan, group, result)
            else:  # unloaded between this step's planning and its run; the worker unloads idle adapters only
                result.rejected.update(dict.fromkeys(group, f"LoRA adapter {lora!r} is not loaded"))
        result.exported = {s: self._export(s) for s in plan.exports if s not in result.rejected}
        return result

    def _decode_isolating(self, plan: StepPlan, seq_ids: list[int], result: StepResult) -> None:
        """Decode the rows of `seq_ids` and sample them. When llama.cpp refuses the batch (an id outside
        the vocabulary fails the whole of it), retry each half apart until the sequences it refuses are
        found: those alone are rejected, their neighbours decode as if nothing happened."""
        wanted = set(seq_ids)
        rows = [row for row, seq_id in enumerate(plan.seq_ids) if seq_id in wanted]
        self._fill_batch(plan, rows)
        code = llama_cpp.llama_decode(self._ctx, self._batch)
        if code == 0:
            self._sample(plan, rows, result)
            return
        self._forget(plan, rows)
        if len(seq_ids) == 1:
            logger.warning("llama_decode refused seq %d's %d tokens (code %d)", seq_ids[0], len(rows), code)
            result.rejected[seq_ids[0]] = f"llama.cpp could not decode its tokens (llama_decode returned {code})"
            return
        half = len(seq_ids) // 2
        self._decode_isolating(plan, seq_ids[:half], result)
        self._decode_isolating(plan, seq_ids[half:], result)

    def _fill_batch(self, plan: StepPlan, rows: list[int]) -> None:
        batch = self._batch
        wanted = set(plan.logits_rows)
        for i, row in enumerate(rows):
            batch.token[i] = plan.tokens[row]
            batch.pos[i] = plan.positions[row]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = plan.seq_ids[row]
            batch.logits[i] = row in wanted
        batch.n_tokens = len(rows)

    def _sample(self, plan: StepPlan, rows: list[int], result: StepResult) -> None:
        index = {row: i for i, row in enumerate(rows)}
        for sampler, row, top_n in zip(plan.samplers, plan.logits_rows, plan.logprobs, strict=True):
            if row not in index:
                continue
            seq_id = plan.seq_ids[row]
            if top_n is not None:  # before sampling: the chain reads the same logits, never writes them
                logits = llama_cpp.llama_get_logits_ith(self._ctx, index[row])
                result.logprobs[seq_id] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()
            if not isinstance(sampler, GuidedSampler):
                token = int(llama_cpp.llama_sampler_sample(sampler, self._ctx, index[row]))
            else:
                try:
                    token = sampler.sample(self._ctx, index[row])
                except GrammarDeadEnd as exc:
                    result.rejected[seq_id] = str(exc)
                    result.logprobs.pop(seq_id, None)
                    continue
            result.sampled[seq_id] = token
            if top_n is not None:
                result.logprobs[seq_id] = token_logprob(result.logprobs[seq_id], token, top_n)

    def _forget(self, plan: StepPlan, rows: list[int]) -> None:
        """After a refused decode: drop whatever llama.cpp may have kept of these rows' positions."""
        first: dict[int, int] = {}
        for row in rows:
            seq_id = plan.seq_ids[row]
            first[seq_id] = min(first.get(seq_id, plan.positions[row]), plan.positions[row])
        for seq_id, pos in first.items():
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, pos, -1)

    def _apply_memory_ops(self, ops: list[MemoryOp], result: StepResult) -> list[int]:
        failed: list[int] = []
        for op in ops:
            if op.kind == "export":
                started = time.perf_counter()
                result.evicted[op.key] = self._export(op.seq_id)
                result.evict_seconds += time.perf_counter() - started
            elif op.kind == "rm":
                llama_cpp.llama_memory_seq_rm(self._memory, op.seq_id, op.start, op.end)
            elif op.kind == "cp" and self.options.kv_unified:
                llama_cpp.llama_memory_seq_cp(self._memory, op.src_seq_id, op.seq_id, 0, op.end)
            elif op.kind == "cp":  # across streams llama.cpp copies whole streams only
                llama_cpp.llama_memory_seq_rm(self._memory, op.seq_id, -1, -1)
                llama_cpp.llama_memory_seq_cp(self._memory, op.src_seq_id, op.seq_id, -1, -1)
                llama_cpp.llama_memory_seq_rm(self._memory, op.seq_id, op.end, -1)
            elif op.kind == "clear":
                llama_cpp.llama_memory_clear(self._memory, True)
            elif op.kind == "import" and not self._import(op.seq_id, op.state):
                failed.append(op.seq_id)
        return failed

    ##### LoRA adapters #####

    def load_lora(self, name: str, path: str) -> None:
        """Load adapter file `path` (checked first: `adapters.check_adapter`) under `name`, in place of one
        loaded under that name before; RequestError (param "lora_path") when llama.cpp refuses it."""
        adapter = llama_cpp.llama_adapter_lora_init(self._model, path.encode())
        if not adapter:
            raise RequestError(f"llama.cpp refused LoRA adapter {path} (its log says why)", param="lora_path")
        self.unload_lora(name)
        self._loras[name] = adapter

    def unload_lora(self, name: str) -> None:
        """Free adapter `name`, taking it off the context first if it is on. Idempotent."""
        adapter = self._loras.pop(name, None)
        if adapter is None:
            return
        if self._lora_on == name:
            self._use_lora("")
        llama_cpp.llama_adapter_lora_free(adapter)

    def _use_lora(self, name: str) -> bool:
        """Put adapter `name` ("": none) on the context for the next decodes, unless it is on already; False
        when it is not loaded. A change costs the next llama_decode a re-reserve of its compute graph."""
        if name == self._lora_on:
            return True
        if name and name not in self._loras:
            return False
        if name:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._loras[name])
            llama_cpp.llama_set_adapters_lora(self._ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        else:
            llama_cpp.llama_set_adapters_lora(self._ctx, None, 0, None)
        self._lora_on = name
        return True

    ##### KV state export/import #####

    def _export(self, seq_id: int) -> bytes:
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq_id)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, seq_id)
        return bytes(memoryview(buffer).cast("B")[:written])

    def _import(self, seq_id: int, state: CheckedState | None) -> bool:
        """Load a checked state into `seq_id`, its stream header rewritten for this context."""
        if state is None or self.state_layout is None:
            return False
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        parts = rebased(state, self.state_layout.n_stream)
        size = sum(len(part) for part in parts)
        buffer = (ctypes.c_uint8 * size)()
        view, offset = memoryview(buffer).cast("B"), 0
        for part in parts:
            view[offset : offset + len(part)] = part
            offset += len(part)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, buffer, size, seq_id)
        if read != size:
            logger.warning("KV state import into seq %d failed (%d of %d bytes read)", seq_id, read, size)
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        return bool(read == size)

    def _learn_state_layout(self) -> StateLayout | None:
        """Decode one token into sequence 0, export it and read the layout of its state (then free it):
        the reference every imported state is checked against. None: a layout kv_state cannot read."""
        batch = self._batch
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 0, 0, 1, 0, False
        batch.n_tokens = 1
        try:
            if llama_cpp.llama_decode(self._ctx, batch) != 0:
                return None
            return StateLayout.learn(self._export(0))
        except ValueError as exc:
            logger.warning("llama.cpp's sequence state is in a layout dyn cannot check (%s): no KV import", exc)
            return None
        finally:
            llama_cpp.llama_memory_seq_rm(self._memory, 0, -1, -1)

    def close(self) -> None:
        """Free the adapters, batch, context and model. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._loras):
            self.unload_lora(name)
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        llama_cpp.llama_model_free(self._model)


def token_logprob(logits: Any, token: int, top_n: int) -> TokenLogprob:
    """The chosen token's logprob and the `top_n` most likely tokens', by log-softmax over raw logits."""
    shifted = logits.astype(np.float64) - float(logits.max())
    logprobs = shifted - np.log(np.exp(shifted).sum())
    top: list[tuple[int, float]] = []
    if top_n > 0:
        best = np.argpartition(-logprobs, top_n - 1)[:top_n] if top_n < logprobs.size else np.arange(logprobs.size)
        best = best[np.argsort(-logprobs[best], kind="stable")]
        top = [(int(t), float(logprobs[t])) for t in best]
    return TokenLogprob(logprob=float(logprobs[token]), top=top)


def lora_groups(loras: dict[int, str], seq_ids: list[int], lora_on: str) -> list[tuple[str, list[int]]]:
    """`seq_ids` grouped by adapter (`loras`: seq id -> adapter name, absent for the base model ""), one
    llama_decode each, in name order (the base model's first) but for the group of `lora_on`, the adapter
    on the context now, which goes first: a step then switches adapters one time fewer."""
    groups: dict[str, list[int]] = {}
    for seq_id in seq_ids:
        groups.setdefault(loras.get(seq_id, ""), []).append(seq_id)
    return sorted(groups.items(), key=lambda group: (group[0] != lora_on, group[0]))


def _half_of_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def default_threads() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
