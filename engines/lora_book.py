"""The LoRA adapters an engine library holds: each file checked before the library reads it, and its int id.

vLLM, SGLang and TensorRT-LLM take HF PEFT adapter folders (`adapter_config.json` with the rank `r` and the
`target_modules`, and `adapter_model.safetensors` or `.bin`); TensorRT-LLM takes NeMo `.nemo` archives too.
The path comes from a remote caller (the worker's `lora` endpoint) and a library reads it in its engine
process, so `check_adapter` refuses, as the caller's mistake (RequestError, param "lora_path"), whatever is not
one before the library sees it. `LoraBook` gives each load a fresh int id (vLLM's and TensorRT-LLM's
`lora_int_id`, from 1, never reused: both libraries cache adapters by id, so a name loaded again from another
folder must not find the old weights), and maps the ids back to names for KV events that carry only the id.
This module imports no inference library; the vllm, sglang and trtllm adapters share it (as `adapter.py`).
"""

from __future__ import annotations

import json
import logging
import tarfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from dynamo_cli.errors import RequestError
from dynamo_cli.wire import GenerateRequest

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_CONFIG_BYTES = 1 << 20
"""Largest adapter_config.json read (PEFT writes about 1 KiB)."""
NUM_RETIRED_NAMES = 256
"""Unloaded adapters whose id -> name is kept, for KV events published after the unload."""


@dataclass(frozen=True, slots=True)
class LoadedLora:
    """One adapter as the library knows it."""

    name: str
    """Its served name (the request's `lora`, the library's `lora_name`)."""
    lora_id: int
    """The library's `lora_int_id` (from 1)."""
    path: str
    """The adapter, resolved: a PEFT folder or a `.nemo` file."""
    source: str = "hf"
    """`hf` (PEFT) or `nemo` (TensorRT-LLM's `lora_ckpt_source`)."""


def check_adapter(path: str, max_rank: int | None = None, *, takes_nemo: bool = False) -> tuple[Path, str]:
    """The adapter at `path`, resolved, and its kind (`hf`, or `nemo` where `takes_nemo`), once it is an HF
    PEFT LoRA folder of rank at most `max_rank` (None: unchecked), or a NeMo archive; else RequestError
    (param "lora_path") naming what is wrong."""
    resolved = Path(path).expanduser().resolve()
    if takes_nemo and resolved.suffix == ".nemo" and resolved.is_file():
        if not tarfile.is_tarfile(resolved):
            raise _refused(path, "is not a NeMo archive (a .nemo file is a tar archive)")
        return resolved, "nemo"
    if not resolved.is_dir():
        kinds = "an HF PEFT adapter folder or a .nemo file" if takes_nemo else "an HF PEFT adapter folder"
        raise _refused(path, f"is not {kinds}")
    config = _read_config(path, resolved / CONFIG_FILE)
    peft_type = str(config.get("peft_type") or "LORA")
    if peft_type.upper() != "LORA":
        raise _refused(path, f"is a {peft_type} adapter, not a LoRA one")
    rank = config.get("r", config.get("rank"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise _refused(path, f"has no positive integer rank `r` in {CONFIG_FILE} (found {rank!r})")
    if max_rank is not None and rank > max_rank:
        raise _refused(path, f"has rank {rank}, above the engine's max_lora_rank {max_rank}; start it with more")
    modules = config.get("target_modules")
    modules = [modules] if isinstance(modules, str) else modules  # PEFT also takes one name, or a regex
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) and m for m in modules):
        raise _refused(path, f"names no target_modules in {CONFIG_FILE}")
    if not any((resolved / name).is_file() for name in WEIGHT_FILES):
        raise _refused(path, f"holds no weights ({' or '.join(WEIGHT_FILES)})")
    return resolved, "hf"


