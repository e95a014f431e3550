"""`dyn batch ls|show|cancel`: a deployment's batches, through its frontend's /v1/batches (what any OpenAI
client sees, so it works against every frontend of the deployment and through its API keys)."""

from __future__ import annotations

import datetime
import json
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dynamo_cli.errors import ConfigError

app = typer.Typer(help="OpenAI batches of a deployment: list them, show one, cancel one.", no_args_is_help=True)

Url = Annotated[str, typer.Option("--url", envvar="DYN_URL", help="The frontend, http://HOST:PORT.")]
ApiKey = Annotated[
    str | None, typer.Option("--api-key", envvar="DYN_API_KEY", help="Bearer key, when the frontend needs one.")
]
Json = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")]
TIMEOUT_S = 10.0


@app.command("ls")
def list_batches(
    url: Url = "http://127.0.0.1:8000",
    api_key: ApiKey = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=100, help="Most batches shown, newest first.")] = 20,
    as_json: Json = False,
) -> None:
    """List the batches, newest first: status, endpoint, lines done / failed / total, age."""
    page = _request("GET", url, f"/v1/batches?limit={limit}", api_key)
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    table = Table("id", "status", "endpoint", "done", "failed", "total", "created", box=None)
    for batch in page.get("data", []):
        counts = batch.get("request_counts") or {}
        table.add_row(
            batch["id"],
            batch["status"],
            batch["endpoint"],
            str(counts.get("completed", 0)),
            str(counts.get("failed", 0)),
            str(counts.get("total", 0)),
            _when(batch.get("created_at")),
        )
    Console().print(table)


@app.command("show")
def show(
    batch_id: Annotated[str, typer.Argument(help="The batch's id (batch_...).")],
    url: Url = "http://127.0.0.1:8000",
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """One batch: its status and each time it changed, its counts, its files, its metadata."""
    batch = _request("GET", url, f"/v1/batches/{batch_id}", api_key)
    if as_json:
        typer.echo(json.dumps(batch, indent=2))
        return
    _print_batch(batch)


@app.command("cancel")
def cancel(
    batch_id: Annotated[str, typer.Argument(help="The batch's id (batch_...).")],
    url: Url = "http://127.0.0.1:8000",
    api_key: ApiKey = None,
) -> None:
    """Cancel a batch: no new line starts, lines running stop, what finished stays in its output file."""
    batch = _request("POST", url, f"/v1/batches/{batch_id}/cancel", api_key)
    typer.echo(f"{batch['id']}: {batch['status']}")


def _print_batch(batch: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None)
    counts = batch.get("request_counts") or {}
    rows = [
        ("id", batch["id"]),
        ("status", batch["status"]),
        ("endpoint", batch["endpoint"]),
        ("lines", f"{counts.get('completed', 0)} done, {counts.get('failed', 0)} failed of {counts.get('total', 0)}"),
        ("input file", batch.get("input_file_id") or "-"),
        ("output file", batch.get("output_file_id") or "-"),
        ("error file", batch.get("error_file_id") or "-"),
    ]
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at"):
        if batch.get(stamp):
            rows.append((stamp.removesuffix("_at").replace("_", " "), _when(batch[stamp])))
    for stamp in ("cancelling_at", "cancelled_at", "expires_at"):
        if batch.get(stamp):
            rows.append((stamp.removesuffix("_at"), _when(batch[stamp])))
    if batch.get("metadata"):
        rows.append(("metadata", json.dumps(batch["metadata"])))
    for error in (batch.get("errors") or {}).get("data", []):
        rows.append(("error", f"{error.get('code')}: {error.get('message')}"))
    for name, value in rows:
        table.add_row(name, escape(str(value)))
    Console().print(table)


def _request(method: str, url: str, path: str, api_key: str | None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ConfigError(f"--url {url}: cannot reach the frontend ({exc})") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200 or not isinstance(body, dict):
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else response.text[:200]
        raise ConfigError(f"{url}{path}: {response.status_code} {message}")
    return body


def _when(epoch: Any) -> str:
    if not isinstance(epoch, int | float):
        return "-"
    return datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")
