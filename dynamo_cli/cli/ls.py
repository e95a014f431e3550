"""`dyn ls`: what is registered on the planes (instances and their models)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from dynamo_cli.cli import options as o
from dynamo_cli.model_card import ModelCard
from dynamo_cli.runtime.endpoint import InstanceRecord
from dynamo_cli.runtime.names import parse_instance_key
from dynamo_cli.runtime.planes import open_discovery
from dynamo_cli.runtime.supervisor import run
from dynamo_cli.runtime.urls import redact_url


async def _snapshot(url: str, timeout: float) -> tuple[dict[str, bytes], dict[str, bytes]]:
    discovery = open_discovery(url)
    await discovery.start()
    try:
        async with asyncio.timeout(timeout):
            return await discovery.get_prefix("v1/instances/"), await discovery.get_prefix("v1/mdc/")
    finally:
        await discovery.close()


def command(
    discovery: o.Discovery = "embedded",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for discovery.")] = 5.0,
) -> None:
    """List registered instances: namespace/component/endpoint/id, address, role, model."""
    instances, cards = run(_snapshot(discovery, timeout))
    card_by_id = {parse_instance_key(k)[1]: msgspec.json.decode(v, type=ModelCard) for k, v in cards.items()}
    rows = []
    for key, value in sorted(instances.items()):
        name, instance_id = parse_instance_key(key)
        record = msgspec.json.decode(value, type=InstanceRecord)
        card = card_by_id.get(instance_id)
        rows.append(
            {
                "instance": f"{name}/{instance_id:x}",
                "address": record.address,
                "role": record.role,
                "model": card.display_name if card else "-",
                "engine": card.engine if card else "-",
                "ranks": _ranks(card),
                "nodes": card.nnodes if card else 1,
                "pid": record.pid,
                "host": record.hostname,
            }
        )
    if as_json:
        typer.echo(msgspec.json.encode(rows).decode())
        return
    table = Table(title=f"dyn: {len(rows)} instance(s) on {redact_url(discovery)}")
    columns = ("instance", "model", "engine", "role", "ranks", "nodes", "address", "host", "pid")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    Console().print(table)


def _ranks(card: ModelCard | None) -> str:
    """The data-parallel ranks an instance serves: `0-3`, or `-` for a rank-blind one (or no card)."""
    if card is None or not card.is_ranked:
        return "-"
    ranks = card.ranks
    return f"{ranks.start}" if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"
