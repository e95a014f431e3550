"""Settings declared once: each option's help is its field's docstring, and `dyn serve --planner-*` is
`dyn plan run`'s own settings under a prefix."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import typer.main

from dynamo_cli.cli import bench, main, plan, serve, settings
from dynamo_cli.cli import router as router_cmd
from dynamo_cli.cli import worker as worker_cmd
from dynamo_cli.config import ServeConfig
from dynamo_cli.settings import Setting, field_help, setting


@dataclass(frozen=True)
class _Base:
    size: int = setting(1, "--size", env=None)
    """Blocks per page (0: off).

    A note for the code's reader, not for --help."""


@dataclass(frozen=True)
class _Child(_Base):
    name: str = setting("x", "--name", env=None)
    """The    name,
    folded."""


def test_the_help_is_the_first_paragraph_of_the_fields_docstring_folded_and_found_on_a_base() -> None:
    assert field_help(_Child, "size") == "Blocks per page (0: off)."
    assert field_help(_Child, "name") == "The name, folded."
    assert field_help(_Child, "missing") == ""


def _shared_settings() -> set[int]:
    """Module-level Setting objects: shared by the fields of several configs, they carry their own help."""
    return {
        id(value)
        for name, module in list(sys.modules.items())
        if name.startswith("dynamo_cli.")
        for value in vars(module).values()
        if isinstance(value, Setting)
    }


COMMANDS = {
    "serve": [*serve.KNOBS, *serve.PLANNER_KNOBS],
    "worker": worker_cmd.KNOBS,
    "router": router_cmd.KNOBS,
    "plan run": plan.PLANNER_KNOBS,
    "bench": bench.KNOBS,
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_only_a_shared_setting_writes_its_own(command: str) -> None:
    knobs, shared = COMMANDS[command], _shared_settings()
    helpless = [k.setting.flags[0] for k in knobs if not _help(k)]
    assert helpless == [], "give the field a docstring: its first paragraph is the option's --help"
    twice = [k.setting.flags[0] for k in knobs if k.setting.help and id(k.setting) not in shared]
    assert twice == [], "drop help=: the field's docstring is the help"


def _help(knob: settings.Knob) -> str:
    return str(knob.annotation.__metadata__[0].help or "")


def test_dyn_serve_takes_the_planners_settings_as_planner_flags_with_one_environment_twin() -> None:
    ours = {k.name: k for k in plan.PLANNER_KNOBS}
    prefixed = {k.name: k for k in serve.PLANNER_KNOBS}
    assert "mode" in ours and "planner_mode" not in prefixed  # dyn serve's mode is --disagg's
    for name, knob in ours.items():
        if name == "mode":
            continue
        twin = prefixed[f"planner_{name}"]
        assert twin.setting.flags == tuple(f"--planner-{f.removeprefix('--')}" for f in knob.setting.flags)
        assert (twin.setting.env, twin.fields, twin.default) == (knob.setting.env, knob.fields, knob.default)


def test_a_planner_flag_of_dyn_serve_reaches_its_plan() -> None:
    values = {name: param.default for name, param in inspect.signature(serve.command).parameters.items()}
    values.update(disagg=True, engine="mocker", planner=True)
    values.update(planner_ttft=250.0, planner_itl=25.0, planner_predictor="kalman", planner_max_workers=6)
    config, planned = serve.deployment(values, {}, serve.KNOBS)
    assert isinstance(config, ServeConfig) and planned is not None
    planner = planned.config
    assert (planner.mode, planner.predictor, planner.targets.ttft_ms, planner.bounds.max_workers) == (
        "disagg",
        "kalman",
        250.0,
        6,
    )


def _options(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """(command path, option) of every option under a click command, its subcommands' included."""
    for name, sub in getattr(command, "commands", {}).items():
        yield from _options(sub, (*path, name))
    for param in command.params:
        if param.param_type_name == "option" and not param.hidden:
            yield " ".join(path), param


def test_every_option_of_every_command_says_what_it_does() -> None:
    if not main.app.registered_groups:  # once per process: main() registers them when dyn runs
        main._register()
    root = typer.main.get_command(main.app)
    helpless = [(path, option.opts[0]) for path, option in _options(root, ("dyn",)) if not option.help]
    assert helpless == []


def test_the_help_of_a_choice_lists_every_choice() -> None:
    from dynamo_cli.config import (
        DISAGG_POLICIES,
        KV_TRANSFERS,
        ROUTER_COSTS,
        DisaggConfig,
        KvRouterConfig,
        WorkerConfig,
    )
    from dynamo_cli.planner.planner import PlannerConfig
    from dynamo_cli.planner.predictors import PREDICTORS

    for cls, name, choices in [
        (DisaggConfig, "policy", DISAGG_POLICIES),
        (KvRouterConfig, "cost", ROUTER_COSTS),
        (WorkerConfig, "kv_transfer", KV_TRANSFERS),
        (PlannerConfig, "predictor", PREDICTORS),
    ]:
        assert all(choice in field_help(cls, name) for choice in choices), (cls.__name__, name)
