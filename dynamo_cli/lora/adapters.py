"""The adapters one worker serves, and the ones it has loaded.

An adapter is served from `--lora NAME=PATH` or a run-time load (`lora` endpoint) until it is unloaded; at
most `--max-loras` are loaded at once. A request for a served adapter that is not loaded loads it first
(counted in `loads`), evicting the least recently used adapter no request is running with; when every loaded
adapter is in use the request waits up to LOAD_WAIT_S, then fails as Overloaded (503). A request pins its
adapter while it runs: eviction and unloading never pull an adapter out from under a stream (an unload of an
adapter in use stops new requests at once and frees it when its last stream ends).

Run-time loads read a file the caller names on this worker's machine, which the engine's own parser then
reads: only files inside the `--lora-dir` folders (and the folders of the `--lora` files) are accepted.

NOTE: block hashes are seeded by the adapter's name alone (Dynamo's rule), so KV computed under one file of
a name would be taken for another file's under the same name (the engine's cached prefixes, the KV tiers, the
routers' indexes). A name therefore stands for one file for the worker's lifetime: loading it again from
another path, or from a file changed since (size, mtime), is refused; a new version takes a new name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from dynamo_cli.config.lora import check_lora_name
from dynamo_cli.engine import ServesLoras
from dynamo_cli.errors import ConfigError, ModelNotFound, Overloaded, RequestError

logger = logging.getLogger(__name__)

LOAD_WAIT_S = 30.0
"""How long a request waits for a loaded adapter to fall idle when every one is in use."""


class AdapterSet:
    """A worker's served and loaded adapters over one engine (`engine.ServesLoras`; None: it serves none)."""

    def __init__(self, engine: ServesLoras | None, engine_name: str, max_loras: int, dirs: Iterable[str]) -> None:
        self._engine = engine
        self._engine_name = engine_name
        self._base_model = ""
        self.max_loras = max_loras
        self._dirs = [Path(d).expanduser().resolve() for d in dirs]
        self.served: dict[str, str] = {}
        """Adapter name -> its file."""
        self._identity: dict[str, tuple[str, int, int]] = {}
        """Every name ever served here -> (path, size, mtime) of its file: one file per name (see the NOTE)."""
        self.resident: OrderedDict[str, None] = OrderedDict()
        """Loaded adapters, least recently used first."""
        self._pins: dict[str, int] = {}
        self._lock = asyncio.Lock()
        """Loads and evictions, one at a time."""
        self._freed = asyncio.Event()
        """Set when a pin is dropped (an adapter may have fallen idle)."""
        self.loads = 0
        """Adapters loaded since start (a reload after an eviction counts again)."""
        self.evictions = 0
        self.last_load_s = 0.0
        """Seconds the last load took."""

    @property
    def is_enabled(self) -> bool:
        return self._engine is not None

    async def start(self, base_model: str, adapters: dict[str, str]) -> None:
        """Serve the `--lora` adapters over `base_model` (no adapter may take its name): each file is loaded
        once (its check), the last `max_loras` stay loaded. ConfigError for an engine without adapters or a
        file the engine refuses."""
        self._base_model = base_model
        if adapters and self._engine is None:
            raise ConfigError(f"--lora: the {self._engine_name} engine serves no LoRA adapters")
        found = [Path(path).expanduser().resolve().parent for path in adapters.values()]
        self._dirs = list(dict.fromkeys([*self._dirs, *found]))
        for name, path in adapters.items():
            try:
                await self.add(name, path)
            except RequestError as exc:
                raise ConfigError(f"--lora {name}={path}: {exc.message}") from None

    ##### Serving set #####

    async def add(self, name: str, path: str) -> None:
        """Serve adapter `name` from `path` (loaded now: a bad file is refused here, with RequestError)."""
        if self._engine is None:
            raise RequestError(f"the {self._engine_name} engine serves no LoRA adapters", param="lora_name")
        try:
            check_lora_name(name, "lora_name")
        except ConfigError as exc:
            raise RequestError(str(exc), param="lora_name") from None
        if name in self.served or name == self._base_model:
            raise RequestError(f"the LoRA adapter '{name}' is already served here", param="lora_name")
        if name in self._pins:  # unloaded, and requests still run with it: it is freed when they end
            raise RequestError(
                f"the LoRA adapter '{name}' is being unloaded; retry once its requests end", param="lora_name"
            )
        file = self._allowed(path)
        identity = _identity(file)
        if self._identity.get(name, identity) != identity:
            raise RequestError(
                f"the LoRA adapter name '{name}' was served here from another file (or this file changed since); "
                "its cached KV would be reused: load the new version under a new name",
                param="lora_name",
            )
        async with self._lock:
            await self._make_room()
            await self._load(name, file)
        self.served[name] = file
        self._identity[name] = identity  # once loaded: a file the engine refused binds nothing

    async def remove(self, name: str) -> None:
        """Stop serving `name`; freed now, or when its last stream ends. ModelNotFound if it is not served."""
        if name not in self.served:
            raise ModelNotFound(name, list(self.served))
        del self.served[name]
        if not self._pins.get(name):
            async with self._lock:
                await self._unload(name)

    def _allowed(self, path: str) -> str:
        """`path` resolved, if it exists inside an allowed folder; else RequestError(param="lora_path")."""
        if not path:
            raise RequestError("lora_path is missing: name the adapter file", param="lora_path")
        file = Path(path).expanduser().resolve()
        if not any(file.is_relative_to(folder) for folder in self._dirs):
            allowed = ", ".join(map(str, self._dirs)) or "none (start the worker with --lora-dir)"
            raise RequestError(
                f"{path} is outside the folders adapters may be loaded from ({allowed})", param="lora_path"
            )
        if not file.exists():  # a file (GGUF) or a folder (PEFT: adapter_config.json and weights)
            raise RequestError(f"{path} does not exist on the worker", param="lora_path")
        return str(file)

    ##### Requests #####

    @contextlib.asynccontextmanager
    async def using(self, name: str) -> AsyncIterator[None]:
        """Run a request with adapter `name` ("": the base model, nothing to do): loaded first if it is not,
        pinned until the body ends. ModelNotFound for an adapter not served here."""
        if not name:
            yield
            return
        if name not in self.served:
            raise ModelNotFound(name, list(self.served))
        self._pins[name] = self._pins.get(name, 0) + 1
        try:
            if name not in self.resident:
                async with self._lock:
                    if name not in self.resident:
                        await self._make_room()
                        await self._load(name, self.served[name])
            self.resident.move_to_end(name)
            yield
        finally:
            await self._unpin(name)

    async def _unpin(self, name: str) -> None:
        self._pins[name] -= 1
        if self._pins[name]:
            return
        del self._pins[name]
        self._freed.set()
        if name not in self.served and name in self.resident:  # unloaded while it ran
            async with self._lock:
                await self._unload(name)

    ##### Loading #####

    async def _make_room(self) -> None:
        """Evict idle adapters, least recently used first, until one more fits (the lock is held)."""
        deadline = time.monotonic() + LOAD_WAIT_S
        while len(self.resident) >= self.max_loras:
            victim = next((name for name in self.resident if not self._pins.get(name)), None)
            if victim is not None:
                await self._unload(victim)
                self.evictions += 1
                continue
            self._freed.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):  # wait_for can swallow a cancel
                    await self._freed.wait()
            except TimeoutError:
                raise Overloaded(
                    f"all {len(self.resident)} loaded LoRA adapters (--max-loras {self.max_loras}) are in use "
                    f"for {LOAD_WAIT_S:.0f} s"
                ) from None

    async def _load(self, name: str, file: str) -> None:
        assert self._engine is not None
        started = time.perf_counter()
        await self._engine.load_lora(name, file)
        self.last_load_s = time.perf_counter() - started
        self.resident[name] = None
        self.loads += 1
        logger.info("LoRA adapter %s loaded from %s in %.3f s", name, file, self.last_load_s)

    async def _unload(self, name: str) -> None:
        if name in self.resident and self._engine is not None:
            del self.resident[name]
            await self._engine.unload_lora(name)


def _identity(file: str) -> tuple[str, int, int]:
    """(path, size, newest mtime) of an adapter file, or of a folder and the files in it (PEFT)."""
    path = Path(file)
    entries = [path, *path.iterdir()] if path.is_dir() else [path]
    stats = [entry.stat() for entry in entries]
    return file, sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats)
