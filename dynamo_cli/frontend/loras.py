"""LoRA adapters at run time: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (vLLM's names and
bodies) and `GET /v1/loras`; the adapters' rows of `/v1/models`.

The frontend fans a load out to the base model's workers itself (core/loras.py); behind `dyn router`s
(`--router remote`) it hands the command to one router, which fans it out to its backends and advertises
the adapter in its own card. Either way the reply comes once this frontend lists the adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dynamo_cli.config import FrontendConfig
from dynamo_cli.config.lora import check_lora_name
from dynamo_cli.core import loras
from dynamo_cli.core.holds import ONLY_HUNG, Pool, Wanted, choose
from dynamo_cli.errors import ConfigError, DynError, RequestError
from dynamo_cli.frontend.openai import decode_body
from dynamo_cli.frontend.replies import error_response
from dynamo_cli.frontend.served_models import FrontendRegistry, ServedModel
from dynamo_cli.wire import LoraCommand

MAX_BODY = 64 * 1024


class LoadLora(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/load_lora_adapter`'s body (vLLM's, plus `base_model` when several models take adapters)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """vLLM's: reload the adapter of that name if one is served (unloaded, then loaded from `lora_path`, which
    must be the file it was served from: a name stands for one file, dynamo_cli/lora/adapters.py)."""
    base_model: str | None = None


class UnloadLora(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/unload_lora_adapter`'s body (vLLM's; `lora_int_id` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


_LOAD = msgspec.json.Decoder(LoadLora)
_UNLOAD = msgspec.json.Decoder(UnloadLora)


class LoraAdmin:
    """The adapter routes of one frontend over its registry."""

    def __init__(self, config: FrontendConfig, registry: FrontendRegistry) -> None:
        self._replicas = config.lora_replicas
        self._behind_routers = config.router == "remote"
        self._registry = registry
        self._busy: set[str] = set()
        """Adapter names with a load or unload under way here (a second one at once is refused)."""

    async def load(self, request: Request) -> Response:
        try:
            body: LoadLora = await request_body(request, _LOAD)
            return JSONResponse(await self._load(body))
        except DynError as exc:
            return error_response(exc)

    async def unload(self, request: Request) -> Response:
        try:
            body: UnloadLora = await request_body(request, _UNLOAD)
            return JSONResponse(await self._unload(body.lora_name))
        except DynError as exc:
            return error_response(exc)

    async def listing(self, request: Request) -> Response:
        """`GET /v1/loras`: every adapter, its base and where it is served and loaded."""
        return JSONResponse({"object": "list", "data": adapter_rows(self._registry, detail=True)})

    ##### Load and unload #####

    async def _load(self, body: LoadLora) -> dict[str, Any]:
        name = body.lora_name
        try:
            check_lora_name(name, "lora_name")
        except ConfigError as exc:
            raise RequestError(str(exc), param="lora_name") from None
        if name in self._registry.models:
            raise RequestError(f"'{name}' is a base model's name", param="lora_name")
        if name in self._registry.adapters:
            if not body.load_inplace:
                raise RequestError(f"the LoRA adapter '{name}' has already been loaded", param="lora_name")
            await self._unload(name)
        entry = self._base(body.base_model)
        command = LoraCommand(action="load", name=name, path=body.lora_path)
        with _claim(self._busy, name):
            if self._behind_routers:
                await self._via_router(entry, command)
                workers: list[str] = []  # the router's backends: its business
            else:
                taken = await loras.load(self._registry, entry, command, self._replicas)
                workers = [f"{w.instance_id:x}" for w in taken]
        return {"object": "lora_adapter", "id": name, "parent": entry.name, "status": "loaded", "workers": workers}

    async def _unload(self, name: str) -> dict[str, Any]:
        with _claim(self._busy, name):
            if self._behind_routers:
                entry, _ = self._registry.resolve(name)
                await self._via_router(entry, LoraCommand(action="unload", name=name))
            else:
                entry = await loras.unload(self._registry, name)
        return {"object": "lora_adapter", "id": name, "parent": entry.name, "status": "unloaded"}

    async def _via_router(self, entry: ServedModel, command: LoraCommand) -> None:
        """Hand the command to one of the model's `dyn router`s; wait to see its card list the adapter (or not)."""
        pool = Pool(entry.name, entry.workers, noun="routers")
        hold = choose(pool, Wanted(f"lora-{command.action}-{command.name}"), ONLY_HUNG)
        try:
            await loras.call(hold, command)
        except DynError as exc:
            raise loras.client_error(exc, "lora_path") from None
        finally:
            hold.release()
        is_load = command.action == "load"
        await loras.seen(self._registry, lambda: (command.name in self._registry.adapters) == is_load)

    def _base(self, base_model: str | None) -> ServedModel:
        """The model the adapter goes over: `base_model`, or the one model whose workers take adapters."""
        if base_model is not None:
            return self._registry.get(base_model)
        takers = [e for e in self._registry.servable() if any(w.card.max_loras for w in e.workers.values())]
        if len(takers) != 1:
            names = ", ".join(e.name for e in takers) or "none"
            raise RequestError(
                f"{len(takers)} models here take LoRA adapters ({names}); name one in base_model", param="base_model"
            )
        return takers[0]


@contextlib.contextmanager
def _claim(busy: set[str], name: str) -> Iterator[None]:
    """One load or unload of a name at a time (a second is the client's 400, to retry)."""
    if name in busy:
        raise RequestError(f"the LoRA adapter '{name}' is being loaded or unloaded; retry", param="lora_name")
    busy.add(name)
    try:
        yield
    finally:
        busy.discard(name)


def adapter_rows(registry: FrontendRegistry, *, detail: bool = False) -> list[dict[str, Any]]:
    """One `/v1/models` row per served adapter (its base as `parent`, as vLLM lists them); `detail`: with the
    workers serving it and those that have it loaded (`/v1/loras`)."""
    rows = []
    for name, entry in sorted(registry.adapters.items()):
        row: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "dyn",
            "root": name,
            "parent": entry.name,
            "max_model_len": entry.card.context_length,
        }
        if detail:
            serving = [w for w in entry.workers.values() if w.adapters.serves(name)]
            row["workers"] = [f"{w.instance_id:x}" for w in serving]
            row["loaded_on"] = [f"{w.instance_id:x}" for w in serving if w.adapters.is_resident(name)]
        rows.append(row)
    return rows


async def request_body(request: Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    """The JSON body, decoded (a 400 naming the field), at most MAX_BODY bytes."""
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise RequestError(f"the request body is over {MAX_BODY} bytes", param="body")
    return decode_body(decoder, body)
