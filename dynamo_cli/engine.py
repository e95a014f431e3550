"""The engine contract: token ids in, token ids out, KV events on the side.

An engine is a plugin (entry-point group `dyn.engines`) wrapping one inference library. The worker
drives it; the frontend never sees it. Closing or cancelling a `generate` iterator aborts the request
and frees its KV blocks (Dynamo's `kill`).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, NewType, Protocol, runtime_checkable

from dynamo_cli.errors import ConfigError, ContextOverflow, EngineNotInstalled, RequestError, UnknownEngine
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.tiers import KvTierConfig as KvTierConfig  # re-exported: config.py may not import kv
from dynamo_cli.wire import (
    EmbedRequest,
    EmbedResponse,
    GenerateChunk,
    GenerateRequest,
    ImageInput,
    ImageSpec,
    LoadMetrics,
    ScoreRequest,
    ScoreResponse,
)

RequestId = NewType("RequestId", str)


class Role(enum.Enum):
    """What a worker does in a (possibly disaggregated) deployment."""

    BOTH = "both"  # aggregated: prefill and decode
    PREFILL = "prefill"  # computes the prompt's KV, returns a handle to it, one token
    DECODE = "decode"  # imports prefilled KV and decodes
    ENCODE = "encode"  # runs the vision encoder only: images in, embeddings out (E/P/D)


class Feature(enum.Enum):
    """A request feature an engine honours; its card lists them and the frontend refuses, with a 400
    naming the field and the engine, a request that asks for one the serving engine does not have
    (issue 17's rule: nothing accepted is ignored)."""

    LOGPROBS = "logprobs"  # per-token logprobs of the chosen token and `top_logprobs` alternatives
    PENALTIES = "penalties"  # presence_penalty, frequency_penalty, repetition_penalty
    LOGIT_BIAS = "logit_bias"
    MIN_P = "min_p"
    GUIDED_JSON = "guided_json"  # constrained decoding to JSON / a JSON schema (response_format, tools)
    GUIDED_GRAMMAR = "guided_grammar"  # constrained decoding to an engine grammar (regex / GBNF)
    EMBEDDINGS = "embeddings"  # the engine serves `embed` (/v1/embeddings)
    SCORE = "score"  # the engine serves `score` (/v1/rerank, /v1/score)
    KV_RETAIN = "kv_retain"  # keeps a finished call's blocks resident for its session's next call (`retain_s`)


class FinishReason(enum.Enum):
    """Why a stream ended."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"  # the engine failed


##### The contract #####


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine tells the worker once started; published in the model card."""

    model_name: str
    """Served model name (what clients put in `model`)."""
    tokenizer_source: str
    """Local path the frontend loads the tokenizer and chat template from (GGUF file or HF dir)."""
    block_size: int
    """Tokens per KV block; the router hashes with the same size."""
    context_length: int
    """Largest prompt + output the engine accepts."""
    total_kv_blocks: int
    """KV capacity in blocks."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    """Token ids the model knows (0..vocab_size-1); 0: unknown, ids are then only bounded by MAX_TOKEN_ID."""
    extra: dict[str, Any] = field(default_factory=dict)
    features: frozenset[Feature] = frozenset()
    """Request features this engine honours (published in the card; the frontend checks against it)."""
    images: ImageSpec | None = None
    """How the model takes images; None: text only (a request with images is refused)."""


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """The nodes one engine spans (`dyn worker --nnodes N --node-rank R`): what an engine maps to its library's
    multi-node settings (vLLM `nnodes`/`node_rank`/`master_addr`; SGLang `nnodes`/`node_rank`/`dist_init_addr`)."""

    nnodes: int = 1
    node_rank: int = 0
    """0: the leader, which serves; others run the engine's headless part (`load_headless`)."""
    leader_host: str = ""
    """The leader's host: where a library's own rendezvous (torch.distributed's master) listens."""


SINGLE_NODE = NodeGroup()


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Arguments common to every engine; engine-specific ones travel in `extra`."""

    model: str
    """Model alias, GGUF path or HF directory."""
    served_model_name: str | None = None
    role: Role = Role.BOTH
    block_size: int | None = None
    """None: the engine's default."""
    context_length: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific options (`--speedup-ratio`, `--num-gpu-blocks` …), already parsed."""
    host: str = "127.0.0.1"
    """The worker's advertised address (`--host`): where an engine's own KV transfer listens for peers
    (vLLM's NIXL side channel, SGLang's bootstrap server) unless its options say otherwise."""
    kv_tiers: KvTierConfig = field(default_factory=KvTierConfig)
    """Host and disk KV tiers below the engine's own cache (`--kv-host-cache-gb` ...; off by default)."""
    group: NodeGroup = SINGLE_NODE
    """The nodes the engine spans (a group of one by default)."""
    max_loras: int = 0
    """LoRA adapters the engine must hold at once (`--max-loras`) when the worker serves any (`--lora`,
    `--lora-dir`); 0: none asked for. A library that reserves memory for adapters (vLLM's `enable_lora`,
    SGLang's `max_loras_per_batch`) turns them on only then; llama.cpp and the mocker serve them anyway."""


DETERMINISTIC = "deterministic"
"""The `EngineArgs.extra` key (`--deterministic`) asking for greedy output that does not depend on
batching, prefix-cache hits or migration; each engine maps it to its library's switch."""


def is_deterministic(extra: dict[str, Any]) -> bool:
    """Whether `extra` asks for deterministic decoding (true, "true", "1", "yes")."""
    return str(extra.get(DETERMINISTIC, False)).lower() in ("1", "true", "yes")


class Engine(Protocol):
    """An inference engine behind a worker (optional abilities: `SpawnsProcesses`)."""

    async def start(self) -> EngineInfo:
        """Load the model and start the step loop."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's tokens; closing the iterator aborts it and frees its KV."""
        ...

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """Every KV cache change, in event-id order, for as long as the engine runs."""
        ...

    def load_metrics(self) -> LoadMetrics:
        """A snapshot of the engine's current load."""
        ...

    async def stop(self) -> None:
        """Abort everything and release the model. Idempotent."""
        ...


@runtime_checkable
class Embeds(Protocol):
    """An engine that also serves embeddings; its card then lists Feature.EMBEDDINGS."""

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        """The inputs' embeddings; RequestError for an input the engine cannot take."""
        ...


@runtime_checkable
class ClearsKv(Protocol):
    """An engine whose prefix cache an operator can empty (Dynamo's `clear_kv_blocks`, vLLM's
    `reset_prefix_cache`)."""

    async def clear_kv_blocks(self) -> int:
        """Evict every cached block no running request holds, each eviction published as `BlockRemoved`; the
        number evicted."""
        ...


@runtime_checkable
class Scores(Protocol):
    """An engine that scores text pairs (a causal model's yes/no logits); its card then lists Feature.SCORE."""

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """Each pair's score; RequestError for a pair it cannot take (too long, an id outside the vocabulary)."""
        ...


@runtime_checkable
class EncodesImages(Protocol):
    """An engine whose vision encoder can serve `--role encode` (E/P/D): images in, embeddings out in the engine's
    own format, which the same engine on the serving workers takes back (`ImageInput.embeds`)."""

    async def encode_images(self, images: list[ImageInput]) -> tuple[list[bytes], int]:
        """Each image's embeddings, and how many came from the engine's embedding cache."""
        ...


@runtime_checkable
class ServesLoras(Protocol):
    """An engine that runs LoRA adapters over its base model. The worker owns which adapters are served and
    which are resident (`lora.AdapterSet`: `--lora`, `--max-loras`, least recently used eviction); the
    engine only loads one into memory, frees one, and runs a request whose `lora` names a loaded one."""

    async def load_lora(self, name: str, path: str) -> None:
        """Load adapter `path` under `name`; RequestError(param="lora_path") naming what is wrong with the
        file (not found, not an adapter of this model, refused by the library); the engine serves on."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Free adapter `name` (no request of it is in flight). Idempotent."""
        ...


@runtime_checkable
class CountsWork(Protocol):
    """An engine that counts its own work (forward passes, tokens batched ...): its worker's system server
    shows each counter as `dynamo_component_engine_{name}_total`. Libraries with a Prometheus registry of their
    own (vLLM's `vllm:*`, SGLang's `sglang:*`) are shown as they are instead."""

    def work_counters(self) -> Mapping[str, float]:
        """Counter name -> value since start (monotonic)."""
        ...


@runtime_checkable
class SpawnsProcesses(Protocol):
    """An engine that starts processes of its own: its worker then runs a watchdog (`runtime.reaper`)
    that stops them if the worker dies, even by SIGKILL."""

    spawns_processes: bool
    """True when this engine's library starts processes."""


MAX_TOKEN_ID = 2**31 - 1
"""The largest token id any engine takes (llama.cpp's and vLLM's token ids are int32)."""


def check_request(
    request: GenerateRequest,
    context_length: int,
    in_flight: Container[str],
    vocab_size: int = 0,
    images: ImageSpec | None = None,
) -> None:
    """Reject what no engine can serve: an empty prompt, a token id outside the vocabulary (or outside
    0..MAX_TOKEN_ID when `vocab_size` is 0, unknown), max_tokens < 1, prompt + max_tokens over the
    context, or a request id already in flight. Raises RequestError / ContextOverflow (HTTP 400)."""
    num_prompt = len(request.token_ids)
    if num_prompt == 0:
        raise RequestError("the prompt has no tokens; send at least one", param="prompt")
    check_token_ids(request.token_ids, "prompt", vocab_size)
    check_token_ids(request.sampling.stop_token_ids, "stop_token_ids", vocab_size)
    check_token_ids(list(request.sampling.logit_bias), "logit_bias", vocab_size)
    check_sampling(request)
    check_images(request, images)
    if request.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}", param="max_tokens")
    if num_prompt + request.max_tokens > context_length:
        raise ContextOverflow(num_prompt, request.max_tokens, context_length)
    if request.request_id in in_flight:
        raise RequestError(f"request id '{request.request_id}' is already in flight", param="request_id")


MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""Largest encoded image a worker takes (the frontend's `--mm-max-image-mb` is at most this)."""


def check_image_inputs(images: list[ImageInput], spec: ImageSpec) -> None:
    """Images as such, wherever they go (a prompt, an encode worker): at most `max_images`, each a 64-hex digest
    and 1 to MAX_IMAGE_BYTES bytes of image."""
    if len(images) > spec.max_images:
        raise RequestError(f"{len(images)} images; this model takes at most {spec.max_images}", param="messages")
    for i, image in enumerate(images):
        where = f"images[{i}]"
        if len(image.digest) != 64 or any(c not in "0123456789abcdef" for c in image.digest):
            raise RequestError(f"{where}: the digest must be 64 lowercase hex digits", param="messages")
        if not 0 < len(image.data) <= MAX_IMAGE_BYTES:
            raise RequestError(f"{where}: the image must have 1 to {MAX_IMAGE_BYTES} bytes", param="messages")


def check_images(request: GenerateRequest, spec: ImageSpec | None) -> None:
    """The request's images against the model's `spec`, before any byte reaches a decoder: none for a text-only
    model; at most `max_images`; each a 64-hex digest, bytes within MAX_IMAGE_BYTES, a run of exactly
    `tokens_per_image` placeholder tokens inside the prompt, in order; and no placeholder token outside a run."""
    images = request.images
    if spec is None:
        if images:
            raise RequestError("this model takes text only; it has no vision tower for images", param="messages")
        return
    check_image_inputs(images, spec)
    tokens, end = request.token_ids, 0
    for i, image in enumerate(images):
        where = f"images[{i}]"
        if image.length != spec.tokens_per_image or image.offset < end or image.offset + image.length > len(tokens):
            raise RequestError(
                f"{where}: {image.length} placeholders at {image.offset} do not fit this model's "
                f"{spec.tokens_per_image} per image inside the prompt, in order",
                param="messages",
            )
        if tokens[end : image.offset].count(spec.token_id):
            break
        if tokens[image.offset : image.offset + image.length].count(spec.token_id) != image.length:
            raise RequestError(f"{where}: its run is not placeholder tokens alone", param="messages")
        end = image.offset + image.length
    else:
        if not tokens[end:].count(spec.token_id):
            return
    raise RequestError("the prompt holds an image placeholder token outside the images' runs", param="messages")


MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's top_logprobs limit)."""


def check_sampling(request: GenerateRequest) -> None:
    """Sampling values inside the ranges OpenAI (and every engine) define, else RequestError naming one;
    the frontend checks the same ranges, this guards the request plane."""
    s = request.sampling
    ranges = {
        "presence_penalty": (s.presence_penalty, -2.0, 2.0),
        "frequency_penalty": (s.frequency_penalty, -2.0, 2.0),
        "repetition_penalty": (s.repetition_penalty, 1e-6, 2.0),
        "min_p": (s.min_p, 0.0, 1.0),
        "logprobs": (s.logprobs if s.logprobs is not None else 0, 0, MAX_LOGPROBS),
        "num_generated": (request.num_generated, 0, len(request.token_ids)),
        "logit_bias": (next((b for b in s.logit_bias.values() if not -100.0 <= b <= 100.0), 0.0), -100.0, 100.0),
    }
    for name, (value, low, high) in ranges.items():
        if not low <= value <= high:  # also refuses NaN
            raise RequestError(f"{name} must be in {low}..{high}, got {value}", param=name)


def check_token_ids(token_ids: Sequence[int], param: str, vocab_size: int) -> None:
    """Every id is a token of the vocabulary (0..vocab_size-1; 0..MAX_TOKEN_ID when the size is 0),
    else RequestError naming `param` (C-speed min/max: this runs for every request)."""
    if not token_ids:
        return
    highest = vocab_size - 1 if vocab_size > 0 else MAX_TOKEN_ID
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high > highest:
        bad = low if low < 0 else high
        raise RequestError(
            f"{param} has token id {bad}, outside this model's vocabulary (0..{highest}); send ids in that range",
            param=param,
        )


MAX_SCORE_PAIRS = 1024
"""Most text pairs in one `score` request (the frontend asks for fewer; this guards the worker)."""


def check_score_request(request: ScoreRequest, context_length: int, vocab_size: int) -> None:
    """A `score` request an engine can run: 1..MAX_SCORE_PAIRS pairs, each prompt within the context and
    every id (the candidates' too) inside the vocabulary, else RequestError naming what is wrong."""
    if not 1 <= len(request.pairs) <= MAX_SCORE_PAIRS:
        raise RequestError(f"score takes 1..{MAX_SCORE_PAIRS} pairs, got {len(request.pairs)}", param="documents")
    if len(request.candidates) != 2:
        raise RequestError(f"score takes 2 candidate tokens, got {len(request.candidates)}", param="model")
    check_token_ids(request.candidates, "model", vocab_size)
    for pair in request.pairs:
        size = len(pair.first) + len(pair.second)
        if not pair.second or size > context_length:
            raise RequestError(
                f"a pair's prompt has {size} tokens; this model scores 1..{context_length}", param="documents"
            )
        check_token_ids(pair.first, "query", vocab_size)
        check_token_ids(pair.second, "documents", vocab_size)


EngineFactory = Callable[[EngineArgs], Engine]

ENGINE_GROUP = "dyn.engines"

_EXTRA_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm", "llamacpp": "llama-cpp-python"}


def registered_engines() -> dict[str, str]:
    """Engine name → `module:attr` for every installed plugin."""
    return {ep.name: ep.value for ep in entry_points(group=ENGINE_GROUP)}


HeadlessRunner = Callable[[EngineArgs], Awaitable[None]]
"""A follower node's part of a multi-node engine (`args.group.node_rank` > 0): runs until cancelled."""

HEADLESS_GROUP = "dyn.headless"


def load_headless(name: str) -> HeadlessRunner:
    """The headless part of engine `name` for a follower node; ConfigError for an engine that runs on one node."""
    found = {ep.name: ep for ep in entry_points(group=HEADLESS_GROUP)}
    if name not in found:
        multi = ", ".join(sorted(found)) or "none installed"
        raise ConfigError(f"--engine {name} runs on one node: --nnodes > 1 takes an engine with followers: {multi}")
    try:
        runner: HeadlessRunner = found[name].load()
    except ImportError as exc:
        raise EngineNotInstalled(name, _EXTRA_PACKAGES.get(name, name), exc) from exc
    return runner


def load_engine(name: str) -> EngineFactory:
    """Resolve `--engine NAME` to its factory; clear errors for unknown or uninstalled engines."""
    found = {ep.name: ep for ep in entry_points(group=ENGINE_GROUP)}
    if name not in found:
        raise UnknownEngine(name, list(found))
    try:
        factory: EngineFactory = found[name].load()
    except ImportError as exc:
        raise EngineNotInstalled(name, _EXTRA_PACKAGES.get(name, name), exc) from exc
    return factory
