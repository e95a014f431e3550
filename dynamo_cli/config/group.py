"""One engine over several nodes: the group a worker belongs to (`dyn worker --nnodes N --node-rank R`).

The leader (node rank 0) joins the deployment and serves; followers (ranks 1..N-1) run the engine's headless part
and never register as routable workers. They meet at the leader's request-plane address (`--leader-addr`). The
group lives and dies together (node_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.engine import NodeGroup
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import ENGINE, setting

MAX_NODES = 64
"""`--nnodes`: a bound, so that a typo cannot make a leader wait for thousands of followers."""


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Where this worker sits in a multi-node engine (the default: a group of one)."""

    nnodes: int = setting(1, "--nnodes", env="DYN_NNODES", panel=ENGINE)
    """Nodes one engine spans (vLLM/SGLang `--nnodes`); 1: a single-node worker."""
    node_rank: int = setting(0, "--node-rank", env="DYN_NODE_RANK", panel=ENGINE)
    """This node's rank in the group: 0 is the leader, which serves; the others are headless followers."""
    leader_addr: str | None = setting(None, "--leader-addr", env="DYN_LEADER_ADDR", panel=ENGINE)
    """HOST:PORT of the leader's request plane, where followers join (the leader listens there)."""
    join_timeout_s: float = setting(300.0, "--group-join-timeout", env="DYN_GROUP_JOIN_TIMEOUT", panel=ENGINE)
    """Seconds the leader waits for every follower, and a follower for the leader, before giving up."""

    def __post_init__(self) -> None:
        if not 1 <= self.nnodes <= MAX_NODES:
            raise ConfigError(f"--nnodes must be between 1 and {MAX_NODES}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be between 0 and {self.nnodes - 1} (--nnodes), got {self.node_rank}")
        if self.nnodes > 1 and not self.leader_addr:
            raise ConfigError("--nnodes > 1 needs --leader-addr HOST:PORT (the leader's request-plane address)")
        if self.leader_addr is not None:
            host, _, port = self.leader_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--leader-addr '{self.leader_addr}' must be HOST:PORT with a port of 1..65535")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"--group-join-timeout must be positive, got {self.join_timeout_s}")

    @property
    def is_leader(self) -> bool:
        """The node that joins the deployment and serves (also the only node of a group of one)."""
        return self.node_rank == 0

    @property
    def is_grouped(self) -> bool:
        """The engine spans several nodes."""
        return self.nnodes > 1

    @property
    def leader_host(self) -> str:
        """The leader's host (`--leader-addr` without its port)."""
        return (self.leader_addr or "").rpartition(":")[0]

    @property
    def leader_port(self) -> int:
        """The leader's request-plane port (the one it listens on)."""
        return int((self.leader_addr or ":0").rpartition(":")[2])

    def node_group(self) -> NodeGroup:
        """What the engine is told of its nodes."""
        return NodeGroup(self.nnodes, self.node_rank, self.leader_host)
