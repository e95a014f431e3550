"""The kubernetes connector, driven by the real `kubernetes` client with a generated kubeconfig, against a loopback
fake API server that serves the Scale subresource and the Deployment, records every request and answers errors on
demand; then `dyn plan run --connector kubernetes` under the planner's load-step scenario against it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.connectors import ScaleTarget
from dynamo_cli.planner.kubernetes import KubernetesConfig, KubernetesConnector
from tests.conftest import DynProcess, wait_until
from tests.k8s_fake import TOKEN, Seen, serving, status_object, write_kubeconfig
from tests.planner.test_plan_cli import _load, _wait_lines, dyn, profile_file  # noqa: F401 (profile_file: a fixture)

pytest.importorskip("kubernetes")

NS = "inference"
BASE = f"/apis/apps/v1/namespaces/{NS}/deployments"
LWS_BASE = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"


@dataclass
class FakeApiServer:
    """Deployments (or, `base` LWS_BASE, LeaderWorkerSets) by name: spec replicas, ready replicas (reaching spec
    `ready_delay_s` after each PATCH)."""

    replicas: dict[str, int]
    base: str = BASE
    ready_delay_s: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    failures: list[tuple[str | None, str | None, int]] = field(default_factory=list)
    ready_at: dict[str, float] = field(default_factory=dict)
    ready: dict[str, int] = field(default_factory=dict)
    port: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, status: int, times: int, method: str | None = None, resource: str | None = None) -> None:
        """Answer `status` to the next `times` requests (of `method` on `resource`, scale or deployment, if given)."""
        self.failures.extend([(method, resource, status)] * times)

    def patches(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "PATCH"]

    def answer(self, seen: Seen) -> tuple[int, dict[str, Any]]:
        method, path, body = seen.method, seen.path, seen.body
        with self.lock:
            name, _, sub = path.removeprefix(self.base + "/").partition("/")
            resource = "scale" if sub else "deployment"
            for i, (only, on, status) in enumerate(self.failures):
                if only in (None, method) and on in (None, resource):
                    del self.failures[i]
                    return status, status_object(status)
            if not path.startswith(self.base + "/") or name not in self.replicas or sub not in ("", "scale"):
                return 404, status_object(404)
            if method == "PATCH" and sub == "scale":
                self.ready[name] = self.ready_now(name)
                self.replicas[name] = body["spec"]["replicas"]
                self.ready_at[name] = time.monotonic() + self.ready_delay_s
            return 200, scale_object(name, self.replicas[name]) if sub else self.deployment(name)

    def ready_now(self, name: str) -> int:
        if time.monotonic() >= self.ready_at.get(name, 0.0):
            return self.replicas[name]
        return min(self.ready.get(name, 0), self.replicas[name])

    def deployment(self, name: str) -> dict[str, Any]:
        labels = {"app.kubernetes.io/name": name}
        ready = self.ready_now(name)
        if self.base == LWS_BASE:
            return leader_worker_set(name, self.replicas[name], ready)
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "7", "generation": 2},
            "spec": {
                "replicas": self.replicas[name],
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "worker", "image": "dyn:0.1.0", "args": ["worker"]}]},
                },
            },
            "status": {"observedGeneration": 2, "replicas": self.replicas[name], "readyReplicas": ready or None},
        }


def leader_worker_set(name: str, replicas: int, ready: int) -> dict[str, Any]:
    """A LeaderWorkerSet as the API server returns it (a custom object: plain JSON), its replicas groups."""
    template = {"spec": {"containers": [{"name": "worker", "image": "dyn:0.1.0", "args": ["worker"]}]}}
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "7", "generation": 2},
        "spec": {"replicas": replicas, "leaderWorkerTemplate": {"size": 2, "workerTemplate": template}},
        "status": {"replicas": replicas, "readyReplicas": ready, "hpaPodSelector": f"lws={name},worker-index=0"},
    }


def scale_object(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "7"},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": f"app.kubernetes.io/name={name}"},
    }


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    yield from _serving(FakeApiServer(replicas={"dyn-decode": 1, "dyn-prefill": 1}))


@pytest.fixture
def lws_fake() -> Iterator[FakeApiServer]:
    """The pools of `dyn k8s render --nodes-per-worker N`: LeaderWorkerSets, each replica a group."""
    yield from _serving(FakeApiServer(replicas={"dyn-worker": 1, "dyn-prefill": 1}, base=LWS_BASE))


def _serving(server: FakeApiServer) -> Iterator[FakeApiServer]:
    with serving(server) as server.port:
        yield server
    # whatever a test did: the connector only ever patched the Scale subresource, and only its replicas
    for seen in server.patches():
        assert seen.path.endswith("/scale") and set(seen.body) == {"spec"} and set(seen.body["spec"]) == {"replicas"}
    assert all("template" not in json.dumps(seen.body) for seen in server.seen)


@pytest.fixture
def kubeconfig(fake: FakeApiServer, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", fake.port, NS)


def connector(kubeconfig: Path, **overrides: Any) -> KubernetesConnector:
    settings: dict[str, Any] = {
        "namespace": NS,
        "kubeconfig": str(kubeconfig),
        "min_replicas": 1,
        "max_replicas": 8,
        "min_patch_interval_s": 0.0,
        "backoff_s": 0.01,
        "ready_timeout_s": 5.0,
        **overrides,
    }
    return KubernetesConnector(KubernetesConfig(**settings))


def requests(fake: FakeApiServer) -> list[tuple[str, str]]:
    return [(s.method, s.path.removeprefix(BASE + "/")) for s in fake.seen]


async def test_a_scale_up_is_one_merge_patch_of_the_scale_subresource(fake: FakeApiServer, kubeconfig: Path) -> None:
    scaler = connector(kubeconfig)
    try:
        assert await scaler.next_decision_id() == 1
        assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=3))
        assert await scaler.next_decision_id() == 2
    finally:
        await scaler.close()
    assert requests(fake) == [("GET", "dyn-decode/scale"), ("PATCH", "dyn-decode/scale"), ("GET", "dyn-decode")]
    (patch,) = fake.patches()
    assert patch.path == f"/apis/apps/v1/namespaces/{NS}/deployments/dyn-decode/scale"
    assert (patch.content_type, patch.body) == ("application/merge-patch+json", {"spec": {"replicas": 3}})
    assert {s.authorization for s in fake.seen} == {f"Bearer {TOKEN}"}
    assert fake.replicas == {"dyn-decode": 3, "dyn-prefill": 1}  # agg mode: the prefill Deployment is not touched


async def test_disagg_scales_the_prefill_and_the_decode_deployment(fake: FakeApiServer, kubeconfig: Path) -> None:
    scaler = connector(kubeconfig, prefill_deployment="dyn-prefill")
    try:
        assert await scaler.apply(ScaleTarget(4, num_prefill=2, num_decode=5))
    finally:
        await scaler.close()
    assert sorted((p.path.split("/")[-2], p.body["spec"]["replicas"]) for p in fake.patches()) == [
        ("dyn-decode", 5),
        ("dyn-prefill", 2),
    ]
    assert fake.replicas == {"dyn-decode": 5, "dyn-prefill": 2}


async def test_no_patch_is_sent_when_the_deployment_already_has_the_target(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    scaler = connector(kubeconfig)
    try:
        assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=1))
        assert await scaler.apply(ScaleTarget(2, num_prefill=0, num_decode=1))
    finally:
        await scaler.close()
    assert requests(fake) == [("GET", "dyn-decode/scale")] * 2  # nothing scaled up: no readiness to follow


async def test_targets_are_clamped_to_the_replica_bounds(fake: FakeApiServer, kubeconfig: Path) -> None:
    scaler = connector(kubeconfig, min_replicas=2, max_replicas=4)
    try:
        assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=10))
        assert await scaler.apply(ScaleTarget(2, num_prefill=0, num_decode=0))
    finally:
        await scaler.close()
    assert [p.body["spec"]["replicas"] for p in fake.patches()] == [4, 2]


async def test_patches_of_one_deployment_are_spaced_by_the_minimum_interval(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    scaler = connector(kubeconfig, min_patch_interval_s=0.5)
    try:
        assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=2))
        started = time.monotonic()
        assert not await scaler.apply(ScaleTarget(2, num_prefill=0, num_decode=3))  # too soon: left, not waited
        assert time.monotonic() - started < 0.4
        time.sleep(0.5)
        assert await scaler.apply(ScaleTarget(3, num_prefill=0, num_decode=3))
    finally:
        await scaler.close()
    first, second = fake.patches()
    assert second.at - first.at >= 0.5 and second.body == {"spec": {"replicas": 3}}


@pytest.mark.parametrize(
    ("status", "method"),
    [
        pytest.param(409, "PATCH", id="409 conflict on the patch"),
        pytest.param(429, "GET", id="429 throttled on the read"),
        pytest.param(500, "PATCH", id="500 on the patch"),
        pytest.param(503, "GET", id="503 on the read"),
    ],
)
async def test_transient_errors_are_retried_with_backoff_until_the_call_succeeds(
    fake: FakeApiServer, kubeconfig: Path, status: int, method: str
) -> None:
    fake.fail(status, 2, method)
    scaler = connector(kubeconfig, max_attempts=3)
    try:
        assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=2))
    finally:
        await scaler.close()
    calls = [s.method for s in fake.seen]
    assert calls.count(method) == 3 + (method == "GET")  # two failures, then the call; GET: plus the ready read
    assert [p.body for p in fake.patches()][-1] == {"spec": {"replicas": 2}} and fake.replicas["dyn-decode"] == 2


async def test_retries_are_bounded_and_then_apply_says_false(
    fake: FakeApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail(500, 10, "PATCH")
    scaler = connector(kubeconfig, max_attempts=3)
    try:
        with caplog.at_level(logging.WARNING, logger="dynamo_cli.planner.kubernetes"):
            assert not await scaler.apply(ScaleTarget(5, num_prefill=0, num_decode=2))
    finally:
        await scaler.close()
    assert len(fake.patches()) == 3 and fake.replicas["dyn-decode"] == 1
    failed = "patch deployments/scale dyn-decode: HTTP 500 after 3 attempts"
    assert f"decision 5 not applied to the decode pool: {failed}" in caplog.text


@pytest.mark.parametrize(
    ("method", "resource", "missing"),
    [
        pytest.param("PATCH", "scale", "may not patch deployments/scale", id="no patch on deployments/scale"),
        pytest.param("GET", "scale", "may not get deployments/scale", id="no get on deployments/scale"),
        pytest.param("GET", "deployment", "may not get deployments in", id="no get on deployments"),
    ],
)
async def test_a_403_is_one_warning_naming_the_missing_verb_and_apply_says_false(
    fake: FakeApiServer,
    kubeconfig: Path,
    caplog: pytest.LogCaptureFixture,
    method: str,
    resource: str,
    missing: str,
) -> None:
    scaler = connector(kubeconfig)
    try:
        with caplog.at_level(logging.WARNING, logger="dynamo_cli.planner.kubernetes"):
            for decision in (1, 2):  # denied twice: warned once
                fake.fail(403, 1, method, resource)
                assert not await scaler.apply(ScaleTarget(decision, num_prefill=0, num_decode=2))
    finally:
        await scaler.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"forbidden (403): the planner's service account {missing}" in warnings[0]
    assert f"namespace {NS}" in warnings[0] and fake.failures == []
    # denied before the PATCH: the replicas are as they were; denied the readiness read after it: changed
    assert fake.replicas["dyn-decode"] == (2 if resource == "deployment" else 1)


async def test_a_scale_up_returns_once_accepted_and_its_readiness_is_followed_after(
    fake: FakeApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.ready_delay_s = 0.6
    scaler = connector(kubeconfig)
    try:
        with caplog.at_level(logging.INFO, logger="dynamo_cli.planner.kubernetes"):
            started = time.monotonic()
            assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=3))
            assert time.monotonic() - started < 0.5  # the pods start on their own time, not the planner's
            time.sleep(0.7)
            assert await scaler.apply(ScaleTarget(2, num_prefill=0, num_decode=3))  # the same target: no PATCH
    finally:
        await scaler.close()
    assert len(fake.patches()) == 1
    assert f"decode: deployment {NS}/dyn-decode has its 3 replicas ready" in caplog.text


async def test_a_scale_up_not_ready_in_time_is_one_warning_on_a_later_decision(
    fake: FakeApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.ready_delay_s = 30.0
    scaler = connector(kubeconfig, ready_timeout_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="dynamo_cli.planner.kubernetes"):
            assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=3))
            time.sleep(0.35)
            for decision in (2, 3):
                assert await scaler.apply(ScaleTarget(decision, num_prefill=0, num_decode=3))
    finally:
        await scaler.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"decode: deployment {NS}/dyn-decode has 1 of 3 replicas ready" in warnings[0]


async def test_a_prefill_scale_up_stuck_pending_does_not_hold_up_the_decode_pool(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    """The issue's outage: prefill first, waited for up to 10 minutes, then decode skipped. Now each pool is its
    own PATCH, both at once, and no apply waits for pods: decode grows again while prefill's pods stay Pending."""
    fake.ready_delay_s = 3600.0  # no pod of either pool ever becomes ready here (no GPU free)
    scaler = connector(kubeconfig, prefill_deployment="dyn-prefill", ready_timeout_s=600.0)
    try:
        started = time.monotonic()
        assert await scaler.apply(ScaleTarget(1, num_prefill=3, num_decode=4))
        assert time.monotonic() - started < 1.0  # well under any planner interval
        assert (fake.replicas["dyn-prefill"], fake.replicas["dyn-decode"]) == (3, 4)
        assert await scaler.apply(ScaleTarget(3, num_prefill=3, num_decode=6))
    finally:
        await scaler.close()
    assert fake.replicas["dyn-decode"] == 6 and fake.replicas["dyn-prefill"] == 3


