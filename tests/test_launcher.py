"""`dyn serve` behind `dyn router`s: when every router sees every worker."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec

from dynamo_cli.launcher import _backends_seen
from dynamo_cli.wire import BestWorkerReply, InFlight


class Client:
    """A router's client that answers `best_worker_id` with one reply."""

    def __init__(self, reply: BestWorkerReply) -> None:
        self.reply = reply

    async def call(self, endpoint: str, query: Any) -> BestWorkerReply:
        return self.reply


async def test_a_worker_of_several_ranks_counts_once_among_the_backends_a_router_sees() -> None:
    rows = [
        InFlight(worker_id=w, dp_rank=r, num_requests=0, active_blocks=0, active_prefill_tokens=0)
        for w in (1, 2)
        for r in (0, 1)
    ]
    first = BestWorkerReply(
        worker_id=1,
        overlap_blocks=0,
        explanation={},
        router_id=9,
        model="m",
        in_flight=rows[:2],  # worker 1's two ranks: worker 2 not seen yet
        queued=0,
        indexed_workers=[],
        prefill_workers=[7],
    )
    client = Client(first)
    router: Any = SimpleNamespace(client=client)

    assert await _backends_seen(router) == 2  # one decode worker and the prefill one, not 3
    client.reply = msgspec.structs.replace(first, in_flight=rows)
    assert await _backends_seen(router) == 3
