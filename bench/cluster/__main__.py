"""``python -m bench.cluster``: the soak on a RabbitMQ cluster and a replicated PostgreSQL, booted on this
machine beside its own servers (which it never touches), with nodes lost under load.

    python -m bench.cluster --profile short|long [--minutes M] [--runs R] [--seed N] [--json PATH]
                            [--scaling] [--scaling-runs N]
    python -m bench.cluster --boot-only [--seconds S]
    python -m bench.cluster --cleanup

What happens (``--profile``):

1. The servers (``bench/cluster/servers.py``): three RabbitMQ nodes joined in one cluster on ports
   5701-5703, a PostgreSQL primary on 5801 with a synchronous streaming standby on 5802, all under one
   temporary directory.
2. The soak (``bench/soak``) runs on them: a fresh database and vhost with real, confined users, 4 workers
   and 2 sweepers given the URL lists, a host per scope, two approvers, a bus and mallory, the soak's
   command faults and worker faults, and the cluster's (``bench/cluster/faults.py``): SIGKILL of the
   RabbitMQ node leading the command queues and its return, SIGKILL of the PostgreSQL primary's process
   group with the standby promoted and a new standby rebuilt, stalled workers (SIGSTOP/SIGCONT), backend
   terminations and, in the long profile, a worker cut off from its node by a network namespace.
3. The drain, the soak's invariant checker, and the cluster's own checks (``bench/cluster/site.py``): no
   call charged twice in the charge journal kept outside the database, every fault proven real, every
   quorum queue healthy.
4. ``--scaling``: resumes per second with 1, 2 and 4 workers on the cluster (``bench/cluster/scaling.py``).
5. Everything it started is removed, also when it is interrupted (SIGINT/SIGTERM); after a SIGKILL,
   ``--cleanup`` removes what was left (it runs by itself at the start of every run too).

Profiles: ``short`` (CI: 120 s of load, both heavy faults in the first deck, about three minutes in all)
and ``long`` (20 minutes of load by default; ``--minutes`` changes it). ``--seed`` replays the same
choices. ``--heavy-per-deck N`` puts N heavy faults (node kill, failover, partition, in turn) in every deck
of faults instead of the profile's number: a short run that must see every kind sets it to their number.
Exit status 0 when no invariant was violated, 1 when one was, 2 when it could not run, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg

from bench.cluster.profile import PROFILES, resolve
from bench.cluster.scaling import scaling
from bench.cluster.servers import Servers, cleanup
from bench.cluster.site import AFTERMATH_SECONDS, ClusterSite
from bench.soak.harness import Options, soak


def say(text: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {text}", flush=True)


async def boot_only(folder: Path, seconds: float) -> int:
    servers = Servers(folder)
    try:
        await servers.start()
        print(f"INTERMISSION_AMQP_URL={servers.amqp_url}")
        print(f"INTERMISSION_DATABASE_URL={servers.database_url}")
        print((await servers.cluster_status()).strip())
        con = await asyncpg.connect(servers.primary.dsn)
        try:
            rows = await con.fetch("SELECT application_name, state, sync_state FROM pg_stat_replication")
            print("replication:", [tuple(r.values()) for r in rows])
        finally:
            await con.close()
        await asyncio.sleep(seconds)
        return 0
    finally:
        for problem in await cleanup(folder):
            print(f"not cleaned up: {problem}", file=sys.stderr)


def cluster_text(figures: dict[str, Any]) -> str:
    lines = ["== the cluster =="]
    lines.append(
        f"failovers: {figures['failovers']}; charges journalled outside the database: {figures['journal_entries']}"
    )
    logs = figures["worker_log_counts"]
    lines.append(
        "workers said: "
        f"{logs.get('redelivered', 0)} commands delivered again (never acknowledged before); "
        f"{logs.get('duplicate', 0)} duplicates acknowledged without a second effect (those and the harness's "
        f"re-sends); {logs.get('amqp_moved', 0)} connections moved to another RabbitMQ node; "
        f"{logs.get('pg_connected', 0)} pools connected to a PostgreSQL server (at start and after failovers)"
    )
    lines.append(f"within {AFTERMATH_SECONDS:.0f} s of each fault, by kind (faults may overlap):")
    for kind, a in figures["aftermath"].items():
        lines.append(
            f"  {kind:<24} {a['faults']:>3} faults: {a['runs_reclaimed']} runs reclaimed by another worker, "
            f"{a['commands_redelivered']} commands delivered again, {a['events_heard_twice']} events heard twice"
        )
    lines.append("time from a fault to the next completed run, by kind:")
    for kind, r in figures["recovery_by_kind"].items():
        lines.append(f"  {kind:<24} {r['faults']:>3} faults, median {r['median_s']} s, max {r['max_s']} s")
    lines.append("fault proofs:")
    for proof in figures["fault_proofs"]:
        facts = ", ".join(f"{k} {v}" for k, v in proof.items() if k not in ("kind", "problems"))
        problems = f" PROBLEMS: {proof['problems']}" if proof["problems"] else ""
        lines.append(f"  {proof['kind']}: {facts}{problems}")
    return "\n".join(lines)


def scaling_text(figures: dict[str, Any]) -> str:
    lines = [f"== resumes per second on the cluster ({figures['runs']} runs each; every node on this machine) =="]
    one = figures["workers"].get("1", {}).get("resumes_per_second")
    for n, m in figures["workers"].items():
        ratio = f" ({m['resumes_per_second'] / one:.2f}x one worker)" if one else ""
        cpu = m["cpu_ms_per_resume"]
        lines.append(
            f"  {n} worker(s): {m['resumes_per_second']} resumes/s{ratio}; latency p50 {m['latency_ms']['p50']} ms, "
            f"p99 {m['latency_ms']['p99']} ms; CPU ms per resume {cpu}"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    for problem in await cleanup():
        say(f"left over by an earlier harness and not removed: {problem}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    profile = resolve(args.profile, minutes=args.minutes, runs=args.runs)
    say(f"seed {seed} (replay with --profile {args.profile} --seed {seed})")
    folder = Path(tempfile.mkdtemp(prefix="intermission-cluster-"))
    servers = Servers(folder)
    try:
        began = time.monotonic()
        await servers.start()
        say(f"cluster up in {time.monotonic() - began:.1f} s: {servers.amqp_url} and {servers.database_url}")
        site = ClusterSite(
            servers,
            partitions=profile.partitions,
            node_down=profile.node_down,
            stall_seconds=profile.stall_seconds,
            partition_hold=profile.partition_hold,
            heavy_per_deck=args.heavy_per_deck or profile.heavy_per_deck,
        )
        report = await soak(Options(profile=profile.soak, seed=seed, site=site), say)
        print(report.text(), flush=True)
        print(cluster_text(report.extra["cluster"]), flush=True)
        result = report.as_dict()
        if args.scaling:
            say("scaling: 1, 2 and 4 workers")
            result["scaling"] = await scaling(servers, site.endpoints.ctl, runs=args.scaling_runs)
            print(scaling_text(result["scaling"]), flush=True)
        if args.json_path is not None:
            args.json_path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
        return 1 if report.violations else 0
    except asyncio.CancelledError:
        say(f"interrupted (seed {seed}); removing the cluster")
        return 130
    finally:
        for problem in await cleanup(folder):
            say(f"not cleaned up: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None)
    parser.add_argument("--minutes", type=float, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, dest="json_path")
    parser.add_argument("--heavy-per-deck", type=int, default=None)
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--scaling-runs", type=int, default=500)
    parser.add_argument("--boot-only", action="store_true")
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--cleanup", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        # aio-pika narrates every reconnection attempt; the harness reports node losses itself.
        for name in ("aio_pika", "aiormq", "intermission"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.cleanup:
        problems = asyncio.run(cleanup())
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if args.boot_only:
        return asyncio.run(boot_only(Path(tempfile.mkdtemp(prefix="intermission-cluster-")), args.seconds))
    if args.profile is None:
        parser.error("give --profile short|long, --boot-only or --cleanup")
    try:
        return asyncio.run(run(args))
    except (OSError, RuntimeError) as exc:
        print(f"the cluster harness could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