def _lws_connector(kubeconfig: Path, **overrides: Any) -> KubernetesConnector:
    return connector(kubeconfig, kind="LeaderWorkerSet", decode_deployment="dyn-worker", **overrides)


async def test_a_leader_worker_set_pool_is_scaled_in_groups_through_its_scale_subresource(
    lws_fake: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scaler = _lws_connector(write_kubeconfig(tmp_path / "kubeconfig", lws_fake.port, NS))
    try:
        with caplog.at_level(logging.INFO, logger="dynamo_cli.planner.kubernetes"):
            assert await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=3))  # 3 groups of N pods each
            assert await scaler.apply(ScaleTarget(2, num_prefill=0, num_decode=3))  # the same target: no PATCH
    finally:
        await scaler.close()
    paths = [(s.method, s.path.removeprefix(LWS_BASE + "/")) for s in lws_fake.seen]
    assert paths == [("GET", "dyn-worker/scale"), ("PATCH", "dyn-worker/scale"), ("GET", "dyn-worker")] + [
        ("GET", "dyn-worker/scale")
    ]
    (patch,) = lws_fake.patches()
    assert (patch.content_type, patch.body) == ("application/merge-patch+json", {"spec": {"replicas": 3}})
    assert {s.authorization for s in lws_fake.seen} == {f"Bearer {TOKEN}"}
    assert lws_fake.replicas == {"dyn-worker": 3, "dyn-prefill": 1}
    assert f"decode: leaderworkerset {NS}/dyn-worker replicas 1 → 3" in caplog.text
    assert f"decode: leaderworkerset {NS}/dyn-worker has its 3 replicas ready" in caplog.text


