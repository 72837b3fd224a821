"""The scaling benchmark: claim latency as the tables grow, and with the expiry sweeper at work.

    python -m bench.scaling [--sizes 10000,100000,1000000] [--samples 1000] [--expired 100000] [--quick]
                            [--database-url DSN] [--amqp-url URL] [--rabbitmqctl CMD] [--out FILE]

In a fresh database (and, for the sweeper, a fresh RabbitMQ virtual host), removed at the end:

1. For each size, ``runs`` and ``suspensions`` are filled up to that many paused runs (bulk-loaded with
   ``INSERT … SELECT generate_series``: the demo agent paused on ``lookup``, spread over 16 tenants, each
   pause with its own deadline a day ahead), then analysed. On a random sample of those runs it times, one
   at a time:
   - ``claim``: the product's pinned leased claim with its first snapshot,
     ``SuspensionStore.claim_suspension_leased`` (one transaction);
   - ``resume``: the whole ``run.resume`` command, the engine's ``Resume`` operation with an inbox
     receipt (its read; inbox record, checks, claim, removal of the pause, outbox event).
2. At the largest size, ``--expired`` more paused runs whose deadlines have passed are loaded, the claims
   are timed again (the baseline), and then once more while an expiry sweeper
   (``python -m intermission.ops.cli sweeper``, a process of its own, configured by the environment as in production)
   works through them, for ``--sweep-seconds`` at most: it pages through the expired pauses and publishes
   one ``run.expire`` command per pause with confirms (nobody consumes them here: the measure is what the
   sweep costs the claims, not the expiries).

It prints the latencies and the targets of issue 7 (claim p99 at the largest size <= 1.2 x at the
smallest; the sweeper slows claims, p50 and p99, by at most 20 %), and writes every figure as JSON to
``bench/results/scaling-<UTC time>.json`` (or ``--out``), printing the path.

Options:
  --sizes LIST     paused runs per measurement, ascending (default 10000,100000,1000000)
  --samples N      claims (and resumes) timed per measurement (default 1000)
  --expired N      expired pauses for the sweeper to work through (default 100000)
  --sweep-seconds S  how long claims are timed while the sweeper works, at most (default 30; less when the
                   sweep is done sooner). The sweeper runs as configured (INTERMISSION_SWEEP_MAX_RATE etc.
                   from the environment)
  --quick          a tiny run for smoke tests (sizes 1000,3000; 100 samples; 2000 expired); figures mean
                   nothing
  --database-url, --amqp-url, --rabbitmqctl, --out: as for ``python -m bench.resume``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg

from bench.infra import (
    DEFAULT_AMQP_URL,
    DEFAULT_DATABASE_URL,
    ROOT,
    CpuProbe,
    RabbitAdmin,
    drop_database,
    fresh_database,
    machine,
    soak_processes,
    stop_process,
    summary_ms,
    url_user,
    vhost_url,
    write_results,
)
from bench.resume import declare_topology
from intermission.engine.commands import Resume
from intermission.engine.core import Engine
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.config import ExecutionProvenance, RunConfig
from intermission.schemas.llm import Message, Role, ToolCall, Usage
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import ClaimVersion, Continuation, LeasedClaim, PendingCall, Progress
from intermission.store import Stores
from intermission.store.inbox import Receipt
from intermission.store.rows import PENDING, SCRIPT
from intermission.wire import COMMAND_QUEUES, Command
from tests.support.factories import writes

APP = "bench"
TENANTS = 16
REVISION = 2
CHUNK = 100_000
LEASE = Lease(owner=f"bench-scaling@{os.getpid()}", ttl_seconds=30)
TARGET_GROWTH = 1.2
TARGET_SWEEPER = 1.2


@dataclass(frozen=True)
class Options:
    sizes: list[int]
    samples: int
    expired: int
    sweep_seconds: float
    database_url: str
    amqp_url: str
    rabbitmqctl: list[str]
    quick: bool
    out: Path | None


def run_id(n: int) -> str:
    return f"scale-{n:08d}"


def scope_of(n: int) -> Scope:
    return Scope(app=APP, tenant=f"t{n % TENANTS:02d}")


def paused_documents() -> dict[str, str]:
    """The stored columns of a demo run paused on ``lookup``, as the product writes them."""
    config = RunConfig(max_steps=32)
    call = ToolCall(id="call-0-0", name="lookup", arguments=json.dumps({"query": "weather in Lyon"}))
    continuation = Continuation(
        messages=[
            Message(role=Role.USER, content="What's the weather in Lyon?"),
            Message(role=Role.ASSISTANT, content="", tool_calls=[call]),
        ],
        system_prompt="You are the Intermission demo agent. Use the tools you are given; answer briefly.",
        step_index=1,
        tokens_used=24,
        usage=Usage(input_tokens=16, output_tokens=8, total_tokens=24),
        session_id="",
        config=config,
        provenance=ExecutionProvenance(agent_id="demo", executor="agent_loop", worker="bench"),
    )
    script = [
        ScriptTurn.model_validate({"call": [{"tool": "lookup", "arguments": {"query": "weather in Lyon"}}]}),
        ScriptTurn.model_validate({"say": "It is sunny in Lyon."}),
    ]
    pending = [PendingCall(id=call.id, name=call.name, arguments=call.arguments)]
    return {
        "config": config.model_dump_json(),
        "script": SCRIPT.dump_json(script).decode(),
        "pending": PENDING.dump_json(pending).decode(),
        "continuation": continuation.model_dump_json(),
    }


LOAD_RUNS = """
INSERT INTO runs (id, app, tenant, agent_id, state, revision, input, session_id, config, script,
                  pause_ttl_seconds, start_digest, step_count, tokens_used)
