"""A real worker process (``intermission worker``) over a test's database and vhost, running the executor a
test names (``INTERMISSION_EXECUTOR``), optionally crashing at a named point (``tests/support/crash.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from intermission.fleet.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT = 20.0


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a worker process over ``settings`` (nothing of this process's INTERMISSION_*)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERMISSION_")}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "INTERMISSION_DATABASE_URL": settings.database_url,
            "INTERMISSION_AMQP_URL": settings.amqp_url,
            "INTERMISSION_BUS_USER": settings.bus_user,
            "INTERMISSION_DELIVERY_LIMIT": str(settings.delivery_limit),
            "INTERMISSION_LEASE_SECONDS": str(settings.lease_seconds),
            "INTERMISSION_LEASE_RENEW_SECONDS": str(settings.lease_renew_seconds),
            "INTERMISSION_RECLAIM_INTERVAL_SECONDS": str(settings.reclaim_interval_seconds),
            "INTERMISSION_PAUSE_TTL_SECONDS": "0",
        }
    )
    env.update(extra)
    return env


CLI_SECONDS = 60.0


def cli_process(
    *args: str, env: dict[str, str], stdout: int = asyncio.subprocess.PIPE, stderr: int = asyncio.subprocess.PIPE
) -> Awaitable[asyncio.subprocess.Process]:
    """``intermission ARGS`` as a process of its own, started from the checkout."""
    return asyncio.create_subprocess_exec(
        sys.executable, "-m", "intermission.ops.cli", *args, cwd=ROOT, env=env, stdout=stdout, stderr=stderr
    )


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


async def cli(*args: str, env: dict[str, str], within: float = CLI_SECONDS) -> CliResult:
    """Run ``intermission ARGS`` to its end: its exit code and what it printed."""
    proc = await cli_process(*args, env=env)
    async with asyncio.timeout(within):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return CliResult(proc.returncode, out.decode(), err.decode())


@dataclass
class WorkerProcess:
    proc: asyncio.subprocess.Process
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def died(self, *, within: float = 60.0) -> int:
        """Wait for the process to exit by itself; its return code."""
        async with asyncio.timeout(within):
            return await self.proc.wait()


@asynccontextmanager
async def worker_process(
    settings: Settings, executor: str, log: Path, *, crash_at: str = "", crash_after: int = 0
) -> AsyncIterator[WorkerProcess]:
    """A worker process for the block; stopped with SIGTERM (then SIGKILL) when the block ends, unless it
    already died. Its stderr goes to ``log`` (a pipe nobody reads could fill and stall the worker)."""
    extra = {"INTERMISSION_EXECUTOR": executor}
    if crash_at:
        extra |= {"INTERMISSION_CRASH_AT": crash_at, "INTERMISSION_CRASH_AFTER": str(crash_after)}
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.crash",
            "worker",
            cwd=ROOT,
            env=worker_env(settings, **extra),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
        )
    try:
        yield WorkerProcess(proc, log)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
