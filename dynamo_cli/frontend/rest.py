"""The frontend's ordinary routes (Starlette): `/v1/models`, the LoRA admin routes, `/health`, `/live`, `/metrics` and
`/openapi.json`, with OpenAI-shaped 404/405/500 pages; the generation APIs take the raw ASGI path (app.py)."""

from __future__ import annotations

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dynamo_cli.config import FrontendConfig
from dynamo_cli.core.holds import pool_targets
from dynamo_cli.frontend.admin import Admin
from dynamo_cli.frontend.loras import LoraAdmin, adapter_rows
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.frontend.metrics_group import MetricsGroup
from dynamo_cli.frontend.openai import error_body
from dynamo_cli.frontend.openapi import openapi_document
from dynamo_cli.frontend.replies import internal
from dynamo_cli.frontend.served_models import FrontendRegistry
from dynamo_cli.routing.base import InFlightLoad, PolicySnapshot


class Rest:
    """The Starlette routes over the frontend's registry and metrics; `app` serves them."""

    def __init__(
        self,
        config: FrontendConfig,
        registry: FrontendRegistry,
        metrics: FrontendMetrics,
        group: MetricsGroup | None,
        instance_id: int,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.group = group
        """`dyn serve --frontends N`: /metrics shows the group's totals."""
        self.instance_id = instance_id
        """This frontend's id on the planes (its lease), which `/health` names."""
        self._openapi = msgspec.json.encode(openapi_document())
        loras, admin = LoraAdmin(config, registry), Admin(config, registry)
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.list_models),
                Route("/v1/load_lora_adapter", loras.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", loras.unload, methods=["POST"]),
                Route("/v1/loras", loras.listing),
                Route("/v1/admin/clear_kv_blocks", admin.clear_kv_blocks, methods=["POST"]),
                Route("/health", self.health),
                Route("/live", self.live),
                Route("/metrics", self.prometheus),
                Route("/openapi.json", self.openapi),
            ],
            exception_handlers={404: _not_found, 405: _not_found, Exception: _server_error},
        )

    async def list_models(self, request: Request) -> Response:
        # servable(): a model only prefill workers serve has nothing to decode on, so it is not listed
        data = [
            {
                "id": e.name,
                "object": "model",
                "created": 0,
                "owned_by": "dyn",
                "max_model_len": e.card.context_length,
                "num_workers": len(e.workers) + len(e.prefill_workers),
            }
            for e in self.registry.servable()
        ]
        return JSONResponse({"object": "list", "data": data + adapter_rows(self.registry)})

    async def health(self, request: Request) -> Response:
        instances = []
        for e in self.registry.servable():
            workers = {**e.workers, **e.prefill_workers, **e.encode_workers}
            by_worker: dict[int, list[tuple[int, InFlightLoad]]] = {}
            for target, load in e.policy.snapshot(pool_targets(workers, list(workers))).in_flight.items():
                by_worker.setdefault(target.worker, []).append((target.rank, load))
            for wid, w in workers.items():
                row: dict[str, object] = {
                    "model": e.name,
                    "instance_id": f"{wid:x}",
                    "address": w.record.address,
                    "role": w.card.role,
                }
                if w.hung is not None:
                    row["hung"] = w.hung
                loads = by_worker.get(wid, [])
                if loads:  # the KV router's count (every replica's, with replica sync)
                    row |= {
                        "in_flight_requests": sum(load.num_requests for _, load in loads),
                        "active_blocks": sum(load.active_blocks for _, load in loads),
                    }
                if w.card.is_ranked:
                    row["ranks"] = [{"dp_rank": r, "in_flight_requests": x.num_requests} for r, x in loads]
                instances.append(row)
        healthy = bool(instances)
        body: dict[str, object] = {"status": "healthy" if healthy else "unhealthy", "frontend": f"{self.instance_id:x}"}
        body["instances"] = instances
        body["sessions"] = {e.name: len(e.sessions) for e in self.registry.servable()}
        if not healthy:
            body["message"] = "No endpoints available"
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type="application/json")

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    def metrics_text(self) -> bytes:
        """What `/metrics` shows: this frontend's registry, or with `--frontends N` the group's totals."""
        if self.group is not None:
            return self.group.merged(self.refresh_metrics)
        self.refresh_metrics()
        return generate_latest(self.metrics.registry)

    def refresh_metrics(self) -> None:
        """Set the gauges read at scrape time: workers, queues, KV tiers, the router's counters."""
        snapshots: dict[str, PolicySnapshot] = {}
        for name, entry in self.registry.models.items():
            self.metrics.workers.labels(name).set(len(entry.workers) + len(entry.prefill_workers))
            self.metrics.queued.labels(name).set(len(entry.queue))
            for worker in (*entry.workers.values(), *entry.prefill_workers.values()):
                if worker.load is not None and worker.load.kv_tiers is not None:
                    self.metrics.export_kv_tiers(name, worker.instance_id, worker.load.kv_tiers)
            snapshot = snapshots[name] = entry.policy.snapshot()
            if snapshot.counters:  # a policy that counts (the KV router)
                self.metrics.export_router(name, snapshot.counters)
        self.metrics.export_workers(
            (name, worker, snapshots[name].precise)
            for name, entry in self.registry.models.items()
            for worker in (*entry.workers.values(), *entry.prefill_workers.values())
        )


async def _server_error(request: Request, exc: Exception) -> Response:
    error = internal(exc, f"serving {request.method} {request.url.path}")
    return Response(
        error_body(str(error), "internal_error", None, "internal_error"),
        status_code=500,
        media_type="application/json",
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    message = f"no route {request.method} {request.url.path}" if status == 404 else f"{request.method} not allowed"
    return Response(
        error_body(message, "not_found_error" if status == 404 else "invalid_request_error"),
        status_code=status,
        media_type="application/json",
    )
