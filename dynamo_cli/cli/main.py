"""`dyn`: the root command; registers one subcommand per module and maps DynError to one red line."""

from __future__ import annotations

import importlib
import logging
import sys

import typer
from rich.console import Console
from rich.markup import escape

from dynamo_cli import __version__
from dynamo_cli.errors import DynError

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
}


def _register() -> None:
    for name, module_name in _SUBCOMMANDS.items():
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
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    """Console-script entry: run the app, print a DynError as one red line and exit non-zero."""
    _register()
    try:
        app(standalone_mode=False)
    except DynError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