SELECT 'scale-' || lpad(g::text, 8, '0'), 'bench', 't' || lpad((g % 16)::text, 2, '0'), 'demo', 'paused', 2,
       'What''s the weather in Lyon?', 'scale-' || lpad(g::text, 8, '0'), $3::jsonb, $4::jsonb, 86400,
       md5(g::text), 1, 24
  FROM generate_series($1::int, $2::int) AS g
"""

# Live pauses expire a day ahead, expired ones an hour ago; each its own deadline (1 ms apart).
LOAD_PAUSES = """
INSERT INTO suspensions (run_id, app, tenant, reason, pending, continuation, expires_at)
SELECT 'scale-' || lpad(g::text, 8, '0'), 'bench', 't' || lpad((g % 16)::text, 2, '0'), 'external_tool',
       $3::jsonb, $4::jsonb,
       CASE WHEN $5::bool THEN now() - interval '1 hour' ELSE now() + interval '1 day' END
         + (g - $1::int) * interval '1 millisecond'
  FROM generate_series($1::int, $2::int) AS g
"""


async def load(con: asyncpg.Connection[Any], docs: dict[str, str], first: int, last: int, *, expired: bool) -> None:
    """Paused runs numbered first..last (inclusive), in chunks so that progress shows."""
    for start in range(first, last + 1, CHUNK):
        end = min(last, start + CHUNK - 1)
        async with con.transaction():
            await con.execute(LOAD_RUNS, start, end, docs["config"], docs["script"])
            await con.execute(LOAD_PAUSES, start, end, docs["pending"], docs["continuation"], expired)
        print(f"  loaded {end - first + 1} of {last - first + 1}", flush=True)
    await con.execute("VACUUM ANALYZE runs")
    await con.execute("VACUUM ANALYZE suspensions")
    # The load wrote gigabytes of WAL: flush it now, so that the claims are timed on the tables at this size
    # and not against the checkpoint the load itself set off.
    await con.execute("CHECKPOINT")


async def suspension_ids(con: asyncpg.Connection[Any], numbers: list[int]) -> dict[int, int]:
    # Each run by its key (a run id is unique only within its scope).
    found = await con.fetch(
        "SELECT s.app, s.tenant, s.run_id, s.id FROM suspensions s"
        " JOIN unnest($1::text[], $2::text[], $3::text[]) AS k (app, tenant, run_id)"
        " ON s.app = k.app AND s.tenant = k.tenant AND s.run_id = k.run_id",
        [scope_of(n).app for n in numbers],
        [scope_of(n).tenant for n in numbers],
        [run_id(n) for n in numbers],
    )
    by_run = {(r["app"], r["tenant"], r["run_id"]): r["id"] for r in found}
    return {n: by_run[(scope_of(n).app, scope_of(n).tenant, run_id(n))] for n in numbers}


async def time_claims(
    stores: Stores,
    con: asyncpg.Connection[Any],
    continuation: Continuation,
    numbers: list[int],
    *,
    until: asyncio.Task[Any] | None = None,
    began_at: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Alternate a leased claim and a resume command over ``numbers``; the seconds each took. With
    ``until``, stop as soon as that task is done; with ``began_at``, also record when (wall clock) each
    began, in the same order."""
    starts: dict[str, list[float]] = began_at if began_at is not None else {"claim": [], "resume": []}
    ids = await suspension_ids(con, numbers)
    # One engine for every claim and resume: one at a time, so each is a statement (a batch) of its own.
    engine = Engine.over(stores, lease=LEASE)
    timings: dict[str, list[float]] = {"claim": [], "resume": []}
    for i, n in enumerate(numbers):
        if until is not None and until.done():
            break
        scope = scope_of(n)
        version = ClaimVersion(run_id=run_id(n), suspension_id=ids[n], run_revision=REVISION)
        if i % 2 == 0:
            claim = LeasedClaim(
                version=version,
                lease=LEASE,
                first=Progress(run_id=run_id(n), owner=LEASE.owner, continuation=continuation),
            )
            starts["claim"].append(time.time())
            started = time.perf_counter()
            await writes(stores, scope, engine).suspensions.claim_suspension_leased(claim)
            timings["claim"].append(time.perf_counter() - started)
        else:
            command = ResumeCommand(
                scope=scope, version=version, results=[ToolAnswer(call_id="call-0-0", content="sunny, 24°C")]
            )
            message_id = str(uuid.uuid4())
            receipt = Receipt.of(message_id, "run.resume", command)
            starts["resume"].append(time.time())
            started = time.perf_counter()
            await engine.apply(Resume(command, receipt=receipt, correlation_id=message_id))
            timings["resume"].append(time.perf_counter() - started)
    return timings


