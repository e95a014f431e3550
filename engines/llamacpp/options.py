"""The llamacpp engine's settings: `EngineArgs` and its `extra` dict, checked once at the edge.

Options (`EngineArgs.extra`): `n_ctx` (KV cache tokens shared by all sequences), `n_batch` (tokens per
decode step), `n_threads`, `max_num_seqs`, `max_cached_seqs` and `max_cached_tokens` (finished prefixes
kept for reuse; with the unified cache they are parked outside it, see `park_prefixes`), `park_prefixes`
(default true: with KV tiers off, finished prefixes wait in a host pool of max_cached_tokens tokens instead
of llama.cpp's cache, whose every cell in use each decode step's attention walks; with tiers on they go to
the host tier, and the unified cache keeps max_cached_tokens only when given; see
`engines.llamacpp.tiering`), `block_size`, `kv_unified` (default true: one KV cache shared by all
sequences), and
`deterministic` (see `engines.llamacpp.engine`): every sequence id then gets its own KV stream of
`context_length` tokens (default DETERMINISTIC_CONTEXT) and n_ctx follows from that; `embeddings`
(default false: true also serves /v1/embeddings from a second, embedding-mode context of n_batch tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamo_cli.engine import DETERMINISTIC, EngineArgs, Role, is_deterministic
from dynamo_cli.errors import ConfigError
from dynamo_cli.model.paths import model_display_name, resolve_model_path

from .runner import default_threads

DETERMINISTIC_CONTEXT = 4096
"""Deterministic mode: each sequence's KV stream, in tokens, when no context length is given."""


@dataclass(frozen=True, slots=True)
class LlamaCppOptions:
    """Engine settings, from `EngineArgs` and its `extra` dict."""

    model_path: str
    """The GGUF file."""
    served_model_name: str
    role: Role
    block_size: int
    """Tokens per KV block (prefix reuse granularity and router hashing)."""
    n_ctx: int
    """KV cache size in tokens, over every sequence."""
    context_length: int | None
    """Largest prompt + max_tokens; None: min(model's training context, n_ctx)."""
    n_batch: int
    """Most tokens in one decode step: a token per decoding sequence, prefill chunks in the rest."""
    n_threads: int
    max_num_seqs: int
    """Sequences decoded together."""
    max_cached_seqs: int
    """Finished sequences whose full blocks stay cached for prefix reuse (LRU)."""
    max_cached_tokens: int
    """Most tokens those cached prefixes may hold together (LRU eviction beyond)."""
    kv_unified: bool
    """One KV cache for all sequences (default); False: a stream of n_ctx / n_seq_max cells each."""
    park_prefixes: bool = True
    """With the unified cache and KV tiers off: keep finished prefixes in a host pool, not llama.cpp's cache."""
    deterministic: bool = False
    """Batch-invariant greedy output: flash attention off, one KV stream of context_length per sequence."""
    embeddings: bool = False
    """Option `embeddings=true`: also serve /v1/embeddings, from a second context of n_batch tokens."""

    @classmethod
    def from_args(cls, args: EngineArgs) -> LlamaCppOptions:
        extra = args.extra
        path = resolve_model_path(args.model)
        if not path.endswith(".gguf"):
            raise ConfigError(f"the llamacpp engine needs a .gguf file, got {path}; pass --model PATH.gguf")
        max_num_seqs = _positive(extra, "max_num_seqs", 16)
        sized = _deterministic_sizes if is_deterministic(extra) else _shared_sizes
        sizes = sized(args, max_num_seqs)
        return cls(
            model_path=path,
            served_model_name=args.served_model_name or model_display_name(args.model),
            role=args.role,
            block_size=args.block_size or _positive(extra, "block_size", 16),
            n_batch=_positive(extra, "n_batch", 512),
            n_threads=_positive(extra, "n_threads", default_threads()),
            max_num_seqs=max_num_seqs,
            embeddings=str(extra.get("embeddings", False)).lower() in ("1", "true", "yes"),
            **sizes,
        )


def _shared_sizes(args: EngineArgs, max_num_seqs: int) -> dict[str, Any]:
    extra = args.extra
    n_ctx = _positive(extra, "n_ctx", 8192)
    return {
        "n_ctx": n_ctx,
        "context_length": args.context_length,
        "max_cached_seqs": int(extra.get("max_cached_seqs", max_num_seqs)),
        "max_cached_tokens": int(extra.get("max_cached_tokens", n_ctx // 4)),
        "kv_unified": str(extra.get("kv_unified", True)).lower() not in ("0", "false", "no"),
        "park_prefixes": str(extra.get("park_prefixes", True)).lower() not in ("0", "false", "no"),
    }


def _deterministic_sizes(args: EngineArgs, max_num_seqs: int) -> dict[str, Any]:
    """One stream of context_length cells per sequence id; cached prefixes hold a whole stream each, so
    a few of them by default, and their tokens cost the other sequences nothing."""
    extra = args.extra
    if str(extra.get("kv_unified", False)).lower() in ("1", "true", "yes"):
        raise ConfigError(f"llamacpp option {DETERMINISTIC}=true needs kv_unified=false (one KV stream each)")
    context = args.context_length or DETERMINISTIC_CONTEXT
    max_cached_seqs = int(extra.get("max_cached_seqs", min(4, max_num_seqs)))
    return {
        "n_ctx": context * (max_num_seqs + max_cached_seqs),
        "context_length": context,
        "max_cached_seqs": max_cached_seqs,
        "max_cached_tokens": int(extra.get("max_cached_tokens", context * max_cached_seqs)),
        "kv_unified": False,
        "deterministic": True,
    }


def _positive(extra: dict[str, Any], key: str, default: int) -> int:
    value = int(extra.get(key, default))
    if value <= 0:
        raise ConfigError(f"llamacpp option {key} must be a positive integer, got {value}")
    return value
