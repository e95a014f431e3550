"""`dyn serve --backend-file PATH`: the engine servers a file lists, one `--engine http` worker each, kept in step
with the file while dyn serves.

NOTE: the file has one backend a line, as `--backend` takes it (`URL[,KEY=VALUE...]`; `#` starts a comment). It is
read again every POLL_S: a line added starts its worker, a line removed stops its worker (its streams end on the
worker's graceful shutdown, and the router forgets it when it leaves discovery). A file that cannot be read, or
that has a bad line, leaves the backends as they are and is named in one warning until it is fixed. Each worker is
a pool of its own (process_pool.py), restarted on a crash like every `dyn serve` child, and supervised by a task
this object owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from pathlib import Path

from dynamo_cli.config import WorkerConfig, backend_options, child_command
from dynamo_cli.errors import ConfigError
from dynamo_cli.process_pool import ProcessPool, RestartPolicy

logger = logging.getLogger(__name__)

POLL_S = 2.0
"""How often the file is read again."""
MAX_FILE_BYTES = 1 << 20
MAX_BACKENDS = 1024


def read_backends(path: Path) -> list[str]:
    """The backends `path` lists, each checked as `--backend` checks it, in order, each once; ConfigError naming the
    file (and the line) when it is not one."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--backend-file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"--backend-file {path}: over {MAX_FILE_BYTES} bytes")
    specs: list[str] = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        spec = line.split("#", 1)[0].strip()
        if not spec or spec in specs:
            continue
        try:
            backend_options(spec)
        except ConfigError as exc:
            raise ConfigError(f"--backend-file {path}, line {number}: {exc}") from None
        specs.append(spec)
    if len(specs) > MAX_BACKENDS:
        raise ConfigError(f"--backend-file {path}: {len(specs)} backends, over {MAX_BACKENDS}")
    return specs


class BackendFile:
    """One worker per backend the file lists; `sync()` brings them in step, `watch()` keeps them so."""

    def __init__(self, path: Path, worker: WorkerConfig, policy: RestartPolicy, env: dict[str, str]) -> None:
        self.path = path
        self.worker = worker
        """Every backend's worker config but its engine options (`url` and the line's pairs)."""
        self.policy = policy
        self.env = env
        self._pools: dict[str, ProcessPool] = {}
        self._supervisors: dict[str, asyncio.Task[None]] = {}
        self._problem: str | None = None
        """The last reading's error, warned of once."""

    @property
    def backends(self) -> list[str]:
        return list(self._pools)

    @property
    def procs(self) -> list[asyncio.subprocess.Process]:
        return [proc for pool in self._pools.values() for proc in pool.procs]

    async def sync(self, supervise: bool = True) -> None:
        """Start a worker for each backend new in the file and stop the workers of those gone from it."""
        try:
            wanted = read_backends(self.path)
        except ConfigError as exc:
            if str(exc) != self._problem:
                logger.warning("%s; the backends stay as they are", exc)
            self._problem = str(exc)
            return
        self._problem = None
        for spec in [s for s in self._pools if s not in wanted]:
            logger.info("backend %s left %s: stopping its worker", spec.split(",", 1)[0], self.path)
            await self._stop(spec)
        for spec in [s for s in wanted if s not in self._pools]:
            logger.info("backend %s in %s: starting its worker", spec.split(",", 1)[0], self.path)
            await self._start(spec, supervise)

    async def _start(self, spec: str, supervise: bool) -> None:
        config = replace(self.worker, extra={**self.worker.extra, **backend_options(spec)})
        command = child_command(config)
        pool = self._pools[spec] = ProcessPool(self.policy, self.env)
        await pool.spawn(list(command.argv), command.env)
        if supervise:
            self.supervise(spec)

    def supervise(self, spec: str | None = None) -> None:
        """Supervise one backend's worker (None: every one not yet supervised), in tasks owned here."""
        for name in [spec] if spec is not None else list(self._pools):
            if name not in self._supervisors:
                self._supervisors[name] = asyncio.get_running_loop().create_task(
                    self._pools[name].supervise(), name=f"backend-worker {name.split(',', 1)[0]}"
                )

    async def _stop(self, spec: str) -> None:
        pool, task = self._pools.pop(spec), self._supervisors.pop(spec, None)
        await pool.stop(self.worker.graceful_shutdown_s)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def watch(self) -> None:
        """Read the file every POLL_S until cancelled."""
        while True:
            await asyncio.sleep(POLL_S)
            await self.sync()

    async def close(self) -> None:
        """Stop every backend's worker, at once. Idempotent."""
        await asyncio.gather(*(self._stop(spec) for spec in list(self._pools)))
