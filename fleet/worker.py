"""``intermission worker``: consumers, the outbox relay and the fleet (with its reclaim sweep) in one
process; and ``intermission sweeper``.

Start order: pool, broker connection, topology, fleet, relay, consumers. Stop order on SIGTERM/SIGINT is
the reverse of the work's flow: stop consuming and let in-flight command transactions finish; let runs stop
at their next boundary within the grace period (their leases are released for another worker); let the
relay publish what those last transactions wrote; then close channel, connection and pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aio_pika.abc import AbstractRobustConnection

from intermission.agent.executor import Executor
from intermission.agent.plugins import load_executor
from intermission.consumers.handlers import CommandHandlers
from intermission.consumers.policy import AckPolicy, CommandLimits
from intermission.consumers.rejection import Rejecter
from intermission.consumers.service import CommandConsumers
from intermission.engine.core import Engine
from intermission.engine.observer import CrashPoints, Observer, Observers, Spans
from intermission.engine.starts import Quota, RunDefaults
from intermission.fleet import health
from intermission.fleet.identity import incarnation, session_name
from intermission.fleet.metrics import SweeperMetrics, WorkerMetrics
from intermission.fleet.pruning import PRUNER_TASK, PruneLoop
from intermission.fleet.runtime import RECLAIM_TASK, Fleet
from intermission.fleet.settings import Settings
from intermission.fleet.signals import stop_on_signals
from intermission.fleet.supervisor import SupervisedTaskFailed, Supervisor
from intermission.publishers.amqp import connect
from intermission.publishers.relay import OutboxRelay
from intermission.publishers.sweeper import ExpirySweeper
from intermission.store import Stores
from intermission.wire import Topology, declare

log = logging.getLogger("intermission.worker")

RELAY_TASK = "outbox-relay"
SWEEPER_TASK = "expiry-sweeper"
# The supervised loops a process is not ready without (the lease keeper runs only while runs are held).
WORKER_TASKS = (RELAY_TASK, RECLAIM_TASK)
SWEEPER_TASKS = (SWEEPER_TASK, PRUNER_TASK)


def broker_connected(connection: AbstractRobustConnection) -> bool:
    """Whether the robust connection is up now: ``is_closed`` turns true only once it is closed for good,
    while ``connected`` is cleared the moment a link is lost and set again when a reconnect succeeds."""
    return connection.connected.is_set() and not connection.is_closed


@dataclass
class Worker:
    """A running worker's parts, for tests and tools that drive one in-process."""

    settings: Settings
    stores: Stores
    connection: AbstractRobustConnection
    topology: Topology
    fleet: Fleet
    consumers: CommandConsumers
    relay: OutboxRelay
    supervisor: Supervisor

    async def drain(self) -> None:
        """Return when nothing is left to do here: no run in flight, nothing to reclaim, the outbox sent (but
        for rows the broker refused: those wait for their next attempt, or are quarantined)."""
        while True:
            await self.fleet.drain()
            await self.relay.handed_settled()
            await self.relay.run_once()
            if self.fleet.running == 0 and self.consumers.in_flight == 0:
                return


def run_defaults(settings: Settings) -> RunDefaults:
    """What a start takes from the settings when its command leaves it out, and the most it may ask for."""
    return RunDefaults(
        pause_ttl_seconds=settings.pause_ttl_seconds,
        max_steps=settings.max_steps,
        max_tool_calls=settings.max_tool_calls,
        max_steps_limit=settings.max_steps_limit,
        max_tool_calls_limit=settings.max_tool_calls_limit,
        max_total_tokens_limit=settings.max_total_tokens_limit,
        max_tokens_limit=settings.max_tokens_limit,
        quota=Quota(settings.quota_live_runs, settings.quota_starts_per_second),
    )


def worker_engine(stores: Stores, settings: Settings, observer: Observer) -> Engine:
    """The engine a worker applies everything through: its defaults, its group commit's bounds, its
    observer. (The fleet gives it the worker's lease.)"""
    return Engine.over(
        stores,
        defaults=run_defaults(settings),
        observer=observer,
        max_size=settings.command_batch_size,
        max_in_flight=settings.command_batches_in_flight,
        max_statements=settings.commands_in_flight,
    )


