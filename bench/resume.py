"""The resume benchmark: Intermission beside its peers and this machine's limit, in ONE run.

    python -m bench.resume [--runs N] [--reps R] [--peers dbos,langgraph | --no-peers] [--quick]
                           [--workers 1,2] [--prefetch P] [--window W] [--unloaded-samples S]
                           [--database-url DSN] [--amqp-url URL] [--rabbitmqctl CMD]
                           [--bare-shape cte|transaction] [--peers-venv DIR] [--out FILE]

Each REPETITION measures, in turn, every system once, each Intermission phase and the bare pipeline in a
fresh database and a fresh RabbitMQ virtual host of its own (created here, removed at the end of the
repetition, so nothing else on the servers is touched), each peer in a database of its own:

1. the LIMIT (``bench/bare.py``): one Python process that consumes a message from its own quorum queue,
   runs one claim-shaped transaction on its own small table (an ``UPDATE … RETURNING`` plus a 4 KB
   snapshot write), publishes one event with a publisher confirm and acknowledges; messages/s.
2. INTERMISSION, with 1 and with 2 worker processes (``python -m intermission.ops.cli worker``) and one
   sweeper (``… sweeper``) beside them, as in production (product defaults: its pauses expire after a
   day, so it finds nothing to expire and does not touch the runs; its CPU counts with the workers'): N
   runs of the demo agent are started THROUGH THE PRODUCT (``run.start`` commands sent by a
   ``HostClient``) and each pauses on ``lookup``; once every Notice has arrived, N ``run.resume``
   commands are published. Resumes/s is N over the time from the first publish to the last
   ``run.completed`` event; latency is per run, from its publish to its ``run.completed``.
3. LANGGRAPH (``bench/peers/bench_langgraph.py one --n N --lock semaphore``) and DBOS
   (``bench/peers/bench_dbos.py one --n N --sender proc``): the same workload on the peers, on the same
   PostgreSQL, each a subprocess of the peers' own venv (``bench.peer_runs``: ``bench/.peers-venv``, made
   on first use, never the project's venv), read from the JSON line it prints last. A peer that fails is
   reported with the tail of its stderr, and the benchmark goes on.
4. UNLOADED latency: one worker and the sweeper, one resume at a time (publish, wait for
   ``run.completed``, next); then the broker's FLOOR for it (``bench/floor.py``): one message at a time
   through two quorum queues with a relay between, the two hops every unloaded resume crosses.

Phases (1) and (2) keep the same number of commands in flight (``--window``, default four times the
prefetch per consumer process) with the same prefetch and the same message size, and are driven by this
process, which publishes with confirms and listens for the events (its CPU is reported apart, as
``driver``).

CPU per resume is read from ``/proc/<pid>/stat`` before and after the measured phase, split between the
Python processes (the workers and the sweeper, or the bare pipeline), PostgreSQL (the phase's database's
backends and the server's shared processes: WAL writer, checkpointer, postmaster, …; the peers count
theirs the same way) and RabbitMQ (``beam.smp``: the peers have none); ``other`` is busy time none of them
accounts for, which should be near zero: the machine must be quiet, and a fault-injection soak
(``bench.soak``) running at the same time makes every figure meaningless. The benchmark says so when it
sees one. Peak memory of a worker is ``VmHWM`` from ``/proc/<pid>/status``.

It prints, per system, the median resumes/s over the repetitions with the min and max, p50/p99, CPU per
resume, then the ratios (each taken within one repetition, then summarised the same way) and issue 17's
targets (met / NOT met / not measured), and writes every figure as JSON, each repetition's raw figures
and the machine's facts included, to ``bench/results/resume-<UTC time>.json`` (or ``--out``), printing
the path. ``docs/benchmarks.md`` says how to read it.

Options:
  --runs N              runs per measurement (default 1000; the limit uses 2 N messages)
  --reps R              repetitions (default 3; 1 with --quick)
  --peers LIST          the peers to run, of "langgraph,dbos" (default both; none with --quick unless given)
  --no-peers            run no peer
  --peers-venv DIR      the peers' venv (default INTERMISSION_BENCH_PEERS_VENV or bench/.peers-venv)
  --quick               a tiny run for smoke tests (40 runs, 10 unloaded samples, 1 repetition, no peers):
                        its figures mean nothing
  --workers LIST        worker process counts to measure (default "1,2")
  --prefetch P          consumer prefetch, for the workers and the bare pipeline (default: the settings'
                        default, 16)
  --window W            commands in flight per consumer process (default 4 times the prefetch)
  --unloaded-samples S  resumes measured one at a time (default 50, after 5 warm-up resumes)
  --database-url DSN    a server-level PostgreSQL DSN (default INTERMISSION_BENCH_DATABASE_URL or
                        postgresql://postgres@127.0.0.1:5432/postgres); the role needs CREATEDB
  --amqp-url URL        the RabbitMQ broker (default INTERMISSION_BENCH_AMQP_URL or
                        amqp://guest:guest@127.0.0.1:5672/); its user gets rights on the new vhosts
  --rabbitmqctl CMD     how to administer that broker (default "rabbitmqctl")
  --bare-shape SHAPE    the bare pipeline's transaction: "cte" (one statement, default) or "transaction"
  --out FILE            where to write the JSON
  --profile DIR         sample each worker with py-spy during the measured phases (stacks in DIR; summarise
                        them with ``python -m bench.profile``). With INTERMISSION_BENCH_NATIVE=1 py-spy
                        also samples C frames (uvloop, asyncpg, the kernel's socket calls); with
                        INTERMISSION_BENCH_PERF=1 ``perf record -a -g`` samples the whole machine into
                        DIR/<phase>.perf as well
  --worker-cwd DIR      run the workers from another copy of the product's packages (schemas, store, fleet,
                        consumers, publishers) to compare two versions under the same conditions
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aio_pika
import asyncpg
from aio_pika.abc import AbstractIncomingMessage

from bench import bare, floor, summary
from bench.infra import (
    CLK_TCK,
    DEFAULT_AMQP_URL,
    DEFAULT_DATABASE_URL,
    ROOT,
    CpuProbe,
    CpuReading,
    RabbitAdmin,
    database_of,
    drop_database,
    fresh_database,
    fresh_name,
    machine,
    per_item,
    postgres_server_version,
    soak_processes,
    status_kib,
    stop_process,
    summary_ms,
    url_user,
    vhost_url,
    with_database,
    write_results,
)
from bench.peer_runs import DEFAULT_VENV, PEERS, VenvError, ensure_venv, failed, run_peer, venv_python
from intermission.fleet.settings import Settings
from intermission.publishers.amqp import ConfirmingPublisher, connect
from intermission.publishers.clients import ALL_KINDS, HostClient, Subscription, host_bindings, version_of
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import ClaimVersion, Notice, SuspendReason
from intermission.wire import declare, run_event_key
from intermission.wire import message as json_message

SCOPE = Scope(app="bench", tenant="resume")
WARMUP = 5
MB = 1024 * 1024
# The peers, in the order a repetition runs them.
PEER_ORDER = (summary.LANGGRAPH, summary.DBOS)
WARNING_LEVELS = {"WARNING", "ERROR", "CRITICAL"}


@dataclass(frozen=True)
class Options:
    runs: int
    workers: list[int]
    prefetch: int
    window: int
    unloaded_samples: int
    database_url: str
    amqp_url: str
    rabbitmqctl: list[str]
    bare_shape: str
    quick: bool
    out: Path | None
    profile: Path | None = None
    worker_cwd: Path | None = None
    reps: int = 1
    # The peers to run in each repetition (of PEER_ORDER), and their venv.
    peers: tuple[str, ...] = ()
    peers_venv: Path = DEFAULT_VENV
    # One sweeper process beside the workers of each Intermission measurement, as in production.
    sweeper: bool = True


def run_script(i: int) -> list[ScriptTurn]:
    return [
        ScriptTurn.model_validate({"call": [{"tool": "lookup", "arguments": {"query": f"weather in city {i}"}}]}),
        ScriptTurn.model_validate({"say": f"It is sunny in city {i}."}),
    ]


def answer_for(notice: Notice) -> ResumeCommand:
    return ResumeCommand(
        scope=notice.scope,
        version=version_of(notice),
        results=[ToolAnswer(call_id=call.id, content="sunny, 24°C") for call in notice.pending],
    )


# --- the product ----------------------------------------------------------------------------------------


@dataclass
class Tracker:
    """The events a host hears, turned into per-run futures: the run's Notice, and the time its
    ``run.completed`` arrived."""

    notices: dict[str, asyncio.Future[Notice]] = field(default_factory=dict)
    completed: dict[str, asyncio.Future[float]] = field(default_factory=dict)

    def expect(self, run_ids: list[str]) -> None:
        loop = asyncio.get_running_loop()
        for run_id in run_ids:
            self.notices[run_id] = loop.create_future()
            self.completed[run_id] = loop.create_future()

    async def pump(self, events: Subscription[Notice | RunEvent | CommandRejected]) -> None:
        async for received in events:
            event = received.event
            if isinstance(event, Notice):
                waiting = self.notices.get(event.run_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(event)
            elif isinstance(event, RunEvent):
                done = self.completed.get(event.run_id)
                if done is None or done.done():
                    continue
                if event.kind is RunEventKind.COMPLETED:
                    done.set_result(time.perf_counter())
                elif event.kind is not RunEventKind.RESUMED:
                    done.set_exception(RuntimeError(f"run {event.run_id} ended {event.kind.value}: {event.error}"))
            else:
                raise RuntimeError(f"a command was refused: {event.code} ({event.detail})")


def host_events(host: HostClient, prefetch: int = 64) -> Subscription[Notice | RunEvent | CommandRejected]:
    """What the benchmark's host listens to: its scope's notices, refusals and the ends of its runs, but
    not ``run.resumed``, which it has no use for (a host binds what it needs; an event nobody is bound to
    costs the broker less and the host nothing)."""
    keys = {
        key: model
        for key, model in host_bindings(SCOPE, ALL_KINDS).items()
        if key != run_event_key(RunEventKind.RESUMED, SCOPE)
    }

    def decode(routing_key: str, body: bytes) -> Notice | RunEvent | CommandRejected:
        event = keys[routing_key].model_validate_json(body)
        assert isinstance(event, Notice | RunEvent | CommandRejected)
        return event

    return Subscription(host.connection, keys, decode, prefetch=prefetch)


def logged_problems(logs: list[IO[bytes]]) -> dict[str, int]:
    """How many warnings and errors ``logs`` hold, by their ``action`` (and lines that are not JSON, as
    ``unparsed``): a clean run has none."""
    found: Counter[str] = Counter()
    for log in logs:
        log.flush()
        for line in Path(log.name).read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                found["unparsed"] += 1
                continue
            if not isinstance(record, dict):
                found["?"] += 1
            elif str(record.get("level", "WARNING")) in WARNING_LEVELS:
                found[str(record.get("action", "?"))] += 1
    return dict(found)


def logged_action(log: IO[bytes], action: str) -> bool:
    log.flush()
    for line in Path(log.name).read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("action") == action:
                return True
    return False


@dataclass
class Workers:
    """The worker processes of a measurement, and the sweeper beside them (when there is one)."""

    procs: list[asyncio.subprocess.Process]
    logs: list[IO[bytes]]
    sweeper: asyncio.subprocess.Process | None = None
    sweeper_log: IO[bytes] | None = None

    @property
    def pids(self) -> list[int]:
        """The workers' (not the sweeper's)."""
        return [p.pid for p in self.procs]

    @property
    def app_pids(self) -> list[int]:
        """Every process of the product: the workers and the sweeper."""
        return self.pids + ([self.sweeper.pid] if self.sweeper is not None else [])

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.returncode is not None:
                raise RuntimeError(f"worker {proc.pid} exited {proc.returncode}: {tail(log)}")
        if self.sweeper is not None and self.sweeper.returncode is not None:
            assert self.sweeper_log is not None
            raise RuntimeError(f"the sweeper exited {self.sweeper.returncode}: {tail(self.sweeper_log)}")

    def warnings(self) -> dict[str, int]:
        """How many warnings and errors the workers logged, by their ``action`` (the workers log nothing
        below WARNING here, so a clean run has none)."""
        return logged_problems(self.logs)

    def sweeper_warnings(self) -> dict[str, int]:
        return logged_problems([self.sweeper_log]) if self.sweeper_log is not None else {}

    async def sweeping(self) -> None:
        """Once the sweeper has said it started (its imports and connections are done before anything
        is measured)."""
        if self.sweeper_log is None:
            return
        async with asyncio.timeout(60):
            while not logged_action(self.sweeper_log, "sweeper_started"):
                self.check_alive()
                await asyncio.sleep(0.1)


def tail(log: IO[bytes], lines: int = 20) -> str:
    log.flush()
    return "\n".join(Path(log.name).read_text(errors="replace").splitlines()[-lines:])


@asynccontextmanager
async def workers_running(count: int, dsn: str, url: str, opts: Options) -> AsyncIterator[Workers]:
    env = {
        **os.environ,
        "INTERMISSION_DATABASE_URL": dsn,
        "INTERMISSION_AMQP_URL": url,
        "INTERMISSION_PREFETCH": str(opts.prefetch),
        # Warnings and errors only: the logs count how often something went wrong under load.
        "INTERMISSION_LOG_LEVEL": "WARNING",
    }
    procs: list[asyncio.subprocess.Process] = []
    logs: list[IO[bytes]] = []
    sweeper: asyncio.subprocess.Process | None = None
    sweeper_log: IO[bytes] | None = None
    try:
        for _ in range(count):
            log = tempfile.NamedTemporaryFile(prefix="bench-worker-", suffix=".log")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "intermission.ops.cli",
                    "worker",
                    cwd=opts.worker_cwd or ROOT,
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
        if opts.sweeper:
            # As in production: the product's defaults (its log at INFO, which says when it started).
            sweeper_log = tempfile.NamedTemporaryFile(prefix="bench-sweeper-", suffix=".log")  # noqa: SIM115 - closed below
            sweeper = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "intermission.ops.cli",
                "sweeper",
                cwd=opts.worker_cwd or ROOT,
                env={**env, "INTERMISSION_LOG_LEVEL": "INFO"},
                stdout=sweeper_log,
                stderr=sweeper_log,
            )
        yield Workers(procs, logs, sweeper, sweeper_log)
    finally:
        await asyncio.gather(*(stop_process(p) for p in [*procs, *([sweeper] if sweeper else [])]))
        for opened in [*logs, *([sweeper_log] if sweeper_log else [])]:
            opened.close()


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise RuntimeError("--profile needs py-spy (pip install py-spy)")
    return found


@asynccontextmanager
async def profiling(folder: Path | None, label: str, pids: list[int]) -> AsyncIterator[None]:
    """With ``--profile``: py-spy samples each pid for the length of the block and writes its stacks as
    collapsed text (``<label>-<pid>.txt``: one stack per line with its sample count), which
    ``python -m bench.profile`` summarises."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything is measured
    spies = [
        await asyncio.create_subprocess_exec(
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--format",
            "raw",
            *(["--native"] if os.environ.get("INTERMISSION_BENCH_NATIVE") else []),
            "--output",
            str(folder / f"{label}-{pid}.txt"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for pid in pids
    ]
    if os.environ.get("INTERMISSION_BENCH_PERF"):
        # The whole machine (every process, kernel included), for `perf report --sort comm,dso`.
        spies.append(
            await asyncio.create_subprocess_exec(
                "perf",
                "record",
                "-a",
                "-g",
                "-F",
                "499",
                "-o",
                str(folder / f"{label}.perf"),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        )
    await asyncio.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            await spy.wait()


async def database_counters(dsn: str) -> dict[str, int]:
    """The database's transaction and row counters (pg_stat_database): their growth per resume says how
    many transactions and row writes a resume costs, whoever ran them (consumers, fleet, relay)."""
    con = await asyncpg.connect(dsn)
    try:
        row = await con.fetchrow(
            "SELECT xact_commit + xact_rollback AS transactions, tup_inserted AS inserted, tup_updated AS updated,"
            "       tup_deleted AS deleted"
            "  FROM pg_stat_database WHERE datname = current_database()"
        )
        assert row is not None
        return {k: int(v) for k, v in row.items()}
    finally:
        await con.close()


async def declare_topology(url: str) -> None:
    # The broker may be restarting (the machine is shared): give it a minute before giving up.
    for attempt in range(60):
        try:
            # The product's connect: ``url`` may list the nodes of a cluster (bench.cluster measures on one).
            connection = await connect(url, "bench topology")
            break
        except (OSError, aio_pika.exceptions.AMQPConnectionError):
            if attempt == 59:
                raise
            await asyncio.sleep(1.0)
    try:
        await declare(await connection.channel(), delivery_limit=Settings().delivery_limit)
    finally:
        await connection.close()


async def bounded(limit: int, jobs: list[Callable[[], Awaitable[Any]]]) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(job) for job in jobs))


async def pause_runs(host: HostClient, tracker: Tracker, workers: Workers, run_ids: list[str]) -> list[Notice]:
    """Start the runs through the product and wait until every one has paused on ``lookup``."""
    tracker.expect(run_ids)
    commands = [
        StartCommand(scope=SCOPE, run_id=run_id, agent_id="demo", input=f"weather {i}?", script=run_script(i))
        for i, run_id in enumerate(run_ids)
    ]
    await bounded(64, [functools.partial(host.start, c) for c in commands])
    notices: list[Notice] = []
    deadline = time.monotonic() + 120 + len(run_ids) / 10
    for run_id in run_ids:
        while True:
            workers.check_alive()
            try:
                async with asyncio.timeout(1.0):
                    notices.append(await asyncio.shield(tracker.notices[run_id]))
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run {run_id} did not pause in time") from None
    bad = [n.run_id for n in notices if n.reason is not SuspendReason.EXTERNAL_TOOL]
    if bad:
        raise RuntimeError(f"runs paused for another reason than lookup: {bad[:3]}")
    return notices


async def windowed(
    items: list[str],
    window: int,
    send: Callable[[str], Coroutine[Any, Any, Any]],
    done: dict[str, asyncio.Future[float]],
    check: Callable[[], None],
) -> tuple[dict[str, float], float]:
    """Publish one command per item, at most ``window`` not yet done at any time; returns each item's
    publish time and the time of the first publish. Fails (rather than waits forever) when a process it
    depends on died, a publication failed, or the whole did not finish in a generous time."""
    gate = asyncio.Semaphore(window)
    published: dict[str, float] = {}
    sends: list[asyncio.Task[Any]] = []
    first = 0.0
    deadline = time.monotonic() + 120 + len(items) / 10

    def healthy() -> None:
        check()
        for task in sends:
            if task.done():
                task.result()  # a publication that failed fails the benchmark
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(items)} commands were not done in time")

    for item in items:
        while True:
            try:
                async with asyncio.timeout(1.0):
                    await gate.acquire()
                break
            except TimeoutError:
                healthy()
        now = time.perf_counter()
        first = first or now
        published[item] = now
        done[item].add_done_callback(lambda _f: gate.release())
        sends.append(asyncio.create_task(send(item)))
    waiting = {done[item] for item in items}
    while waiting:
        healthy()
        finished, waiting = await asyncio.wait(waiting, timeout=1.0)
        for f in finished:
            f.result()  # a run that failed fails the benchmark
    await asyncio.gather(*sends)
    return published, first


