"""`--engine http`: a worker whose engine is an OpenAI-compatible server it forwards to (`--engine-arg url=...`).

NOTE: the worker registers, is routed to, migrated from and health-checked as any other; each request goes on as
the backend's own streamed `/v1/completions` with the prompt's token ids, and closing its stream closes the HTTP
request, which the backend aborts. A backend that does not answer, or fails on its side, raises
BackendUnavailable: the request moves to another worker and this one is out of routing until a canary (a one-token
generation, through to the backend) gets through. With `--engine-arg kv_events=` the backend's own KV events are
relayed as this worker's (events.py) and a KV router routes to it from them; without, approximately (its own
decisions stand in for the cache). The router's block size is the backend's where its `/metrics` says it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import httpx
import msgspec

from dynamo_cli.engine import EngineArgs, EngineInfo, Feature, Role, check_request, check_token_ids
from dynamo_cli.errors import BackendUnavailable, ConfigError, DynError, RequestError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.model.paths import model_vocab_size, resolve_model_path
from dynamo_cli.model.tokenizer import Tokenizer, load_tokenizer
from dynamo_cli.wire import GenerateChunk, GenerateRequest, LoadMetrics, SamplingParams, TokenLogprob

from .events import BackendEvents
from .options import DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS, HttpOptions
from .scrape import Scraper
from .upstream import (
    FINISH_REASONS,
    Dialect,
    Event,
    Model,
    completion_body,
    events,
    models_of,
    refusal,
    token_logprobs,
)

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096
"""The context assumed for a backend whose `/v1/models` does not say (`--context-length` sets it)."""

POLL_S = 0.5
"""How often a backend that is not up yet is asked again at start."""


class HttpEngine:
    """The backend at `--engine-arg url=` as this worker's engine."""

    def __init__(self, args: EngineArgs) -> None:
        if args.role is not Role.BOTH:
            raise ConfigError(f"--engine http serves --role both (the backend prefills and decodes), not {args.role}")
        self.args = args
        self.options = HttpOptions.of(args.extra)
        self._client: httpx.AsyncClient | None = None
        self._tokenizer: Tokenizer | None = None
        self._info: EngineInfo | None = None
        self._model = ""
        self._dialect = Dialect(token_ids=False)
        self._in_flight: set[str] = set()
        self._stopped = asyncio.Event()
        self._scraper: Scraper | None = None
        self._scraping: asyncio.Task[None] | None = None
        self._events: BackendEvents | None = None
        self._blocks = DEFAULT_BLOCKS

    async def start(self) -> EngineInfo:
        """Wait for the backend to list its model, learn its dialect with a one-token completion, and describe it."""
        if self._info is not None:
            return self._info
        source = resolve_model_path(self.args.model)
        self._tokenizer = await asyncio.to_thread(load_tokenizer, source)
        o = self.options
        timeout = httpx.Timeout(o.read_timeout_s, connect=o.connect_timeout_s, write=30.0, pool=o.connect_timeout_s)
        headers = {"authorization": f"Bearer {o.api_key}"} if o.api_key else {}
        limits = httpx.Limits(max_connections=o.max_num_seqs + 4, max_keepalive_connections=o.max_num_seqs)
        self._client = httpx.AsyncClient(base_url=o.url, timeout=timeout, headers=headers, limits=limits)
        model = await self._wait_for_model()
        self._model = model.id
        self._dialect = await self._dialect_of()
        self._scraper = Scraper(self._client)  # the engine owns the task; stop() cancels it
        if await self._scraper.scrape():  # its cache's shape first, for the card
            self._scraping = asyncio.get_running_loop().create_task(self._scraper.run(), name="http-engine-scrape")
        self._info = self._describe(model, source)
        if o.kv_events is not None:
            self._events = BackendEvents(o.kv_events, o.kv_replay, o.kv_topic, self._info.block_size, o.url)
            self._events.start()
        if not self._dialect.token_ids:
            logger.warning(
                "backend %s returns no token ids (vLLM's return_token_ids): its text is tokenized again here, "
                "in the text dialect (the text is the same; token counts can differ)",
                o.url,
            )
        return self._info

    def _describe(self, model: Model, source: str) -> EngineInfo:
        assert self._tokenizer is not None
        context = model.max_model_len or self.args.context_length or DEFAULT_CONTEXT
        if not model.max_model_len and not self.args.context_length:
            logger.warning("backend %s does not say its context; assuming %d (--context-length)", model.id, context)
        assert self._scraper is not None
        shape = self._scraper.shape
        block_size = self._block_size(shape.block_size)
        self._blocks = self.options.num_gpu_blocks or shape.num_gpu_blocks or DEFAULT_BLOCKS
        return EngineInfo(
            model_name=self.args.served_model_name or model.id,
            tokenizer_source=source,
            block_size=block_size,
            context_length=context,
            total_kv_blocks=self._blocks,
            max_num_seqs=self.options.max_num_seqs,
            eos_token_ids=self._tokenizer.eos_token_ids,
            vocab_size=model_vocab_size(source),
            extra={"backend": self.options.url, "dialect": "token_ids" if self._dialect.token_ids else "text"},
            features=frozenset({Feature.PENALTIES, Feature.LOGIT_BIAS, Feature.MIN_P})
            | ({Feature.LOGPROBS} if self._dialect.logprobs else set()),
        )

    def _block_size(self, stated: int | None) -> int:
        """`--block-size`, else the backend's own; with its KV events, the two must be one."""
        given = self.args.block_size
        if given and stated and given != stated and self.options.kv_events is not None:
            raise ConfigError(
                f"--block-size {given}: the backend at {self.options.url} caches {stated}-token blocks (its "
                f"/metrics), so none of its KV events could match; drop --block-size"
            )
        return given or stated or DEFAULT_BLOCK_SIZE

    async def _wait_for_model(self) -> Model:
        """The backend's model (the one named by `served_model`, else the only one listed), asked for until the
        backend answers or `start_timeout_s` passes."""
        deadline, problem = time.monotonic() + self.options.start_timeout_s, "no answer yet"
        while time.monotonic() < deadline:
            try:
                return self._pick(models_of(await self._get("/v1/models")))
            except BackendUnavailable as exc:
                problem = str(exc)
            await asyncio.sleep(POLL_S)
        raise DynError(f"the backend at {self.options.url} did not list a model within "
                       f"{self.options.start_timeout_s:.0f} s: {problem}")  # fmt: skip

    def _pick(self, models: list[Model]) -> Model:
        wanted = self.options.served_model
        found = [m for m in models if m.id == wanted] if wanted else models
        if len(found) == 1:
            return found[0]
        names = ", ".join(m.id for m in models) or "none"
        if wanted:
            raise ConfigError(f"the backend at {self.options.url} serves no model {wanted!r} (it serves {names})")
        raise ConfigError(f"the backend at {self.options.url} serves {names}: name one with --engine-arg served_model=")

    async def _get(self, path: str) -> bytes:
        assert self._client is not None
        try:
            response = await self._client.get(path)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"{self.options.url}{path}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise BackendUnavailable(f"{self.options.url}{path} answered {response.status_code}")
        return response.content

    async def _dialect_of(self) -> Dialect:
        """Token ids if a one-token completion asking for them gets them, else text (a server that refuses the
        field, or ignores it)."""
        assert self._tokenizer is not None
        probe = GenerateRequest(request_id="dyn-dialect-probe", token_ids=self._tokenizer.encode("Hello"), max_tokens=1)
        exact, text = Dialect(token_ids=True), Dialect(token_ids=False)
        try:
            chunks = [chunk async for chunk in self._forward(probe, exact)]
        except RequestError:
            try:
                chunks = [chunk async for chunk in self._forward(probe, text)]
            except RequestError as exc:
                raise ConfigError(
                    f"the backend at {self.options.url} refuses a completion of token ids: {exc}"
                ) from None
            return text
        if not any(chunk.token_ids for chunk in chunks):
            return text
        scored = Dialect(token_ids=True, logprobs=True)
        probe = msgspec.structs.replace(probe, sampling=SamplingParams(logprobs=1))
        with contextlib.suppress(RequestError, BackendUnavailable):  # logprobs not named by id: not forwarded
            if any(chunk.logprobs for chunk in [chunk async for chunk in self._forward(probe, scored)]):
                return scored
        return exact

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The backend's stream of `request`; closing this iterator closes the HTTP request (the backend aborts)."""
        info = self._info
        if info is None or self._stopped.is_set():
            raise DynError("the http engine is not started (or stopped)")
        check_request(request, info.context_length, self._in_flight, info.vocab_size)
        if self._events is not None:
            self._events.sent(request.token_ids)
        self._in_flight.add(request.request_id)
        try:
            async for chunk in self._forward(request, self._dialect):
                yield chunk
        finally:
            self._in_flight.discard(request.request_id)

    async def _forward(self, request: GenerateRequest, dialect: Dialect) -> AsyncIterator[GenerateChunk]:
        assert self._client is not None
        body, reason, cached = completion_body(request, self._model, dialect), None, None
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise await refusal(response)
                async for event in events(response):
                    token_ids = self._token_ids(event, dialect)
                    if token_ids:
                        yield GenerateChunk(token_ids=token_ids, logprobs=self._logprobs(event, request, token_ids))
                    reason = next((c.finish_reason for c in event.choices if c.finish_reason), reason)
                    cached = event.cached_tokens if event.cached_tokens is not None else cached
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"the backend at {self.options.url}: {type(exc).__name__}: {exc}") from None
        if reason is None:
            raise BackendUnavailable(f"the backend at {self.options.url} ended a stream without a finish reason")
        yield GenerateChunk(token_ids=[], finish_reason=FINISH_REASONS.get(reason, "stop"), num_cached_tokens=cached)

    def _logprobs(self, event: Event, request: GenerateRequest, token_ids: list[int]) -> list[TokenLogprob] | None:
        """The piece's logprobs, where the request asked for them (the logprobs dialect: named by token id)."""
        top_n = request.sampling.logprobs
        if top_n is None or not event.choices:
            return None
        logprobs = event.choices[0].logprobs
        if logprobs is None:
            raise BackendUnavailable(f"the backend at {self.options.url} sent a piece without the logprobs asked for")
        return token_logprobs(logprobs, len(token_ids), top_n)

    def _token_ids(self, event: Event, dialect: Dialect) -> list[int]:
        """The event's new token ids: the backend's own, or its text tokenized again; ids outside the vocabulary
        are the backend's fault (it serves another model than the tokenizer's)."""
        if not event.choices:
            return []
        choice = event.choices[0]
        if dialect.token_ids and choice.token_ids is not None:
            token_ids = choice.token_ids
        else:
            assert self._tokenizer is not None
            token_ids = self._tokenizer.encode(choice.text) if choice.text else []
        try:
            check_token_ids(token_ids, "token_ids", self._info.vocab_size if self._info is not None else 0)
        except RequestError as exc:
            raise BackendUnavailable(f"the backend at {self.options.url} sent {exc.message}") from None
        return token_ids

    async def kv_events(self) -> AsyncIterator[KvEventBatch]:
        """The backend's KV events, re-hashed (`kv_events=`); none without (a KV router routes approximately).
        Ends at stop()."""
        if self._events is not None:
            async for batch in self._events.batches():
                yield batch
            return
        await self._stopped.wait()
        nothing: tuple[KvEventBatch, ...] = ()
        for batch in nothing:
            yield batch

    def load_metrics(self) -> LoadMetrics:
        """The backend's own load where its `/metrics` shows it (every client's requests, its KV usage), else the
        requests this worker has there."""
        blocks, mine = self._blocks, len(self._in_flight)
        load = self._scraper.load if self._scraper is not None else None
        if load is None:
            return LoadMetrics(num_running=mine, total_blocks=blocks)
        running = max(load.running, mine - load.waiting)  # the scrape is up to a second old
        return LoadMetrics(
            num_running=running,
            num_waiting=load.waiting,
            active_blocks=int(load.kv_usage * blocks),
            total_blocks=blocks,
        )

    async def stop(self) -> None:
        """Close the connections to the backend (its open requests are aborted by it). Idempotent."""
        self._stopped.set()
        if self._scraping is not None:
            self._scraping.cancel()
            await asyncio.gather(self._scraping, return_exceptions=True)
        if self._events is not None:
            await self._events.close()
        if self._client is not None:
            await self._client.aclose()