@asynccontextmanager
async def running_worker(
    settings: Settings, *, executor: Executor | None = None, stores: Stores | None = None
) -> AsyncIterator[Worker]:
    """A worker with everything started; stopped gracefully on leaving."""
    own_stores = stores is None
    owner = incarnation()
    if stores is None:
        # relayed: this process's commits wake its own relay in-process and notify nobody (store/db.py).
        stores = await Stores.connect(
            settings.database_url,
            max_size=settings.pool_max_size,
            relayed=True,
            connect_timeout=settings.database_connect_timeout_seconds,
            application_name=session_name("worker", owner),
            # Its statements probe keys: plan them once (store/db.py, Database.connect).
            generic_plans=True,
        )
    metrics = WorkerMetrics()
    supervisor = Supervisor(on_restart=lambda task: metrics.task_restarts.labels(task).inc())
    # What watches the engine: the worker's metrics, the spans of shared commits, the crash points.
    observer = Observers(metrics, Spans(), CrashPoints())
    fleet = Fleet(
        stores,
        settings,
        executor or load_executor(settings.executor),
        engine=worker_engine(stores, settings, observer),
        owner=owner,
        metrics=metrics,
        supervisor=supervisor,
    )
    connection = await connect(
        settings.amqp_url,
        f"intermission-worker {fleet.owner}",
        reconnect_interval=settings.amqp_reconnect_seconds,
        offset=settings.amqp_first_node,
        connect_timeout=settings.amqp_connect_timeout_seconds,
    )
    # Closed however the start-up or the work ends, so that the port is released with the worker.
    server: health.HealthServer | None = None
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=settings.prefetch)
        topology = await declare(
            channel, delivery_limit=settings.delivery_limit, dead_max_length=settings.dead_max_length
        )
        relay = OutboxRelay(
            stores.db,
            connection,
            listen_dsn=settings.database_url,
            batch_size=settings.relay_batch,
            poll_seconds=settings.relay_poll_seconds,
            publish_timeout=settings.publish_timeout_seconds,
            max_attempts=settings.outbox_max_attempts,
            hand_over_seconds=settings.outbox_hold_seconds,
        )
        metrics.watch_relay(relay)
        # Every event the engine commits goes to the relay at once: published from memory, its row waiting
        # outbox_hold_seconds for the relays, which publish it only if that failed (0: not handed over, the
        # relay only wakes). LISTEN (above) still brings the rows other processes write (the CLI).
        stop_handing = fleet.engine.hand_events_to(relay)
        policy = AckPolicy(
            CommandHandlers(fleet.engine, bus_user=settings.bus_user),
            Rejecter(topology.events, topology.dead, timeout=settings.publish_timeout_seconds),
            fleet,
            retry_seconds=settings.command_retry_seconds,
            limits=CommandLimits(max_command_bytes=settings.max_command_bytes),
            observer=observer,
        )
        consumers = CommandConsumers(policy, topology.queues, places=fleet.admission)
        relay_stop = asyncio.Event()
        readiness = health.Readiness(
            [health.DATABASE, health.RABBITMQ, health.CONSUMERS, *(health.TASK_PREFIX + t for t in WORKER_TASKS)],
            stale_after=3 * settings.health_probe_seconds,
        )
        server = health.serve(settings.metrics_port, settings.metrics_host, metrics.registry, readiness)
        await fleet.start()
        supervisor.start(RELAY_TASK, lambda: relay.serve(relay_stop))
        await consumers.start()
        worker = Worker(settings, stores, connection, topology, fleet, consumers, relay, supervisor)

        def worker_checks() -> dict[str, bool]:
            return {
                health.RABBITMQ: broker_connected(connection),
                health.CONSUMERS: consumers.consuming,
                **health.task_checks(supervisor.states(), WORKER_TASKS),
            }

        probe = health.HealthProbe(
            readiness,
            stores.db,
            worker_checks,
            interval=settings.health_probe_seconds,
            application_name=session_name("worker-health", owner),
            # Commands waiting on a probe of their own (consumers/policy.py) say the database is away too.
            database_ok=lambda: policy.availability.is_clear,
        )
        if server is not None:
            probe.start()
        log.info("worker started", extra={"action": "worker_started", "owner": fleet.owner})
        try:
            yield worker
        finally:
            log.info("worker stopping", extra={"action": "worker_stopping", "running": fleet.running})
            await probe.close()
            await consumers.stop(settings.shutdown_grace_seconds)
            await fleet.stop()
            relay_stop.set()
            await supervisor.stop(settings.shutdown_grace_seconds)
            stop_handing()
            await relay.close()
            with contextlib.suppress(Exception):
                await channel.close()
    finally:
        if server is not None:
            await asyncio.to_thread(server.close)
        with contextlib.suppress(Exception):
            await connection.close()
        if own_stores:
            await stores.close()
        log.info("worker stopped", extra={"action": "worker_stopped"})


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT (or ``stop``), or until one of its background tasks keeps failing:
    then it stops gracefully all the same and raises ``SupervisedTaskFailed`` (the CLI exits 1)."""
    stop = stop or asyncio.Event()
    with stop_on_signals(stop):
        async with running_worker(settings) as worker:
            settle_garbage_collector()
            failure = await until_stopped(stop, worker.supervisor)
    if failure is not None:
        raise failure


async def until_stopped(stop: asyncio.Event, supervisor: Supervisor) -> SupervisedTaskFailed | None:
    """Wait for ``stop`` or for the supervisor to give up; the latter's reason, if it did."""
    stopped = asyncio.create_task(stop.wait())
    gave_up = asyncio.create_task(supervisor.wait_given_up())
    try:
        await asyncio.wait({stopped, gave_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        gave_up.cancel()
    return supervisor.failure


# Allocations between two young-generation collections (CPython's default is 700).
YOUNG_COLLECTION_THRESHOLD = 20_000


def settle_garbage_collector() -> None:
    """Once the worker is up: move everything alive now (modules, pools, connections, the topology) out of
    the collector's sight, and collect the young generation less often.

    A command allocates a few thousand short-lived objects (frames, pydantic models, AMQP frames, records)
    that reference counting frees at once; with the default threshold the cyclic collector runs every few
    commands and walks what start-up left behind each time (about 4 % of a loaded worker's CPU, measured
    with perf during bench/resume.py). Cycles are still collected, only in larger batches.
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)


async def sweep(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run the expiry sweeper and the retention pruner until SIGTERM/SIGINT: any number of sweepers may run
    at once."""
    stop = stop or asyncio.Event()
    owner = incarnation("sweeper")
    stores = await Stores.connect(
        settings.database_url,
        max_size=2,
        connect_timeout=settings.database_connect_timeout_seconds,
        application_name=session_name("sweeper", owner),
    )
    connection = await connect(
        settings.amqp_url,
        "intermission-sweeper",
        reconnect_interval=settings.amqp_reconnect_seconds,
        offset=settings.amqp_first_node,
        connect_timeout=settings.amqp_connect_timeout_seconds,
    )
    try:
        channel = await connection.channel()
        await declare(channel, delivery_limit=settings.delivery_limit, dead_max_length=settings.dead_max_length)
        await channel.close()
        sweeper = ExpirySweeper(
            stores.db,
            connection,
            interval_seconds=settings.sweep_interval_seconds,
            batch=settings.sweep_batch,
            max_rate=settings.sweep_max_rate,
        )
        metrics = SweeperMetrics()
        readiness = health.Readiness(
            [health.DATABASE, health.RABBITMQ, *(health.TASK_PREFIX + t for t in SWEEPER_TASKS)],
            stale_after=3 * settings.health_probe_seconds,
        )
        pruning = PruneLoop(stores.db, connection, settings, metrics)
        supervisor = Supervisor(on_restart=lambda task: metrics.task_restarts.labels(task).inc())

        def sweeper_checks() -> dict[str, bool]:
            return {
                health.RABBITMQ: broker_connected(connection),
                **health.task_checks(supervisor.states(), SWEEPER_TASKS),
            }

        probe = health.HealthProbe(
            readiness,
            stores.db,
            sweeper_checks,
            interval=settings.health_probe_seconds,
            application_name=session_name("sweeper-health", owner),
        )
        server = health.serve(settings.metrics_port, settings.metrics_host, metrics.registry, readiness)
        try:
            with stop_on_signals(stop):
                log.info("sweeper started", extra={"action": "sweeper_started"})
                supervisor.start(SWEEPER_TASK, lambda: sweeper.serve(stop))
                supervisor.start(PRUNER_TASK, lambda: pruning.serve(stop))
                if server is not None:
                    probe.start()
                failure = await until_stopped(stop, supervisor)
                await probe.close()
                stop.set()
                await supervisor.stop(settings.shutdown_grace_seconds)
            await sweeper.close()
        finally:
            await probe.close()
            if server is not None:
                await asyncio.to_thread(server.close)
        if failure is not None:
            raise failure
    finally:
        with contextlib.suppress(Exception):
            await connection.close()
        await stores.close()
        log.info("sweeper stopped", extra={"action": "sweeper_stopped"})
