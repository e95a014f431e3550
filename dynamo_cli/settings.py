"""How a config field is set from outside: its flags, its `DYN_*` variable, its help, where `--help` shows it.

A setting is declared once, on the field of the frozen config that holds it (`config.py`, `kv/tiers.py`):

    block_size: int | None = setting(None, BLOCK_SIZE)

The CLI builds each command's options from the fields of the configs it assembles (cli/settings.py), and a
process started by another receives the assembled config as one document (config.py `child_command`), so a
new field with a `Setting` reaches every command and child that holds its config, with nothing else to edit.
A `Setting` object shared by two fields (the namespace of the frontend and of its workers) is one option
whose value goes to both.

A field's prose is written once, as its docstring: the first paragraph is the option's `--help` (read from
the class's source once, `field_help`), later paragraphs are notes for the code's reader. Only a `Setting`
shared by several fields carries its own `help=`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
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
MEDIA = "Images (multimodal requests)"


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting's outside names and how its text becomes the field's value."""

    flags: tuple[str, ...]
    """The option's names: `("--port", "-p")`, or a boolean's `("--kv-events/--no-kv-events",)`."""
    env: str | None
    """Its `DYN_*` environment twin (None: flag only)."""
    help: str = ""
    """The `--help` text of a shared Setting; empty: the first paragraph of the field's docstring."""
    panel: str | None = ESSENTIAL
    """The `--help` panel it is listed in."""
    cli_type: Any = None
    """The type the command line parses (default: the field's own type)."""
    parse: Callable[[Any], Any] | None = None
    """Command-line value -> field value, raising ConfigError for a bad one (default: as parsed)."""
    show: Callable[[Any], Any] | None = None
    """Field default -> the command line's default (default: the same)."""


def setting(default: Any, *flags: str | Setting, repr: bool = True, **kwargs: Any) -> Any:
    """A dataclass field with `default` and its Setting: a shared one (`setting(None, BLOCK_SIZE)`), or one made
    from `flags` and `kwargs` (env=, help=, panel=, cli_type=, parse=, show=); `repr=False` keeps a secret out
    of the config's repr."""
    spec = flags[0] if len(flags) == 1 and isinstance(flags[0], Setting) else None
    if spec is None:
        spec = Setting(flags=tuple(str(f) for f in flags), **kwargs)
    return field(default=default, repr=repr, metadata={SETTING: spec})


def setting_of(metadata: Any) -> Setting | None:
    """The Setting in a field's metadata, if any."""
    found = metadata.get(SETTING) if metadata else None
    return found if isinstance(found, Setting) else None


def help_of(spec: Setting, cls: type, name: str) -> str:
    """The `--help` of field `name` of `cls` declaring `spec`: a shared Setting's own, else the field's docstring's."""
    return spec.help or field_help(cls, name)


def field_help(cls: type, name: str) -> str:
    """The first paragraph of field `name`'s docstring in `cls` (or a base), whitespace folded; "" if none."""
    for klass in cls.__mro__:
        doc = _field_docs(klass).get(name)
        if doc is not None:
            return " ".join(doc.split("\n\n")[0].split())
    return ""


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal that follows its annotated assignment in `cls`'s body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # a class defined without source (built in, or made at run time)
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for statement, following in zip(body, body[1:], strict=False):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            if isinstance(following.value.value, str):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _from_mib(mib: float) -> int:
    return int(mib * 1024 * 1024)


def _to_mib(nbytes: int) -> float:
    return nbytes / 1024 / 1024


def _listed(values: tuple[str, ...]) -> list[str] | None:
    return list(values) or None


IN_MIB: dict[str, Any] = {"cli_type": float, "parse": _from_mib, "show": _to_mib}
"""`setting(..., **IN_MIB)`: a byte count the command line sets in MiB (`--body-limit-mb 45`)."""


def _from_kib(kib: float) -> int:
    return int(kib * 1024)


def _to_kib(nbytes: int) -> float:
    return nbytes / 1024


IN_KIB: dict[str, Any] = {"cli_type": float, "parse": _from_kib, "show": _to_kib}
"""`setting(..., **IN_KIB)`: a byte count the command line sets in KiB (`--encode-min-kb 16`)."""


def repeated(parse: Callable[[Any], Any] = tuple) -> dict[str, Any]:
    """`setting(..., **repeated(parse))`: a tuple of strings, one per use of the flag (`--lora A=x --lora B=y`),
    checked by `parse`."""
    return {"cli_type": list[str] | None, "parse": parse, "show": _listed}
