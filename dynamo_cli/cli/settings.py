"""Command-line options built from the configs' declared settings (dynamo_cli/settings.py), and configs built
back from the options' values.

A command names the config it assembles (`ServeConfig`, `WorkerConfig`, `RouterConfig`): every field of it,
and of the configs nested in it, that declares a `Setting` becomes one typer option with that setting's flags,
`DYN_*` twin, help and panel. Fields declaring the same Setting object (the namespace of the frontend and of
its workers) are one option whose value goes to each. Two different settings with one flag are a bug of the
command's declaration, refused when the command is built (`skip` leaves a field at its default instead).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer

from dynamo_cli.settings import Setting, help_of, setting_of

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Knob:
    """One command-line option and the config fields it sets."""

    name: str
    """The command function's parameter name."""
    setting: Setting
    fields: tuple[tuple[type, str], ...]
    """(config class, field name) of every field it sets."""
    annotation: Any
    default: Any


def knobs(
    root: type,
    *,
    skip: Collection[str] = (),
    help: Mapping[str, str] | None = None,
    prefix: str = "",
    panel: str | None = None,
) -> list[Knob]:
    """The options of every setting in `root`'s config tree, in declaration order; `skip`: fields written
    `Class.field` that stay at their default; `help`: replacement help text by flag (computed at start);
    `prefix`: put before each flag's name, and `panel` the help panel of each, when another command takes the
    config among its own (`dyn serve --planner-ttft` is `dyn plan run --ttft`, one `DYN_*` twin for both)."""
    found: dict[int, Knob] = {}
    owner: dict[str, int] = {}
    for cls, f, hint in _settings_fields(root, set()):
        if f"{cls.__name__}.{f.name}" in skip:
            continue
        spec = setting_of(f.metadata)
        assert spec is not None
        key = id(spec)
        known = found.get(key)
        if known is not None:
            found[key] = dataclasses.replace(known, fields=(*known.fields, (cls, f.name)))
            continue
        for flag in _flag_names(spec):
            if owner.setdefault(flag, key) != key:
                raise RuntimeError(f"{flag} is declared by two settings of {root.__name__}; skip one of them")
        text = (help or {}).get(spec.flags[0]) or help_of(spec, cls, f.name)
        if prefix:
            spec = dataclasses.replace(spec, flags=tuple(_prefixed(flag, prefix) for flag in spec.flags), panel=panel)
        option = typer.Option(*spec.flags, envvar=spec.env, help=text, rich_help_panel=spec.panel)
        default = spec.show(f.default) if spec.show is not None else f.default
        cli_type = spec.cli_type if spec.cli_type is not None else hint
        found[key] = Knob(_param_name(spec), spec, ((cls, f.name),), Annotated[cli_type, option], default)
    return list(found.values())


def command(
    body: Callable[..., None],
    knobs: Sequence[Knob],
    extra: Sequence[inspect.Parameter] = (),
    doc: str | None = None,
    *,
    env: bool = True,
) -> Callable[..., None]:
    """A typer command calling `body(**values)`, with the knobs' options then `extra` ones (each an
    `inspect.Parameter` whose annotation is `Annotated[type, typer.Option(...)]`); `env=False`: the options do
    not read their `DYN_*` twins (`dyn k8s render`: the manifests are what its command line says)."""

    def run(**values: Any) -> None:
        body(**values)

    params = [
        inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=k.default, annotation=k.annotation)
        for k in knobs
    ]
    params += list(extra)
    if not env:
        params = [_without_env(p) for p in params]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__doc__ = doc or body.__doc__
    run.__name__ = body.__name__
    return run


def _without_env(param: inspect.Parameter) -> inspect.Parameter:
    """The option with its environment variable dropped (and not shown in `--help`)."""
    kind, info, *rest = typing.get_args(param.annotation)
    info = copy.copy(info)
    info.envvar, info.show_envvar = None, False
    return param.replace(annotation=Annotated[kind, info, *rest])


