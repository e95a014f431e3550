"""The ASGI app: it only routes. The generation APIs on a fast raw-ASGI path, the rest on Starlette.

`POST` to a generation API's path (translation.py's `APIS`: chat completions, completions, Responses, Messages)
and to the APIs with one JSON reply (unary.py's `UNARY_APIS`: embeddings, rerank, score, tokenize) are handled as
raw ASGI (no Request object, no per-request task group) by the edge's one request
lifecycle (lifecycle.py): they are the hot path. `/v1/models`, `/health`, `/live`, `/metrics` and the rest are
ordinary Starlette routes (rest.py). With API keys configured, every path but the probes (and `/metrics` unless
`--metrics-require-key`) passes `auth.Gate` first, before any body is read; with tracing on, each request runs in
its span.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dynamo_cli.config import FrontendConfig
from dynamo_cli.core.dispatch import DispatchRules
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.auth import Gate
from dynamo_cli.frontend.lifecycle import Lifecycle
from dynamo_cli.frontend.messages import MESSAGES_PATH, anthropic_errors
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.metrics_group import MetricsGroup
from dynamo_cli.frontend.replies import send_error
from dynamo_cli.frontend.rest import Rest
from dynamo_cli.frontend.served_models import FrontendRegistry
from dynamo_cli.frontend.tenants import KEY_INDEX_SCOPE
from dynamo_cli.frontend.translation import APIS, Api
from dynamo_cli.frontend.unary import UNARY_APIS
from dynamo_cli.tracing.traceparent import TRACE_SCOPE_KEY

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import Tracing

logger = logging.getLogger(__name__)


class Frontend:
    """The OpenAI-compatible HTTP service over a model registry: the gate, the request's span, then its route."""

    def __init__(
        self,
        config: FrontendConfig,
        registry: FrontendRegistry,
        metrics: FrontendMetrics,
        rules: DispatchRules,
        tracing: Tracing | None = None,
        group: MetricsGroup | None = None,
        instance_id: int = 0,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.tracing = tracing
        """Each OpenAI request's spans (`--otlp-endpoint`); None: tracing off."""
        self.lifecycle = Lifecycle(config, registry, metrics, rules, tracing)
        """Each generation request's steps, for every API; its `standby` is set by `dyn serve`."""
        self.rest = Rest(config, registry, metrics, group, instance_id)
        self.gate = Gate(config.auth) if config.auth.api_keys else None
        """The API-key gate (None: no keys configured, every path open)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(MESSAGES_PATH):
            send = anthropic_errors(send)  # Anthropic's clients read Anthropic's error shape
        if self.gate is not None and scope["type"] == "http" and not self.gate.is_open(scope["path"]):
            return await self._guarded(scope, receive, send, self.gate, self._route)
        await self._route(scope, receive, send)

    async def serve_api(self, api: Api, scope: Scope, receive: Receive, send: Send) -> None:
        """A request of `api` that came by another protocol (KServe gRPC, frontend/kserve/): past the same gate,
        through the same lifecycle."""
        route = functools.partial(self.lifecycle.serve, api)
        if self.gate is not None:
            return await self._guarded(scope, receive, send, self.gate, route)
        await route(scope, receive, send)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, gate: Gate, then: ASGIApp) -> None:
        try:
            admission = gate.admit(scope["headers"], time.monotonic())
        except RequestError as exc:
            logger.debug("refused %s %s from %s: %s", scope["method"], scope["path"], scope.get("client"), exc)
            self.metrics.refused.labels(exc.code).inc()
            return await send_error(send, exc)
        scope[KEY_INDEX_SCOPE] = admission.key_index  # the key's tenant (frontend/tenants.py)
        try:
            await then(scope, receive, send)
        finally:
            admission.release()

    def add_routes(self, routes: list[Route]) -> None:
        """More routes on the ordinary (Starlette) path, behind the API-key gate: the Batch API's."""
        self.rest.app.router.routes.extend(routes)

    async def serve_internal(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request from this process itself (frontend/internal.py): past the API-key gate, which let its
        batch in."""
        await self._route(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            if self.tracing is not None and TRACE_SCOPE_KEY not in scope:  # in the request's span, once
                return await self.tracing.serve_http(scope, receive, send, self._route)
            path = scope["path"]
            api = APIS.get(path)
            if api is not None:
                return await self.lifecycle.serve(api, scope, receive, send)
            unary = UNARY_APIS.get(path)
            if unary is not None:
                return await self.lifecycle.unary(unary, scope, receive, send)
        await self.rest.app(scope, receive, send)
