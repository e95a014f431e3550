"""Pull time of KV payloads between two processes over the KV transfer plane: TCP raw bytes vs NIXL READ.

A server subprocess (`KvTransferServer`, NIXL on when it imports) offers a fresh payload of each size on
request; this process pulls it with `KvTransferClient`, alternating the backends round by round so load
drift hits both alike. Both sides run the cluster-secret handshake, as in production. UCX is held to
loopback TCP (`UCX_TLS=tcp,self UCX_NET_DEVICES=lo`) unless those are already set. One warm-up pull per
backend (NIXL agent creation, the first UCX connection) is not timed. The time of a pull runs from
`pull()` to the last byte in a buffer of the decode side; it includes the connection and the handshake.

    python benchmarks/kv_transfer.py [--sizes-mib 8 64 256] [--repeats 3] [--json benchmarks/out/kv_transfer.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys

import harness

from dynamo_cli.runtime.kv_transfer import KvTransferClient, KvTransferServer
from dynamo_cli.runtime.kv_transfer_nixl import load_agent_class

UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
MiB = 1 << 20


async def serve(secret: bytes) -> None:
    """The server process: one line in (a size in bytes), one JSON offer out; EOF ends it."""
    server = KvTransferServer("127.0.0.1", secret=secret, use_nixl=True, max_bytes=1 << 31)
    print(json.dumps({"address": await server.start()}), flush=True)
    loop = asyncio.get_running_loop()
    base = bytes(range(256)) * (MiB // 256)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        nbytes = int(line)
        payload = bytearray(base * (nbytes // MiB) + base[: nbytes % MiB])  # a fresh buffer per offer
        offer = server.offer(payload)
        print(
            json.dumps(
                {"id": offer.transfer_id, "nbytes": offer.nbytes, "nixl": offer.nixl.hex() if offer.nixl else None}
            ),
            flush=True,
        )
    await server.close()


class Remote:
    """The server subprocess, driven over its stdin/stdout."""

    def __init__(self, secret: bytes) -> None:
        env = {**UCX_ENV, **os.environ, "KV_BENCH_SECRET": secret.hex()}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.address = str(self._read()["address"])

    def _read(self) -> dict[str, object]:
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            if line.startswith("{"):
                return dict(json.loads(line))
        raise RuntimeError("the server process ended")

    def offer(self, nbytes: int) -> tuple[str, int, bytes | None]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{nbytes}\n")
        self.process.stdin.flush()
        reply = self._read()
        nixl = reply["nixl"]
        return str(reply["id"]), int(str(reply["nbytes"])), bytes.fromhex(str(nixl)) if nixl else None

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


async def pull_once(remote: Remote, client: KvTransferClient, nbytes: int) -> float:
    transfer_id, size, nixl = remote.offer(nbytes)
    pulled = await client.pull(remote.address, transfer_id, size, nixl)
    payload = pulled.payload
    assert len(payload) == nbytes and payload[:256] == bytes(range(256)) and payload[-1] == (nbytes - 1) % 256
    return pulled.seconds


async def measure(sizes_mib: list[int], repeats: int) -> list[dict[str, object]]:
    secret = secrets.token_bytes(32)
    remote = Remote(secret)
    clients = {"tcp": KvTransferClient(secret=secret, use_nixl=False)}
    if load_agent_class() is not None:
        clients["nixl"] = KvTransferClient(secret=secret, use_nixl=True)
    try:
        for client in clients.values():
            await pull_once(remote, client, MiB)  # warm-up: agent, first connection
        times: dict[tuple[str, int], list[float]] = {(b, s): [] for b in clients for s in sizes_mib}
        order = list(clients)
        for round_ in range(repeats):
            for size in sizes_mib:
                for backend in order if round_ % 2 == 0 else order[::-1]:
                    times[backend, size].append(await pull_once(remote, clients[backend], size * MiB))
    finally:
        for client in clients.values():
            await client.close()
        remote.close()
    return [row(backend, size, seconds) for (backend, size), seconds in times.items()]


def row(backend: str, size_mib: int, seconds: list[float]) -> dict[str, object]:
    median = statistics.median(seconds)
    return {
        "backend": backend,
        "mib": size_mib,
        "runs": len(seconds),
        "ms_median": round(median * 1e3, 1),
        "ms_min": round(min(seconds) * 1e3, 1),
        "gb_per_s": round(size_mib * MiB / median / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(harness.results_path("kv_transfer")))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(bytes.fromhex(os.environ["KV_BENCH_SECRET"])))
        return
    for key, value in UCX_ENV.items():
        os.environ.setdefault(key, value)  # before this process's NIXL agent is made
    load_start = harness.loadavg()
    rows = asyncio.run(measure(args.sizes_mib, args.repeats))
    print(f"{'backend':8} {'MiB':>5} {'runs':>4} {'ms (median)':>12} {'ms (min)':>9} {'GB/s':>6}")
    for r in rows:
        print(f"{r['backend']:8} {r['mib']:>5} {r['runs']:>4} {r['ms_median']:>12} {r['ms_min']:>9} {r['gb_per_s']:>6}")
    info = {"ucx": {k: os.environ[k] for k in UCX_ENV}}
    harness.write_results("kv_transfer", {"info": info, "rows": rows}, args.json, loadavg_start=load_start)


if __name__ == "__main__":
    main()
