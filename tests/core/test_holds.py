"""Holding a worker (core/holds.py): the one writer of a worker's in-flight ledger and of its policy's, from the
choice to an idempotent release, for every path to a worker."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from dynamo_cli.config import BusyThresholds, KvRouterConfig, QueueConfig
from dynamo_cli.core.holds import ONLY_HUNG, Hold, Pool, Wanted, choose, choose_or_wait, wait_for
from dynamo_cli.core.queue import QueuedRequest, WaitQueue
from dynamo_cli.core.registry import Worker
from dynamo_cli.errors import NoWorkers, Overloaded
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.kv_policy import KvRoutingPolicy
from dynamo_cli.runtime.endpoint import InstanceRecord
from dynamo_cli.runtime.request_client import RequestClient

PROMPT = list(range(1, 65))
ONE_EACH = BusyThresholds(max_inflight=1)


def worker(instance_id: int) -> Worker:
    record = InstanceRecord(
        namespace="ns", component="backend", endpoint="generate", instance_id=instance_id, transport={"tcp": "-"}
    )
    card = ModelCard(display_name="m", tokenizer_source="-", engine="mocker")
    return Worker(instance_id, record, card, RequestClient("127.0.0.1:1"))


def pool(*ids: int, policy: KvRoutingPolicy | None = None, queue: WaitQueue | None = None) -> Pool:
    return Pool("m", {i: worker(i) for i in ids}, policy, queue=queue)


async def test_a_hold_counts_the_worker_and_the_policy_until_one_release_however_often_it_is_called() -> None:
    kv = KvRoutingPolicy(KvRouterConfig(block_size=16))
    p = pool(1, 2, policy=kv)
    hold = choose(p, Wanted("r", PROMPT), BusyThresholds())
    held = hold.worker
    assert held.num_inflight == 1 and kv.sequences.num_requests() == 1
    hold.queue_prefill(len(PROMPT))
    assert held.pending_prefill_tokens == len(PROMPT)
    hold.first_token()
    hold.first_token()
    assert held.pending_prefill_tokens == 0
    hold.queue_prefill(10)  # once the first token came, nothing is left to prefill
    hold.release()
    hold.release()
    assert (held.num_inflight, held.pending_prefill_tokens, kv.sequences.num_requests()) == (0, 0, 0)


async def test_a_release_before_the_first_token_unqueues_the_prefill() -> None:
    p = pool(1)
    hold = choose(p, Wanted("r", PROMPT), BusyThresholds())
    hold.queue_prefill(64)
    hold.release()
    assert (p.workers[1].num_inflight, p.workers[1].pending_prefill_tokens) == (0, 0)


async def test_without_a_policy_the_least_loaded_live_worker_is_chosen() -> None:
    p = pool(1, 2, 3)
    chosen = [choose(p, Wanted(r), ONLY_HUNG).worker.instance_id for r in ("a", "b")]
    assert chosen == [1, 2]
    p.workers[3].hung = "a canary got no answer"  # the least loaded, but out of routing
    assert choose(p, Wanted("c"), ONLY_HUNG).worker.instance_id == 1


async def test_hung_busy_and_excluded_workers_are_not_chosen() -> None:
    p = pool(1, 2)
    p.workers[1].hung = "nothing from it for 2.0 s"
    assert choose(p, Wanted("a"), ONLY_HUNG).worker.instance_id == 2
    with pytest.raises(Overloaded, match=r"all 2 workers of 'm' are busy"):
        choose(p, Wanted("b"), ONE_EACH)  # 1 hung, 2 at its limit
    with pytest.raises(NoWorkers, match="model 'm'"):
        choose(p, Wanted("c"), ONLY_HUNG, excluded={1, 2})


async def test_a_pin_a_lora_and_background_work_narrow_the_choice() -> None:
    p = pool(1, 2)
    assert choose(p, Wanted("a", pinned=2), BusyThresholds()).worker.instance_id == 2
    with pytest.raises(NoWorkers, match="LoRA adapter 'x' of model 'm'"):
        choose(p, Wanted("b", lora="x"), BusyThresholds())
    busy = choose(p, Wanted("c"), BusyThresholds())
    busy.queue_prefill(100)
    assert choose(p, Wanted("d", is_background=True), BusyThresholds()).worker is not busy.worker


async def test_a_hold_given_a_worker_counts_it_and_starts_its_idle_wait_again_on_release() -> None:
    w = worker(1)
    w.used_at = 0.0
    hold = Hold(w, "canary")
    assert w.num_inflight == 1
    hold.release()
    assert w.num_inflight == 0 and w.used_at > 0


async def test_a_waiter_takes_the_worker_a_release_frees() -> None:
    queue = WaitQueue()
    p = pool(1, queue=queue)
    first = choose(p, Wanted("a"), ONE_EACH)
    waiter = asyncio.create_task(wait_for(p, Wanted("b"), ONE_EACH, (), QueuedRequest(), QueueConfig(max_size=4)))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    first.release()
    second = await asyncio.wait_for(waiter, 2)
    assert second.worker is first.worker and second.worker.num_inflight == 1
    second.release()


async def test_choose_or_wait_waits_only_where_every_worker_is_busy_and_says_when_it_waited() -> None:
    p, waits = pool(1, queue=WaitQueue()), list[float]()
    config = QueueConfig(max_size=4)
    first = await choose_or_wait(p, Wanted("a"), ONE_EACH, (), QueuedRequest(), config, waits.append)
    assert waits == []  # chosen at once: no wait to tell of
    waiter = asyncio.create_task(choose_or_wait(p, Wanted("b"), ONE_EACH, (), QueuedRequest(), config, waits.append))
    await asyncio.sleep(0.05)
    first.release()
    second = await asyncio.wait_for(waiter, 2)
    assert len(waits) == 1 and second.worker is first.worker
    with pytest.raises(Overloaded):  # no room to wait: refused at once, and no wait told of
        await choose_or_wait(p, Wanted("c"), ONE_EACH, (), QueuedRequest(), QueueConfig(max_size=0), waits.append)
    assert len(waits) == 1
    second.release()


def test_only_the_holds_write_a_workers_in_flight_ledger() -> None:
    root = Path(__file__).resolve().parents[2] / "dynamo_cli"
    written = re.compile(r"\.(num_inflight|pending_prefill_tokens)\s*[-+]?=[^=]")
    writers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if written.search(path.read_text()) and path.name != "holds.py"
    )
    assert writers == []
