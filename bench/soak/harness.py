"""The soak, start to end: environment, fleet, load with faults, drain, check, report, clean-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.soak.actors import FOREIGN_APP, Actors, Sender, Simulator
from bench.soak.checker import Evidence, check
from bench.soak.env import SoakEnv
from bench.soak.injector import Injector
from bench.soak.ledger import Expect, Fate, Ledger, seeded
from bench.soak.observe import Observer
from bench.soak.procs import ProcessPool, worker_environment
from bench.soak.profile import Profile
from bench.soak.report import Report
from bench.soak.scripts import choose
from bench.soak.servers import restore_after_crash
from bench.soak.site import FaultPlan, LocalSite, Site, SoakRun
from intermission.publishers.amqp import connect, safe_url
from intermission.schemas.scope import Scope
from intermission.wire import COMMAND_QUEUES, declare

log = logging.getLogger("soak")

DELIVERY_LIMIT = 10
LEASE_SECONDS = 2.0
LEASE_RENEW_SECONDS = 0.5
RECLAIM_SECONDS = 0.3
SWEEP_SECONDS = 1.0
SHUTDOWN_GRACE = 3.0
READY_SECONDS = 90.0
PROGRESS_EVERY = 15.0
SCOPE_COUNT = 3

Say = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    profile: Profile
    seed: int
    keep: bool = False
    # Where it runs: the machine's own servers unless told otherwise (bench/soak/site.py).
    site: Site = field(default_factory=LocalSite)


async def _wait_consumers(url: str, wanted: int) -> None:
    """Until every command queue has ``wanted`` consumers (the workers are up)."""
    connection = await connect(url, "soak readiness")
    try:
        deadline = time.monotonic() + READY_SECONDS
        while True:
            channel = await connection.channel()
            counts: list[int] = []
            for name in COMMAND_QUEUES.values():
                queue = await channel.declare_queue(name, passive=True)
                result = queue.declaration_result
                counts.append(int(result.consumer_count or 0) if result is not None else 0)
            await channel.close()
            if min(counts) >= wanted:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not start consuming within {READY_SECONDS} s: {counts}")
            await asyncio.sleep(0.3)
    finally:
        await connection.close()


class Drain:
    """Polls the database until the soak settled: nothing running, every run ended or paused on purpose,
    the outbox sent and delivered, every refusal heard."""

    def __init__(self, database_url: str, ledger: Ledger, observer: Observer, sim: Simulator) -> None:
        self.database_url = database_url
        self.ledger = ledger
        self.observer = observer
        self.sim = sim
        self.outbox_ids: set[str] = set()
        self.watermark = 0
        self.heard_upto = 0
        self.why = "not polled yet"

    async def settled(self) -> bool:
        try:
            con = await asyncpg.connect(self.database_url, timeout=5)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            self.why = f"database unreachable: {exc}"
            return False
        try:
            # By run key: a run id is unique only within its scope.
            states = {
                (r["app"], r["tenant"], r["id"]): r["state"]
                for r in await con.fetch("SELECT app, tenant, id, state FROM runs")
            }
            unsent = await con.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            for row in await con.fetch(
                "SELECT id, message_id::text AS mid FROM outbox WHERE id > $1 ORDER BY id", self.watermark
            ):
                self.outbox_ids.add(row["mid"])
                self.watermark = row["id"]
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            self.why = f"database error: {exc}"
            return False
        finally:
            with contextlib.suppress(Exception):
                await con.close()
        started = [
            (c.scope.app, c.scope.tenant, c.run_id)
            for c in self.ledger.commands
            if c.purpose == "start" and c.confirmed and c.run_id and c.scope is not None
        ]
        missing = [r for r in started if r not in states]
        # A flood's start is settled once applied (its run exists) or refused (its refusal and its dead
        # copy heard).
        unresolved = [
            c
            for c in self.ledger.commands
            if c.purpose == "tenant_flood"
            and c.confirmed
            and c.scope is not None
            and (c.scope.app, c.scope.tenant, c.run_id) not in states
            and not (
                c.message_id is not None
                and self.observer.was_rejected(c.message_id)
                and c.message_id in self.observer.dead_ids
            )
        ]
        unsettled = [
            run_id
            for (app, tenant, run_id), state in states.items()
            if state not in ("completed", "failed", "cancelled")
            and not (state == "paused" and self._abandoned(app, tenant, run_id))
        ]
        undelivered = self.outbox_ids - self.observer.seen_ids
        unheard = self._unheard()
        unrefused = [
            c
            for c in self.ledger.commands
            if c.expect is Expect.REJECT
            and c.confirmed
            and c.message_id is not None
            and (not self.observer.was_rejected(c.message_id) or c.message_id not in self.observer.dead_ids)
        ]
        self.why = (
            f"{len(missing)} runs not created, {len(unresolved)} flood starts neither applied nor refused, "
            f"{len(unsettled)} runs not settled "
            f"(e.g. {unsettled[:3]}), {unsent} outbox rows unsent, {len(undelivered)} undelivered, "
            f"{len(unrefused)} refusals unheard, {unheard} notices not yet heard by the host or bus, "
            f"{self.sim.busy} harness tasks busy "
            f"{sorted(t.get_name() for t in self.sim.tasks)[:5]}"
        )
        return not (
            missing or unresolved or unsettled or unsent or undelivered or unrefused or unheard or self.sim.busy
        )

    def _abandoned(self, app: str, tenant: str, run_id: str) -> bool:
        """Whether the run is one the harness started and means to leave paused (a run of one of its ids at
        another scope is not its run)."""
        plan = self.ledger.runs.get(run_id)
        return plan is not None and (plan.scope.app, plan.scope.tenant) == (app, tenant) and plan.fate is Fate.ABANDON

    def _unheard(self) -> int:
        """Captured notices that the host's (and for agent asks the bus's) subscription has not delivered
        yet; the events before ``heard_upto`` were all heard."""
        events = self.observer.events
        while self.heard_upto < len(events):
            event = events[self.heard_upto]
            body = event.body
            if event.routing_key.startswith("notice.") and body is not None:
                plan = self.ledger.runs.get(str(body.get("run_id")))
                sid = body.get("suspension_id")
                if plan is not None and (
                    sid not in plan.heard_by_host
                    or (body.get("reason") == "agent_reply" and sid not in plan.heard_by_bus)
                ):
                    return 1
            self.heard_upto += 1
        return 0


async def soak(options: Options, say: Say) -> Report:
    profile, seed = options.profile, options.seed
    began = time.monotonic()
    undone = restore_after_crash()
    if undone:
        say(f"undid outages left by a harness that died: {undone}")
    ledger = Ledger(seed=seed)
    tag = f"{seed}_{uuid.uuid4().hex[:6]}"
    scopes = [Scope(app=f"soak-{seed % 1000}", tenant=f"t{i}") for i in range(SCOPE_COUNT)]
    site = options.site
    # The flooder's scope is a tenant of the soak's app like the others (unlike mallory's, where nothing may
    # ever be written).
    flood_scope = Scope(app=f"soak-{seed % 1000}", tenant="flood")
    env = SoakEnv.new(tag, scopes, Scope(app=FOREIGN_APP, tenant="mallory"), flood_scope, site.endpoints)
    logdir = Path(tempfile.mkdtemp(prefix=f"intermission-soak-{tag}-"))
    say(
        f"soak {profile.name}: seed {seed}, {profile.runs} runs over {profile.load_seconds:.0f} s, "
        f"{profile.workers} workers and {profile.sweepers} sweepers; database {env.database}, "
        f"vhost {env.vhost} on {safe_url(env.admin_url)}; logs in {logdir}"
    )
    pool: ProcessPool | None = None
    observer: Observer | None = None
    keep_logs = options.keep
    try:
        await env.create()
        await env.give_quota(flood_scope, profile.flood_quota)
        # The topology first, so that the capture is bound before any event can be published.
        admin = await connect(env.amqp_url(), "soak topology")
        try:
            await declare(await admin.channel(), delivery_limit=DELIVERY_LIMIT)
        finally:
            await admin.close()
        observer = Observer(env.amqp_url())
        await observer.start()
        worker_env = worker_environment(
            database_url=env.database_url,
            amqp_url=env.amqp_url("worker"),
            bus_user=env.user("bus"),
            lease_seconds=LEASE_SECONDS,
            lease_renew_seconds=LEASE_RENEW_SECONDS,
            reclaim_seconds=RECLAIM_SECONDS,
            sweep_seconds=SWEEP_SECONDS,
            shutdown_grace=SHUTDOWN_GRACE,
        )
        worker_env["INTERMISSION_DELIVERY_LIMIT"] = str(DELIVERY_LIMIT)
        worker_env.update(site.fleet_env())
        # The sweepers publish their run.expire commands as an identity of their own.
        sweeper_env = {**worker_env, "INTERMISSION_AMQP_URL": env.amqp_url("sweeper")}
        pool = ProcessPool(
            {"worker": worker_env, "sweeper": sweeper_env},
            logdir,
            workers=profile.workers,
            sweepers=profile.sweepers,
            ledger=ledger,
            rng=seeded(seed, "procs"),
            shutdown_grace=SHUTDOWN_GRACE,
        )
        await pool.start()
        await _wait_consumers(env.amqp_url(), profile.workers)
        run = SoakRun(profile, env, ledger, pool, observer, seeded(seed, "site"), logdir)
        plan = site.fault_plan(run)
        setup_seconds = time.monotonic() - began
        say(f"setup took {setup_seconds:.1f} s; load begins")

        hard_end = began + setup_seconds + profile.load_seconds + profile.drain_seconds + 60.0
        sender = Sender(lambda: hard_end)
        async with AsyncExitStack() as stack:
            actors = await Actors.open(env)
            stack.push_async_callback(actors.close)
            sim = Simulator(
                seed=seed,
                ledger=ledger,
                actors=actors,
                observer=observer,
                sender=sender,
                scopes=scopes,
                rng=seeded(seed, "actors"),
            )
            listeners: list[asyncio.Task[None]] = []
            # Each host hears its own scope, from the durable queue named after it (<user>.<app>.<tenant>:
            # a confined user may declare only queues named <user>.*); the bus hears every scope's asks.
            for scope in scopes:
                subscription = await stack.enter_async_context(actors.hosts[scope].subscribe(scope))
                listeners.append(asyncio.create_task(sim.host_loop(subscription), name=f"host:{scope}"))
            bus_subscription = await stack.enter_async_context(actors.bus.subscribe())
            listeners.append(asyncio.create_task(sim.bus_loop(bus_subscription), name="bus"))
            # The flooder hears its own scope too: its runs' notices must be heard like any others.
            flood_subscription = await stack.enter_async_context(actors.flooder.subscribe(flood_scope))
            listeners.append(asyncio.create_task(sim.host_loop(flood_subscription), name="flooder"))
            try:
                drained = await _load_and_drain(profile, seed, ledger, env, observer, sim, pool, plan, say, hard_end)
            finally:
                for task in listeners:
                    task.cancel()
                for task in list(sim.tasks):
                    task.cancel()
                await asyncio.gather(*listeners, *sim.tasks, return_exceptions=True)
        # The drain saw every outbox row captured and nothing in flight: stopping adds no event.
        await pool.stop()
        result = await check(
            env.database_url,
            ledger,
            Evidence(events=list(observer.events), dead=list(observer.dead)),
            foreign_app=FOREIGN_APP,
            mallory=env.user("mallory"),
        )
        figures = await site.verify(run, result)
        report = Report(
            profile=profile,
            seed=seed,
            ledger=ledger,
            result=result,
            completions=list(observer.completed_at),
            setup_seconds=setup_seconds,
            total_seconds=time.monotonic() - began,
            drained=drained,
            crashes_fired=dict(pool.crashes_fired),
            crashes_not_reached=pool.crashes_not_reached,
            processes_started=pool.spawned,
            publish_retries=sender.retries,
            extra=figures,
        )
        if result.violations:
            keep_logs = True
            report.extra["logs"] = str(logdir)
        return report
    finally:
        if pool is not None:
            pool.kill_all()
        if observer is not None:
            with contextlib.suppress(Exception):
                await observer.close()
        if options.keep:
            say(f"kept database {env.database} and vhost {env.vhost} (--keep)")
        else:
            problems = await env.destroy()
            for problem in problems:
                say(f"clean-up: {problem}")
        if not keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)


async def _load_and_drain(
    profile: Profile,
    seed: int,
    ledger: Ledger,
    env: SoakEnv,
    observer: Observer,
    sim: Simulator,
    pool: ProcessPool,
    plan: FaultPlan,
    say: Say,
    hard_end: float,
) -> bool:
    approvers = sorted(sim.actors.approvers)
    chosen = [choose(seeded(seed, "run", n), approvers, profile.deadline_seconds) for n in range(profile.runs)]
    injector = Injector(profile, seeded(seed, "faults"), ledger, pool, plan, sim)
    stop = asyncio.Event()
    ledger.load_started = time.monotonic()
    until = ledger.load_started + profile.load_seconds
    loops = [
        asyncio.create_task(sim.start_runs(chosen, until, stop), name="starts"),
        asyncio.create_task(injector.infra_loop(until, stop), name="infra-faults"),
        asyncio.create_task(injector.command_loop(until, stop), name="command-faults"),
    ]
    try:
        while time.monotonic() < until:
            await asyncio.sleep(min(PROGRESS_EVERY, max(0.0, until - time.monotonic())))
            say(_progress(ledger, sim, "load"))
        stop.set()
        sim.stop_injecting()
        # Each loop finishes (and undoes) the fault it is in.
        for task in loops:
            await task
    finally:
        stop.set()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    ledger.load_ended = time.monotonic()
    say(f"load over after {ledger.load_ended - ledger.load_started:.0f} s; draining")
    await pool.settle()
    drain = Drain(env.database_url, ledger, observer, sim)
    deadline = min(time.monotonic() + profile.drain_seconds, hard_end)
    last_said = time.monotonic()
    drained = False
    while time.monotonic() < deadline:
        if await drain.settled():
            drained = True
            break
        if time.monotonic() - last_said > PROGRESS_EVERY:
            say(f"draining: {drain.why}")
            last_said = time.monotonic()
        await asyncio.sleep(0.5)
    ledger.drain_ended = time.monotonic()
    if drained:
        say(f"drained in {ledger.drain_ended - ledger.load_ended:.1f} s")
    else:
        ledger.notes.append(f"the drain timed out after {profile.drain_seconds:.0f} s: {drain.why}")
        for task in list(sim.tasks)[:5]:
            where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(task.get_stack(limit=6)))
            ledger.notes.append(f"still busy: {task.get_name()} at {where}")
        say(f"drain timed out: {drain.why}")
    return drained


def _progress(ledger: Ledger, sim: Simulator, phase: str) -> str:
    elapsed = time.monotonic() - ledger.load_started
    ended = sum(1 for p in ledger.runs.values() if p.ended)
    faults = sum(ledger.fault_counts().values())
    return (
        f"{phase} {elapsed:5.0f} s: {sim.starts_done} runs started, {ended} ended; "
        f"{len(ledger.commands)} commands sent; {faults} faults injected; {sim.busy} harness tasks"
    )