def process_ms(before: CpuReading, after: CpuReading, pid: int, group: str = "python") -> float:
    """CPU milliseconds one process of ``group`` used between two readings."""
    return (after.groups[group].get(pid, 0) - before.groups[group].get(pid, 0)) * 1000 / CLK_TCK


def latency_figures(
    published: dict[str, float], done: dict[str, asyncio.Future[float]], first: float
) -> dict[str, Any]:
    ends = {k: done[k].result() for k in published}
    last = max(ends.values())
    elapsed = last - first
    return {
        "count": len(published),
        "elapsed_s": round(elapsed, 4),
        "per_second": round(len(published) / elapsed, 2) if elapsed > 0 else float("nan"),
        "latency_ms": summary_ms([ends[k] - published[k] for k in published]),
    }


async def measure_intermission(opts: Options, admin: RabbitAdmin, vhost: str, workers: int) -> dict[str, Any]:
    dsn = await fresh_database(opts.database_url, f"w{workers}")
    url = vhost_url(opts.amqp_url, vhost)
    try:
        await declare_topology(url)
        async with (
            workers_running(workers, dsn, url, opts) as running,
            await HostClient.connect(url, name="bench host") as host,
            host_events(host, prefetch=256) as events,
        ):
            tracker = Tracker()
            pumping = asyncio.create_task(tracker.pump(events))
            try:
                run_ids = [f"bench-{workers}w-{i:06d}" for i in range(opts.runs)]
                started = time.perf_counter()
                notices = await pause_runs(host, tracker, running, run_ids)
                paused_s = time.perf_counter() - started
                await running.sweeping()
                commands = {n.run_id: answer_for(n) for n in notices}
                body_bytes = sum(len(c.model_dump_json()) for c in commands.values()) / len(commands)
                # Let the relay commit its last batch and the workers settle (and report their database
                # counters) before the readings.
                await asyncio.sleep(1.5)
                probe = CpuProbe(running.app_pids, database=database_of(dsn))
                async with profiling(opts.profile, f"w{workers}", running.pids):
                    before, statements_before = probe.read(), await database_counters(dsn)
                    published, first = await windowed(
                        run_ids,
                        opts.window * workers,
                        lambda run_id: host.resume(commands[run_id]),
                        tracker.completed,
                        running.check_alive,
                    )
                    after = probe.read()
                # Backends report their counters within a second of going idle.
                await asyncio.sleep(1.5)
                statements_after = await database_counters(dsn)
            finally:
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pumping
            peak = [status_kib(pid, "VmHWM") or 0 for pid in running.pids]
            sweeper_peak = status_kib(running.sweeper.pid, "VmHWM") if running.sweeper is not None else None
            figures = latency_figures(published, tracker.completed, first)
            used = CpuProbe.used_ms(before, after)
            sweeper_ms = process_ms(before, after, running.sweeper.pid) if running.sweeper is not None else None
            warnings = running.warnings()
            sweeper_warnings = running.sweeper_warnings()
        return {
            "workers": workers,
            "sweeper": running.sweeper is not None,
            **figures,
            "message_bytes": round(body_bytes, 1),
            "window": opts.window * workers,
            "prefetch": opts.prefetch,
            "pause_phase_s": round(paused_s, 2),
            "cpu_ms_per_resume": per_item(used, figures["count"]),
            "cpu_ms_total": {k: round(v, 1) for k, v in used.items()},
            "database_per_resume": {
                k: round((statements_after[k] - statements_before[k]) / figures["count"], 2) for k in statements_after
            },
            "peak_rss_mib": [round(kib / 1024, 1) for kib in peak],
            "worker_warnings": warnings,
            # The sweeper's share of cpu_ms_per_resume["python"], its memory and its log's warnings.
            "sweeper_cpu_ms_per_resume": round(sweeper_ms / figures["count"], 4) if sweeper_ms is not None else None,
            "sweeper_peak_rss_mib": round(sweeper_peak / 1024, 1) if sweeper_peak else None,
            "sweeper_warnings": sweeper_warnings,
        }
    finally:
        await drop_database(dsn)