def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    """An extra option of a command (one that is not a config field: it feeds a computed one)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def build(
    root: type[T], values: Mapping[str, Any], knobs: Sequence[Knob], given: Mapping[tuple[type, str], Any] = {}
) -> T:
    """`root`'s config from the options' `values` (parsed by each setting), `given` values of other fields
    (by (class, field)), and defaults for the rest. A config class is built once and shared where it recurs
    (the planes of the frontend and of its workers are one PlanesConfig)."""
    chosen: dict[tuple[type, str], Any] = dict(given)
    for knob in knobs:
        value = values[knob.name]
        if value is None:  # left unset: the field's default (a list option's default shows as None)
            continue
        parsed = knob.setting.parse(value) if knob.setting.parse is not None else value
        for target in knob.fields:
            chosen.setdefault(target, parsed)
    built: dict[type, Any] = {}
    return _build(root, chosen, built)  # type: ignore[no-any-return]


def arguments(config: Any, knobs: Sequence[Knob]) -> list[str]:
    """The command-line arguments that make `knobs`' command build `config` back (`build`'s inverse): a flag for
    each setting whose value differs from its field's default, written as the setting shows it (`dyn k8s render`
    writes each pod's command line with it)."""
    instances = _instances(config)
    argv: list[str] = []
    for knob in knobs:
        cls, name = knob.fields[0]
        if cls not in instances:
            continue  # a setting of a config this one does not hold
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        value = getattr(instances[cls], name)
        if value != default:
            argv += _flag(knob.setting, value)
    return argv


def _flag(spec: Setting, value: Any) -> list[str]:
    """One setting's flag and value as typed on the command line."""
    on, _, off = spec.flags[0].partition("/")
    if isinstance(value, bool):
        if not value and not off:
            raise ValueError(f"{on} cannot be turned off on the command line")
        return [on if value else off]
    if value is None:
        raise ValueError(f"{on} cannot be unset on the command line")
    shown = spec.show(value) if spec.show is not None else value
    shown = shown.value if isinstance(shown, Enum) else shown
    if isinstance(shown, list | tuple):
        return [item for one in shown for item in (on, str(one))]
    return [on, str(shown)]


def _instances(config: Any) -> dict[type, Any]:
    """Each config object in `config`'s tree by class (the first one met, breadth first: a class built once by
    `build` is one object wherever it recurs)."""
    found: dict[type, Any] = {}
    stack = [config]
    while stack:
        obj = stack.pop(0)
        if type(obj) in found:
            continue
        found[type(obj)] = obj
        stack += [v for f in dataclasses.fields(obj) if dataclasses.is_dataclass(v := getattr(obj, f.name))]
    return found


def _build(cls: type, chosen: Mapping[tuple[type, str], Any], built: dict[type, Any]) -> Any:
    if cls in built:
        return built[cls]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if (cls, f.name) in chosen:
            kwargs[f.name] = chosen[(cls, f.name)]
        elif _config_class(hints[f.name]) is not None:
            kwargs[f.name] = _build(hints[f.name], chosen, built)
    built[cls] = cls(**kwargs)
    return built[cls]


def _settings_fields(cls: type, seen: set[type]) -> typing.Iterator[tuple[type, dataclasses.Field[Any], Any]]:
    """(class, field, type) of every field with a Setting in `cls`'s tree, depth first in declaration order."""
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if setting_of(f.metadata) is not None:
            yield cls, f, hints[f.name]
        elif (sub := _config_class(hints[f.name])) is not None and sub not in seen:
            yield from _settings_fields(sub, seen)


def _config_class(hint: Any) -> type | None:
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _flag_names(spec: Setting) -> list[str]:
    return [name for flag in spec.flags for name in flag.split("/")]


def _prefixed(flag: str, prefix: str) -> str:
    """`--ttft` -> `--planner-ttft`; `--a/--no-a` -> `--planner-a/--no-planner-a`."""
    return "/".join(
        name.replace("--no-", f"--no-{prefix}", 1) if name.startswith("--no-") else name.replace("--", f"--{prefix}", 1)
        for name in flag.split("/")
    )


def _param_name(spec: Setting) -> str:
    return spec.flags[0].split("/")[0].lstrip("-").replace("-", "_")


def annotated(cls: type, name: str, *, help: str | None = None) -> Any:
    """The `Annotated[type, typer.Option(...)]` of one config field's setting, for a command that takes it
    among options of its own (`dyn plan profile --model`)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    spec = setting_of(f.metadata)
    assert spec is not None, f"{cls.__name__}.{name} declares no setting"
    hint = spec.cli_type if spec.cli_type is not None else typing.get_type_hints(cls)[name]
    return Annotated[hint, typer.Option(*spec.flags, envvar=spec.env, help=help or help_of(spec, cls, name))]
