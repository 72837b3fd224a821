"""The storage benchmark: does retention keep the database flat under a steady load, and what does pruning
cost the claims?

    python -m bench.storage [--minutes N] [--interval S] [--rate R] [--retention S] [--prune-interval S]
                            [--quick] [--database-url DSN] [--amqp-url URL] [--rabbitmqctl CMD] [--json FILE]

In a fresh database and a fresh RabbitMQ virtual host (both removed at the end), with one worker
(``python -m intermission.ops.cli worker``) and one sweeper (``… sweeper``) as subprocesses, configured
with the product's defaults but for retention, which is short for every kind of row (``--retention``,
default 60 s, for INTERMISSION_RETENTION_SECONDS, _INBOX_, _OUTBOX_ and _SESSION_RETENTION_SECONDS).

The workload is the soak's mix without its faults (``bench/soak/scripts.py``'s templates): ``--rate``
runs a second, started at an even pace through a ``HostClient``; external-tool pauses are answered by the
host (``run.resume``), approvals decided by the host (``run.decide``, some denied), agent-reply pauses
answered by a ``BusClient`` (``run.reply``, the worker's INTERMISSION_BUS_USER being the broker's user);
some runs are cancelled at their first pause and some left to expire on a short deadline (the sweeper
expires them). Every answer comes after a think time of up to a second, as a host's would. The soak's
"abandoned" fate (a pause nobody answers, with no deadline) is left out: paused runs are never pruned, so
those would grow the tables by design, which is not what is measured here.

The CLAIM LATENCY is the time from publishing an answer to hearing the ``run.resumed`` event that the
claim's transaction writes to the outbox (so it includes the relay's publication).

Every ``--interval`` seconds (a "minute", 60 s by default) it prints one block: each table's live rows
(the statistics' estimate), dead tuples and size on disk (``pg_total_relation_size``: table, indexes and
TOAST), the total, the runs by state (counted), the rows pruned, the share of heap-only updates of
``runs``, the CPU each process group used, the claim latency p50/p99 of that minute and the runs that
ended in it.

PRUNING ON AND OFF IN ONE RUN. The sweeper runs with INTERMISSION_PRUNE_INTERVAL_SECONDS=0 (it only
reports) and the benchmark runs the sweeper's own prune loop (``fleet.pruning.PruneLoop`` with the same
settings: every ``--prune-interval`` seconds, default 5, a paced prune of everything due, then its storage
report) in this process, where it can be paused: minutes alternate between pruning on and pruning off,
counted back from the last minute, which is always on. Alternating, rather than a block of minutes off
then a block on, is what makes the two comparable on a shared machine: both halves see the same table
sizes and the same neighbours (other engineers' tests come and go over half an hour), and a block "off"
at the start would be a block with nothing due anyway. It is pessimistic for "on": each on-minute begins
with a minute's backlog to remove, more than steady pruning ever has. Claim p99 on vs off pools the
claims of the STEADY minutes of each kind.

A minute is STEADY when it starts after retention plus one prune interval has passed (before, nothing is
due, on or off). The size ratio is the last minute's total bytes over the first steady minute's with
pruning on (the same phase as the last: an off-minute ends with a minute's backlog in the tables). Goals:
size ratio <= 1.1 (flat), claim p99 on / off <= 1.2.

AUTOVACUUM. Flat storage needs vacuum to make the space of deleted rows reusable; that is autovacuum's job
(migration 0008 tunes it per table). A server with autovacuum off (this project's test server has it off,
for speed) never reclaims anything, and the tables grow by every row ever deleted. ``--vacuum auto`` (the
default) then stands in for it: at every minute's end, after the minute's figures are read, the benchmark
runs ``VACUUM (ANALYZE)`` on each of Intermission's tables, and says so; ``--vacuum off`` shows the
server as it is, ``--vacuum on`` vacuums whatever the server does.

A broker or database that goes away (other engineers' tests restart them on a shared machine) does not
stop the benchmark: the commands that could not be published are counted, per minute, and such a minute is
marked as disturbed; its figures are not for the record.

It prints the per-minute table and the ratios at the end and writes every figure as JSON to
``bench/results/storage-<UTC time>.json`` (or ``--json``), printing the path. The machine is shared:
``other`` CPU (busy time none of the benchmark's processes account for) says how much somebody else ran.

Options:
  --minutes N        how many report intervals the workload runs (default 30)
  --interval S       seconds per report interval, a "minute" (default 60)
  --rate R           runs started per second (default 20)
  --retention S      every retention, in seconds (default 60)
  --prune-interval S seconds between two prunes while pruning is on (default 5)
  --vacuum MODE      auto (default: VACUUM every minute when the server's autovacuum is off), on, off
  --quick            a smoke run: 4 intervals of 10 s, retention 5 s, prunes every 2 s; figures mean nothing
  --database-url, --amqp-url, --rabbitmqctl: as for ``python -m bench.resume``
  --json FILE        where the figures go (``--out`` is the same option, as for the other benchmarks)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aio_pika
import asyncpg

from bench.infra import (
    CLK_TCK,
    DEFAULT_AMQP_URL,
    DEFAULT_DATABASE_URL,
    ROOT,
    CpuProbe,
    CpuReading,
    RabbitAdmin,
    drop_database,
    fresh_database,
    machine,
    percentile,
    soak_processes,
    stop_process,
    summary_ms,
    url_user,
    vhost_url,
    write_results,
)
from bench.resume import Workers, declare_topology, tail
from bench.scaling import log_record
from bench.soak.ledger import Fate
from bench.soak.profile import PROFILES
from bench.soak.scripts import TEMPLATES
from intermission.fleet.metrics import SweeperMetrics
from intermission.fleet.pruning import PruneLoop
from intermission.fleet.settings import Settings
from intermission.publishers.amqp import RETRYABLE, PublishFailed, connect
from intermission.publishers.clients import BusClient, HostClient, Subscription, version_of
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ResumeCommand,
    StartCommand,
    ToolAnswer,
)
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store.db import Database
from intermission.store.retention import RUN_TABLES, Kept
from intermission.wire import COMMAND_QUEUES, Command

SCOPE = Scope(app="bench", tenant="storage")
# Everything runs as the broker's one user of the benchmark: the host, the approver named by the approval
# templates, and the bus (the worker is told it is INTERMISSION_BUS_USER).
APPROVERS = ["guest"]
# The soak's fates without its races and without "abandon" (see the docstring); deny applies to runs that
# ask for an approval, the others complete instead.
FATES: tuple[tuple[Fate, float], ...] = (
    (Fate.COMPLETE, 0.84),
    (Fate.DENY, 0.05),
    (Fate.CANCEL, 0.05),
    (Fate.EXPIRE, 0.06),
)
# The soak's short deadlines for the runs left to expire.
EXPIRE_TTL = PROFILES["long"].deadline_seconds
THINK_SECONDS = (0.0, 1.0)
# What a server away raises in the prune loop (see prune_loop).
OUTAGE: tuple[type[BaseException], ...] = (*RETRYABLE, RuntimeError)
TERMINAL = frozenset({RunEventKind.COMPLETED, RunEventKind.FAILED, RunEventKind.CANCELLED, RunEventKind.EXPIRED})
TARGET_FLAT = 1.1
TARGET_P99 = 1.2
MB = 1024 * 1024

log = logging.getLogger("bench.storage")


@dataclass(frozen=True)
class Options:
    minutes: int
    interval: float
    rate: float
    retention: float
    prune_interval: float
    database_url: str
    amqp_url: str
    rabbitmqctl: list[str]
    quick: bool
    out: Path | None
    vacuum: str = "auto"
    seed: int = 7

    def pruning_on(self, minute: int) -> bool:
        """Minutes alternate, counted back from the last, which prunes."""
        return (self.minutes - 1 - minute) % 2 == 0

    def steady(self, minute: int) -> bool:
        """Whether the minute starts after retention and one prune interval: from then on rows are due."""
        return minute * self.interval >= self.retention + self.prune_interval

    def overrides(self) -> dict[str, Any]:
        """The settings that differ from the product's defaults, for every process."""
        return {
            "retention_seconds": self.retention,
            "inbox_retention_seconds": self.retention,
            "outbox_retention_seconds": self.retention,
            "session_retention_seconds": self.retention,
            "prune_interval_seconds": self.prune_interval,
            "bus_user": url_user(self.amqp_url),
        }