async def measure_unloaded(opts: Options, admin: RabbitAdmin, vhost: str) -> dict[str, Any]:
    dsn = await fresh_database(opts.database_url, "unloaded")
    url = vhost_url(opts.amqp_url, vhost)
    try:
        await declare_topology(url)
        async with (
            workers_running(1, dsn, url, opts) as running,
            await HostClient.connect(url, name="bench host") as host,
            host_events(host) as events,
        ):
            tracker = Tracker()
            pumping = asyncio.create_task(tracker.pump(events))
            try:
                total = WARMUP + opts.unloaded_samples
                run_ids = [f"bench-unloaded-{i:04d}" for i in range(total)]
                notices = await pause_runs(host, tracker, running, run_ids)
                await running.sweeping()
                await asyncio.sleep(1.0)
                latencies: list[float] = []
                for i, notice in enumerate(notices):
                    command = answer_for(notice)
                    # A quiet moment between resumes, as an unloaded system has.
                    await asyncio.sleep(0.02)
                    sent = time.perf_counter()
                    await host.resume(command)
                    async with asyncio.timeout(30):
                        ended = await tracker.completed[notice.run_id]
                    if i >= WARMUP:
                        latencies.append(ended - sent)
            finally:
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pumping
            peak = [status_kib(pid, "VmHWM") or 0 for pid in running.pids]
            warnings = running.warnings()
            sweeper_warnings = running.sweeper_warnings()
        return {
            "latency_ms": summary_ms(latencies),
            "peak_rss_mib": [round(k / 1024, 1) for k in peak],
            "sweeper": running.sweeper is not None,
            "worker_warnings": warnings,
            "sweeper_warnings": sweeper_warnings,
        }
    finally:
        await drop_database(dsn)


