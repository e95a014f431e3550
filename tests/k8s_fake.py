"""A loopback fake Kubernetes API server for the real `kubernetes` client: an HTTP server on 127.0.0.1 that
records every request and lets a test object answer it, a kubeconfig that points the client at it, and
FakeCluster, which serves a namespace's Deployments, StatefulSets, LeaderWorkerSets, pods, events, pod logs and a
service proxy."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "planner-token"
GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
"""What the API server's query parameter parsing (Go's strconv.ParseBool) reads as true."""


@dataclass
class Seen:
    """One request the fake API server answered."""

    method: str
    path: str
    content_type: str | None
    authorization: str | None
    body: Any
    at: float
    query: dict[str, str] = field(default_factory=dict)


class Answers(Protocol):
    """What a fake answers with: a dict (JSON) or str (text/plain) and its status."""

    seen: list[Seen]

    def answer(self, seen: Seen) -> tuple[int, Any]: ...


def handler(fake: Answers) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            parts = urlsplit(self.path)
            seen = Seen(
                self.command,
                unquote(parts.path),
                self.headers.get("Content-Type"),
                self.headers.get("Authorization"),
                json.loads(raw) if raw else None,
                time.monotonic(),
                {key: values[-1] for key, values in parse_qs(parts.query).items()},
            )
            fake.seen.append(seen)
            status, answer = fake.answer(seen)
            is_text = isinstance(answer, str)
            data = answer.encode() if is_text else json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if is_text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return Handler


@contextmanager
def serving(fake: Answers) -> Iterator[int]:
    """Serve `fake` on a free loopback port (yielded) until the block ends."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler(fake))
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield http.server_address[1]
    finally:
        http.shutdown()
        http.server_close()
        thread.join(5)


def write_kubeconfig(path: Path, port: int, namespace: str, token: str = TOKEN) -> Path:
    """A kubeconfig whose current context is the fake server on `port`, with a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "planner", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "planner", "namespace": namespace}}],
        "current-context": "fake",
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def status_object(code: int, message: str | None = None) -> dict[str, Any]:
    """The API server's Status body of an error."""
    reasons = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed"}
    reasons |= {409: "Conflict", 429: "TooManyRequests"}
    reason = reasons.get(code, "InternalError" if code == 500 else "ServiceUnavailable")
    body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": reason, "code": code}
    return body | {"message": message or reason}


def matches(labels: dict[str, str], selector: str) -> bool:
    """An equality-based label selector (`a=b,c=d`) against an object's labels."""
    wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
    return all(labels.get(key) == value for key, value in wanted.items())


@dataclass
class FakeCluster:
    """One namespace's objects as the API server's JSON, and how the service proxy answers.

    `logs` maps (pod, container, previous) to the log text; `proxy` answers
    `GET /api/v1/namespaces/NS/services/NAME/proxy/PATH` with (status, body), or forwards the GET to a URL;
    `forbidden` holds the paths' resource words (`pods`, `log`, `events`, `proxy`, `deployments` ...) to
    answer 403."""

    namespace: str
    deployments: list[dict[str, Any]] = field(default_factory=list)
    statefulsets: list[dict[str, Any]] = field(default_factory=list)
    leaderworkersets: list[dict[str, Any]] | None = None
    """None: the cluster has no LWS API (the list is a 404)."""
    pods: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[tuple[str, str, bool], str] = field(default_factory=dict)
    proxy: tuple[int, Any] | Callable[[str], tuple[int, Any]] = (503, None)
    forbidden: set[str] = field(default_factory=set)
    seen: list[Seen] = field(default_factory=list)

    def answer(self, seen: Seen) -> tuple[int, Any]:
        core, apps = f"/api/v1/namespaces/{self.namespace}/", f"/apis/apps/v1/namespaces/{self.namespace}/"
        lws = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{self.namespace}/"
        if seen.method != "GET":
            return 405, status_object(405)
        prefix = next((p for p in (core, apps, lws) if seen.path.startswith(p)), apps)
        rest = seen.path.removeprefix(prefix)
        words = rest.split("/")
        if self.forbidden & set(words):
            return 403, status_object(403, f'{words[0]} is forbidden: User "viewer" cannot get resource {words}')
        if words == ["leaderworkersets"] and self.leaderworkersets is None:
            return 404, status_object(404)  # no LWS API in this cluster
        if words[0] in ("deployments", "statefulsets", "pods", "leaderworkersets") and len(words) == 1:
            kinds = {"deployments": self.deployments, "statefulsets": self.statefulsets, "pods": self.pods}
            items = {**kinds, "leaderworkersets": self.leaderworkersets or []}[words[0]]
            selector = seen.query.get("labelSelector", "")
            return 200, {"items": [i for i in items if matches(i["metadata"].get("labels", {}), selector)]}
        if words[0] == "pods" and words[2:] == ["log"]:
            key = (words[1], seen.query.get("container", ""), seen.query.get("previous") in GO_TRUE)
            lines = self.logs[key].splitlines() if key in self.logs else None
            if lines is None:
                return 400, status_object(400, f"previous terminated container not found for {words[1]}")
            tail = int(seen.query.get("tailLines", len(lines)))
            return 200, "".join(line + "\n" for line in lines[-tail:] if tail)
        if words == ["events"]:
            terms = dict(term.split("=", 1) for term in seen.query.get("fieldSelector", "").split(",") if term)
            return 200, {"items": [e for e in self.events if _event_matches(e, terms)]}
        if words[0] == "services" and words[2:3] == ["proxy"]:
            return self.proxy("/".join(words[3:])) if callable(self.proxy) else self.proxy
        return 404, status_object(404)


def _event_matches(event: dict[str, Any], terms: dict[str, str]) -> bool:
    fields = {"involvedObject.name": event["involvedObject"]["name"], "type": event.get("type", "Normal")}
    return all(fields.get(key) == value for key, value in terms.items())