def _read_config(path: str, file: Path) -> dict[str, object]:
    if not file.is_file():
        raise _refused(path, f"has no {CONFIG_FILE}")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise _refused(path, f"has a {CONFIG_FILE} over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refused(path, f"has a {CONFIG_FILE} that is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _refused(path, f"has a {CONFIG_FILE} that is not a JSON object")
    return config


def _refused(path: str, problem: str) -> RequestError:
    return RequestError(f"LoRA adapter {path} {problem}", param="lora_path")


LibraryCall = Callable[[LoadedLora], Awaitable[object]]
"""An adapter's load into (or removal from) the library; it answers as `_refusal` reads."""


class LoraBook:
    """The adapters one engine's library holds, by served name; `max_loras` 0: LoRA is off there. `add` and
    `remove` put an adapter into the library and take it out."""

    def __init__(
        self, engine: str, max_loras: int, add: LibraryCall, remove: LibraryCall, *, takes_nemo: bool = False
    ) -> None:
        self.engine = engine
        self.max_loras = max_loras
        self._add, self._remove = add, remove
        self.takes_nemo = takes_nemo
        self.loaded: dict[str, LoadedLora] = {}
        self._next_id = 1
        self._retired: OrderedDict[int, str] = OrderedDict()

    async def load(self, name: str, path: str, max_rank: int | None = None) -> None:
        """Check the adapter, then add it to the library under a fresh id; RequestError (param "lora_path")
        when LoRA is off, the file is not an adapter, or the library refuses it (an exception, False, or a
        result whose `success` is false, with the library's message). The same name and path again: nothing;
        the name from another path: the old adapter is removed first (SGLang refuses a name twice)."""
        if self.max_loras <= 0:
            raise RequestError(
                f"the {self.engine} engine was started without LoRA; start the worker with --lora or --lora-dir",
                param="lora_path",
            )
        resolved, source = check_adapter(path, max_rank, takes_nemo=self.takes_nemo)
        old = self.loaded.get(name)
        if old is not None and old.path == str(resolved):
            return
        if old is not None:
            await self.unload(name)
        lora = LoadedLora(name=name, lora_id=self._next_id, path=str(resolved), source=source)
        self._next_id += 1
        try:
            result = await self._add(lora)
        except Exception as exc:  # the library's own check of the file: the caller's mistake, the engine serves on
            raise RequestError(f"{self.engine} refused LoRA adapter {path}: {exc}", param="lora_path") from exc
        problem = _refusal(result)
        if problem is not None:
            raise RequestError(f"{self.engine} refused LoRA adapter {path}: {problem}", param="lora_path")
        self.loaded[name] = lora

    async def unload(self, name: str) -> None:
        """Take adapter `name` out of the library; idempotent. A library that cannot free it is logged, not
        raised: the worker has stopped serving it either way."""
        lora = self.loaded.pop(name, None)
        if lora is None:
            return
        self._retire(lora)
        try:
            problem = _refusal(await self._remove(lora))
        except Exception as exc:
            problem = str(exc)
        if problem is not None:
            logger.warning("%s: LoRA adapter %s (id %d) not freed: %s", self.engine, name, lora.lora_id, problem)

    def of(self, request: GenerateRequest) -> LoadedLora | None:
        """The loaded adapter a request runs with (None: the base model); RequestError (param "model") when
        it names one not loaded here."""
        if not request.lora:
            return None
        lora = self.loaded.get(request.lora)
        if lora is None:
            raise RequestError(f"LoRA adapter '{request.lora}' is not loaded here; load it first", param="model")
        return lora

    def name_of(self, lora_id: int) -> str | None:
        """The served name of library id `lora_id` (loaded, or among the last NUM_RETIRED_NAMES unloaded)."""
        for lora in self.loaded.values():
            if lora.lora_id == lora_id:
                return lora.name
        return self._retired.get(lora_id)

    def _retire(self, lora: LoadedLora) -> None:
        self._retired[lora.lora_id] = lora.name
        while len(self._retired) > NUM_RETIRED_NAMES:
            self._retired.popitem(last=False)


def _refusal(result: object) -> str | None:
    """What a library's answer to a load or unload says went wrong (None: nothing): vLLM answers a bool,
    SGLang an output with `success` and `error_message`."""
    if result is False:
        return "it answered False"
    if getattr(result, "success", True) is False:
        return str(getattr(result, "error_message", None) or "it answered success=False")
    return None