async def test_disagg_scales_both_leader_worker_sets_and_follows_their_ready_groups(
    lws_fake: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lws_fake.ready_delay_s = 30.0  # the groups' pods never all become ready here
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", lws_fake.port, NS)
    scaler = _lws_connector(kubeconfig, prefill_deployment="dyn-prefill", ready_timeout_s=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="dynamo_cli.planner.kubernetes"):
            assert await scaler.apply(ScaleTarget(1, num_prefill=2, num_decode=4))
            time.sleep(0.25)
            assert await scaler.apply(ScaleTarget(2, num_prefill=2, num_decode=4))
    finally:
        await scaler.close()
    assert lws_fake.replicas == {"dyn-worker": 4, "dyn-prefill": 2}
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert [w.split(" ready ")[0] for w in warnings] == [
        f"decode: leaderworkerset {NS}/dyn-worker has 1 of 4 replicas",
        f"prefill: leaderworkerset {NS}/dyn-prefill has 1 of 2 replicas",
    ]


@pytest.mark.parametrize(
    ("method", "resource", "missing"),
    [
        pytest.param("PATCH", "scale", "may not patch leaderworkersets/scale", id="no patch on the scale"),
        pytest.param("GET", "deployment", "may not get leaderworkersets in", id="no get on the object"),
    ],
)
async def test_a_403_on_a_leader_worker_set_names_its_verbs_and_resources(
    lws_fake: FakeApiServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    method: str,
    resource: str,
    missing: str,
) -> None:
    lws_fake.fail(403, 1, method, resource)
    scaler = _lws_connector(write_kubeconfig(tmp_path / "kubeconfig", lws_fake.port, NS))
    try:
        with caplog.at_level(logging.WARNING, logger="dynamo_cli.planner.kubernetes"):
            assert not await scaler.apply(ScaleTarget(1, num_prefill=0, num_decode=2))
    finally:
        await scaler.close()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"the planner's service account {missing}" in warning
    assert "it needs get/patch on leaderworkersets/scale and get on leaderworkersets" in warning


def test_without_the_client_the_connector_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes → ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dynamo-cli\[k8s\]'"):
        KubernetesConnector(KubernetesConfig(namespace=NS))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(["--k8s-namespace", "Bad_NS"], "--k8s-namespace 'Bad_NS' is not", id="a bad namespace"),
        pytest.param(
            ["--k8s-namespace", "ns", "--k8s-decode-deployment", "a b"],
            "--k8s-decode-deployment 'a b' is not a Deployment name",
            id="a bad deployment name",
        ),
        pytest.param(
            ["--k8s-namespace", "ns", "--k8s-ready-timeout", "-1"], "--k8s-ready-timeout must be", id="a bad timeout"
        ),
        pytest.param(
            ["--k8s-namespace", "ns", "--k8s-kind", "StatefulSet"],
            "--k8s-kind 'StatefulSet' is not one of Deployment, LeaderWorkerSet",
            id="a kind it cannot scale",
        ),
        pytest.param(
            ["--k8s-namespace", "ns", "--kubeconfig", "/nonexistent/kubeconfig"],
            "--kubeconfig '/nonexistent/kubeconfig' cannot be used",
            id="a missing kubeconfig",
        ),
    ],
)
def test_bad_kubernetes_flags_are_one_red_line(
    flags: list[str],
    expected: str,
    profile_file: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    base = ["plan", "run", "--profile", str(profile_file), "--ttft", "500", "--itl", "50", "--frontend", "http://x"]
    result = dyn(*base, "--discovery", f"file://{tmp_path / 'discovery'}", "--connector", "kubernetes", *flags)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and expected in lines[0]


def test_a_kubernetes_planner_patches_replicas_up_for_a_load_step_and_back_down(
    dyn_serve,  # type: ignore[no-untyped-def]
    profile_file: Path,  # noqa: F811 (the fixture)
    fake: FakeApiServer,
    kubeconfig: Path,
) -> None:
    frontend: DynProcess = dyn_serve("--engine", "mocker", "--workers", "1", "--speedup-ratio", "50")
    flags = ["--mode", "agg", "--interval", "1", "--load-interval", "0", "--max-workers", "16"]
    k8s = ["--connector", "kubernetes", "--k8s-namespace", NS, "--kubeconfig", str(kubeconfig)]
    k8s += ["--k8s-decode-deployment", "dyn-decode"]  # (agg's default is render's dyn-worker)
    planner = subprocess.Popen(
        [sys.executable, "-m", "dynamo_cli.cli.main", "plan", "run", "--profile", str(profile_file)]
        + ["--ttft", "1000", "--itl", "50", "--discovery", frontend.discovery, *flags, *k8s]
        + ["--k8s-patch-interval", "0", "--k8s-ready-timeout", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert planner.stdout is not None
    threading.Thread(target=lambda: lines.extend(planner.stdout), daemon=True).start()  # type: ignore[arg-type]
    sizes: list[int] = []
    try:
        _wait_lines(lines, 1, 60)  # one idle interval first: at the minimum, nothing to patch
        assert lines and fake.patches() == [], (lines, fake.seen)
        loader = threading.Thread(target=_load, args=(frontend.url, 3.0, threading.Event()))
        loader.start()
        while loader.is_alive():
            sizes.append(fake.replicas["dyn-decode"])
            time.sleep(0.1)
        assert wait_until(lambda: fake.replicas["dyn-decode"] == 1, 40), "the planner did not scale back down"
    finally:
        planner.terminate()
        _, err = planner.communicate(timeout=30)
    assert planner.returncode == 0, err
    patched = [p.body["spec"]["replicas"] for p in fake.patches()]
    assert max(sizes) >= 2 and max(patched) >= 2, (sizes, patched)  # the step: more replicas
    assert patched[-1] == 1, patched  # idle again: back to the minimum
    only = ("application/merge-patch+json", f"{BASE}/dyn-decode/scale")
    assert {(p.content_type, p.path) for p in fake.patches()} == {only}
    assert fake.replicas["dyn-prefill"] == 1  # agg: only the decode Deployment