# --- the limit ------------------------------------------------------------------------------------------


async def measure_limit(opts: Options, admin: RabbitAdmin, vhost: str, count: int) -> dict[str, Any]:
    dsn = await fresh_database(opts.database_url, "bare", migrated=False)
    url = vhost_url(opts.amqp_url, vhost)
    ids = [f"bare-{i:06d}" for i in range(count)]
    try:
        await bare.prepare(dsn, ids)
        connection = await aio_pika.connect_robust(url, client_properties={"connection_name": "bench driver"})
        proc: asyncio.subprocess.Process | None = None
        try:
            channel = await connection.channel()
            await bare.declare(channel)
            events = await channel.declare_queue(None, exclusive=True, auto_delete=True)
            await events.bind(bare.EVENTS, f"run.*.{SCOPE.app}.{SCOPE.tenant}")
            await channel.set_qos(prefetch_count=256)
            loop = asyncio.get_running_loop()
            done: dict[str, asyncio.Future[float]] = {i: loop.create_future() for i in ids}

            async def arrived(message: AbstractIncomingMessage) -> None:
                await message.ack()
                event = json.loads(message.body)
                waiting = done.get(event["run_id"])
                if waiting is not None and not waiting.done():
                    if event["kind"] == "completed":
                        waiting.set_result(time.perf_counter())
                    else:
                        waiting.set_exception(RuntimeError(f"bare claim of {event['run_id']} matched nothing"))

            await events.consume(arrived)
            publisher = ConfirmingPublisher(connection, bare.COMMANDS, mandatory=True)
            # The same bodies as the product's resume commands (same size), each naming a row of the table.
            bodies = {
                i: ResumeCommand(
                    scope=SCOPE,
                    version=ClaimVersion(run_id=i, suspension_id=1000 + n, run_revision=2),
                    results=[ToolAnswer(call_id="call-0-0", content="sunny, 24°C")],
                ).model_dump_json()
                for n, i in enumerate(ids)
            }
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.bare",
                dsn,
                url,
                "--prefetch",
                str(opts.prefetch),
                "--shape",
                opts.bare_shape,
                cwd=ROOT,
                stdout=asyncio.subprocess.PIPE,
            )
            assert proc.stdout is not None
            async with asyncio.timeout(60):
                line = await proc.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"the bare pipeline did not start: {line!r}")

            def alive() -> None:
                if proc is not None and proc.returncode is not None:
                    raise RuntimeError(f"the bare pipeline exited {proc.returncode}")

            async def send(i: str) -> None:
                await publisher.publish(
                    json_message(bodies[i], message_id=f"bare:{i}", routing_key=bare.QUEUE), bare.QUEUE
                )

            # A warm-up, so connections and prepared statements are ready as in a worker that has run a while.
            warm = ids[: opts.window]
            await windowed(warm, opts.window, send, done, alive)
            await asyncio.sleep(0.5)
            measured = ids[opts.window :]
            probe = CpuProbe([proc.pid], database=database_of(dsn))
            before = probe.read()
            published, first = await windowed(measured, opts.window, send, done, alive)
            after = probe.read()
            await publisher.close()
            figures = latency_figures(published, done, first)
            used = CpuProbe.used_ms(before, after)
            peak = status_kib(proc.pid, "VmHWM") or 0
        finally:
            if proc is not None:
                await stop_process(proc)
            await connection.close()
        return {
            **figures,
            "message_bytes": round(sum(len(b) for b in bodies.values()) / len(bodies), 1),
            "snapshot_bytes": len(bare.snapshot_document()),
            "shape": opts.bare_shape,
            "window": opts.window,
            "prefetch": opts.prefetch,
            "cpu_ms_per_message": per_item(used, figures["count"]),
            "cpu_ms_total": {k: round(v, 1) for k, v in used.items()},
            "peak_rss_mib": round(peak / 1024, 1),
        }
    finally:
        await drop_database(dsn)


