"""The import layering of dynamo_cli and engines/, read from the source with `ast` (function-local and
TYPE_CHECKING imports included), so a layer that reaches up is caught before it ships.

Layers, lowest first; each may import the ones listed for it in ALLOWED and its own modules:

    errors                      the DynError tree; imports nothing
    settings                    how a config field is set from outside (flags, DYN_* twin, help); imports nothing
    timing                      the simulated engine's pass times and batch limits; imports nothing
    kv, model                   KV hashing, events and tiers; a model's files and tokenizer (errors, settings)
    wire                        every request-plane endpoint name and message (errors, kv)
    engine                      the engine contract (errors, kv, wire)
    config, model_card          per-role config (settings declared on its fields) and the published model card
    runtime                     distributed planes; knows nothing about LLMs (errors, config)
    tracing                     trace context, spans (OpenTelemetry, imported only when on), log lines
                                naming their request (the contract)
    lora                        multi-LoRA: a worker's served and loaded adapters, the routers' view of them (the
                                contract)
    routing                     the routing policy: which worker, by KV overlap, load and cost (the contract only:
                                no runtime, no request core, no I/O)
    core                        the request core: one request's stream across workers and the pool it draws on,
                                for the frontend and `dyn router` (routing, the contract, runtime, tracing, lora)
    router                      `dyn router`: the request core as a service (core, routing, runtime)
    frontend                    the OpenAI server (core, routing, model, runtime ...; not `dyn router`)
    batch                       OpenAI's Batch API: batches in SQLite, run through the frontend in process
                                (frontend, runtime)
    node_group                  a multi-node engine's leader and followers, over the request plane (the
                                contract, runtime)
    worker                      one engine behind the request plane (the contract, kv, runtime, node_group)
    engines/                    plugins: only the contract, kv, model, errors, config and timing
    bench                       an HTTP load generator (errors, model for token counts)
    planner                     SLA planner: reads frontends' /metrics over HTTP and discovery, drives an
                                engine through the contract to profile it (the contract, runtime); its
                                simulator takes the mocker's pass times (timing)
    process_pool                restarts `dyn serve`'s child processes (nothing of dyn)
    backend_file                `dyn serve --backend-file`: a worker per backend a file lists (config, errors,
                                process_pool)
    monitoring                  Prometheus scrape config, alerting rules, Grafana dashboard (errors, config)
    top                         `dyn top`'s view of a deployment: a frontend's /metrics over HTTP (errors)
    k8s                         Kubernetes objects of a deployment, and its status read from a cluster (errors,
                                config)
    launcher, cli               assemble processes; may import any layer (cli is the top)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CONTRACT = {"errors", "config", "engine", "kv", "model_card", "wire"}
_EVERYTHING = {
    "dynamo_cli",
    "errors",
    "settings",
    "timing",
    "wire",
    "config",
    "engine",
    "kv",
    "model",
    "model_card",
    "runtime",
    "routing",
    "core",
    "router",
    "lora",
    "frontend",
    "batch",
    "worker",
    "node_group",
    "worker_metrics",
    "tracing",
    "launcher",
    "bench",
    "process_pool",
    "backend_file",
    "planner",
    "monitoring",
    "top",
    "k8s",
}

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "settings": set(),
    "timing": set(),
    "kv": {"errors", "settings"},
    "model": {"errors"},
    "wire": {"errors", "kv"},
    "engine": {"errors", "kv", "wire"},
    "config": {"errors", "engine", "model_card", "settings", "wire"},
    "model_card": {"errors", "engine", "wire"},
    "runtime": {"errors", "config"},
    "tracing": {"errors", "config", "kv", "wire"},
    "lora": _CONTRACT,
    "routing": _CONTRACT,
    "core": _CONTRACT | {"runtime", "tracing", "lora", "routing"},
    "router": _CONTRACT | {"runtime", "tracing", "lora", "routing", "core"},
    "frontend": _CONTRACT | {"model", "runtime", "routing", "core", "tracing", "lora"},
    "batch": _CONTRACT | {"frontend", "runtime"},
    "node_group": _CONTRACT | {"runtime"},
    "worker": _CONTRACT | {"runtime", "worker_metrics", "tracing", "lora", "node_group"},
    "worker_metrics": {"errors", "kv", "wire"},
    "engines": {"errors", "config", "engine", "kv", "model", "wire", "timing"},
    "bench": {"errors", "model", "settings"},
    # The planner sees frontends only through their HTTP /metrics and workers only through discovery
    # and the engine contract, so it sits beside the frontend, above runtime, and imports neither router
    # nor frontend; the processes it starts are command lines the CLI builds for it.
    "planner": _CONTRACT
    | {"runtime", "timing", "k8s", "settings"},  # k8s: the API client its Kubernetes connector calls
    "process_pool": set(),  # child-process restarts for `dyn serve`: asyncio only
    "backend_file": {"errors", "config", "process_pool"},  # the command lines of its workers, and their pools
    "monitoring": {"errors", "config"},  # scrape config, alerting rules, dashboard: text generated from code
    "top": {"errors"},  # `dyn top`: a frontend's /metrics over HTTP, none of the frontend's code
    # Kubernetes objects as plain dicts and `dyn k8s status`'s reading of a cluster: the pods' command lines come
    # from the CLI (which knows every command's options), so nothing here imports a process's code.
    "k8s": {"errors", "config", "settings", "dynamo_cli"},
    "dynamo_cli": {"errors", "engine", "kv", "wire"},  # the package's curated __all__
    "launcher": _EVERYTHING,
    "cli": _EVERYTHING | {"cli"},
}
"""Layer -> the layers it may import (besides itself). `engines` is not importable from dynamo_cli at all."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """`dynamo_cli.routing.kv_policy` -> router, `dynamo_cli` -> dynamo_cli, `engines.vllm.engine` -> engines."""
    parts = module.split(".")
    if parts[0] == "engines":
        return "engines"
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(source: str, importer: str) -> Iterator[str]:
    """Every first-party module `source` imports, wherever the import statement is."""
    package = importer.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importer's package
                base = ".".join([*package[: len(package) - node.level], *filter(None, [base])])
            yield from (_submodule_or_package(base, alias.name) for alias in node.names)


def _submodule_or_package(base: str, name: str) -> str:
    """`from dynamo_cli import errors` imports the module dynamo_cli.errors; `import __version__`, the package."""
    candidate = ROOT.joinpath(*base.split("."), name)
    return f"{base}.{name}" if candidate.with_suffix(".py").exists() or candidate.is_dir() else base


def violations(importer: str, source: str) -> set[tuple[str, str]]:
    """(importer, imported) edges that break ALLOWED."""
    layer = layer_of(importer)
    found = set()
    for imported in imported_modules(source, importer):
        root = imported.split(".")[0]
        if root not in ("dynamo_cli", "engines"):
            continue
        target = layer_of(imported)
        if target == "engines" and layer != "engines":
            found.add((importer, imported))  # plugins are loaded through entry points only
        elif target != layer and target not in ALLOWED[layer]:
            found.add((importer, imported))
    return found


def first_party_modules() -> Iterator[tuple[str, str]]:
    for path in sorted([*ROOT.glob("dynamo_cli/**/*.py"), *ROOT.glob("engines/**/*.py")]):
        yield module_name(path), path.read_text()


def test_every_module_belongs_to_a_known_layer() -> None:
    unknown = {name for name, _ in first_party_modules() if layer_of(name) not in ALLOWED}
    assert unknown == set(), "add the new top-level module to ALLOWED in tests/test_layering.py"


def test_no_module_imports_a_layer_above_its_own() -> None:
    found = set().union(*(violations(name, source) for name, source in first_party_modules()))
    assert found == set()


def test_a_function_local_import_counts() -> None:
    source = "def f():\n    from dynamo_cli.frontend.served_models import ModelRegistry\n"
    assert violations("engines.mocker.engine", source) == {
        ("engines.mocker.engine", "dynamo_cli.frontend.served_models")
    }


def test_from_package_imports_resolve_to_the_module() -> None:
    source = "from dynamo_cli import router\nfrom dynamo_cli import errors\n"
    assert violations("dynamo_cli.runtime.x", source) == {("dynamo_cli.runtime.x", "dynamo_cli.router")}


def test_dynamo_cli_never_imports_the_engine_plugins() -> None:
    source = "import engines.mocker\n"
    assert violations("dynamo_cli.worker", source) == {("dynamo_cli.worker", "engines.mocker")}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_modules_import_each_other_even_inside_functions() -> None:
    sources = dict(first_party_modules())
    graph = {
        name: {m for m in imported_modules(source, name) if m in sources and m != name}
        for name, source in sources.items()
    }
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_two_public_classes_of_dynamo_cli_share_a_name() -> None:
    """STYLE rule 17: a name means one thing (the engine plugins, each a package of its own, are apart)."""
    seen: dict[str, list[str]] = {}
    for name, source in first_party_modules():
        if name.startswith("dynamo_cli"):
            for node in ast.parse(source).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    seen.setdefault(node.name, []).append(name)
    assert {cls: where for cls, where in seen.items() if len(where) > 1} == {}
