"""For whoever has a cluster: apply the rendered aggregated deployment (mocker) to a real Kubernetes and ask its
Service a question through the API server's service proxy; then delete the namespace.

Skipped unless KUBECONFIG names a cluster and DYN_K8S_IMAGE names a `dyn` image built from the Containerfile that
the cluster can pull (`docker build --build-arg ENGINE=mocker -t REGISTRY/dyn:0.1.0-mocker . && docker push ...`).
No cluster runs on the machines this project is tested on: this test has not run here.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any

import pytest

from tests.k8s.render_cases import render

pytestmark = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG") or not os.environ.get("DYN_K8S_IMAGE"),
    reason="needs a cluster: KUBECONFIG and DYN_K8S_IMAGE (a pullable dyn image, ENGINE=mocker)",
)
READY_TIMEOUT_S = 600


def _wait(predicate: Any, what: str, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(3)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def test_the_rendered_aggregated_deployment_answers_through_its_service() -> None:
    kubernetes = pytest.importorskip("kubernetes")
    kubernetes.config.load_kube_config()
    client = kubernetes.client.ApiClient()
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    namespace = f"dyn-test-{secrets.token_hex(3)}"
    objects, _ = render(
        [
            "--namespace",
            namespace,
            "--image",
            os.environ["DYN_K8S_IMAGE"],
            "--engine",
            "mocker",
            "--worker-cpu",
            "500m",
            "--worker-memory",
            "1Gi",
        ]
    )
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        secret = {"metadata": {"name": "dyn-cluster-secret"}, "stringData": {"secret": secrets.token_hex(32)}}
        core.create_namespaced_secret(namespace, secret)
        for obj in objects:
            kubernetes.utils.create_from_dict(client, obj, namespace=namespace)

        def ready(name: str) -> bool:
            status = apps.read_namespaced_deployment(name, namespace).status
            return bool(status.ready_replicas) and status.ready_replicas >= 1

        _wait(lambda: ready("dyn-frontend") and ready("dyn-worker"), "the frontend and the worker to be ready")
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        answer = client.call_api(
            f"/api/v1/namespaces/{namespace}/services/dyn-frontend:http/proxy/v1/chat/completions",
            "POST",
            body=body,
            header_params={"Content-Type": "application/json"},
            auth_settings=["BearerToken"],
            response_type="str",
            _preload_content=False,
        )[0]
        reply = json.loads(answer.data)
        assert reply["choices"][0]["message"]["content"]
    finally:
        core.delete_namespace(namespace)
