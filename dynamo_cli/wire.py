"""Every request-plane endpoint of dyn and every message it carries, in one place (Dynamo's `protocols.rs`).

A worker serves `generate` (and `embed`, and the KV side endpoints a router uses to repair its view or free a
prefill's payload); a `dyn router` serves `generate` and `best_worker_id`. Each endpoint's name, request and
reply are declared here, and both sides of every call import them from here. Messages are msgspec structs
(msgpack on the wire): per-token ones are `array_like` and untracked by the collector, as vLLM's
`EngineCoreOutput`. `GenerateRequest` nests one `SamplingParams`, built once at the HTTP edge and carried
unchanged through the frontend, a `dyn router`, migration and the prefill hop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Literal, TypeVar

import msgspec

from dynamo_cli.errors import RemoteError, RequestError
from dynamo_cli.kv.events import KvDump, KvEventBatch
from dynamo_cli.kv.handles import BlobRef, KvHandle, TransferReport
from dynamo_cli.kv.tiers import KvTierStats

Req = TypeVar("Req")
Rep = TypeVar("Rep")

##### Endpoints: each one's name and types (declared at the end, after their messages) #####


class EndpointSpec(Generic[Req, Rep]):
    """One request-plane endpoint: its name, the request it takes and the type of each reply item. Both sides use
    it: the server decodes each request once (`RequestServer.add_endpoint(spec, handler)`), the client encodes once
    (`RequestClient.open(spec, request)`, `call(spec, request)`) and decodes what comes back (`decode_reply`)."""

    __slots__ = ("name", "request", "reply", "reply_decoder", "encode", "_decode_request")

    def __init__(self, name: str, request: type[Req], reply: type[Rep]) -> None:
        self.name = name
        self.request = request
        self.reply = reply
        self._decode_request = msgspec.msgpack.Decoder(request).decode
        self.reply_decoder = msgspec.msgpack.Decoder(reply).decode
        """The bare decoder of a reply item, for a loop over many (it raises msgspec.DecodeError itself)."""
        self.encode: Callable[[object], bytes] = _encode
        """A request or a reply item as msgpack (the C encoder itself: the server calls it once per reply item)."""

    def __repr__(self) -> str:
        return f"EndpointSpec({self.name!r}, {_type_name(self.request)}, {_type_name(self.reply)})"

    def decode_request(self, body: bytes) -> Req:
        """A request body as this endpoint's request; one that is not is the caller's error (RequestError)."""
        try:
            return self._decode_request(body)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise RequestError(f"malformed {self.name} request ({_type_name(self.request)}): {exc}") from exc

    def decode_reply(self, body: bytes) -> Rep:
        """One reply item; one that is not this endpoint's reply is the server's fault (RemoteError, 502)."""
        try:
            return self.reply_decoder(body)
        except msgspec.DecodeError as exc:
            raise RemoteError(f"malformed {self.name} reply ({_type_name(self.reply)}): {exc}", status=502) from exc


def _type_name(kind: type) -> str:
    return getattr(kind, "__name__", str(kind))


_encode = msgspec.msgpack.Encoder().encode


##### GenerateRequest annotations (frontend -> `dyn router`; the trace context to every hop) #####

PIN_ANNOTATION = "worker_instance_id"
"""Names (hex) the backend a `dyn router` must route the request to."""
REPORT_WORKER_ANNOTATION = "report_worker"
""""1": a `dyn router` first sends an empty chunk naming the backend it chose."""
PRIORITY_ANNOTATION = "priority"
"""An integer (`x-dyn-priority`): higher waits less in a `dyn router`'s wait queue."""
DEADLINE_ANNOTATION = "deadline_ms"
"""`x-dyn-deadline-ms`: milliseconds left, when sent, for the request to start."""
TENANT_ANNOTATION = "tenant"
"""The tenant whose share the request is served from, with its `tenant_weight`, `priority_class` (a class's
name) and `tenant_max_queued` (frontend/tenants.py): a `dyn router`'s queue shares by them as the frontend's does."""
TENANT_WEIGHT_ANNOTATION = "tenant_weight"
CLASS_ANNOTATION = "priority_class"
TENANT_MAX_QUEUED_ANNOTATION = "tenant_max_queued"
SESSION_ANNOTATION = "session_id"
"""`x-dyn-session-id`: the agent session the request belongs to (a `dyn router` applies its affinity)."""
PARENT_SESSION_ANNOTATION = "parent_session_id"
"""`x-dyn-parent-session-id`: a sub-agent's parent session."""
TRACEPARENT_ANNOTATION = "traceparent"
"""The W3C trace context of the hop that sent the request (its span): the receiver's spans continue that trace."""
TRACESTATE_ANNOTATION = "tracestate"
"""The W3C vendor trace state, carried along with `traceparent` unchanged."""


