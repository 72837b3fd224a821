"""The metrics operators look at first move during real runs, by the right amount, as Prometheus scrapes them:
a worker's command transactions (a histogram), its lease takeovers, reclaims and writes refused for a lost
lease; a sweeper's open pauses by reason and age, earliest deadline, sweeper lag, outbox lag and dead
letters."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import aio_pika
import pytest

from intermission.agent.executor import RunContext
from intermission.agent.loop import default_executor
from intermission.fleet import health
from intermission.fleet.metrics import WorkerMetrics
from intermission.fleet.runtime import Fleet
from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store import Stores
from intermission.wire import DEAD_EXCHANGE, dead_copy
from tests.support.amqp import DELIVERY_LIMIT, Broker, Vhost
from tests.support.factories import lease, paused_run, running_run, writes
from tests.support.fleet import fast_settings
from tests.support.inspect import Inspector
from tests.support.metrics import free_port, samples, scrape
from tests.support.waiting import eventually
from tests.support.worker_process import cli_process, worker_env

WAIT = 30.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scraped(port: int) -> Samples:
    try:
        return samples(await asyncio.to_thread(scrape, port))
    except OSError:  # not listening yet
        return {}


async def until(port: int, holds: Callable[[Samples], bool], what: str) -> Samples:
    """The scrape in which ``holds`` first holds (within WAIT)."""
    seen: Samples = {}

    async def check() -> bool:
        nonlocal seen
        seen = await scraped(port)
        return bool(seen) and holds(seen)

    await eventually(check, within=WAIT, what=what)
    return seen


def count(values: Samples, command: str) -> float:
    return values.get(("intermission_command_transaction_seconds_count", (("command", command),)), 0.0)


async def test_a_worker_times_each_command_transaction(
    stores: Stores, scope: Scope, database_url: str, amqp_url: str, amqp_vhost: Vhost, rabbit: Broker
) -> None:
    port = free_port()
    settings = fast_settings(
        database_url, amqp_url=amqp_url, bus_user=rabbit.bus.name, delivery_limit=DELIVERY_LIMIT, metrics_port=port
    )
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    script = [
        ScriptTurn.model_validate({"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}),
        ScriptTurn.model_validate({"say": "done"}),
    ]
    async with (
        running_worker(settings, executor=default_executor(), stores=stores),
        await HostClient.connect(amqp_vhost.url(rabbit.host)) as host,
        host.subscribe(scope, exclusive=True) as events,
    ):
        before = await until(port, lambda v: True, "the worker's metrics")
        assert count(before, "run.start") == 0
        await host.start(StartCommand(scope=scope, run_id=run_id, agent_id="demo", script=script))
        async for received in events:
            if isinstance(received.event, Notice) and received.event.run_id == run_id:
                notice = received.event
                break
        after_start = await until(port, lambda v: count(v, "run.start") == 1, "the start's transaction timed")
        # A histogram, not a name: its sum is a real duration.
        assert after_start[("intermission_command_transaction_seconds_sum", (("command", "run.start"),))] > 0
        answers = [ToolAnswer(call_id=c.id, content="found") for c in notice.pending]
        await host.resume(ResumeCommand(scope=scope, version=version_of(notice), results=answers))

        async def completed() -> bool:
            return (await stores.at(scope).runs.get_run(run_id)).state is RunState.COMPLETED

        await eventually(completed, within=WAIT, what="the run completed")
        # One resume's claim: timed once, alone or as a batch of one.
        after = await until(
            port, lambda v: count(v, "run.resume") + count(v, "batch") == 1, "the resume's transaction timed"
        )
        assert count(after, "run.start") == 1
        le = ("intermission_command_transaction_seconds_bucket", (("command", "run.start"), ("le", "+Inf")))
        assert after[le] == 1


class HeldUntilTold:
    """An executor that waits to be told, then saves its run's progress (and finds out whether it still
    holds the run)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def execute(self, ctx: RunContext) -> None:
        self.started.set()
        await self.go.wait()
        await ctx.save_progress(ctx.progress)
        await ctx.complete("done")


