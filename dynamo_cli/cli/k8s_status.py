"""`dyn k8s status`: per component of a rendered deployment, desired and ready replicas, registered
instances and the first reason a pod is not ready (dynamo_cli/k8s/status.py, cluster.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from dynamo_cli.k8s.cluster import StatusConfig, read_status
from dynamo_cli.k8s.names import DEFAULT_K8S_NAMESPACE


def status_command(
    namespace: Annotated[
        str,
        typer.Option(
            "--namespace",
            envvar="DYN_K8S_NAMESPACE",
            help="The deployment's namespace, as given to `dyn k8s render --namespace`.",
        ),
    ] = DEFAULT_K8S_NAMESPACE,
    name: Annotated[str, typer.Option("--name", help="The deployment's --name at render time.")] = "dyn",
    kubeconfig: Annotated[
        str | None, typer.Option("--kubeconfig", help="Kubeconfig file (default: in-cluster, else KUBECONFIG).")
    ] = None,
    frontend_url: Annotated[
        str | None,
        typer.Option(
            "--frontend-url", help="Read /health here (e.g. after kubectl port-forward), not through the API server."
        ),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per API call.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Desired, ready and registered per component, and why a pod is not ready.

    Exit code 0 when every component has as many ready replicas as desired, 1 when one has fewer:

    `until dyn k8s status; do sleep 5; done` waits for a rollout. 2: bad input, 3: the cluster cannot be read.
    """
    config = StatusConfig(namespace, name, kubeconfig, frontend_url, timeout)
    report = read_status(config)
    typer.echo(report.to_json() if as_json else report.to_table())
    if not report.is_ready:
        raise typer.Exit(1)