##### generate #####


class Guided(msgspec.Struct, frozen=True, kw_only=True):
    """Constrained decoding: the output must be JSON (`json_object`) or JSON valid against `schema`
    (`json_schema`); engines with `Feature.GUIDED_JSON` enforce it in their sampler."""

    kind: str
    """`json_object` or `json_schema`."""
    schema: str = ""
    """The JSON schema, as JSON text (empty for `json_object`)."""
    param: str = "response_format"
    """The request field the constraint comes from (`response_format`, `tool_choice`): errors name it."""
    num_accepted: int = 0
    """Output tokens already generated (the tail of `token_ids`, after a migration or a remote prefill):
    the engine replays them through its grammar before sampling."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the next tokens are chosen; the defaults are no-ops, so an engine without a feature
    (Feature.PENALTIES, LOGIT_BIAS, MIN_P, LOGPROBS) serves a request that leaves it alone."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    """Output tokens before EOS or a stop token may end the stream (of this hop: shrunk after a migration)."""
    guided: Guided | None = None
    """Constrained decoding (response_format, tool_choice required/named); None: free text."""
    presence_penalty: float = 0.0
    """OpenAI's: subtract this from the logit of every token generated at least once so far."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtract this times the token's count among the tokens generated so far."""
    repetition_penalty: float = 1.0
    """CTRL's: divide a positive logit of a token already seen by this (multiply a negative one); "seen" is
    the output for llamacpp, prompt and output for vLLM (each library's own rule)."""
    logit_bias: dict[int, float] = {}
    """Token id -> bias added to its logit (-100 bans it, +100 all but forces it)."""
    min_p: float = 0.0
    """Drop tokens whose probability is under min_p times the most likely token's."""
    logprobs: int | None = None
    """None: no logprobs; N: each token's logprob and the N most likely alternatives' (GenerateChunk.logprobs)."""

    def after(self, num_generated: int) -> SamplingParams:
        """These settings for a hop that continues `num_generated` tokens in (a migration, a remote prefill's
        decode): min_tokens counts what is left, a grammar replays what was accepted."""
        if not num_generated:
            return self
        guided = self.guided
        if guided is not None:
            guided = msgspec.structs.replace(guided, num_accepted=guided.num_accepted + num_generated)
        return msgspec.structs.replace(self, min_tokens=max(0, self.min_tokens - num_generated), guided=guided)


class ImageEmbeds(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An image's embeddings as an encode worker computed them (E/P/D): where to pull them, then the bytes."""

    blob: BlobRef | None = None
    """On the encode worker's KV transfer server until pulled once (then None and `payload` set)."""
    payload: bytes = b""
    """The engine's own embedding format (the mocker: tokens x hidden float16)."""
    checksum: str = ""
    """BLAKE2b-128 of the payload (32 hex digits): a pull that does not match is discarded."""


class ImageInput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One image of a prompt: the run of placeholder tokens that stands for it in `token_ids`, and its bytes.

    The frontend checked the bytes (a PNG, JPEG, WebP or GIF that decodes, within the pixel cap) and hashed
    them; an engine checks the run again (`engine.check_images`) before the bytes reach its decoder."""

    digest: str
    """The image's identity: 64 hex digits, BLAKE2b-256 of its bytes as sent (kv/images.py: its routing view,
    the engines' embedding caches)."""
    offset: int
    """Position of its first placeholder token in `token_ids`."""
    length: int
    """Its placeholder tokens (the model's tokens per image)."""
    data: bytes = b""
    """The encoded image file."""
    embeds: ImageEmbeds | None = None
    """Its embeddings from an encode worker (E/P/D); None: the serving engine encodes `data` itself. A pull that
    fails leaves the image to the engine's own encoder."""


class ImageSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How a vision-language model takes images (published in its card; None there: text only)."""

    token_id: int
    """The placeholder token id (LLaVA's `<image>`), repeated `tokens_per_image` times per image."""
    tokens_per_image: int
    max_images: int = 8
    """Images one prompt may hold (vLLM's `--limit-mm-per-prompt`)."""


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A preprocessed request: the frontend has already applied the template and tokenized."""

    request_id: str
    token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    kv_transfer: KvHandle | None = None
    """Disaggregation: the prefill worker's handle to the KV of the first `num_tokens` ids, which the
    decode worker takes over instead of computing them (kv/handles.py)."""
    annotations: dict[str, str] = {}
    num_generated: int = 0
    """The last `num_generated` of token_ids were generated by an earlier hop (a migration, a remote
    prefill's first token): penalties count them as output, as if this engine had sampled them."""
    lora: str = ""
    """The LoRA adapter to run with (its served name, one of the worker card's `loras`); empty: the base model.
    Its KV blocks are hashed with `kv.hashing.lora_seed(lora)`, so no prefix is shared across adapters."""
    dp_rank: int | None = None
    """The data-parallel rank the router chose (one of the card's `ranks`); the engine runs the request there.
    None: a rank-blind engine, or no choice (the engine picks)."""
    images: list[ImageInput] = []
    """The prompt's images, in order, each a run of placeholders in `token_ids` (the card's `images`)."""
    retain_s: float = 0.0
    """Keep this call's KV blocks resident this long after it ends (`Feature.KV_RETAIN`; the agent hint
    `resume_after_s`): its session calls again then. 0: the blocks are evictable at once, as usual."""
    retain_key: str = ""
    """What the retained blocks are kept for (the session): a later call of the same key takes them over.
    "": the request's own id (no later call takes them; they go when `retain_s` is up)."""

    def continued(self, token_ids: list[int], kv_transfer: KvHandle | None = None) -> GenerateRequest:
        """This request carried on after `token_ids` were generated (by a failed worker, or a prefill hop):
        they join the prompt, max_tokens and min_tokens shrink by as many, and `kv_transfer` comes along."""
        n = len(token_ids)
        return msgspec.structs.replace(
            self,
            token_ids=self.token_ids + token_ids,
            max_tokens=self.max_tokens - n,
            sampling=self.sampling.after(n),
            kv_transfer=kv_transfer,
            num_generated=self.num_generated + n,
        )


HEALTH_CHECK_ID = "dyn-health-check"
"""The request id of health checks (a canary): one token, greedy, from one prompt token."""


def health_check_request(token_id: int) -> GenerateRequest:
    """A canary: the smallest generation an engine can run (Dynamo's `health_check_payload`)."""
    return GenerateRequest(
        request_id=HEALTH_CHECK_ID,
        token_ids=[token_id],
        max_tokens=1,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
    )


class EncodeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Images for an encode worker (`--role encode`): it encodes each one its embedding cache does not hold."""

    request_id: str
    images: list[ImageInput]


class EncodeReply(msgspec.Struct, frozen=True, kw_only=True):
    """Each image's embeddings, in order, held for one pull by the worker that will serve the request."""

    embeds: list[ImageEmbeds]
    cached: int = 0
    """How many came from the encode worker's embedding cache."""


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The logprob of one generated token and of the most likely alternatives at its position."""

    logprob: float
    """log P(chosen token) under the model's distribution before sampling (raw logits, log-softmax)."""
    top: list[tuple[int, float]] = []
    """The `SamplingParams.logprobs` most likely (token id, logprob), most likely first."""


class GenerateChunk(msgspec.Struct, array_like=True, gc=False, kw_only=True):
    """One or more new tokens of a stream; the last chunk carries `finish_reason`."""

    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    """Set on the first chunk: prompt tokens served from the prefix cache."""
    kv_transfer: KvHandle | None = None
    """Prefill role, on the last chunk: the handle to this prompt's KV for a decode worker."""
    worker_id: int | None = None
    """Only on a `dyn router`'s first, empty chunk, when asked (REPORT_WORKER_ANNOTATION): the backend it chose."""
    transfer: TransferReport | None = None
    """Decode side, on the first chunk of a request that came with a handle: how its KV pull went."""
    logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.logprobs set: one per entry of token_ids."""


##### embed #####


class EmbedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Inputs to embed, already tokenized by the frontend (one list of ids per input)."""

    request_id: str
    inputs: list[list[int]]


class EmbedResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One unit-length vector per input, in order."""

    embeddings: list[list[float]]


class ScorePair(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One text pair to score, tokenized and templated by the frontend: the engine reads `first + second` as one
    prompt (`first` carries the query, `second` the document and the question's end)."""

    first: list[int]
    second: list[int]


class ScoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`score`: how likely the model answers each pair's prompt with `candidates[0]` rather than `candidates[1]`
    (the ids of "yes" and "no": a causal model's relevance, as vLLM scores with one)."""

    request_id: str
    pairs: list[ScorePair]
    candidates: list[int]


class ScoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One score in 0..1 per pair, in order: softmax over the candidates' logits after the prompt, the first's."""

    scores: list[float]


##### The KV side endpoints (router -> worker) #####


class KvEventsSince(msgspec.Struct, frozen=True, kw_only=True):
    """`kv_events_since`: replay the kept KV event batches from `first_event_id` on."""

    first_event_id: int


class KvDumpQuery(msgspec.Struct, frozen=True, kw_only=True):
    """`kv_dump`: the worker's whole cached block set (no parameters yet)."""


class KvRelease(msgspec.Struct, frozen=True, kw_only=True):
    """`kv_release`: free the held KV payload `transfer_id` no decode worker will pull (the client left)."""

    transfer_id: str


class KvClear(msgspec.Struct, frozen=True, kw_only=True):
    """`kv_clear`: evict every cached KV block no request holds (an operator's prefix-cache reset, after a model
    or adapter update); the evictions go out as `BlockRemoved` events, so the routers' indexes follow."""

    request_id: str


class KvCleared(msgspec.Struct, frozen=True, kw_only=True):
    blocks: int
    """Blocks evicted."""


##### lora (adapters loaded and unloaded at run time) #####


class LoraCommand(msgspec.Struct, frozen=True, kw_only=True):
    """`lora`: add adapter `name` from `path` to what the worker serves (`load`), or take it away (`unload`)."""

    action: Literal["load", "unload"]
    name: str
    path: str = ""
    """`load`: the adapter file, on the worker's machine (inside one of its `--lora-dir`s)."""


class LoraReply(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker serves once the command took effect (its card already says so)."""

    loras: list[str]
    """Every adapter it serves."""
    resident: list[str]
    """Those loaded now, least recently used first."""


##### best_worker_id (a `dyn router`'s explanation of its next choice) #####


class BestWorkerQuery(msgspec.Struct, frozen=True, kw_only=True):
    """The prompt's token ids, optionally a pinned worker and a LoRA adapter."""

    token_ids: list[int]
    worker_instance_id: int | None = None
    lora: str = ""
    """A LoRA adapter's name: its blocks' hashes, and only the backends serving it, with their load costs."""
    images: list[ImageInput] = []
    """The prompt's images (digest and placeholder run; no bytes needed): they route as their content."""


class InFlight(msgspec.Struct, frozen=True, kw_only=True):
    """One backend's load (one rank of it) as one router replica sees it."""

    worker_id: int
    dp_rank: int = 0
    num_requests: int
    """Requests in flight."""
    active_blocks: int
    """Unique KV blocks those requests hold."""
    active_prefill_tokens: int
    """Prompt tokens sent and not yet prefilled."""


class BestWorkerReply(msgspec.Struct, frozen=True, kw_only=True):
    """The backend `generate` would choose now, and why; with the router's view of its pools."""

    worker_id: int
    dp_rank: int = 0
    """The backend's rank chosen (0 for a rank-blind backend)."""
    overlap_blocks: int
    explanation: dict[str, object]
    """The decision explained: candidates, their cost terms and the margin (routing/kv_policy.py)."""
    router_id: int
    """The answering replica's instance id."""
    model: str
    in_flight: list[InFlight]
    """Per decode backend rank, this replica's in-flight view."""
    queued: int
    """Requests waiting in this replica's queue for a backend."""
    indexed_workers: list[int]
    """Backends whose KV events this replica has indexed."""
    prefill_workers: list[int]
    """The prefill pool this replica routes prefill hops to."""
    settings: dict[str, object] = {}
    """The replica's routing settings, as its configuration document gave them (config.py)."""


##### group_join (one engine over several nodes: a follower at its leader) #####


class GroupJoin(msgspec.Struct, frozen=True, kw_only=True):
    """A follower of a multi-node engine joins its leader (node_group.py)."""

    node_rank: int
    """The follower's node rank (1 .. nnodes - 1)."""
    nnodes: int
    """The group size it was started with; the leader refuses a follower of another size."""
    engine: str
    """Its engine plugin; the leader refuses a follower of another engine."""


class GroupBeat(msgspec.Struct, frozen=True, kw_only=True):
    """The leader's beat on a follower's stream while both live."""

    joined: list[int]
    """The followers joined now."""
    serving: bool
    """Every follower joined and the leader serves."""


##### The event plane #####


class RankLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One data-parallel rank's share of a worker's load (each rank has a scheduler and a KV cache of its own)."""

    dp_rank: int
    num_running: int = 0
    num_waiting: int = 0
    active_blocks: int = 0
    total_blocks: int = 0
    active_prefill_tokens: int = 0


class LoadMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's load after a step (subject `…kv-metrics`); routers use it for busy detection, planners for scaling.
    A worker serving several data-parallel ranks reports their sums here and each rank in `ranks`."""

    worker_id: int = 0
    num_running: int = 0
    num_waiting: int = 0
    active_blocks: int = 0
    total_blocks: int = 0
    active_prefill_tokens: int = 0
    num_prefill_tokens_computed: int = 0
    """Cumulative prompt tokens actually computed (excludes prefix-cache hits)."""
    num_prefill_tokens_cached: int = 0
    """Cumulative prompt tokens served from the prefix cache."""
    kv_event_id: int = -1
    """Id of the last KV event batch the worker published (-1: none): lets a router notice events it
    lost even when no later event arrives (anti-entropy)."""
    kv_transfer_held: int = 0
    """Prefill role: KV payloads exported and not yet pulled by a decode worker (nor expired)."""
    kv_transfer_held_bytes: int = 0
    kv_tiers: KvTierStats | None = None
    """The host/disk KV tiers' counters and holdings (None: tiers off or not supported by the engine)."""
    loras: list[str] = []
    """LoRA adapters loaded now (resident), least recently used first; a request for another one loads it."""
    lora_loads: int = 0
    """Cumulative adapter loads (at start, at run time and again after an eviction)."""
    lora_load_s: float = 0.0
    """Seconds the last adapter load took (0: none yet): the router's cost of sending an adapter here."""
    ranks: list[RankLoad] = []
    """A worker serving several data-parallel ranks: each rank's load (the fields above are their sums); empty for
    a rank-blind worker (one rank, the card's first)."""


##### Endpoints #####

GENERATE = EndpointSpec("generate", GenerateRequest, GenerateChunk)
"""Worker and `dyn router`: a stream of chunks; closing the stream aborts it. Its name is the `--endpoint` setting's
default (a worker registers under the name it is given; callers open `worker.record.endpoint`)."""
EMBED = EndpointSpec("embed", EmbedRequest, EmbedResponse)
"""Worker (engines with `Feature.EMBEDDINGS`): one reply."""
SCORE = EndpointSpec("score", ScoreRequest, ScoreResponse)
"""Worker (engines with `Feature.SCORE`): one reply (/v1/rerank, /v1/score)."""
ENCODE = EndpointSpec("encode", EncodeRequest, EncodeReply)
"""Encode worker (`--role encode`): one reply; each image's embeddings held on it for one pull."""
KV_EVENTS_SINCE = EndpointSpec("kv_events_since", KvEventsSince, KvEventBatch)
"""Worker: the kept batches from that id on; error code `too_old` when they are gone."""
KV_DUMP = EndpointSpec("kv_dump", KvDumpQuery, KvDump)
"""Worker: one reply, the whole cached block set."""
KV_RELEASE = EndpointSpec("kv_release", KvRelease, bool)
KV_CLEAR = EndpointSpec("kv_clear", KvClear, KvCleared)
"""Worker (engines that are `ClearsKv`): one reply, the blocks evicted (POST /v1/admin/clear_kv_blocks)."""
"""Prefill worker: one reply, whether a held payload was freed."""
GROUP_JOIN = EndpointSpec("group_join", GroupJoin, GroupBeat)
"""Leader worker of a multi-node group: a follower's stream, one beat every `group.BEAT_S` while both live; the
stream's end is the loss of one of them, and the group's end (node_group.py)."""
BEST_WORKER = EndpointSpec("best_worker_id", BestWorkerQuery, BestWorkerReply)
"""`dyn router`: one reply, the backend `generate` would choose now; routes nothing."""
LORA = EndpointSpec("lora", LoraCommand, LoraReply)
"""Worker and `dyn router`: load or unload an adapter; one reply, once the worker's card says so."""
