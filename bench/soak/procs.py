"""The fleet under test: worker and sweeper SUBPROCESSES (``python -m tests.support.crash worker`` /
``sweeper``: the product's CLI, with the crash points it was told to die at made real),
configured through ``INTERMISSION_*`` variables only, killed and restarted by the fault injector. Each
kind has an environment of its own: the workers and the sweepers connect as identities of their own.

Each child asks the kernel to SIGKILL it when the harness dies (``PR_SET_PDEATHSIG``), so a killed harness
leaves no worker behind. Each child's stderr (JSON logs) goes to a file of its own in the run's log folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.soak.ledger import Ledger

log = logging.getLogger("soak.procs")

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1
# A crash-point worker that has not reached its point by then is stopped (and the fault counted as not
# fired): the load may not have taken it there.
CRASH_WATCH_SECONDS = 30.0
RESTART_BACKOFF = (0.3, 5.0)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


@dataclass
class Proc:
    name: str
    kind: str  # "worker" or "sweeper"
    process: asyncio.subprocess.Process
    log_path: Path
    crash_at: str | None = None
    # Started for one fault and stopped by it (a worker in a network namespace): never replaced.
    extra: bool = False
    started: float = field(default_factory=time.monotonic)
    # Set before the harness kills or stops it: its exit is not news.
    expected_exit: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    returncode: int | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None


class ProcessPool:
    def __init__(
        self,
        envs: Mapping[str, Mapping[str, str]],
        logdir: Path,
        *,
        workers: int,
        sweepers: int,
        ledger: Ledger,
        rng: random.Random,
        shutdown_grace: float,
    ) -> None:
        # The environment of each kind of process ("worker", "sweeper").
        self._envs = {kind: dict(env) for kind, env in envs.items()}
        self._logdir = logdir
        self._workers = workers
        self._sweepers = sweepers
        self._ledger = ledger
        self._rng = rng
        self._grace = shutdown_grace
        self._procs: list[Proc] = []
        self._count = 0
        self._stopping = False
        self._watchers: set[asyncio.Task[None]] = set()
        self._restart_failures = 0
        # Crash points that fired (the worker died by SIGKILL at its point), by point.
        self.crashes_fired: dict[str, int] = {}
        self.crashes_not_reached = 0

    # --- spawning ----------------------------------------------------------------------------------

    async def _spawn(
        self,
        kind: str,
        *,
        crash_at: str | None = None,
        crash_after: int = 0,
        label: str = "",
        enter: Callable[[], None] | None = None,
        extra: bool = False,
        overrides: Mapping[str, str] | None = None,
    ) -> Proc:
        self._count += 1
        name = f"{kind}-{self._count}" + (f"-crash-{crash_at}" if crash_at else "") + (f"-{label}" if label else "")
        env = {**self._envs[kind], **(overrides or {})}
        if crash_at:
            env["INTERMISSION_CRASH_AT"] = crash_at
            env["INTERMISSION_CRASH_AFTER"] = str(crash_after)
        log_path = self._logdir / f"{name}.log"
        with log_path.open("ab") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                # The product's CLI, with the crash points this worker was told to die at made real.
                "tests.support.crash",
                kind,
                cwd=ROOT,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
                preexec_fn=_die_with_parent if enter is None else _then(_die_with_parent, enter),
            )
        proc = Proc(name=name, kind=kind, process=process, log_path=log_path, crash_at=crash_at, extra=extra)
        self._procs.append(proc)
        watcher = asyncio.create_task(self._watch(proc), name=f"watch:{name}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return proc

    async def _watch(self, proc: Proc) -> None:
        proc.returncode = await proc.process.wait()
        proc.exited.set()
        if proc.expected_exit or self._stopping:
            return
        if proc.extra:
            self._unexpected(proc)
            return
        if proc.crash_at is not None:
            if proc.returncode == -signal.SIGKILL:
                self.crashes_fired[proc.crash_at] = self.crashes_fired.get(proc.crash_at, 0) + 1
            else:
                self._unexpected(proc)
            return  # crash-point workers are extras: not replaced
        self._unexpected(proc)
        await asyncio.sleep(min(RESTART_BACKOFF[1], RESTART_BACKOFF[0] * 2**self._restart_failures))
        self._restart_failures = min(self._restart_failures + 1, 5)
        if not self._stopping:
            await self._spawn(proc.kind)

    def _unexpected(self, proc: Proc, how: str = "on its own") -> None:
        tail = ""
        with contextlib.suppress(OSError):
            lines = proc.log_path.read_text(errors="replace").strip().splitlines()
            tail = lines[-1][-300:] if lines else ""
        self._ledger.unexpected_exits.append(f"{proc.name} exited {proc.returncode} {how}: {tail}")

    async def start(self) -> None:
        for _ in range(self._workers):
            await self._spawn("worker")
        for _ in range(self._sweepers):
            await self._spawn("sweeper")

    def live(self, kind: str = "worker", *, normal: bool = True) -> list[Proc]:
        return [
            p
            for p in self._procs
            if p.kind == kind and p.alive and not p.expected_exit and not p.extra and (p.crash_at is None) == normal
        ]

    def pids(self) -> dict[int, str]:
        """Every running process of the fleet, by pid: its name."""
        return {p.process.pid: p.name for p in self._procs if p.alive}

    # --- faults ------------------------------------------------------------------------------------

    async def kill_worker(self, sig: signal.Signals) -> str | None:
        """Send ``sig`` to a random normal worker, wait for it to exit, start a new one. Returns what was done."""
        candidates = self.live()
        if not candidates:
            return None
        proc = self._rng.choice(candidates)
        proc.expected_exit = True
        with contextlib.suppress(ProcessLookupError):
            proc.process.send_signal(sig)
        waited = self._grace + 15.0 if sig == signal.SIGTERM else 10.0
        began = time.monotonic()
        try:
            async with asyncio.timeout(waited):
                await proc.exited.wait()
        except TimeoutError:
            self._ledger.notes.append(f"{proc.name} did not exit within {waited:.0f} s of {sig.name}; killed")
            with contextlib.suppress(ProcessLookupError):
                proc.process.kill()
            await proc.exited.wait()
        took = time.monotonic() - began
        if sig == signal.SIGTERM and proc.returncode not in (0, -signal.SIGTERM):
            self._unexpected(proc, "when stopped with SIGTERM")
        await self._spawn("worker")
        return f"{proc.name} ({sig.name}, exited {proc.returncode} after {took:.1f} s)"

    async def stall_worker(self, seconds: float) -> str | None:
        """SIGSTOP a random normal worker for ``seconds`` (a process that stops answering without dying: a
        long GC pause, a frozen VM), then SIGCONT it, always. Its leases lapse meanwhile and are taken over;
        once it runs again, every write it still attempts under them must be refused."""
        candidates = self.live()
        if not candidates:
            return None
        proc = self._rng.choice(candidates)
        with contextlib.suppress(ProcessLookupError):
            proc.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.process.send_signal(signal.SIGCONT)
        return f"{proc.name} stopped for {seconds:.1f} s"

    async def start_extra_worker(
        self, label: str, *, enter: Callable[[], None] | None = None, overrides: Mapping[str, str] | None = None
    ) -> Proc:
        """Start a worker for one fault, with ``overrides`` in its environment, that first runs ``enter`` in
        the child when given (before it executes Python: entering a network namespace); it is the caller's
        to stop (``stop_extra``), and never replaced."""
        return await self._spawn("worker", label=label, enter=enter, extra=True, overrides=overrides)

    async def stop_extra(self, proc: Proc) -> None:
        proc.expected_exit = True
        with contextlib.suppress(ProcessLookupError):
            proc.process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self._grace + 15.0):
                await proc.exited.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.process.kill()
            await proc.exited.wait()

    async def crash_worker(self, point: str, after: int) -> str | None:
        """Start an extra worker that SIGKILLs itself at ``point`` (after ``after`` earlier passes); it is
        not replaced when it dies. At most one at a time."""
        if self.live(normal=False):
            return None
        proc = await self._spawn("worker", crash_at=point, crash_after=after)
        watch = asyncio.create_task(self._crash_watch(proc), name=f"crash-watch:{proc.name}")
        self._watchers.add(watch)
        watch.add_done_callback(self._watchers.discard)
        return f"{proc.name} (after {after} passes)"

    async def _crash_watch(self, proc: Proc) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CRASH_WATCH_SECONDS):
                await proc.exited.wait()
                return
        if proc.alive:
            proc.expected_exit = True
            self.crashes_not_reached += 1
            with contextlib.suppress(ProcessLookupError):
                proc.process.send_signal(signal.SIGTERM)
            await proc.exited.wait()

    # --- drain and stop ----------------------------------------------------------------------------

    async def settle(self) -> None:
        """For the drain: no crash-point worker left, every normal worker and sweeper running."""
        for proc in self.live(normal=False):
            proc.expected_exit = True
            with contextlib.suppress(ProcessLookupError):
                proc.process.send_signal(signal.SIGTERM)
            await proc.exited.wait()
        for kind, wanted in (("worker", self._workers), ("sweeper", self._sweepers)):
            for _ in range(wanted - len(self.live(kind))):
                await self._spawn(kind)

    async def stop(self) -> None:
        """SIGTERM everything, wait for the graceful stops, SIGKILL what is left."""
        self._stopping = True
        alive = [p for p in self._procs if p.alive]
        for proc in alive:
            proc.expected_exit = True
            with contextlib.suppress(ProcessLookupError):
                proc.process.send_signal(signal.SIGTERM)
        for proc in alive:
            try:
                async with asyncio.timeout(self._grace + 20.0):
                    await proc.exited.wait()
            except TimeoutError:
                self._ledger.notes.append(f"{proc.name} did not stop on SIGTERM at the end; killed")
                with contextlib.suppress(ProcessLookupError):
                    proc.process.kill()
                await proc.exited.wait()
        for watcher in list(self._watchers):
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    def kill_all(self) -> None:
        """Last resort on the way out (the harness failed or was interrupted)."""
        self._stopping = True
        for proc in self._procs:
            if proc.alive:
                with contextlib.suppress(ProcessLookupError):
                    proc.process.kill()

    @property
    def spawned(self) -> int:
        return self._count


def worker_environment(
    *,
    database_url: str,
    amqp_url: str,
    bus_user: str,
    lease_seconds: float,
    lease_renew_seconds: float,
    reclaim_seconds: float,
    sweep_seconds: float,
    shutdown_grace: float,
) -> dict[str, str]:
    """The environment of every worker and sweeper: the parent's, minus any INTERMISSION_* setting, plus
    the soak's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERMISSION_")}
    env.update(
        {
            "INTERMISSION_DATABASE_URL": database_url,
            "INTERMISSION_AMQP_URL": amqp_url,
            "INTERMISSION_BUS_USER": bus_user,
            "INTERMISSION_LEASE_SECONDS": str(lease_seconds),
            "INTERMISSION_LEASE_RENEW_SECONDS": str(lease_renew_seconds),
            "INTERMISSION_RECLAIM_INTERVAL_SECONDS": str(reclaim_seconds),
            "INTERMISSION_SWEEP_INTERVAL_SECONDS": str(sweep_seconds),
            "INTERMISSION_SHUTDOWN_GRACE_SECONDS": str(shutdown_grace),
            # Runs that set no deadline have none; the runs that test deadlines set their own.
            "INTERMISSION_PAUSE_TTL_SECONDS": "0",
            "INTERMISSION_RELAY_POLL_SECONDS": "1",
            "INTERMISSION_PUBLISH_TIMEOUT_SECONDS": "5",
            "INTERMISSION_POOL_MAX_SIZE": "5",
            "INTERMISSION_LOG_LEVEL": "WARNING",
            # The checker reads every event the soak caused from the outbox at the end (one Notice per
            # pause), so sent rows are kept for the soak's length; the sweepers still run their prune loop
            # (inbox records and ended runs are kept longer than any soak by the defaults).
            "INTERMISSION_OUTBOX_RETENTION_SECONDS": str(7 * 86400),
        }
    )
    return env
