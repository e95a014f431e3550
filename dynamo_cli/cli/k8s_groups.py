"""`dyn k8s render --nodes-per-worker N`: every worker pool as groups of N pods running one engine (a LeaderWorkerSet,
dynamo_cli/k8s/groups.py): the leader's and the followers' `dyn worker` flags, the engines that can span nodes,
and where the pods are scheduled (`--scheduler-name`, for a gang scheduler)."""

from __future__ import annotations

from dataclasses import replace
from importlib.metadata import entry_points
from typing import Any

from dynamo_cli.cli import settings
from dynamo_cli.cli import worker as worker_cmd
from dynamo_cli.cli.k8s_target import ClusterTarget, opt
from dynamo_cli.config import ServeConfig, WorkerConfig
from dynamo_cli.config.group import GroupConfig
from dynamo_cli.engine import HEADLESS_GROUP
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.groups import LEADER_ADDRESS, WORKER_INDEX
from dynamo_cli.k8s.names import check_name

GROUPS = [
    opt(
        "scheduler_name",
        "--scheduler-name",
        str | None,
        None,
        "Workers' scheduler (e.g. volcano, with LWS's gang scheduling on: a --nodes-per-worker group is placed "
        "whole or not at all; default: the cluster's).",
    ),
]
"""Render's options for where the worker pods, and the groups of them, are scheduled."""


def with_groups(target: ClusterTarget, given: dict[str, Any]) -> ClusterTarget:
    """`target` with the `GROUPS` options' values (`given`), its groups checked: refused, naming the flag, when the
    engine cannot span nodes."""
    scheduler = given["scheduler_name"]
    if scheduler is not None:
        placement = replace(target.placement, scheduler_name=check_name("--scheduler-name", scheduler))
        target = replace(target, placement=placement)
    _check_groups(target.config)
    return target


def _check_groups(config: ServeConfig) -> None:
    nodes, engine = config.nodes_per_worker, config.worker.engine
    spanning = sorted(ep.name for ep in entry_points(group=HEADLESS_GROUP))  # named, not loaded: no engine here
    if nodes > 1 and engine not in spanning:
        raise ConfigError(
            f"--nodes-per-worker {nodes}: --engine {engine} runs on one node (it has no headless part for the "
            f"follower pods); use an engine that spans nodes ({', '.join(spanning) or 'none installed'}) or drop "
            "--nodes-per-worker"
        )


def group_flags(config: WorkerConfig, nodes: int, join_timeout_s: float) -> tuple[list[str], list[str]]:
    """The group flags of a leader's and of its followers' `dyn worker` command lines: one engine over `nodes`
    pods, meeting at the leader's request-plane port on the address LWS gives the leader, a follower's rank its
    index in the group; each side waits `join_timeout_s` for the other (a pod of a group may wait that long for a
    node)."""
    group = GroupConfig(nnodes=nodes, leader_addr=f"{LEADER_ADDRESS}:{config.port}", join_timeout_s=join_timeout_s)
    replace(config, group=group)  # the leader's config, checked: it listens where its followers join
    flags = settings.arguments(group, worker_cmd.KNOBS)  # --nnodes, --leader-addr, --group-join-timeout
    at = flags.index("--nnodes") + 2
    leader, follower = ([*flags[:at], "--node-rank", rank, *flags[at:]] for rank in ("0", WORKER_INDEX))
    return leader, follower