# --- the peers ------------------------------------------------------------------------------------------


def peer_limit_s(runs: int) -> float:
    """How long one peer run may take before it counts as failed: generous, for a slow shared machine
    (DBOS parks and resumes at well under 100 runs/s here, and both peers settle 11 s before measuring)."""
    return 600.0 + 0.5 * runs


async def measure_peer(opts: Options, name: str, python: Path) -> dict[str, Any]:
    """One run of a peer in a database of its own (the script creates it; it is dropped here whatever
    happened); the outcome of ``bench.peer_runs.run_peer``."""
    database = fresh_name(f"peer_{name}")
    try:
        return await run_peer(PEERS[name], python, opts.runs, opts.database_url, database, peer_limit_s(opts.runs))
    finally:
        await drop_database(with_database(opts.database_url, database))


async def peers_python(opts: Options, facts: dict[str, Any]) -> tuple[Path | None, str | None]:
    """The peers' venv's python, made or reused (``bench.peer_runs.ensure_venv``), with its packages'
    versions added to ``facts``; or why there is none (every peer then fails with that reason)."""
    if not opts.peers:
        return None, None
    try:
        found = await ensure_venv(opts.peers_venv, lambda line: print(line, flush=True))
    except (VenvError, OSError, RuntimeError, ValueError) as exc:
        print(f"warning: the peers' venv could not be made; the peers are reported as failed: {exc}", flush=True)
        return None, f"the peers' venv could not be made: {exc}"
    facts["peers_venv"] = str(opts.peers_venv)
    facts["peer_packages"] = found
    facts["dbos"] = found.get("dbos")
    facts["langgraph"] = found.get("langgraph")
    return venv_python(opts.peers_venv), None


