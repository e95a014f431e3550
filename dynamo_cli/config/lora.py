"""Multi-LoRA settings: the adapters a worker serves, how many stay loaded, where run-time loads may read."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import ENGINE, repeated, setting

LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
"""What an adapter's served name may be (it is a model name clients send, a key suffix, a metric label)."""
MAX_LORAS = 1024


def check_lora_name(name: str, what: str = "--lora") -> str:
    """`name` if it can serve as an adapter's model name, else ConfigError saying what may be."""
    if not LORA_NAME.fullmatch(name):
        raise ConfigError(
            f"{what}: adapter name {name[:64]!r} is invalid; use 1-128 letters, digits and ._:/@+- "
            "starting with a letter or digit"
        )
    return name


def parse_loras(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--lora NAME=PATH` values, checked (a valid name, a path, no name twice); ConfigError otherwise."""
    seen: set[str] = set()
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise ConfigError(f"--lora {value!r} is invalid; write NAME=PATH (an adapter file)")
        if check_lora_name(name) in seen:
            raise ConfigError(f"--lora: adapter {name!r} is given twice")
        seen.add(name)
    return tuple(values)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters a worker serves over its base model (each one a model of its own; dynamo_cli/lora)."""

    adapters: tuple[str, ...] = setting(
        (),
        "--lora",
        env="DYN_LORAS",
        panel=ENGINE,
        **repeated(parse_loras),
    )
    """NAME=PATH: serve adapter PATH as model NAME from the start (repeatable)."""
    max_loras: int = setting(4, "--max-loras", env="DYN_MAX_LORAS", panel=ENGINE)
    """Adapters loaded at once; a request for another one evicts the least recently used idle one."""
    lora_dirs: tuple[str, ...] = setting(
        (),
        "--lora-dir",
        env="DYN_LORA_DIRS",
        panel=ENGINE,
        **repeated(),
    )
    """Folders run-time loads (POST /v1/load_lora_adapter) may read adapters from, besides the --lora files'
    folders (repeatable).

    A load is a file read by the engine's parser on the worker's machine, so only these folders are open to it."""

    def __post_init__(self) -> None:
        parse_loras(self.adapters)
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ConfigError(f"--max-loras must be between 1 and {MAX_LORAS}, got {self.max_loras}")

    def named(self) -> dict[str, str]:
        """Adapter name -> path, in the order given."""
        return dict(value.partition("=")[::2] for value in self.adapters)
