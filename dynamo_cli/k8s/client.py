"""How dyn connects to a Kubernetes API server: the official `kubernetes` client (extra `[k8s]`, imported
here only when a command needs it), configured in-cluster, else from --kubeconfig / KUBECONFIG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynamo_cli.errors import ConfigError

INSTALL = "pip install 'dynamo-cli[k8s]'"
POD_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""In a pod: the namespace it runs in (mounted with its service account token)."""


def client_modules(needed_by: str) -> tuple[Any, Any]:
    """`kubernetes.client` and `kubernetes.config`; ConfigError naming the extra when the client is missing."""
    try:
        import kubernetes.client
        import kubernetes.config
    except ImportError:
        raise ConfigError(f"{needed_by} needs the kubernetes client: {INSTALL}") from None
    return kubernetes.client, kubernetes.config


def api_client(kubeconfig: str | None, needed_by: str) -> Any:
    """An ApiClient from --kubeconfig, else in-cluster config, else KUBECONFIG / ~/.kube/config.

    urllib3's own retries are off: a caller that retries does it with its own backoff and bound, and one
    that does not learns at once that the API server is unreachable."""
    client, config = client_modules(needed_by)
    settings = client.Configuration()
    try:
        if kubeconfig is None:
            try:
                config.load_incluster_config(client_configuration=settings)
            except config.ConfigException:
                config.load_kube_config(client_configuration=settings)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=settings)
    except (config.ConfigException, OSError) as exc:
        if kubeconfig is not None:
            raise ConfigError(f"--kubeconfig '{kubeconfig}' cannot be used: {exc}") from None
        raise ConfigError(
            f"no Kubernetes API config: not in a cluster, and KUBECONFIG / ~/.kube/config cannot be used ({exc}); "
            "pass --kubeconfig PATH"
        ) from None
    settings.retries = 0
    return client.ApiClient(settings)


def context_namespace(kubeconfig: str | None, needed_by: str) -> str:
    """The namespace kubectl would use: in a pod, its own; else the kubeconfig's current context's; else `default`."""
    _, config = client_modules(needed_by)
    if kubeconfig is None and Path(POD_NAMESPACE).is_file():
        return Path(POD_NAMESPACE).read_text().strip() or "default"
    try:
        _, current = config.list_kube_config_contexts(config_file=kubeconfig)
        namespace = current["context"].get("namespace")
    except (config.ConfigException, OSError, KeyError, TypeError, AttributeError):
        namespace = None  # api_client() says what is wrong with the file
    return str(namespace or "default")