def environment(settings: dict[str, Any], *, log_level: str) -> dict[str, str]:
    return {
        **os.environ,
        **{f"INTERMISSION_{name.upper()}": str(value) for name, value in settings.items()},
        "INTERMISSION_LOG_LEVEL": log_level,
    }


# --- the workload ---------------------------------------------------------------------------------------


@dataclass
class Minute:
    """What the workload saw in one report interval."""

    claims: list[float] = field(default_factory=list)
    ended: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    pruned: Counter[str] = field(default_factory=Counter)
    prune_seconds: float = 0.0
    # Commands the broker did not take (it was away): their runs are not counted, or stay paused.
    unpublished: Counter[str] = field(default_factory=Counter)


class Workload:
    """Starts runs at a steady pace and answers their pauses as the soak's host and bus do, minus faults;
    times every answer to its ``run.resumed``."""

    def __init__(self, host: HostClient, bus: BusClient, opts: Options) -> None:
        self.host = host
        self.bus = bus
        self.opts = opts
        self.fates: dict[str, Fate] = {}
        self.handled: dict[str, set[int]] = {}
        # Run id -> when its answer was published, until its run.resumed arrives (one pause at a time).
        self.answered: dict[str, float] = {}
        self.now = Minute()
        self.started = 0
        self.ended = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.failures: list[BaseException] = []

    def take(self) -> Minute:
        """The interval that ends now; a fresh one begins."""
        ended, self.now = self.now, Minute()
        return ended

    def check(self) -> None:
        if self.failures:
            raise RuntimeError("the workload failed") from self.failures[0]

    def spawn(self, job: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(job)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (failure := task.exception()) is not None:
            self.failures.append(failure)

    # --- starting -------------------------------------------------------------------------------------

    async def start_runs(self, until: float) -> None:
        """Start ``rate`` runs a second until ``until`` (perf_counter), on an absolute schedule so that a
        slow publish does not slow the pace."""
        began = time.perf_counter()
        n = 0
        while (at := began + n / self.opts.rate) < until:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            self.spawn(self.start(n))
            n += 1

    async def start(self, n: int) -> None:
        rng = random.Random(f"{self.opts.seed}:{n}")  # noqa: S311 - a reproducible mix, not cryptography
        template = rng.choices(TEMPLATES, weights=[t.weight for t in TEMPLATES])[0]
        script = template.build(rng, APPROVERS)
        fate = Fate.COMPLETE
        if template.pauses:
            fate = rng.choices([f for f, _ in FATES], weights=[w for _, w in FATES])[0]
            if fate is Fate.DENY and "approval" not in template.pauses:
                fate = Fate.COMPLETE
        run_id = f"storage-{n:07d}"
        self.fates[run_id] = fate
        self.handled[run_id] = set()
        command = StartCommand(
            scope=SCOPE,
            run_id=run_id,
            agent_id="demo",
            input=f"storage run {n} ({template.name}, {fate.value})",
            script=[ScriptTurn.model_validate(t) for t in script],
            pause_ttl_seconds=rng.randint(*EXPIRE_TTL) if fate is Fate.EXPIRE else None,
        )
        self.started += 1
        try:
            await self.host.start(command)
        except PublishFailed:
            self.now.unpublished["run.start"] += 1
            self.started -= 1
            del self.fates[run_id], self.handled[run_id]

    # --- hearing ----------------------------------------------------------------------------------------

    async def host_loop(self, events: Subscription[Notice | RunEvent | CommandRejected]) -> None:
        async for received in events:
            event = received.event
            if isinstance(event, Notice):
                self.on_notice(event, "host")
            elif isinstance(event, RunEvent):
                self.on_run_event(event)
            else:
                self.now.rejected[event.code] += 1

    async def bus_loop(self, notices: Subscription[Notice]) -> None:
        async for received in notices:
            self.on_notice(received.event, "bus")

    def on_run_event(self, event: RunEvent) -> None:
        if event.kind is RunEventKind.RESUMED:
            sent = self.answered.pop(event.run_id, None)
            if sent is not None:
                self.now.claims.append(time.perf_counter() - sent)
        elif event.kind in TERMINAL and self.fates.pop(event.run_id, None) is not None:
            self.handled.pop(event.run_id, None)
            self.answered.pop(event.run_id, None)
            self.now.ended[event.kind.value] += 1
            self.ended += 1

    def on_notice(self, notice: Notice, via: str) -> None:
        """Both subscriptions hear agent-reply notices: the bus answers them, but the host cancels or lets
        expire a run whose fate it is, at its first pause (the soak's rule)."""
        fate = self.fates.get(notice.run_id)
        handled = self.handled.get(notice.run_id)
        if fate is None or handled is None or notice.suspension_id in handled:
            return
        first = not handled
        if first and fate in (Fate.CANCEL, Fate.EXPIRE):
            responsible = "host"
        else:
            responsible = "bus" if notice.reason is SuspendReason.AGENT_REPLY else "host"
        if via != responsible:
            return
        handled.add(notice.suspension_id)
        if first and fate is Fate.EXPIRE:
            return
        self.spawn(self.answer(notice, cancel=first and fate is Fate.CANCEL, deny=fate is Fate.DENY))

    async def answer(self, notice: Notice, *, cancel: bool, deny: bool) -> None:
        try:
            await self._answer(notice, cancel=cancel, deny=deny)
        except PublishFailed:
            # The run stays paused (until its deadline, a day ahead): counted, and in flight to the end.
            self.now.unpublished["answer"] += 1
            self.answered.pop(notice.run_id, None)

    async def _answer(self, notice: Notice, *, cancel: bool, deny: bool) -> None:
        rng = random.Random(f"{self.opts.seed}:{notice.run_id}:{notice.suspension_id}")  # noqa: S311
        await asyncio.sleep(rng.uniform(*THINK_SECONDS))
        version = version_of(notice)
        if cancel:
            await self.host.cancel(CancelCommand(scope=SCOPE, run_id=notice.run_id, reason="storage cancels"))
            return
        # The clock starts as the answer is handed to the client: the publish (with its confirm) is part of
        # what a host waits for.
        self.answered[notice.run_id] = time.perf_counter()
        if notice.reason is SuspendReason.EXTERNAL_TOOL:
            results = [ToolAnswer(call_id=p.id, content=f"answer to {p.id}") for p in notice.pending]
            await self.host.resume(ResumeCommand(scope=SCOPE, version=version, results=results))
        elif notice.reason is SuspendReason.APPROVAL:
            assert notice.checkpoint_id is not None
            decision = DecideCommand(
                scope=SCOPE,
                version=version,
                checkpoint_id=notice.checkpoint_id,
                decision=Decision.DENY if deny else Decision.APPROVE,
                reason="storage denies" if deny else "storage approves",
            )
            await self.host.decide(decision)
        else:
            call = notice.pending[0]
            assert call.reply_with is not None
            reply = json.dumps({"performative": "inform", "sender": "pricer", "content": f"reply to {call.id}"})
            await self.bus.reply(SCOPE, version, call.reply_with, reply)


# --- pruning --------------------------------------------------------------------------------------------


async def prune_loop(pruning: PruneLoop, workload: Workload, opts: Options, began: float) -> None:
    """The sweeper's loop (``PruneLoop.serve``: a prune, then an interval), but only in the minutes that
    prune: an on-minute prunes at its start (after the off-minute before it) and every interval after."""
    while (minute := int((time.perf_counter() - began) // opts.interval)) < opts.minutes:
        next_minute = began + (minute + 1) * opts.interval
        if not opts.pruning_on(minute):
            await asyncio.sleep(max(0.0, next_minute - time.perf_counter()))
            continue
        started = time.perf_counter()
        # PruneLoop.once, in its two parts: a server away skips the rest of the interval, as the sweeper
        # does. The report reads the dead-letter queue over AMQP, where a robust connection that is
        # reconnecting raises a bare RuntimeError ("Connection was not opened"), which the sweeper's loop
        # does not count as an outage (its supervisor restarts it); here it is one.
        try:
            workload.now.pruned.update(await pruning.pruner.prune())
            await pruning.report()
        except OUTAGE as exc:
            workload.now.pruned["skipped"] += 1
            log.warning("prune or report skipped: %r", exc)
        workload.now.prune_seconds += time.perf_counter() - started
        await asyncio.sleep(max(0.0, min(pruning.interval, next_minute - time.perf_counter())))


# --- readings -------------------------------------------------------------------------------------------

TABLE_STATS = """
SELECT relname AS name, n_tup_upd AS updated, n_tup_hot_upd AS hot, autovacuum_count AS autovacuums
  FROM pg_stat_user_tables
 WHERE schemaname = current_schema()
"""
RUNS_BY_STATE = "SELECT state, count(*) AS n FROM runs GROUP BY state"
# Intermission's tables that churn (every one retention prunes), by their fixed names.
VACUUMED = (*RUN_TABLES, *(k.value for k in Kept if k is not Kept.RUNS))


async def autovacuum_on(con: asyncpg.Connection[Any]) -> bool:
    return bool(await con.fetchval("SELECT current_setting('autovacuum')::bool"))


async def vacuum(con: asyncpg.Connection[Any]) -> float:
    """What autovacuum would do, all at once: VACUUM (ANALYZE) each table; the seconds it took."""
    started = time.perf_counter()
    for table in VACUUMED:
        await con.execute(f"VACUUM (ANALYZE) {table}")  # a fixed table name of the schema, never input
    return time.perf_counter() - started


async def snapshot(pruning: PruneLoop, con: asyncpg.Connection[Any]) -> dict[str, Any]:
    tables = await pruning.pruner.storage()
    stats = {r["name"]: r for r in await con.fetch(TABLE_STATS)}
    states = {r["state"]: int(r["n"]) for r in await con.fetch(RUNS_BY_STATE)}
    runs = stats.get("runs")
    return {
        "tables": {
            t.name: {
                "live_rows": t.live_rows,
                "dead_rows": t.dead_rows,
                "bytes": t.bytes,
                "autovacuums": int(stats[t.name]["autovacuums"]) if t.name in stats else 0,
            }
            for t in tables
        },
        "total_bytes": sum(t.bytes for t in tables),
        "runs_by_state": states,
        "runs_updated": int(runs["updated"]) if runs is not None else 0,
        "runs_hot_updated": int(runs["hot"]) if runs is not None else 0,
    }


def cpu_percent(
    used: dict[str, float], pids: dict[str, int], before: CpuReading, after: CpuReading
) -> dict[str, float]:
    """Percent of one core each process group used over the interval, the worker and the sweeper apart."""
    wall = used["wall"]
    found = {k: round(100 * v / wall, 1) for k, v in used.items() if k not in ("wall", "python")}
    for name, pid in pids.items():
        then = before.groups["python"].get(pid, 0)
        now = after.groups["python"].get(pid, then)
        found[name] = round(100 * (now - then) * 1000 / CLK_TCK / wall, 1)
    return found


def hot_share(updated: int, hot: int) -> float | None:
    return round(hot / updated, 4) if updated else None


def minute_figures(
    index: int, opts: Options, seen: Minute, reading: dict[str, Any], previous: dict[str, Any] | None
) -> dict[str, Any]:
    updated = reading["runs_updated"] - (previous["runs_updated"] if previous else 0)
    hot = reading["runs_hot_updated"] - (previous["runs_hot_updated"] if previous else 0)
    return {
        "minute": index,
        "start_s": index * opts.interval,
        "pruning": opts.pruning_on(index),
        "steady": opts.steady(index),
        "claim_ms": summary_ms(seen.claims),
        "ended": dict(seen.ended),
        "rejected": dict(seen.rejected),
        "unpublished": dict(seen.unpublished),
        "pruned": dict(seen.pruned),
        "prune_s": round(seen.prune_seconds, 2),
        "runs_hot_share": hot_share(updated, hot),
        **reading,
    }


def fmt_bytes(n: float) -> str:
    return f"{n / MB:.2f} MB" if n >= MB else f"{n / 1024:.0f} kB"


def block(m: dict[str, Any], opts: Options, in_flight: int) -> str:
    claim = m["claim_ms"]
    ended = m["ended"]
    lines = [
        f"minute {m['minute'] + 1}/{opts.minutes} ({m['start_s']:.0f}-{m['start_s'] + opts.interval:.0f} s), "
        f"pruning {'on' if m['pruning'] else 'off'}{', steady' if m['steady'] else ''}: "
        f"claims {claim['count']}, p50 {claim['p50']:.1f} ms, p99 {claim['p99']:.1f} ms; "
        f"{sum(ended.values())} runs ended ({', '.join(f'{k} {v}' for k, v in sorted(ended.items())) or 'none'}); "
        f"{in_flight} in flight",
        f"  {'table':<18} {'live rows':>10} {'dead':>8} {'size':>10} {'autovac':>8}",
    ]
    for name, t in m["tables"].items():
        lines.append(
            f"  {name:<18} {t['live_rows']:>10} {t['dead_rows']:>8} {fmt_bytes(t['bytes']):>10} {t['autovacuums']:>8}"
        )
    lines.append(f"  {'total':<18} {'':>10} {'':>8} {fmt_bytes(m['total_bytes']):>10}")
    states = ", ".join(f"{k} {v}" for k, v in sorted(m["runs_by_state"].items())) or "none"
    pruned = sum(v for k, v in m["pruned"].items() if k != "skipped")
    hot = m["runs_hot_share"]
    lines.append(
        f"  runs by state: {states}; pruned {pruned} rows in {m['prune_s']:.1f} s; "
        f"HOT share of runs updates {'-' if hot is None else f'{hot:.0%}'}"
    )
    cpu = m["cpu_percent"]
    lines.append(
        "  cpu % of a core: "
        + ", ".join(f"{k} {cpu[k]:.0f}" for k in ("worker", "sweeper", "postgres", "rabbitmq", "driver", "other"))
    )
    if m["rejected"]:
        lines.append(f"  REFUSED commands: {m['rejected']}")
    if m["unpublished"]:
        lines.append(f"  DISTURBED: commands the broker did not take: {m['unpublished']}")
    if m.get("vacuum_s") is not None:
        lines.append(f"  then VACUUM (ANALYZE) of every table, standing in for autovacuum: {m['vacuum_s']:.1f} s")
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------------------


async def consumed(url: str, queue: str) -> None:
    """Return once somebody consumes ``queue`` (the worker is up)."""
    connection = await aio_pika.connect(url)
    try:
        async with asyncio.timeout(60):
            while True:
                channel = await connection.channel()
                declared = await channel.declare_queue(queue, passive=True)
                await channel.close()
                if declared.declaration_result.consumer_count:
                    return
                await asyncio.sleep(0.2)
    finally:
        await connection.close()


async def product(role: str, env: dict[str, str]) -> tuple[asyncio.subprocess.Process, IO[bytes]]:
    log_file = tempfile.NamedTemporaryFile(prefix=f"bench-{role}-", suffix=".log")  # noqa: SIM115 - closed by caller
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "intermission.ops.cli", role, cwd=ROOT, env=env, stdout=log_file, stderr=log_file
    )
    return proc, log_file


async def measure(opts: Options, dsn: str, url: str) -> dict[str, Any]:
    settings = opts.overrides()
    await declare_topology(url)
    worker, worker_log = await product(
        "worker", environment({**settings, "database_url": dsn, "amqp_url": url}, log_level="WARNING")
    )
    # The sweeper expires pauses as in production but only reports storage: this process prunes.
    sweeper_settings = {**settings, "database_url": dsn, "amqp_url": url, "prune_interval_seconds": 0}
    sweeper, sweeper_log = await product("sweeper", environment(sweeper_settings, log_level="INFO"))
    both = Workers([worker, sweeper], [worker_log, sweeper_log])
    db = await Database.connect(dsn, min_size=1, max_size=2, application_name="bench-pruner")
    amqp = await connect(url, "bench-pruner")
    con = await asyncpg.connect(dsn)
    pumps: list[asyncio.Task[Any]] = []
    try:
        vacuuming = opts.vacuum == "on" or (opts.vacuum == "auto" and not await autovacuum_on(con))
        if vacuuming:
            print("autovacuum is off on this server: the benchmark vacuums every table each minute", flush=True)
        pruning = PruneLoop(db, amqp, Settings(**settings, database_url=dsn, amqp_url=url), SweeperMetrics())
        await consumed(url, COMMAND_QUEUES[Command.START])
        async with asyncio.timeout(60):
            while log_record(Path(sweeper_log.name), "sweeper_started") is None:
                both.check_alive()
                await asyncio.sleep(0.1)
        async with (
            await HostClient.connect(url, name="bench host") as host,
            await BusClient.connect(url, name="bench bus") as bus,
            host.subscribe(SCOPE, exclusive=True, prefetch=256) as events,
            bus.subscribe(SCOPE, exclusive=True, prefetch=256) as notices,
        ):
            workload = Workload(host, bus, opts)
            pumps += [asyncio.create_task(workload.host_loop(events)), asyncio.create_task(workload.bus_loop(notices))]
            probe = CpuProbe([worker.pid, sweeper.pid])
            pids = {"worker": worker.pid, "sweeper": sweeper.pid}
            minutes: list[dict[str, Any]] = []
            previous: dict[str, Any] | None = None
            began = time.perf_counter()
            end = began + opts.minutes * opts.interval
            pumps.append(asyncio.create_task(workload.start_runs(end)))
            pumps.append(asyncio.create_task(prune_loop(pruning, workload, opts, began)))
            cpu_before = probe.read()
            for index in range(opts.minutes):
                boundary = began + (index + 1) * opts.interval
                while (left := boundary - time.perf_counter()) > 0:
                    await asyncio.sleep(min(1.0, left))
                    both.check_alive()
                    workload.check()
                    for pump in pumps:
                        if pump.done() and not pump.cancelled() and pump.exception() is not None:
                            raise RuntimeError("a loop of the benchmark failed") from pump.exception()
                seen = workload.take()
                cpu_after = probe.read()
                reading = await snapshot(pruning, con)
                reading["cpu_percent"] = cpu_percent(
                    CpuProbe.used_ms(cpu_before, cpu_after), pids, cpu_before, cpu_after
                )
                cpu_before = cpu_after
                figures = minute_figures(index, opts, seen, reading, previous)
                figures["vacuum_s"] = round(await vacuum(con), 2) if vacuuming else None
                figures["claim_latencies_ms"] = [round(s * 1000, 3) for s in seen.claims]
                previous = reading
                minutes.append(figures)
                print(block(figures, opts, workload.started - workload.ended), flush=True)
            waiting = len(workload.answered)
            warnings = Workers([worker], [worker_log]).warnings()
        return {
            "server_autovacuum": await autovacuum_on(con),
            "benchmark_vacuums": vacuuming,
            "minutes": minutes,
            "runs_started": workload.started,
            "runs_ended": workload.ended,
            "answers_unresumed_at_end": waiting,
            "worker_warnings": warnings,
        }
    except BaseException:
        print(f"worker log:\n{tail(worker_log)}\nsweeper log:\n{tail(sweeper_log)}", flush=True)
        raise
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await con.close()
        await amqp.close()
        await db.close()
        await asyncio.gather(stop_process(worker), stop_process(sweeper))
        worker_log.close()
        sweeper_log.close()


def outcome(measured: dict[str, Any], opts: Options) -> dict[str, Any]:
    """The ratios of the issue, from the per-minute figures."""
    minutes = measured["minutes"]
    first = next((m for m in minutes if m["steady"] and m["pruning"]), None)
    last = minutes[-1]
    size_ratio = round(last["total_bytes"] / first["total_bytes"], 4) if first is not None else None
    on = [s / 1000 for m in minutes if m["steady"] and m["pruning"] for s in m["claim_latencies_ms"]]
    off = [s / 1000 for m in minutes if m["steady"] and not m["pruning"] for s in m["claim_latencies_ms"]]
    p99_on, p99_off = percentile(on, 99) * 1000, percentile(off, 99) * 1000
    p99_ratio = round(p99_on / p99_off, 4) if on and off else None
    pruned: Counter[str] = Counter()
    for m in minutes:
        pruned.update({k: v for k, v in m["pruned"].items() if k != "skipped"})
    return {
        "first_steady_minute": first["minute"] if first is not None else None,
        "size_first_steady_bytes": first["total_bytes"] if first is not None else None,
        "size_last_bytes": last["total_bytes"],
        "size_ratio": size_ratio,
        "claim_on_ms": summary_ms(on),
        "claim_off_ms": summary_ms(off),
        "claim_p99_ratio": p99_ratio,
        "runs_hot_share": hot_share(last["runs_updated"], last["runs_hot_updated"]),
        "pruned": dict(pruned),
        "targets": [
            {
                "target": f"total size, last minute / first steady minute <= {TARGET_FLAT}",
                "value": "-" if size_ratio is None else f"{size_ratio:.2f}",
                "met": size_ratio is not None and size_ratio <= TARGET_FLAT,
            },
            {
                "target": f"claim p99 pruning on / off <= {TARGET_P99}",
                "value": "-" if p99_ratio is None else f"{p99_ratio:.2f} ({p99_on:.1f} vs {p99_off:.1f} ms)",
                "met": p99_ratio is not None and p99_ratio <= TARGET_P99,
            },
        ],
    }


async def run(opts: Options) -> dict[str, Any]:
    soak_before = soak_processes()
    if soak_before:
        print("warning: a soak is running on this machine; these figures are for development only", flush=True)
    results: dict[str, Any] = {
        "benchmark": "storage",
        "machine": machine(),
        "options": {
            "minutes": opts.minutes,
            "interval_s": opts.interval,
            "rate": opts.rate,
            "retention_s": opts.retention,
            "prune_interval_s": opts.prune_interval,
            "vacuum": opts.vacuum,
            "settings": opts.overrides(),
            "quick": opts.quick,
            "command": "python -m bench.storage " + shlex.join(sys.argv[1:]),
        },
    }
    admin = RabbitAdmin(opts.rabbitmqctl, url_user(opts.amqp_url))
    dsn = await fresh_database(opts.database_url, "storage")
    try:
        (vhost,) = await admin.add_vhosts(["storage"])
        measured = await measure(opts, dsn, vhost_url(opts.amqp_url, vhost))
    finally:
        await admin.delete_all()
        await drop_database(dsn)
    results.update(measured)
    results.update(outcome(measured, opts))
    soak_after = soak_processes()
    results["contended"] = bool(soak_before or soak_after)
    results["soak_processes"] = sorted(set(soak_before + soak_after))
    return results


def table(results: dict[str, Any]) -> str:
    rows = [
        (
            "minute",
            "pruning",
            "total MB",
            "runs rows",
            "dead rows",
            "claims",
            "p50 ms",
            "p99 ms",
            "ended",
            "other cpu %",
        )
    ]
    for m in results["minutes"]:
        rows.append(
            (
                f"{m['minute'] + 1}{'' if m['steady'] else ' (warm)'}{' DISTURBED' if m['unpublished'] else ''}",
                "on" if m["pruning"] else "off",
                f"{m['total_bytes'] / MB:.2f}",
                str(sum(m["runs_by_state"].values())),
                str(sum(t["dead_rows"] for t in m["tables"].values())),
                str(m["claim_ms"]["count"]),
                f"{m['claim_ms']['p50']:.1f}",
                f"{m['claim_ms']['p99']:.1f}",
                str(sum(m["ended"].values())),
                f"{m['cpu_percent']['other']:.0f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    on, off = results["claim_on_ms"], results["claim_off_ms"]
    first = results["first_steady_minute"]
    lines.append(
        f"size: last minute {fmt_bytes(results['size_last_bytes'])}"
        + (
            f" / first steady minute ({first + 1}) {fmt_bytes(results['size_first_steady_bytes'])}"
            f" = {results['size_ratio']:.2f}"
            if first is not None
            else " (no steady minute with pruning on: run longer)"
        )
    )
    lines.append(
        f"claim p50/p99 in steady minutes: pruning on {on['p50']:.1f}/{on['p99']:.1f} ms ({on['count']} claims), "
        f"off {off['p50']:.1f}/{off['p99']:.1f} ms ({off['count']} claims)"
        + (f"; p99 on / off = {results['claim_p99_ratio']:.2f}" if results["claim_p99_ratio"] is not None else "")
    )
    hot = results["runs_hot_share"]
    lines.append(f"HOT updates of runs (n_tup_hot_upd / n_tup_upd): {'-' if hot is None else f'{hot:.1%}'}")
    pruned = results["pruned"]
    lines.append(
        f"rows pruned: {sum(pruned.values())} ("
        + ", ".join(f"{k} {v}" for k, v in sorted(pruned.items()))
        + f"); runs started {results['runs_started']}, ended {results['runs_ended']}"
    )
    for t in results["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['value']}")
    if results["benchmark_vacuums"]:
        lines.append("The server's autovacuum is off: the benchmark ran VACUUM (ANALYZE) on every table each minute.")
    disturbed = [m["minute"] + 1 for m in results["minutes"] if m["unpublished"]]
    if disturbed:
        lines.append(f"warning: the broker was away in minute(s) {disturbed}: those figures are not for the record")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.storage",
        description="Storage and claim latency under a steady load with short retention (see the docstring).",
    )
    parser.add_argument("--minutes", type=int, default=None)
    parser.add_argument("--interval", type=float, default=None)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--retention", type=float, default=None)
    parser.add_argument("--prune-interval", type=float, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--database-url", default=os.environ.get("INTERMISSION_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    parser.add_argument("--amqp-url", default=os.environ.get("INTERMISSION_BENCH_AMQP_URL", DEFAULT_AMQP_URL))
    parser.add_argument("--rabbitmqctl", default="rabbitmqctl")
    parser.add_argument("--json", "--out", dest="out", type=Path, default=None)
    parser.add_argument("--vacuum", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args(argv)

    def chosen(value: float | None, quick: float, default: float) -> float:
        return value if value is not None else (quick if args.quick else default)

    opts = Options(
        minutes=int(chosen(args.minutes, 4, 30)),
        interval=chosen(args.interval, 10.0, 60.0),
        rate=args.rate,
        retention=chosen(args.retention, 5.0, 60.0),
        prune_interval=chosen(args.prune_interval, 2.0, 5.0),
        database_url=args.database_url,
        amqp_url=args.amqp_url,
        rabbitmqctl=shlex.split(args.rabbitmqctl),
        quick=args.quick,
        out=args.out,
        vacuum=args.vacuum,
    )
    if opts.minutes < 1 or opts.interval <= 0 or opts.rate <= 0 or opts.retention <= 0 or opts.prune_interval <= 0:
        parser.error("--minutes, --interval, --rate, --retention and --prune-interval must be positive")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    results = asyncio.run(run(opts))
    print()
    print(
        f"Storage benchmark, {results['machine']['date']}, {results['machine']['nproc']} cores: "
        f"{opts.minutes} x {opts.interval:g} s at {opts.rate:g} runs/s, retention {opts.retention:g} s, "
        f"prunes every {opts.prune_interval:g} s when on"
    )
    print(table(results))
    if results["contended"]:
        print("warning: a soak ran during this benchmark; its figures are not for the record")
    path = write_results("storage", results, opts.out)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
