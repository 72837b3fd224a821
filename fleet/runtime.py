"""The fleet inside one worker process: running claimed runs under their leases, and the reclaim sweep.

A consumer (or the in-process control) claims a run in one transaction and calls ``submit``; from then
on the run's safety rests on its lease, not on the broker. Each run gets a task; the worker's one lease
keeper renews all of their leases in one statement per tick over a connection of its own
(``fleet/lease.py``), so no renewal waits behind the commands that share the pool. The reclaim sweep takes
over runs whose lease lapsed (their worker died) and continues them from their last snapshot.

Runs in flight are capped per worker (``INTERMISSION_RUNS_IN_FLIGHT``): a command that would start or
resume a run is admitted (``admitting``) only while the runs this worker continues, and the commands being
admitted, are fewer than the cap; past it the delivery waits unacknowledged (nothing is lost, the broker
holds what the prefetch does not), and the reclaim sweep takes over only as many lapsed runs as there is
room for. Each admission is counted before the command's transaction and until it has handed its run
over, so the cap holds against concurrent consumers and group commits alike.

Stopping: ``stop()`` stops taking work, lets each run reach its next boundary (where it releases its
lease, so another worker continues at once) for up to the grace period, then cancels what is left.
``drain()`` returns when nothing is left to do, which is what tests and one-shot tools want.

What the fleet uses beside its engine is a ``FleetStore``: the lease keeper's line, the demo ledger a run's
tools book charges in, and the count of running runs a drain waits on. A worker's is ``DatabaseFleetStore``
(PostgreSQL, ``store/``); the fast tier of tests gives ``engine/memory.py``'s ``InMemoryFleetStore`` and an
engine over the same in-memory committer. Every other read (a takeover's) goes through the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from intermission.agent.executor import EndedOnRequest, Executor, RunContext, RunHandle, StopAtBoundary
from intermission.agent.tools import Ledger
from intermission.engine.claims import ReadForCommand
from intermission.engine.commands import Claimed
from intermission.engine.core import Engine
from intermission.engine.holding import Reclaimed, ReclaimLapsed, ReleaseLease, Unreadable
from intermission.engine.replies import ReadEvidence, StartResume
from intermission.engine.runs import EndRun
from intermission.fleet.admission import Admission
from intermission.fleet.identity import incarnation
from intermission.fleet.lease import LeaseKeeper, LeaseLine
from intermission.fleet.metrics import WorkerMetrics
from intermission.fleet.run_spans import continuing
from intermission.fleet.settings import Settings
from intermission.fleet.supervisor import Supervisor
from intermission.schemas.errors import (
    IntermissionError,
    InvalidContinuation,
    PermanentError,
    RunLeaseLost,
    SuspensionExpired,
    TransientError,
)
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Lease, Run
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, Ending, EndingKind, Progress
from intermission.store import Stores, leases
from intermission.tracing import annotate, failed

log = logging.getLogger("intermission.fleet")

RECLAIM_TASK = "reclaim-sweep"


class FleetStore(Protocol):
    """What a fleet uses beside its engine: nothing here changes a run (that is the engine's), and each of
    them is kept off the engine's batches on purpose."""

    def lease_line(self, owner: str, *, timeout: float) -> LeaseLine:
        """The lease keeper's line for ``owner``, each renewal bounded by ``timeout``."""
        ...

    def ledger(self, scope: Scope) -> Ledger:
        """The demo ledger at ``scope``, where the tools of a run of that scope book their charges."""
        ...

    async def count_running(self) -> int:
        """How many runs are running in any scope, whoever holds them (``drain(wait_for_lapsed=True)``)."""
        ...


@dataclass(frozen=True)
class DatabaseFleetStore:
    """A worker's ``FleetStore``: PostgreSQL, through ``stores``."""

    stores: Stores

    def lease_line(self, owner: str, *, timeout: float) -> leases.LeaseLine:
        # A connection of its own, outside the pool (fleet/lease.py says why), named for the worker in
        # pg_stat_activity.
        return leases.LeaseLine(self.stores.db, timeout=timeout, application_name=f"intermission-leases {owner}")

    def ledger(self, scope: Scope) -> Ledger:
        return self.stores.at(scope).ledger

    async def count_running(self) -> int:
        return (await self.stores.across_scopes.count_running()).running


class Fleet:
    """``stores``: the worker's PostgreSQL stores (what the fleet uses beside its engine is then
    ``DatabaseFleetStore``), or any other ``FleetStore``; ``engine``: what every change of a run is applied
    through, under this worker's lease (one over ``stores`` when none is given, which only PostgreSQL can
    give)."""

    def __init__(
        self,
        stores: Stores | FleetStore,
        settings: Settings,
        executor: Executor,
        *,
        engine: Engine | None = None,
        owner: str | None = None,
        metrics: WorkerMetrics | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        if isinstance(stores, Stores):
            self.stores: Stores | None = stores
            self.store: FleetStore = DatabaseFleetStore(stores)
            engine = engine or Engine.over(stores)
        elif engine is None:
            raise TypeError("a fleet over anything but PostgreSQL's stores needs its engine, over the same store")
        else:
            self.stores = None
            self.store = stores
        self.metrics = metrics or WorkerMetrics()
        self.metrics.running.set_function(lambda: len(self._tasks))
        self.settings = settings
        self.executor = executor
        self.owner = owner or incarnation()
        self.engine = engine.under(lease=self.lease())
        # Each run's task, by the run's key: its scope and id (an id is unique only within its scope).
        self._tasks: dict[tuple[Scope, str], asyncio.Task[None]] = {}
        self.admission = Admission(settings.runs_in_flight, lambda: len(self._tasks))
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # The worker's supervisor, or one of the fleet's own when it runs alone (tests, tools).
        self.supervisor = supervisor or Supervisor()
        # A statement that cannot renew within a tick is not worth waiting for: the next tick asks again,
        # and a run is given up only once its lease may have lapsed by this process's clock.
        self.keeper = LeaseKeeper(
            self.store.lease_line(self.owner, timeout=settings.lease_renew_seconds),
            self.owner,
            ttl_seconds=settings.lease_seconds,
            renew_every=settings.lease_renew_seconds,
            supervisor=self.supervisor,
        )

    # --- work in -----------------------------------------------------------------------------------

    def lease(self) -> Lease:
        """The lease this worker takes a run under; the database adds the ttl to its own clock."""
        return Lease(owner=self.owner, ttl_seconds=self.settings.lease_seconds)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def running(self) -> int:
        return len(self._tasks)

    def room(self) -> int:
        """How many more runs this worker may take now (a large number when it has no cap)."""
        return self.admission.room()

    def admitting(self, key: str = "") -> AbstractAsyncContextManager[None]:
        """Hold one of the worker's places for runs while a command that may start or resume one is
        applied; past the cap wait for one first, served in turn with the other scopes waiting
        (``fleet/admission.py``). ``key``: the command's routing key, which names its scope."""
        return self.admission.place(key)

    def submit(self, claimed: Claimed, *, taken_over: bool = False) -> asyncio.Task[None]:
        """Run a claimed run under this worker's lease until it pauses, ends, or leaves this worker.
        ``taken_over``: the run's worker died and this one took it over (its span says so)."""
        # A run's key is its id within its scope: this worker may run "r1" of two scopes side by side.
        key = (claimed.run.scope, claimed.run.id)
        existing = self._tasks.get(key)
        if existing is not None and not existing.done():
            # Only one claim can hold the run; a second submit of it is a bug upstream, not a second run.
            raise RuntimeError(f"run {claimed.run.id} of {claimed.run.scope} is already running in this worker")
        # The task copies the context it is created in: the span of the command that claimed the run is
        # current in it, and the run's span starts from there (fleet/run_spans.py).
        task = asyncio.create_task(self._run(claimed, taken_over), name=f"run:{claimed.run.scope}/{claimed.run.id}")
        self._tasks[key] = task
        self._idle.clear()
        task.add_done_callback(lambda t: self._forget(key, t))
        return task

    def _forget(self, key: tuple[Scope, str], task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
            self.admission.serve()
        if not self._tasks:
            self._idle.set()

    async def _run(self, claimed: Claimed, taken_over: bool) -> None:
        """The run's task: it continues in its trace, in a ``run.continue`` span (fleet/run_spans.py)."""
        with continuing(claimed.run, claimed.progress, taken_over=taken_over) as span:
            how = await self._continue(claimed)
            annotate(span, {"intermission.run.left": how})
            if how == "failed":
                failed(span, "executor_error")
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "the run left this worker",
                    extra={"action": "run_left_worker", "how": how, "run_id": claimed.run.id},
                )

    async def _continue(self, claimed: Claimed) -> str:
        """Run ``claimed`` until it leaves this worker; how it left (``runs_left``'s label)."""
        handle = RunHandle(ending=claimed.run.ending)
        progress = claimed.progress
        if claimed.run.ending is not None and progress.ending is None:
            # Asked to end while it ran (a cancel), and taken over before its holder finished that: the
            # executor finishes it first, as it does a claim's ending.
            progress = progress.model_copy(update={"ending": claimed.run.ending})
        lease = Lease(owner=claimed.run.lease_owner or self.owner, ttl_seconds=self.settings.lease_seconds)
        ctx = RunContext(
            self.engine,
            claimed.run,
            progress,
            lease,
            correlation_id=claimed.correlation_id,
            stopping=self._stopping,
            handle=handle,
            history_limit=self.settings.session_history_messages,
            ledger=self.store.ledger(claimed.run.scope),
        )
        me = asyncio.current_task()
        assert me is not None

        def lost() -> None:
            if handle.ended or handle.paused or handle.leaving:
                # It left running by its own write, which the renewal saw (or its pause or end is in flight,
                # and that transition's answer says whether the lease was lost): nothing to stop.
                return
            handle.lost = True
            me.cancel()

        def asked_to_end(ending: Ending) -> None:
            # Only noted: the run ends itself at its next boundary (RunContext), never mid-call.
            handle.ending = ending

        holding = self.keeper.hold(
            claimed.run.id, claimed.run.scope, owner=lease.owner, on_lost=lost, on_ending=asked_to_end
        )
        extra = {"run_id": claimed.run.id, "scope": str(claimed.run.scope)}
        how = "released"
        try:
            await self.executor.execute(ctx)
            if not (handle.ended or handle.paused):
                log.error("executor returned without ending or pausing the run", extra={"action": "run_left", **extra})
                await self._release(ctx)
        except EndedOnRequest as asked:
            log.info("ended as asked", extra={"action": "run_ended_on_request", "ending": asked.ending.kind, **extra})
        except StopAtBoundary:
            log.info("stopped at a boundary; releasing the run", extra={"action": "run_released", **extra})
            await self._release(ctx)
        except RunLeaseLost:
            handle.lost = True
            self.metrics.lease_lost_writes.inc()
            log.warning("lease lost; writing nothing more", extra={"action": "run_lease_lost", **extra})
        except asyncio.CancelledError:
            if handle.lost:
                me.uncancel()
                log.warning("lease lost; run task cancelled", extra={"action": "run_lease_lost", **extra})
                return "lease_lost"
            await asyncio.shield(self._release(ctx))
            raise
        except TransientError as exc:
            # The database went away mid-run. The lease lapses on its own and a worker (this one or
            # another) takes the run over from its last snapshot.
            how = "interrupted"
            log.warning("run interrupted", extra={"action": "run_interrupted", "error": exc.code, **extra})
        except Exception as exc:
            how = "failed"
            log.exception("executor failed", extra={"action": "executor_error", **extra})
            # A run whose executor crashes would crash every worker that reclaims it; end it instead.
            with contextlib.suppress(IntermissionError):
                await ctx.fail(f"executor_error: {type(exc).__name__}")
        finally:
            self.keeper.release(holding)
            if handle.lost:
                how = "lease_lost"
            elif handle.paused:
                how = "paused"
            elif handle.ended and how != "failed":
                how = "ended"
            self.metrics.runs_left.labels(how).inc()
        return how

    async def _release(self, ctx: RunContext) -> None:
        if ctx.handle.lost or ctx.handle.ended or ctx.handle.paused:
            return
        with contextlib.suppress(IntermissionError):
            await self.engine.apply(ReleaseLease(ctx.scope, ctx.run.id, ctx.owner))

    # --- reclaim -----------------------------------------------------------------------------------

    async def reclaim_once(self) -> int:
        """Take over up to a batch of runs whose lease lapsed, and continue each from its snapshot.

        Each run is handled on its own: one that cannot be continued never stops the others. A run whose
        row or snapshot does not decode, or whose admitted start cannot be granted, is ended ``failed``
        (quarantined): retrying it would fail the same way on every sweep of every worker. One that fails
        for a passing reason is left to its lease, which lapses, and a later sweep takes it again."""
        if self.stopping:
            return 0
        batch = min(self.settings.reclaim_batch, self.room())
        if batch == 0:
            return 0
        # The batch's places are held from before the claim until each run is handed over (or given up),
        # as an admitted command's are: a command admitted while the claim is in the database would
        # otherwise take a place the takeover counted on, and the worker would pass its cap.
        self.admission.hold(batch)
        held = batch
        try:
            taken = await self.engine.apply(ReclaimLapsed(self.lease(), batch))
        except BaseException:
            self.admission.give_back(held)
            raise
        self.admission.give_back(held - len(taken))
        held = len(taken)
        self.metrics.lease_takeovers.inc(len(taken))
        try:
            for one in taken:
                run_id, scope = (one.run_id, one.scope) if isinstance(one, Unreadable) else (one.run.id, one.run.scope)
                extra = {"run_id": run_id, "scope": str(scope)}
                try:
                    if isinstance(one, Unreadable):
                        await self._quarantine(one.run_id, one.scope, one.revision, InvalidContinuation(one.detail))
                    else:
                        await self._continue_reclaimed(one)
                except TransientError as exc:
                    log.warning(
                        "could not continue a reclaimed run; its lease will lapse and it is taken again",
                        extra={"action": "reclaim_run_retry", "error": exc.code, **extra},
                    )
                except Exception:
                    log.exception("could not continue a reclaimed run", extra={"action": "reclaim_run_error", **extra})
                finally:
                    held -= 1
                    self.admission.give_back(1)
        finally:
            # Cancelled part way (the worker stopping): the places of the runs not reached are given back.
            self.admission.give_back(held)
        return len(taken)

    async def _continue_reclaimed(self, reclaimed: Reclaimed) -> None:
        run = reclaimed.run
        progress = reclaimed.progress
        if progress is None:
            # Leased without a first snapshot (a leased claim or start that wrote none; plain claims hold
            # no lease and are never taken over): continue from the pause if it is still there, else from
            # the run's start.
            cont = Continuation(config=run.config, session_id=run.session_id)
            with contextlib.suppress(IntermissionError):
                pause = (await self.engine.apply(ReadForCommand(run.scope, run.id))).pause
                if pause is not None:
                    cont = pause.continuation
            progress = Progress(run_id=run.id, scope=run.scope, owner=self.owner, continuation=cont)
        try:
            progress = await self._grant_admitted_start(run, progress)
        except PermanentError as exc:
            await self._quarantine(run.id, run.scope, run.revision, exc, traceparent=progress.continuation.traceparent)
            return
        log.info("reclaimed a run", extra={"action": "run_reclaimed", "run_id": run.id, "scope": str(run.scope)})
        self.metrics.reclaimed.inc()
        self.submit(Claimed(run=run, progress=progress, suspension=None, correlation_id=None), taken_over=True)

    async def _quarantine(
        self, run_id: str, scope: Scope, revision: int, error: IntermissionError, *, traceparent: str | None = None
    ) -> None:
        """End a run that can never be continued ``failed``, with its code, under the lease just taken (its
        ``run.failed`` in the run's trace, when its snapshot could be read)."""
        log.error(
            "a reclaimed run cannot be continued; ending it failed",
            extra={"action": "run_quarantined", "run_id": run_id, "code": error.code, "detail": error.detail},
        )
        await self.engine.apply(
            EndRun(
                scope,
                run_id,
                self.owner,
                revision,
                RunEventKind.FAILED,
                error=f"{error.code}: {error.detail}",
                traceparent=traceparent,
            )
        )
        self.metrics.quarantined.inc()

    async def _grant_admitted_start(self, run: Run, progress: Progress) -> Progress:
        """A run whose agent reply was admitted but never started (its admitter died in between) may only
        execute after the single grant: take it now. An admission that was expired instead must not run:
        the run finishes as expired."""
        # The run's latest admission is whichever pause id is asked about; 0 names no pause (ids start at
        # 1), so this first read carries no pause's own evidence.
        admission = (await self.engine.apply(ReadEvidence(run.scope, run.id, 0))).latest
        if admission is None:
            return progress
        if admission.claimed_revision != run.revision:
            return progress  # an older pause's admission; this run moved on since
        key = admission.request.version.suspension_id
        if (await self.engine.apply(ReadEvidence(run.scope, run.id, key))).start is not None:
            return progress  # started before: the grant was given, and this takeover inherits it
        try:
            await self.engine.apply(StartResume(run.scope, run.id, key, admission.request_digest, self.lease()))
        except SuspensionExpired as exc:
            ending = Ending(kind=EndingKind.EXPIRE, reason=exc.detail)
            return progress.model_copy(update={"ending": ending})
        return progress

    async def _reclaim_forever(self) -> None:
        """The reclaim sweep, supervised: passing failures are retried at the next interval here; anything
        else ends this call and the supervisor logs it and starts the sweep again."""
        while not self.stopping:
            try:
                await self.reclaim_once()
            except TransientError as exc:
                log.warning("reclaim sweep failed; retrying", extra={"action": "reclaim_retry", "error": exc.code})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.settings.reclaim_interval_seconds)

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def reclaiming(self) -> bool:
        """Whether the reclaim sweep runs (it stops only with the fleet, or when its supervisor gave up)."""
        return self.supervisor.running(RECLAIM_TASK)

    async def start(self) -> None:
        if not self.supervisor.running(RECLAIM_TASK):
            self.supervisor.start(RECLAIM_TASK, self._reclaim_forever)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def drain(self, *, wait_for_lapsed: bool = False) -> None:
        """Return when this worker has nothing left to do: no run in flight, nothing to reclaim and, with
        ``wait_for_lapsed``, no run anywhere still running under someone else's lease (its lease will
        lapse and this worker will take it over). Bound it with ``asyncio.timeout``."""
        while True:
            await self.wait_idle()
            if await self.reclaim_once():
                continue
            if wait_for_lapsed and await self.store.count_running():
                # Another worker's lease has yet to lapse: look again at the reclaim cadence.
                await asyncio.sleep(min(self.settings.reclaim_interval_seconds, 0.2))
                continue
            if self._idle.is_set():
                return

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking work, let runs stop at their next boundary within ``grace``, cancel the rest; then
        stop renewing leases (none is held any more)."""
        self._stopping.set()
        await self.supervisor.cancel(RECLAIM_TASK)
        pending = list(self._tasks.values())
        if pending:
            wait = self.settings.shutdown_grace_seconds if grace is None else grace
            _, late = await asyncio.wait(pending, timeout=wait)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)
        await self.keeper.stop()