# --- the run --------------------------------------------------------------------------------------------


def systems_of(opts: Options) -> list[str]:
    """The systems a repetition measures, in the order of the table."""
    return [
        summary.BARE,
        *(summary.intermission(n) for n in opts.workers),
        *(p for p in PEER_ORDER if p in opts.peers),
        summary.UNLOADED,
        summary.FLOOR,
    ]


def labels_of(opts: Options, facts: dict[str, Any]) -> dict[str, str]:
    labels = {summary.BARE: "bare pipeline (per message)"}
    for n in opts.workers:
        labels[summary.intermission(n)] = f"Intermission, {n} worker{'s' if n != 1 else ''}" + (
            " + sweeper" if opts.sweeper else ""
        )
    names = {
        summary.LANGGRAPH: f"LangGraph {facts.get('langgraph') or ''} + PostgresSaver (no claim)",
        summary.DBOS: f"DBOS {facts.get('dbos') or ''} send/recv",
    }
    for peer in PEER_ORDER:
        if peer in opts.peers:
            labels[peer] = " ".join(names[peer].split())
    labels[summary.UNLOADED] = "Intermission, unloaded (one at a time)"
    labels[summary.FLOOR] = "RabbitMQ alone: 2 quorum hops (floor)"
    return labels


def figures_of(raw: dict[str, Any]) -> dict[str, summary.Figures | None]:
    """One repetition's measurements as one row of figures per system (None: a peer that failed)."""
    figures: dict[str, summary.Figures | None] = {summary.BARE: summary.of_limit(raw["limit"])}
    for n, measured in raw["intermission"].items():
        figures[summary.intermission(int(n))] = summary.of_intermission(measured)
    for peer, outcome in raw["peers"].items():
        figures[peer] = summary.of_peer(outcome)
    figures[summary.UNLOADED] = summary.of_unloaded(raw["unloaded"])
    if "floor" in raw:
        figures[summary.FLOOR] = summary.of_floor(raw["floor"])
    return figures


