"""`dyn`: the root command; registers one subcommand per module and maps DynError to one red line."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from dynamo_cli import __version__
from dynamo_cli.errors import DynError
from dynamo_cli.tracing.logs import configure_logging

app = typer.Typer(
    name="dyn",
    help="dyn: distributed LLM inference (frontend, KV-aware router, workers, planner, bench).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)

# name → module; a module exposes either `command` (a function) or `app` (a Typer with subcommands).
_SUBCOMMANDS = {
    "serve": "dynamo_cli.cli.serve",
    "worker": "dynamo_cli.cli.worker",
    "router": "dynamo_cli.cli.router",
    "plan": "dynamo_cli.cli.plan",
    "bench": "dynamo_cli.cli.bench",
    "ls": "dynamo_cli.cli.ls",
    "top": "dynamo_cli.cli.top",
    "monitoring": "dynamo_cli.cli.monitoring",
    "k8s": "dynamo_cli.cli.k8s",
    "batch": "dynamo_cli.cli.batch",
}


def _register(argv: list[str] | None = None) -> None:
    """Register the subcommand `argv` names, else all of them (`dyn --help`, a typo). One module, not ten: a
    `dyn worker` that `dyn serve` starts imports neither the launcher nor the batch service (~1 s on 2 cores)."""
    named = next((arg for arg in argv or [] if arg in _SUBCOMMANDS), None)
    for name, module_name in _SUBCOMMANDS.items():
        if named is not None and name != named:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not built yet
            raise
        if hasattr(module, "app"):
            app.add_typer(module.app, name=name)
        else:
            app.command(name, help=module.command.__doc__)(module.command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dyn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    log_level: str = typer.Option("WARNING", "--log-level", envvar="DYN_LOG_LEVEL", help="Python log level."),
) -> None:
    configure_logging(log_level)  # text lines; a command with --log-format json switches them (tracing/logs.py)


def main() -> None:
    """Console-script entry: run the app; any usage error or DynError is one red line and a non-zero exit."""
    _register(sys.argv[1:])
    try:
        code = app(standalone_mode=False)  # click returns (not raises) a command's typer.Exit(code) here
    except DynError as exc:
        _fail(str(exc), exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:
        if not _is_click_error(exc):
            logging.getLogger("dynamo_cli").debug("internal error", exc_info=exc)
            _fail(f"internal error: {type(exc).__name__}: {exc} (DYN_LOG_LEVEL=DEBUG shows the traceback)", 1)
        _fail(exc.format_message(), int(getattr(exc, "exit_code", 2)), _usage_hint(exc))  # type: ignore[attr-defined]
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        sys.exit(code)  # `dyn k8s status`: 1 while a component is not ready


def _click_modules() -> list[Any]:
    """The click a Typer uses: its vendored copy (typer >= 0.29: `typer._click`) and/or the click package."""
    found = []
    for name in ("typer._click", "click"):
        with contextlib.suppress(ImportError):
            found.append(importlib.import_module(name))
    return found


def _is_click_error(exc: BaseException) -> bool:
    """A usage or parameter error from whichever click raised it (by class where known, else by shape)."""
    classes = tuple(m.ClickException for m in _click_modules() if hasattr(m, "ClickException"))
    if classes and isinstance(exc, classes):
        return True
    return callable(getattr(exc, "format_message", None)) and isinstance(getattr(exc, "exit_code", None), int)


def _usage_hint(exc: BaseException) -> str:
    """`try 'dyn serve --help'`: the command whose arguments failed, from click's context or the argv."""
    path = getattr(getattr(exc, "ctx", None), "command_path", None)
    if not path:
        sub = next((arg for arg in sys.argv[1:] if arg in _SUBCOMMANDS), None)
        path = f"dyn {sub}" if sub else "dyn"
    return f"try '{path} --help'"


def _fail(message: str, exit_code: int, hint: str | None = None) -> NoReturn:
    line = " ".join(message.split())  # click's messages may span lines; the error is one line
    if hint:
        line += f" ({hint})"
    Console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
