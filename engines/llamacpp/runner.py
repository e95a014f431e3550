"""The llama.cpp model and context behind the engine: one batched decode step at a time.

Everything here calls llama.cpp through ctypes, which releases the GIL for the duration of each call,
so a step run in a worker thread leaves the event loop free. The runner is not thread-safe: the engine
calls `execute` from its single step thread and touches nothing else while a step is in flight.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any

import llama_cpp

from dynamo_cli.errors import DynError
from engines.llamacpp.plan import MemoryOp, StepPlan, StepResult

logger = logging.getLogger(__name__)


class LlamaCppError(DynError):
    """llama.cpp refused an operation (load, decode, state import)."""

    def __init__(self, what: str, code: int | None = None) -> None:
        self.what = what
        self.code = code
        suffix = f" (llama.cpp returned {code})" if code is not None else ""
        super().__init__(f"llama.cpp: {what}{suffix}")


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
        self._ctx = llama_cpp.llama_init_from_model(self._model, self._context_params(options))
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise LlamaCppError(f"cannot create a context of {options.n_ctx} tokens")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(options.n_batch, 0, 1)
        self._closed = False

    @staticmethod
    def _context_params(options: RunnerOptions) -> Any:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = options.n_ctx
        params.n_batch = options.n_batch
        params.n_ubatch = options.n_batch
        params.n_seq_max = options.n_seq_max
        params.n_threads = params.n_threads_batch = options.n_threads
        # One cache for all sequences: seq_cp then shares cells (prefix reuse without a copy) and
        # every sequence may grow to the whole context.
        params.kv_unified = options.kv_unified
        # The CPU flash-attention kernel skips masked cells, so a token attends only to its own
        # sequence's cells rather than to every cell in the shared cache.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        return params

    ##### Model facts #####

    @property
    def n_ctx_train(self) -> int:
        return int(llama_cpp.llama_model_n_ctx_train(self._model))

    @property
    def n_vocab(self) -> int:
        return int(llama_cpp.llama_vocab_n_tokens(self._vocab))

    def eos_token_ids(self) -> tuple[int, ...]:
        ids = {llama_cpp.llama_vocab_eos(self._vocab), llama_cpp.llama_vocab_eot(self._vocab)}
        return tuple(sorted(i for i in ids if i >= 0))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    ##### Samplers #####

    def new_sampler(self, temperature: float, top_p: float, top_k: int, seed: int | None) -> Any:
        """A sampler chain for one request: greedy at temperature 0, else top-k, top-p, temperature."""
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if temperature <= 0.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            return chain
        if top_k > 0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
        dist_seed = llama_cpp.LLAMA_DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(dist_seed))
        return chain

    @staticmethod
    def free_sampler(sampler: Any) -> None:
        llama_cpp.llama_sampler_free(sampler)

    ##### The step #####

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the memory ops, decode the batch, sample, export: one engine step."""
        failed = self._apply_memory_ops(plan.memory_ops)
        if plan.tokens:
            self._fill_batch(plan)
            code = llama_cpp.llama_decode(self._ctx, self._batch)
            if code != 0:
                raise LlamaCppError(f"decode of {len(plan.tokens)} tokens failed", code)
        sampled = [
            int(llama_cpp.llama_sampler_sample(sampler, self._ctx, row))
            for sampler, row in zip(plan.samplers, plan.logits_rows, strict=True)
        ]
        exported = {seq_id: self._export(seq_id) for seq_id in plan.exports}
        return StepResult(sampled=sampled, exported=exported, failed_imports=failed)

    def _fill_batch(self, plan: StepPlan) -> None:
        batch = self._batch
        wanted = set(plan.logits_rows)
        for i, (token, pos, seq_id) in enumerate(zip(plan.tokens, plan.positions, plan.seq_ids, strict=True)):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = i in wanted
        batch.n_tokens = len(plan.tokens)

    def _apply_memory_ops(self, ops: list[MemoryOp]) -> list[int]:
        failed: list[int] = []
        for op in ops:
            if op.kind == "rm":
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

    ##### KV state export/import #####

    def _export(self, seq_id: int) -> bytes:
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq_id)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, seq_id)
        return bytes(buffer)[:written]

    def _import(self, seq_id: int, state: bytes) -> bool:
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, buffer, len(state), seq_id)
        if read == 0:
            logger.warning("KV state import into seq %d failed (%d bytes)", seq_id, len(state))
        return bool(read)

    def close(self) -> None:
        """Free the batch, context and model. Idempotent."""
        if self._closed:
            return
        self._closed = True
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        llama_cpp.llama_model_free(self._model)


def default_threads() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