async def test_takeovers_reclaims_and_writes_refused_for_a_lost_lease_are_counted(
    stores: Stores, db: Inspector, scope: Scope, database_url: str
) -> None:
    # Leases long enough that the lease keeper never renews during the test: the save finds the loss.
    settings = fast_settings(database_url, lease_seconds=60.0, lease_renew_seconds=30.0)
    metrics = WorkerMetrics()
    executor = HeldUntilTold()
    fleet = Fleet(stores, settings, executor, metrics=metrics)
    port = free_port()
    server = health.serve(port, "127.0.0.1", metrics.registry, health.Readiness([], stale_after=60))
    assert server is not None
    try:
        run, _ = await running_run(stores, scope, holder=lease("a-worker-that-died", ttl=0.2))
        await db.wait_lease_lapsed(run.id)
        before = await scraped(port)
        assert before[("intermission_lease_takeovers_total", ())] == 0
        assert await fleet.reclaim_once() == 1
        await asyncio.wait_for(executor.started.wait(), WAIT)
        taken = await scraped(port)
        assert taken[("intermission_lease_takeovers_total", ())] == 1
        assert taken[("intermission_runs_reclaimed_total", ())] == 1
        assert taken[("intermission_lease_lost_writes_total", ())] == 0

        # Another worker takes the run over from under this one (its lease lapsed: made so on purpose).
        await db.con.execute("UPDATE runs SET lease_expires_at = now() WHERE id = $1", run.id)
        await writes(stores, scope).runs.claim_continuation_leased(run.id, lease("the-next-worker"))
        executor.go.set()
        await asyncio.wait_for(fleet.wait_idle(), WAIT)
        lost = await scraped(port)
        assert lost[("intermission_lease_lost_writes_total", ())] == 1
        assert lost[("intermission_runs_left_total", (("how", "lease_lost"),))] == 1
        assert lost[("intermission_lease_takeovers_total", ())] == 1
        assert (await db.run(run.id))["lease_owner"] == "the-next-worker"
    finally:
        await fleet.stop(1.0)
        await asyncio.to_thread(server.close)


def gauge(values: Samples, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


async def dead_letter(url: str) -> None:
    """One refused command's dead copy in intermission.dead, as a worker leaves it."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(DEAD_EXCHANGE)
        copy = dead_copy(
            b"{}",
            {},
            message_id="refused-1",
            correlation_id=None,
            routing_key="run.resume.acme.t1",
            code="invalid_message",
            detail="a test's refusal",
        )
        await exchange.publish(copy, routing_key="")
    finally:
        await connection.close()


async def test_a_sweeper_reports_pauses_deadlines_sweeper_lag_outbox_lag_and_dead_letters(
    settings: Settings, stores: Stores, db: Inspector, scope: Scope, amqp_url: str
) -> None:
    answered = await paused_run(stores, scope, ttl_seconds=3600)
    await paused_run(stores, scope, ttl_seconds=0)
    expired = await paused_run(stores, scope, reason=SuspendReason.APPROVAL, ttl_seconds=0.001)
    await db.wait_pause_expired(expired.run.id)
    await dead_letter(amqp_url)
    port = free_port()
    env = worker_env(
        settings,
        INTERMISSION_METRICS_PORT=str(port),
        INTERMISSION_PRUNE_INTERVAL_SECONDS="0.3",
        INTERMISSION_SWEEP_INTERVAL_SECONDS="0.3",
    )
    proc = await cli_process("sweeper", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        # A whole report: the database's figures, then the dead-letter queue's (a scrape may fall between).
        first = await until(
            port,
            lambda v: (
                v.get(("intermission_outbox_pending_rows", ())) == 3 and v.get(("intermission_dead_letters", ())) == 1
            ),
            "the sweeper's first whole report",
        )
        open_pauses = "intermission_pauses_open"
        assert gauge(first, open_pauses, reason="external_tool", age="under_1m") == 2
        assert gauge(first, open_pauses, reason="approval", age="under_1m") == 1
        assert gauge(first, open_pauses, reason="agent_reply", age="under_1m") == 0
        assert gauge(first, open_pauses, reason="external_tool", age="over_7d") == 0
        # No worker consumes the expiry the sweeper published: the expired pause waits, and the lag says so.
        assert expired.suspension.expires_at is not None
        lag = gauge(first, "intermission_sweeper_lag_seconds")
        assert 0 < lag < WAIT + 5
        earliest = gauge(first, "intermission_pause_earliest_deadline_timestamp_seconds")
        assert earliest == pytest.approx(expired.suspension.expires_at.timestamp(), abs=1e-3)
        assert gauge(first, "intermission_outbox_oldest_pending_seconds") > 0
        assert gauge(first, "intermission_dead_letters") == 1

        # A worker comes: the relay publishes the three Notices, the expiry is claimed and the run ends.
        async with running_worker(settings, executor=default_executor(), stores=stores):
            after = await until(
                port,
                lambda v: (
                    v.get(("intermission_outbox_pending_rows", ())) == 0
                    and v.get(("intermission_pauses_open", (("age", "under_1m"), ("reason", "approval")))) == 0
                ),
                "the figures after a worker ran",
            )
        assert gauge(after, open_pauses, reason="external_tool", age="under_1m") == 2
        assert gauge(after, "intermission_sweeper_lag_seconds") == 0
        assert gauge(after, "intermission_outbox_oldest_pending_seconds") == 0
        assert answered.suspension.expires_at is not None
        assert gauge(after, "intermission_pause_earliest_deadline_timestamp_seconds") == pytest.approx(
            answered.suspension.expires_at.timestamp(), abs=1e-3
        )
        assert (await db.run(expired.run.id))["state"] != "paused"
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), WAIT)
