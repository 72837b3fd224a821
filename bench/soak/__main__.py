"""Fault-injection soak of Intermission against the real PostgreSQL and RabbitMQ, with an invariant checker.

Usage::

    python -m bench.soak --profile short|long --seed N [--minutes M] [--runs R] [--json PATH] [--keep]

Options:

``--profile short|long``
    ``short`` (CI; about 3 minutes on two cores: 130 s of load, 330 runs, a drain) or ``long`` (30 minutes
    of load by default). Default: short.
``--seed N``
    Seeds every random choice (run scripts and fates, fault decks, who answers how). Printed at the start
    and in the report, so a failure can be replayed (timing still varies). Default: a random seed.
``--minutes M``
    Length of the load phase in minutes; the number of runs scales with it at the profile's rate.
``--runs R``
    Total number of runs to start over the load phase (overrides the scaled number).
``--json PATH``
    Also write the report as JSON to PATH.
``--keep``
    Keep the soak's database, vhost, users and worker logs afterwards (for debugging).
``--restore``
    Only undo server outages left in progress by a harness that was killed (see ``bench/soak/servers.py``).

What happens: a fresh database and a fresh RabbitMQ vhost with real users are created (trusted identities
for the workers, the sweepers and the bus; a host per scope, two approvers and "mallory", each confined by
the broker to its scopes as ``intermission grant`` confines a host); three workers and two sweepers run as
subprocesses (``python -m intermission.ops.cli worker|sweeper``, with 2 s leases renewed every 0.5 s, a
0.3 s reclaim sweep and a 1 s expiry sweep); a host in each of three scopes starts runs with random demo
scripts and answers their notices, two approvers decide approvals and a bus answers agent asks, while
faults are injected at random:
SIGKILL, SIGTERM and crash points of workers, RabbitMQ ``stop_app``/``start_app``, PostgreSQL backend
terminations and a short PostgreSQL stop/start, and duplicate, reordered, malformed, oversized, foreign,
forged and unauthorised commands (mallory's for other tenants among them, refused by the broker or by the
workers), and a flooding tenant's bursts of starts over its quota, each with another tenant's run timed
behind it. Then the faults stop, the harness drains (every run ended or paused on
purpose, the outbox sent) and the invariant checker (``bench/soak/checker.py``) reads the database, the
``demo_charges`` ledger, every event captured from ``intermission.events`` and every dead-lettered copy.

The report gives runs, pauses, resumes (and per second), faults injected by kind, invariants checked,
violations, the time from each fault to the next completed run, and the floods with the probes' waits
behind them. The exit status is 0 when no invariant
was violated, 1 when one was, 2 when the soak could not run, 130 when interrupted.

Servers (see ``bench/soak/env.py``): ``INTERMISSION_SOAK_DATABASE_URL`` (server DSN, default the local
``postgres`` user), ``INTERMISSION_SOAK_AMQP_URL`` (administrator URL, default guest on localhost),
``INTERMISSION_SOAK_RABBITMQCTL`` (default ``rabbitmqctl``) - each falling back to the test suite's
``INTERMISSION_TEST_*`` variable - and ``INTERMISSION_SOAK_PG_CLUSTER`` (e.g. ``"15 main"``; found with
``pg_lsclusters`` when unset; without one, PostgreSQL restarts are skipped and reported). Every outage is
undone even if the harness dies; ``INTERMISSION_SOAK_STATE_DIR`` holds the markers for that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import sys
import time
from pathlib import Path

from bench.soak.harness import Options, soak
from bench.soak.profile import PROFILES, resolve
from bench.soak.servers import restore_after_crash


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--minutes", type=float, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, dest="json_path")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--restore", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


def say(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", flush=True)


async def run(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    profile = resolve(args.profile, minutes=args.minutes, runs=args.runs)
    say(f"seed {seed} (replay with --profile {args.profile} --seed {seed})")
    try:
        report = await soak(Options(profile=profile, seed=seed, keep=args.keep), say)
    except asyncio.CancelledError:
        say(f"interrupted (seed {seed}); servers restored, environment removed")
        return 130
    print(report.text(), flush=True)
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    return 1 if report.violations else 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        # aio-pika narrates every reconnection attempt; the harness reports outages itself.
        for name in ("aio_pika", "aiormq"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.restore:
        undone = restore_after_crash()
        print(f"undone: {undone}" if undone else "nothing to undo")
        return 0
    try:
        return asyncio.run(run(args))
    except (OSError, RuntimeError) as exc:
        print(f"soak could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
