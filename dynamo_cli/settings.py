"""How a config field is set from outside: its flags, its `DYN_*` variable, its help, where `--help` shows it.

A setting is declared once, on the field of the frozen config that holds it (`config.py`, `kv/tiers.py`):

    block_size: int | None = setting(None, BLOCK_SIZE)

The CLI builds each command's options from the fields of the configs it assembles (cli/settings.py), and a
process started by another receives the assembled config as one document (config.py `child_command`), so a
new field with a `Setting` reaches every command and child that holds its config, with nothing else to edit.
A `Setting` object shared by two fields (the namespace of the frontend and of its workers) is one option
whose value goes to both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SETTING = "dyn_setting"
"""The key of a field's `Setting` in its `dataclasses.field` metadata."""

ESSENTIAL: str | None = None
"""The help panel shown first (rich's default panel): what a new user needs."""
ROUTING = "Routing"
DISAGG = "Disaggregation"
OVERLOAD = "Queue and overload"
ENGINE = "Engine"
KV_TIERS = "KV tiers (host memory and disk below the engine's cache)"
PLANES = "Planes and cluster"
SECURITY = "Security"
HTTP = "HTTP server"
SUPERVISION = "Supervision"
OBSERVABILITY = "Observability (probes, metrics, traces, logs)"
BATCH = "Batch API (/v1/files, /v1/batches)"


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting's outside names and how its text becomes the field's value."""

    flags: tuple[str, ...]
    """The option's names: `("--port", "-p")`, or a boolean's `("--kv-events/--no-kv-events",)`."""
    env: str | None
    """Its `DYN_*` environment twin (None: flag only)."""
    help: str
    panel: str | None = ESSENTIAL
    """The `--help` panel it is listed in."""
    cli_type: Any = None
    """The type the command line parses (default: the field's own type)."""
    parse: Callable[[Any], Any] | None = None
    """Command-line value -> field value, raising ConfigError for a bad one (default: as parsed)."""
    show: Callable[[Any], Any] | None = None
    """Field default -> the command line's default (default: the same)."""


def setting(default: Any, *flags: str | Setting, **kwargs: Any) -> Any:
    """A dataclass field with `default` and its Setting: a shared one (`setting(None, BLOCK_SIZE)`), or one made
    from `flags` and `kwargs` (env=, help=, panel=, cli_type=, parse=, show=)."""
    spec = flags[0] if len(flags) == 1 and isinstance(flags[0], Setting) else None
    if spec is None:
        spec = Setting(flags=tuple(str(f) for f in flags), **kwargs)
    return field(default=default, metadata={SETTING: spec})


def setting_of(metadata: Any) -> Setting | None:
    """The Setting in a field's metadata, if any."""
    found = metadata.get(SETTING) if metadata else None
    return found if isinstance(found, Setting) else None