def rounded(used: dict[str, float]) -> dict[str, float]:
    """CPU milliseconds per group while the claims were timed (``python`` is the sweeper, ``driver`` this
    process); ``other`` is busy time none of them accounts for: somebody else on the machine."""
    return {k: round(v, 1) for k, v in used.items()}


def figures(timings: dict[str, list[float]]) -> dict[str, Any]:
    return {name: summary_ms(values) for name, values in timings.items()}


async def queue_depth(url: str, queue: str) -> int:
    """How many messages wait in ``queue`` (nobody consumes the sweeper's commands here)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        return int(result.message_count or 0)
    finally:
        await connection.close()


def log_record(log: Path, action: str) -> dict[str, Any] | None:
    """The first JSON log record with this ``action`` that the process wrote, if any."""
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("action") == action:
            return record
    return None


async def sweeping(dsn: str, url: str) -> tuple[asyncio.subprocess.Process, Any]:
    """A sweeper process that has started sweeping, and its log."""
    env = {
        **os.environ,
        "INTERMISSION_DATABASE_URL": dsn,
        "INTERMISSION_AMQP_URL": url,
        # One sweep: the next one is an hour away.
        "INTERMISSION_SWEEP_INTERVAL_SECONDS": "3600",
        "INTERMISSION_LOG_LEVEL": "INFO",
    }
    log = tempfile.NamedTemporaryFile(prefix="bench-sweeper-", suffix=".log")  # noqa: SIM115 - closed by caller
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "intermission.ops.cli", "sweeper", cwd=ROOT, env=env, stdout=log, stderr=log
    )
    # Its first sweep begins right after it says it started (the import and connections come before). The
    # log is read here, before anything is timed, and once more after: never while claims are timed, when
    # reading it would cost the loop that times them.
    async with asyncio.timeout(60):
        while log_record(Path(log.name), "sweeper_started") is None:
            if proc.returncode is not None:
                raise RuntimeError(f"the sweeper exited {proc.returncode}")
            await asyncio.sleep(0.05)
    return proc, log


def logged_at(record: dict[str, Any]) -> float:
    """A log record's time (``asctime``, local time) as a Unix timestamp."""
    return datetime.strptime(record["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def begun_before(
    timings: dict[str, list[float]], began_at: dict[str, list[float]], cutoff: float
) -> dict[str, list[float]]:
    """Only the timings of what began before ``cutoff``."""
    return {k: [t for t, b in zip(v, began_at[k], strict=True) if b < cutoff] for k, v in timings.items()}


async def run(opts: Options) -> dict[str, Any]:
    soak_before = soak_processes()
    if soak_before:
        print("warning: a soak is running on this machine; these figures are for development only", flush=True)
    results: dict[str, Any] = {
        "benchmark": "scaling",
        "machine": machine(),
        "options": {
            "sizes": opts.sizes,
            "samples": opts.samples,
            "expired": opts.expired,
            "sweep_seconds": opts.sweep_seconds,
            "tenants": TENANTS,
            "quick": opts.quick,
            "command": "python -m bench.scaling " + shlex.join(sys.argv[1:]),
        },
        "sizes": {},
    }
    docs = paused_documents()
    continuation = Continuation.model_validate_json(docs["continuation"])
    rng = random.Random(7)  # the same sample every time  # noqa: S311 - not cryptography
    dsn = await fresh_database(opts.database_url, "scaling")
    admin = RabbitAdmin(opts.rabbitmqctl, url_user(opts.amqp_url))
    try:
        con = await asyncpg.connect(dsn)
        stores = await Stores.connect(dsn, min_size=1, max_size=2)
        try:
            loaded = 0
            taken: set[int] = set()

            def sample(count: int, upto: int) -> list[int]:
                chosen: list[int] = []
                while len(chosen) < count:
                    n = rng.randint(1, upto)
                    if n not in taken:
                        taken.add(n)
                        chosen.append(n)
                return chosen

            for size in opts.sizes:
                print(f"{size} paused runs: loading ...", flush=True)
                started = time.perf_counter()
                await load(con, docs, loaded + 1, size, expired=False)
                results["sizes"][str(size)] = {"load_s": round(time.perf_counter() - started, 1)}
                loaded = size
                # A few claims first, so that connections and plans are warm.
                await time_claims(stores, con, continuation, sample(20, loaded))
                before = CpuProbe([]).read()
                measured = figures(await time_claims(stores, con, continuation, sample(2 * opts.samples, loaded)))
                measured["cpu_ms"] = rounded(CpuProbe.used_ms(before, CpuProbe([]).read()))
                results["sizes"][str(size)].update(measured)
                print(
                    f"  claim p50 {measured['claim']['p50']:.2f} ms, p99 {measured['claim']['p99']:.2f} ms; "
                    f"resume p50 {measured['resume']['p50']:.2f} ms, p99 {measured['resume']['p99']:.2f} ms",
                    flush=True,
                )

            largest = opts.sizes[-1]
            print(f"{opts.expired} expired pauses beside {largest} live ones: loading ...", flush=True)
            await load(con, docs, 10**8 - opts.expired, 10**8 - 1, expired=True)
            # The baseline is timed exactly as the claims beside the sweeper are (as many runs to draw from,
            # for as long a window): a p99 over 1,000 claims in 2 s and one over 10,000 claims in 30 s are
            # not comparable, the longer window meets more of the machine's own rare stalls.
            claims_per_window = min(20 * opts.samples, largest // 4)
            before = CpuProbe([]).read()
            quiet = asyncio.create_task(asyncio.sleep(opts.sweep_seconds))
            try:
                baseline = figures(
                    await time_claims(stores, con, continuation, sample(claims_per_window, largest), until=quiet)
                )
            finally:
                quiet.cancel()
            baseline["cpu_ms"] = rounded(CpuProbe.used_ms(before, CpuProbe([]).read()))
            (vhost,) = await admin.add_vhosts(["sweep"])
            url = vhost_url(opts.amqp_url, vhost)
            await declare_topology(url)
            print("  claims while the sweeper works through them ...", flush=True)
            proc, log = await sweeping(dsn, url)
            probe = CpuProbe([proc.pid])
            before_cpu = probe.read()
            window = asyncio.create_task(asyncio.sleep(opts.sweep_seconds))
            began_at: dict[str, list[float]] = {"claim": [], "resume": []}
            try:
                started = time.perf_counter()
                # Claims go on until the window closes (or the sample runs out).
                during = await time_claims(
                    stores, con, continuation, sample(claims_per_window, largest), until=window, began_at=began_at
                )
                sweep_s = time.perf_counter() - started
                used = CpuProbe.used_ms(before_cpu, probe.read())
                published = await queue_depth(url, COMMAND_QUEUES[Command.EXPIRE])
                # Read before the sweeper is stopped: a stopped sweep logs its end too.
                swept = log_record(Path(log.name), "sweep")
            finally:
                window.cancel()
                await stop_process(proc)
                log.close()
            completed = swept is not None
            if swept is not None:
                # The sweep ended inside the window: what came after it was not beside a sweep.
                during = begun_before(during, began_at, logged_at(swept))
            results["sweeper"] = {
                "size": largest,
                "expired": opts.expired,
                "baseline": baseline,
                "during_sweep": {**figures(during), "cpu_ms": rounded(used)},
                "sweep_completed": completed,
                "sweep_published": published,
                "sweep_per_second": round(published / sweep_s, 1),
                "sweep_s": round(sweep_s, 2),
                "max_rate": os.environ.get("INTERMISSION_SWEEP_MAX_RATE", "the settings' default"),
            }
        finally:
            await stores.close()
            await con.close()
    finally:
        await drop_database(dsn)
        await admin.delete_all()
    results["targets"] = targets(results, opts)
    soak_after = soak_processes()
    results["contended"] = bool(soak_before or soak_after)
    results["soak_processes"] = sorted(set(soak_before + soak_after))
    return results


def targets(results: dict[str, Any], opts: Options) -> list[dict[str, Any]]:
    smallest = results["sizes"][str(opts.sizes[0])]["claim"]
    largest = results["sizes"][str(opts.sizes[-1])]["claim"]
    growth = largest["p99"] / smallest["p99"]
    sweeper = results["sweeper"]
    slowed_p50 = sweeper["during_sweep"]["claim"]["p50"] / sweeper["baseline"]["claim"]["p50"]
    slowed_p99 = sweeper["during_sweep"]["claim"]["p99"] / sweeper["baseline"]["claim"]["p99"]
    return [
        {
            "target": f"claim p99 at {opts.sizes[-1]} rows <= 1.2 x at {opts.sizes[0]}",
            "value": f"{growth:.2f} x ({largest['p99']:.2f} vs {smallest['p99']:.2f} ms)",
            "ratio": round(growth, 3),
            "met": growth <= TARGET_GROWTH,
        },
        {
            "target": "the sweeper at work slows claims by <= 20 % (p50 and p99)",
            "value": f"p50 {slowed_p50:.2f} x, p99 {slowed_p99:.2f} x",
            "ratio": round(max(slowed_p50, slowed_p99), 3),
            "met": slowed_p50 <= TARGET_SWEEPER and slowed_p99 <= TARGET_SWEEPER,
        },
    ]


def table(results: dict[str, Any]) -> str:
    rows = [("", "claim p50", "claim p99", "resume p50", "resume p99", "claims")]
    for size, m in results["sizes"].items():
        rows.append(
            (
                f"{int(size):,} paused runs",
                f"{m['claim']['p50']:.2f}",
                f"{m['claim']['p99']:.2f}",
                f"{m['resume']['p50']:.2f}",
                f"{m['resume']['p99']:.2f}",
                str(m["claim"]["count"]),
            )
        )
    sweeper = results["sweeper"]
    for label, m in (("+ expired, no sweeper", sweeper["baseline"]), ("+ expired, sweeper", sweeper["during_sweep"])):
        rows.append(
            (
                label,
                f"{m['claim']['p50']:.2f}",
                f"{m['claim']['p99']:.2f}",
                f"{m['resume']['p50']:.2f}",
                f"{m['resume']['p99']:.2f}",
                str(m["claim"]["count"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(
        f"Latencies in ms. While the claims were timed ({sweeper['sweep_s']} s) the sweeper published "
        f"{sweeper['sweep_published']} run.expire commands ({sweeper['sweep_per_second']}/s"
        f"{', the whole backlog' if sweeper['sweep_completed'] else ', part of the backlog'})."
    )
    for t in results["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['value']}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling",
        description="Claim latency as the tables grow, and with the expiry sweeper at work (see the docstring).",
    )
    parser.add_argument("--sizes", default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--expired", type=int, default=None)
    parser.add_argument("--sweep-seconds", type=float, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--database-url", default=os.environ.get("INTERMISSION_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    parser.add_argument("--amqp-url", default=os.environ.get("INTERMISSION_BENCH_AMQP_URL", DEFAULT_AMQP_URL))
    parser.add_argument("--rabbitmqctl", default="rabbitmqctl")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    default_sizes = "1000,3000" if args.quick else "10000,100000,1000000"
    sizes = sorted(int(s) for s in (args.sizes or default_sizes).split(",") if s.strip())
    samples = args.samples if args.samples is not None else (100 if args.quick else 1000)
    expired = args.expired if args.expired is not None else (2000 if args.quick else 100_000)
    if len(sizes) < 2:
        parser.error("--sizes needs at least two sizes")
    if sizes[-1] < 10 * samples:
        parser.error("the largest size must hold at least 10 times --samples runs")
    return Options(
        sizes=sizes,
        samples=samples,
        expired=expired,
        sweep_seconds=args.sweep_seconds if args.sweep_seconds is not None else (3.0 if args.quick else 30.0),
        database_url=args.database_url,
        amqp_url=args.amqp_url,
        rabbitmqctl=shlex.split(args.rabbitmqctl),
        quick=args.quick,
        out=args.out,
    )


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    results = asyncio.run(run(opts))
    print()
    print(f"Scaling benchmark, {results['machine']['date']}, {results['machine']['nproc']} cores")
    print(table(results))
    if results["contended"]:
        print("warning: a soak ran during this benchmark; its figures are not for the record")
    path = write_results("scaling", results, opts.out)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
