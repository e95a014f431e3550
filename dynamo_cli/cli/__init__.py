"""The `dyn` command line: one Typer module per subcommand; the only place that imports rich."""
