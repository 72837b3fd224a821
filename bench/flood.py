"""One tenant floods starts; how long does another tenant's run wait? (docs/decisions.md, "Fairness
between tenants").

A worker (in this process, on a database and a vhost of the benchmark's own) serves two tenants. The
flooding tenant has a quota of live runs (``--quota``); it publishes ``--flood`` starts of runs that pause
for a tool result, all at once. Right behind them, the other tenant starts one run that pauses the same
way and answers it. Printed: how long the other tenant's run took from its start to its completion, how
long the flood took to drain (every start applied or refused), and how the flood's starts ended. Without
the quota (``--quota 0``) every start of the flood becomes a paused run, which shows what the quota buys.

    python -m bench.flood                      # 5,000 starts, quota 100
    python -m bench.flood --flood 500 --quota 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

from bench.infra import RabbitAdmin, drop_database, fresh_database, url_user, vhost_url
from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from intermission.store.quotas import set_quota

FLOODING = Scope(app="bench", tenant="flood")
OTHER = Scope(app="bench", tenant="other")
LOOKUP = [ScriptTurn.model_validate({"call": [{"tool": "lookup", "arguments": {"query": "q"}}]})]
DONE = [*LOOKUP, ScriptTurn.model_validate({"say": "done"})]


def started(scope: Scope, script: list[ScriptTurn]) -> StartCommand:
    return StartCommand(scope=scope, run_id=f"run-{uuid.uuid4().hex[:12]}", agent_id="demo", script=script)


async def measure(dsn: str, url: str, flood: int, quota: int) -> dict[str, Any]:
    settings = Settings(database_url=dsn, amqp_url=url, pause_ttl_seconds=0)
    stores = await Stores.connect(dsn, relayed=True)
    try:
        return await flooded(settings, stores, url, flood, quota)
    finally:
        await stores.close()


async def flooded(settings: Settings, stores: Stores, url: str, flood: int, quota: int) -> dict[str, Any]:
    async with (
        running_worker(settings, stores=stores),
        await HostClient.connect(url, name="bench flood host") as host,
        host.subscribe(FLOODING) as flood_events,
        host.subscribe(OTHER) as other_events,
    ):
        await set_quota(stores.db, FLOODING, live_runs=quota, starts_per_second=None)
        outcomes = {"paused": 0, "refused": 0}
        drained = asyncio.Event()

        async def count_flood() -> None:
            async for received in flood_events:
                event = received.event
                if isinstance(event, Notice):
                    outcomes["paused"] += 1
                elif isinstance(event, CommandRejected):
                    outcomes["refused"] += 1
                if outcomes["paused"] + outcomes["refused"] >= flood:
                    drained.set()
                    return

        counting = asyncio.create_task(count_flood())
        began = time.perf_counter()
        await asyncio.gather(*(host.start(started(FLOODING, LOOKUP)) for _ in range(flood)))
        published = time.perf_counter()
        mine = started(OTHER, DONE)
        await host.start(mine)
        other_paused = other_done = 0.0
        async for received in other_events:
            event = received.event
            if isinstance(event, Notice) and event.run_id == mine.run_id:
                other_paused = time.perf_counter()
                answer = ToolAnswer(call_id=event.pending[0].id, content="42")
                await host.resume(ResumeCommand(scope=OTHER, version=version_of(event), results=[answer]))
            elif isinstance(event, RunEvent) and event.run_id == mine.run_id and event.kind is RunEventKind.COMPLETED:
                other_done = time.perf_counter()
                break
        await asyncio.wait_for(drained.wait(), 600)
        flood_drained = time.perf_counter()
        counting.cancel()
    return {
        "flood": flood,
        "quota": quota,
        "flood_published_s": round(published - began, 2),
        "other_start_to_pause_s": round(other_paused - published, 2),
        "other_start_to_completed_s": round(other_done - published, 2),
        "flood_drained_s": round(flood_drained - began, 2),
        "flood_outcomes": outcomes,
    }


async def run(flood: int, quota: int) -> dict[str, Any]:
    server = os.environ.get("INTERMISSION_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    base = os.environ.get("INTERMISSION_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    rabbit = RabbitAdmin(["rabbitmqctl"], url_user(base))
    dsn = await fresh_database(server, "flood")
    try:
        [vhost] = await rabbit.add_vhosts(["flood"])
        return await measure(dsn, vhost_url(base, vhost), flood, quota)
    finally:
        await rabbit.delete_all()
        await drop_database(dsn)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=5000, help="starts the flooding tenant publishes")
    parser.add_argument("--quota", type=int, default=100, help="its quota of live runs (0: none)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    opts = parser.parse_args(argv)
    figures = asyncio.run(run(opts.flood, opts.quota))
    if opts.json:
        print(json.dumps(figures, indent=2))
        return
    print(
        f"{figures['flood']} starts flooded by one tenant (quota of live runs: {figures['quota'] or 'none'}), "
        f"published in {figures['flood_published_s']} s"
    )
    print(
        f"the other tenant's run: paused {figures['other_start_to_pause_s']} s and completed "
        f"{figures['other_start_to_completed_s']} s after its start"
    )
    outcomes = figures["flood_outcomes"]
    print(
        f"the flood drained in {figures['flood_drained_s']} s: {outcomes['paused']} runs paused, "
        f"{outcomes['refused']} starts refused quota_exceeded"
    )


if __name__ == "__main__":
    main()