def failures_of(reps: list[dict[str, Any]]) -> list[str]:
    """Each failed peer run, with the tail of its stderr, for the printed table."""
    lines: list[str] = []
    for raw in reps:
        for peer, outcome in raw["peers"].items():
            if not outcome.get("ok"):
                stderr = outcome.get("stderr_tail") or "(nothing on stderr)"
                indented = "\n".join("      " + line for line in stderr.splitlines()[-8:])
                lines.append(f"{peer} in repetition {raw['repetition']}: {outcome.get('error')}\n{indented}")
    return lines


async def repetition(
    opts: Options, admin: RabbitAdmin, rep: int, python: Path | None, why: str | None
) -> dict[str, Any]:
    """Every system measured once, in turn: the bare pipeline, Intermission with each worker count, each
    peer, the unloaded latency."""
    labels = ["bare", *(f"w{n}" for n in opts.workers), "unloaded"]
    vhosts = dict(zip(labels, await admin.add_vhosts([f"r{rep}-{label}" for label in labels]), strict=True))
    raw: dict[str, Any] = {"repetition": rep}
    try:
        print(f"  the bare pipeline, {2 * opts.runs} messages ...", flush=True)
        raw["limit"] = await measure_limit(opts, admin, vhosts["bare"], 2 * opts.runs + opts.window)
        print(f"    {raw['limit']['per_second']:.0f} messages/s", flush=True)
        raw["intermission"] = {}
        for n in opts.workers:
            print(
                f"  intermission: {n} worker(s) and {'a' if opts.sweeper else 'no'} sweeper, {opts.runs} runs ...",
                flush=True,
            )
            measured = await measure_intermission(opts, admin, vhosts[f"w{n}"], n)
            raw["intermission"][str(n)] = measured
            print(f"    {measured['per_second']:.0f} resumes/s", flush=True)
        raw["peers"] = {}
        for peer in PEER_ORDER:
            if peer not in opts.peers:
                continue
            print(f"  {peer}: {opts.runs} runs ...", flush=True)
            if python is None:
                outcome = failed(peer, why or "no venv", "")
            else:
                outcome = await measure_peer(opts, peer, python)
            raw["peers"][peer] = outcome
            if outcome["ok"]:
                print(f"    {outcome['result']['resumes_per_s']:.0f} resumes/s", flush=True)
            else:
                print(f"    FAILED: {outcome['error']}\n{outcome['stderr_tail']}", flush=True)
        print(f"  intermission: unloaded, {opts.unloaded_samples} resumes one at a time ...", flush=True)
        raw["unloaded"] = await measure_unloaded(opts, admin, vhosts["unloaded"])
        print(
            f"    p50 {raw['unloaded']['latency_ms']['p50']:.1f} ms, p99 {raw['unloaded']['latency_ms']['p99']:.1f} ms",
            flush=True,
        )
        print(f"  the broker alone: {opts.unloaded_samples} messages through two quorum queues ...", flush=True)
        hops = await floor.quorum_round_trips(vhost_url(opts.amqp_url, vhosts["unloaded"]), opts.unloaded_samples)
        raw["floor"] = {"latency_ms": summary_ms(hops)}
        print(
            f"    p50 {raw['floor']['latency_ms']['p50']:.1f} ms, p99 {raw['floor']['latency_ms']['p99']:.1f} ms",
            flush=True,
        )
    finally:
        await admin.delete_all()
    return raw


