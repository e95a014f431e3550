"""The mocker's settings: `EngineArgs` plus its engine-specific `extra` keys, checked once at the edge."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_cli.config import TIER_DISK_GBS, TIER_DISK_LATENCY_S, TIER_HOST_GBS, TIER_HOST_LATENCY_S
from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.model.gguf_meta import read_gguf_metadata
from dynamo_cli.model.paths import resolve_model_path
from dynamo_cli.timing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 64
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_KV_BYTES_PER_TOKEN = 131072
"""Llama-3-8B in bf16: 32 layers x 2 (K and V) x 8 KV heads x 128 dims x 2 bytes. Used when the model's own size is
not known (`model_kv_bytes_per_token`)."""
KV_TRANSFER_MODES = ("pull", "rendezvous")
"""How a prefill-role mocker hands its KV on (engines/mocker/handoff.py)."""
PREEMPTION_MODES = ("lifo", "fifo")
DECODE_KV_INPUTS = ("decoding_tokens", "active_blocks")
PREFILLED_ADMISSIONS = ("materialized", "prompt")
KV_EVENT_VISIBILITIES = ("pass_start", "pass_end")
"""The scheduling rules: the first of each is the default (Dynamo 1.6.1's, or dyn's where docs/guides/mocker.md
says why)."""
HOST_MS = TIER_HOST_LATENCY_S * 1e3
DISK_MS = TIER_DISK_LATENCY_S * 1e3
"""The KV tiers' transfer latencies in ms: the router's (config.TIER_*) by default."""

_KNOWN_KEYS = (
    "speedup_ratio",
    "decode_speedup_ratio",
    "num_gpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "kv_bytes_per_token",
    "kv_transfer_bandwidth",
    "kv_host_bandwidth",
    "kv_disk_bandwidth",
    "kv_host_latency_ms",
    "kv_disk_latency_ms",
    "vocab_size",
    "kv_transfer_mode",
    "startup_time",
    "preemption_mode",
    "decode_kv_input",
    "prefilled_admission",
    "kv_event_visibility",
    "lora_load_ms",
    "data_parallel_size",
    "data_parallel_start_rank",
    "data_parallel_hidden",
    "image_tokens",
    "image_token_id",
    "max_images",
    "image_encode_ms",
    "image_cache_size",
    "kv_retain_fraction",
)


@dataclass(frozen=True, slots=True)
class MockerConfig:
    """Everything the simulated engine needs; built by `from_args`."""

    model: str
    """Model alias or path: the tokenizer source the frontend loads."""
    served_model_name: str | None
    role: Role
    block_size: int
    """Tokens per KV block."""
    context_length: int
    """Largest prompt + max_tokens accepted."""
    num_gpu_blocks: int = 16384
    """KV capacity in blocks."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most requests running at once."""
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """Token budget of one pass."""
    enable_prefix_caching: bool = True
    """Reuse cached prefix blocks and publish KV events."""
    speedup_ratio: float = 1.0
    """Divides prefill and decode time (1e6: as fast as the event loop goes)."""
    decode_speedup_ratio: float = 1.0
    """Further divides decode time."""
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    """Size of one token's KV, for the simulated disaggregated transfer."""
    kv_transfer_bandwidth: float = 0.0
    """GB/s of the simulated KV transfer; 0 (the default, as Dynamo 1.6.1's unset bandwidth): no delay."""
    vocab_size: int = 0
    """Token ids accepted (0..vocab_size-1); 0: the model's (GGUF or config.json), unknown if it has none."""
    kv_host_bandwidth: float = TIER_HOST_GBS
    """KV tiers: GB/s of an onboard from host (engines/mocker/tiers.py)."""
    kv_disk_bandwidth: float = TIER_DISK_GBS
    """KV tiers: GB/s of an onboard from disk."""
    kv_host_latency_ms: float = HOST_MS
    """KV tiers: fixed time of an onboard from host."""
    kv_disk_latency_ms: float = DISK_MS
    """KV tiers: fixed time of an onboard that reads disk."""
    kv_transfer_mode: str = "pull"
    """"pull": a prefill returns its first token and a MockerKv the decode worker pulls (llama.cpp, vLLM);
    "rendezvous": the frontend makes an SglangKv up front and both halves run at once (SGLang)."""
    startup_time: float = 0.0
    """Seconds `start()` takes, as a real engine's load does (Dynamo's mocker `--startup-time`)."""
    host: str = "127.0.0.1"
    """The worker's advertised host: the host of the bootstrap address a rendezvous prefill publishes."""
    preemption_mode: str = "lifo"
    """Which running request gives its blocks back when blocks run out: "lifo" the newest, "fifo" the oldest."""
    decode_kv_input: str = "decoding_tokens"
    """The decode time's KV usage: "decoding_tokens" (Dynamo) or "active_blocks" (dyn before issue 35)."""
    prefilled_admission: str = "materialized"
    """A transferred request takes no token budget ("materialized", Dynamo) or len(prompt) + 1 ("prompt")."""
    kv_event_visibility: str = "pass_start"
    """When a pass's KV events are published: "pass_start" (dyn's router expects it) or "pass_end" (Dynamo)."""
    lora_load_ms: float = 50.0
    """Time one LoRA adapter load takes, before the speedup ratio (a rank-16 adapter of an 8B model, tens of MB,
    copied from host memory to the GPU and set up)."""
    data_parallel_size: int = 1
    """Data-parallel ranks in the engine, each a whole mocker (scheduler, KV cache of `num_gpu_blocks`, step loop)
    and a routing target of its own (Dynamo's mocker `--data-parallel-size`; engines/mocker/ranks.py)."""
    data_parallel_start_rank: int = 0
    """The global rank of the first of them: the engine serves ranks start .. start + size - 1."""
    data_parallel_hidden: bool = False
    """Keep the ranks to the engine, as vLLM's internal load balancer does: a rank-blind card, load and KV events
    (every rank's as rank 0's), and a request goes to the least loaded rank (benchmarks/dp_routing.py's "blind")."""

    image_tokens: int = 0
    """Tokens each image takes in the prompt (a vision-language model, LLaVA-1.5's 576 say); 0: text only."""
    image_token_id: int = 0
    """The placeholder token of an image (SmolLM2's `<|endoftext|>`, which no chat prompt holds)."""
    max_images: int = 8
    """Images one prompt may hold."""
    image_encode_ms: float = 20.0
    """Time the vision encoder takes per image not in the embedding cache, before the speedup ratio (a
    CLIP-L/336 on one GPU)."""
    image_cache_size: int = 64
    """Encoded images kept, by digest, most recently used first (the embedding cache); 0: none."""
    kv_retain_fraction: float = 0.5
    """Share of the KV blocks that finished calls may keep pinned for their sessions' next calls (the agent hint
    `resume_after_s`); 0: none (the hint is then refused: the card lacks `kv_retain`)."""

    @property
    def is_ranked(self) -> bool:
        """Whether the engine runs ranks (ranks.py): several, or one that is not rank 0."""
        return self.data_parallel_size > 1 or self.data_parallel_start_rank != 0

    @classmethod
    def from_args(cls, args: EngineArgs) -> MockerConfig:
        """Read and validate `args`; a bad value raises ConfigError naming the key and the fix."""
        extra = {key: value for key, value in args.extra.items() if value is not None}
        unknown = sorted(set(extra) - set(_KNOWN_KEYS))
        if unknown:  # other engines' options may travel in the same dict: not fatal
            logger.warning("mocker ignores option(s) %s; it knows %s", unknown, ", ".join(_KNOWN_KEYS))
        block_size = args.block_size if args.block_size is not None else DEFAULT_BLOCK_SIZE
        context_length = args.context_length if args.context_length is not None else DEFAULT_CONTEXT_LENGTH
        return cls(
            model=args.model,
            served_model_name=args.served_model_name,
            role=args.role,
            block_size=_positive_int("block_size", block_size),
            context_length=_positive_int("context_length", context_length),
            num_gpu_blocks=_positive_int("num_gpu_blocks", extra.get("num_gpu_blocks", 16384)),
            max_num_seqs=_positive_int("max_num_seqs", extra.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
            max_num_batched_tokens=_positive_int(
                "max_num_batched_tokens", extra.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
            ),
            enable_prefix_caching=_boolean("enable_prefix_caching", extra.get("enable_prefix_caching", True)),
            speedup_ratio=_positive_float("speedup_ratio", extra.get("speedup_ratio", 1.0)),
            decode_speedup_ratio=_positive_float("decode_speedup_ratio", extra.get("decode_speedup_ratio", 1.0)),
            kv_bytes_per_token=_positive_int("kv_bytes_per_token", _kv_bytes_per_token(extra, args.model)),
            kv_transfer_bandwidth=_non_negative_float("kv_transfer_bandwidth", extra.get("kv_transfer_bandwidth", 0.0)),
            vocab_size=_non_negative_int("vocab_size", extra.get("vocab_size", 0), "0: the model's"),
            kv_host_bandwidth=_positive_float("kv_host_bandwidth", extra.get("kv_host_bandwidth", TIER_HOST_GBS)),
            kv_disk_bandwidth=_positive_float("kv_disk_bandwidth", extra.get("kv_disk_bandwidth", TIER_DISK_GBS)),
            kv_host_latency_ms=_non_negative_float("kv_host_latency_ms", extra.get("kv_host_latency_ms", HOST_MS)),
            kv_disk_latency_ms=_non_negative_float("kv_disk_latency_ms", extra.get("kv_disk_latency_ms", DISK_MS)),
            kv_transfer_mode=_one_of("kv_transfer_mode", extra.get("kv_transfer_mode", "pull"), KV_TRANSFER_MODES),
            startup_time=_non_negative_float("startup_time", extra.get("startup_time", 0.0)),
            lora_load_ms=_non_negative_float("lora_load_ms", extra.get("lora_load_ms", 50.0)),
            host=args.host,
            data_parallel_size=_positive_int("data_parallel_size", extra.get("data_parallel_size", 1)),
            data_parallel_start_rank=_start_rank(extra),
            data_parallel_hidden=_boolean("data_parallel_hidden", extra.get("data_parallel_hidden", False)),
            **_image_options(extra),
            **_scheduling_rules(extra),
        )

    def transfer_delay_s(self, nbytes: int) -> float:
        """Simulated time to pull `nbytes` of KV from a prefill worker (Dynamo: bytes ÷ GB/s)."""
        if self.kv_transfer_bandwidth == 0:
            return 0.0
        return nbytes / (self.kv_transfer_bandwidth * 1e9)


def _kv_bytes_per_token(extra: dict[str, Any], model: str) -> Any:
    if "kv_bytes_per_token" in extra:
        return extra["kv_bytes_per_token"]
    return model_kv_bytes_per_token(model) or DEFAULT_KV_BYTES_PER_TOKEN


def model_kv_bytes_per_token(model: str) -> int | None:
    """The KV bytes one token of `model` takes in 16-bit precision (layers x 2 x KV heads x head dim x 2), from its
    GGUF metadata or its directory's config.json, as Dynamo's mocker computes it from the model's config; None when
    the model says nothing of it (a bare directory)."""
    try:
        path = Path(resolve_model_path(model))
        if path.is_file():
            meta = read_gguf_metadata(str(path))
            arch = meta["general.architecture"]
            layers, heads = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.attention.head_count"])
            kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
            head_dim = int(meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads)
        else:
            config = json.loads((path / "config.json").read_text())
            layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (ConfigError, OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * 2 * kv_heads * head_dim * 2 if layers > 0 and kv_heads > 0 and head_dim > 0 else None


def _scheduling_rules(extra: dict[str, Any]) -> dict[str, Any]:
    rules = {
        "preemption_mode": PREEMPTION_MODES,
        "decode_kv_input": DECODE_KV_INPUTS,
        "prefilled_admission": PREFILLED_ADMISSIONS,
        "kv_event_visibility": KV_EVENT_VISIBILITIES,
    }
    return {key: _one_of(key, extra.get(key, choices[0]), choices) for key, choices in rules.items()}


def _image_options(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "image_tokens": _non_negative_int("image_tokens", extra.get("image_tokens", 0), "0: text only"),
        "image_token_id": _non_negative_int("image_token_id", extra.get("image_token_id", 0), "SmolLM2's EOT"),
        "max_images": _positive_int("max_images", extra.get("max_images", 8)),
        "image_encode_ms": _non_negative_float("image_encode_ms", extra.get("image_encode_ms", 20.0)),
        "image_cache_size": _non_negative_int("image_cache_size", extra.get("image_cache_size", 64), "0: none"),
        "kv_retain_fraction": _fraction("kv_retain_fraction", extra.get("kv_retain_fraction", 0.5)),
    }


def _start_rank(extra: dict[str, Any]) -> int:
    return _non_negative_int("data_parallel_start_rank", extra.get("data_parallel_start_rank", 0), "0: the first rank")


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"mocker option {key} must be a positive integer, got {value!r}")
    return value


def _non_negative_int(key: str, value: Any, zero: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"mocker option {key} must be an integer >= 0 ({zero}), got {value!r}")
    return value


def _positive_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"mocker option {key} must be a number above 0, got {value!r}")
    return float(value)


def _non_negative_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"mocker option {key} must be a number >= 0 (0 disables it), got {value!r}")
    return float(value)


def _fraction(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"mocker option {key} must be a share from 0 to 1, got {value!r}")
    return float(value)


def _one_of(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"mocker option {key} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"mocker option {key} must be true or false, got {value!r}")
    return value