async def run(opts: Options) -> dict[str, Any]:
    soak_before = soak_processes()
    if soak_before:
        print("warning: a soak is running on this machine; these figures are for development only", flush=True)
    admin = RabbitAdmin(opts.rabbitmqctl, url_user(opts.amqp_url))
    facts = machine()
    facts["postgres_server"] = await postgres_server_version(opts.database_url)
    facts["dbos"] = facts["langgraph"] = None
    results: dict[str, Any] = {"benchmark": "resume", "machine": facts}
    results["options"] = {
        "runs": opts.runs,
        "reps": opts.reps,
        "workers": opts.workers,
        "peers": list(opts.peers),
        "sweeper": opts.sweeper,
        "prefetch": opts.prefetch,
        "window_per_process": opts.window,
        "unloaded_samples": opts.unloaded_samples,
        "bare_shape": opts.bare_shape,
        "quick": opts.quick,
        "command": "python -m bench.resume " + shlex.join(sys.argv[1:]),
    }
    python, why = await peers_python(opts, facts)
    reps: list[dict[str, Any]] = []
    for rep in range(1, opts.reps + 1):
        print(f"repetition {rep}/{opts.reps}:", flush=True)
        raw = await repetition(opts, admin, rep, python, why)
        raw["figures"] = {system: summary.as_json(f) for system, f in figures_of(raw).items()}
        reps.append(raw)
    results["repetitions"] = reps
    rows = [figures_of(raw) for raw in reps]
    systems = systems_of(opts)
    results["labels"] = labels_of(opts, facts)
    results["summary"] = summary.summarise(rows, systems)
    results["ratios"] = summary.ratios(rows)
    results["targets"] = summary.targets(results["summary"], results["ratios"])
    results["peer_failures"] = failures_of(reps)
    soak_after = soak_processes()
    results["contended"] = bool(soak_before or soak_after)
    results["soak_processes"] = sorted(set(soak_before + soak_after))
    return results


def table(results: dict[str, Any]) -> str:
    return summary.table(
        results["summary"], results["labels"], results["ratios"], results["targets"], results["peer_failures"]
    )


def peer_list(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PEER_ORDER))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(unknown)}: choose from {', '.join(PEER_ORDER)}")
    return tuple(p for p in PEER_ORDER if p in names)


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.resume",
        description="Intermission's resume rate and latency beside its peers and this machine's limit "
        "(see the module docstring).",
    )
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--peers", type=peer_list, default=None)
    peers.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--peers-venv", type=Path, default=Path(os.environ.get("INTERMISSION_BENCH_PEERS_VENV", DEFAULT_VENV))
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--prefetch", type=int, default=Settings.model_fields["prefetch"].default)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--unloaded-samples", type=int, default=None)
    parser.add_argument(
        "--database-url", default=os.environ.get("INTERMISSION_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    parser.add_argument("--amqp-url", default=os.environ.get("INTERMISSION_BENCH_AMQP_URL", DEFAULT_AMQP_URL))
    parser.add_argument("--rabbitmqctl", default="rabbitmqctl")
    parser.add_argument("--bare-shape", choices=("cte", "transaction"), default="cte")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--worker-cwd", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = args.runs if args.runs is not None else (40 if args.quick else 1000)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if runs < 1 or reps < 1:
        parser.error("--runs and --reps must be at least 1")
    if args.no_peers:
        chosen: tuple[str, ...] = ()
    elif args.peers is not None:
        chosen = args.peers
    else:
        # A quick run is a smoke test: it never needs the peers' venv unless asked for them.
        chosen = () if args.quick else PEER_ORDER
    return Options(
        runs=runs,
        workers=[int(w) for w in args.workers.split(",") if w.strip()],
        prefetch=args.prefetch,
        window=args.window if args.window is not None else 4 * args.prefetch,
        unloaded_samples=args.unloaded_samples if args.unloaded_samples is not None else (10 if args.quick else 50),
        database_url=args.database_url,
        amqp_url=args.amqp_url,
        rabbitmqctl=shlex.split(args.rabbitmqctl),
        bare_shape=args.bare_shape,
        quick=args.quick,
        out=args.out,
        profile=args.profile,
        worker_cwd=args.worker_cwd,
        reps=reps,
        peers=chosen,
        peers_venv=args.peers_venv,
    )


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    results = asyncio.run(run(opts))
    facts = results["machine"]
    print()
    print(
        f"Resume benchmark, {facts['date']}, {facts['nproc']} cores, PostgreSQL {facts['postgres_server']}, "
        f"{opts.reps} repetition{'s' if opts.reps != 1 else ''} of {opts.runs} runs"
    )
    print(table(results))
    if results["contended"]:
        print("warning: a soak ran during this benchmark; its figures are not for the record")
    path = write_results("resume", results, opts.out)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
