"""THE fleet (``fleet/runtime.py``) on the in-memory engine, with the demo agent: a claimed run runs to its
end under its lease and lets it go; a run that pauses writes its Notice; the lease keeper renews a held
run's lease by the store's clock and cancels a run whose lease lapsed; a graceful stop releases a run at
its boundary for another worker; the reclaim sweep takes over a run whose worker stopped renewing and
continues it from its snapshot, never running its started charge again, and grants the start a dead
admitter never took.

The same against the real database: ``tests/integration/test_fleet_runs.py``, ``test_fleet_leases.py``,
``test_takeover.py``. Time on the store's side is the memory clock, moved by the tests; the keeper's own
ticks are real, so each test picks a renewal interval that either never comes within it or comes at once.
A run is held mid-call by a ledger whose charge waits on an event, never by a sleep. No I/O."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

from intermission.agent.durable import OUTCOME_UNKNOWN
from intermission.agent.loop import default_executor
from intermission.engine.commands import Claimed, Start
from intermission.engine.memory import InMemoryFleetStore, InMemoryLeaseLine, InMemoryLedger
from intermission.engine.replies import AdmitResume, ReadEvidence
from intermission.engine.runs import ReadSession
from intermission.fleet.runtime import Fleet
from intermission.fleet.settings import Settings
from intermission.schemas.answers import reply_progress
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Role
from intermission.schemas.resume import ResumeAdmissionRequest
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason, Suspension
from intermission.store.leases import HeldRun, Renewed
from intermission.wire import notice_key, run_event_key
from tests.support.conformance import (
    SCOPE,
    MemoryWorld,
    Row,
    forbid_sockets,
    outbox_of,
    run_row,
    stored_pause,
    stored_progress,
)
from tests.support.control import LocalControl
from tests.support.fleet import fast_settings, start_command

# Every wait of a test is bounded by this: nothing here takes more than a few turns of the event loop.
WITHIN = 5.0
LEASE_SECONDS = 30.0
# A keeper that never ticks within a test (a worker that stopped renewing), and one that ticks at once.
NEVER = 20.0
AT_ONCE = 0.01

CHARGE_THEN_PAY: list[dict[str, Any]] = [{"call": [{"tool": "charge", "arguments": {"amount": 5}}]}, {"say": "paid"}]


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_sockets(monkeypatch)


def settings(renew_every: float = NEVER, **changes: Any) -> Settings:
    # The URL is never dialled: a fleet given an engine and a store of its own opens no connection.
    return fast_settings(
        "postgresql://nobody@unused.invalid/none",
        lease_seconds=LEASE_SECONDS,
        lease_renew_seconds=renew_every,
        **changes,
    )


# --- the store beside the engine, as the tests hold it -------------------------------------------------


class Gate:
    """Where a gated charge waits: ``entered`` once the charge is booked, and the call returns once
    ``opened``."""

    def __init__(self, *, opened: bool = False) -> None:
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()
        if opened:
            self.opened.set()
        self.calls = 0


class GatedLedger:
    """The demo ledger, but a charge's call returns only once its gate opens: the charge is booked (the
    side effect happened) and the worker is held in the call, as one that died there would be."""

    def __init__(self, inner: InMemoryLedger, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    async def charge(self, run_id: str, call_id: str, amount: Decimal) -> int:
        receipt = await self._inner.charge(run_id, call_id, amount)
        self._gate.calls += 1
        self._gate.entered.set()
        await self._gate.opened.wait()
        return receipt


class HeardLine:
    """The in-memory lease line, telling the test after each renewal it answered."""

    def __init__(self, inner: InMemoryLeaseLine) -> None:
        self.inner = inner
        self.renewed = asyncio.Event()

    async def renew(self, owner: str, ttl_seconds: float, held: Sequence[HeldRun]) -> dict[HeldRun, Renewed]:
        found = await self.inner.renew(owner, ttl_seconds, held)
        self.renewed.set()
        return found

    async def close(self) -> None:
        await self.inner.close()


class GatedStore:
    """The in-memory fleet store (a ``FleetStore`` by its shape) with its charges gated and its renewals
    heard."""

    def __init__(self, world: MemoryWorld, gate: Gate) -> None:
        self.inner = InMemoryFleetStore(world.memory)
        self.gate = gate
        self.heard: list[HeardLine] = []

    def lease_line(self, owner: str, *, timeout: float) -> HeardLine:
        line = HeardLine(self.inner.lease_line(owner, timeout=timeout))
        self.heard.append(line)
        return line

    def ledger(self, scope: Scope) -> GatedLedger:
        return GatedLedger(self.inner.ledger(scope), self.gate)

    async def count_running(self) -> int:
        return await self.inner.count_running()


class MemoryWorker:
    """A worker of the fast tier: a fleet over the world's engine, the test's store, the in-process control."""

    def __init__(self, world: MemoryWorld, owner: str, *, gate: Gate | None = None, renew_every: float = NEVER) -> None:
        self.world = world
        self.gate = gate or Gate(opened=True)
        self.store = GatedStore(world, self.gate)
        self.fleet = Fleet(self.store, settings(renew_every), default_executor(), engine=world.engine, owner=owner)
        self.control = LocalControl(self.fleet)

    @property
    def line(self) -> HeardLine:
        [line] = self.store.heard
        return line

    async def drain(self, *, wait_for_lapsed: bool = False) -> None:
        async with asyncio.timeout(WITHIN):
            await self.fleet.drain(wait_for_lapsed=wait_for_lapsed)

    def counted(self, name: str, **labels: str) -> float:
        return self.fleet.metrics.registry.get_sample_value(name, labels) or 0.0


def charges(world: MemoryWorld, run_id: str) -> dict[str, int]:
    return world.memory.times_charged(SCOPE, run_id)


def snapshot_of(world: MemoryWorld) -> dict[str, dict[Any, Row]]:
    """Every table as it stands (rows are never changed in place, so a shallow copy of each is a snapshot)."""
    tables = world.memory.tables
    return {name: copy.copy(getattr(tables, name)) for name in vars(tables)}


async def tool_messages(world: MemoryWorld, run_id: str) -> list[tuple[str | None, str]]:
    row = await run_row(world, SCOPE, run_id)
    assert row is not None
    session = await world.engine.apply(ReadSession(SCOPE, row["session_id"], 100))
    return [(m.tool_call_id, m.content) for m in session if m.role is Role.TOOL]


async def routing_keys(world: MemoryWorld, run_id: str) -> list[str]:
    return [r["routing_key"] for r in await outbox_of(world, SCOPE, run_id)]


def key(kind: RunEventKind) -> str:
    return run_event_key(kind, SCOPE)


async def finished(task: asyncio.Task[None]) -> None:
    async with asyncio.timeout(WITHIN):
        await task


# --- the cases ---------------------------------------------------------------------------------------


async def test_a_claimed_run_submitted_runs_to_its_end_and_lets_its_lease_go() -> None:
    world = MemoryWorld()
    w = MemoryWorker(world, "worker-a")
    cmd = start_command(
        SCOPE,
        [
            {"call": [{"tool": "echo", "arguments": {"x": 1}}, {"tool": "charge", "arguments": {"amount": 5}}]},
            {"say": "paid"},
        ],
    )
    claimed = await w.control.engine.apply(Start(cmd, correlation_id="m-start"))
    assert isinstance(claimed, Claimed)
    assert claimed.run.lease_owner == "worker-a"  # taken at claim time, under the fleet's lease

    await finished(w.fleet.submit(claimed))

    row = await run_row(world, SCOPE, cmd.run_id)
    assert row is not None
    assert (row["state"], row["output"]) == ("completed", "paid")
    # An ended run holds no lease, and its snapshot is gone.
    assert (row["lease_owner"], row["lease_expires_at"]) == (None, None)
    assert await stored_progress(world, SCOPE, cmd.run_id) is None
    assert w.fleet.keeper.held == 0
    assert w.fleet.running == 0
    # The non-retry-safe call was booked exactly once, in the run's own scope.
    assert charges(world, cmd.run_id) == {"call-0-1": 1}
    [completed] = await outbox_of(world, SCOPE, cmd.run_id)
    assert completed["routing_key"] == key(RunEventKind.COMPLETED)
    event = RunEvent.model_validate_json(completed["body"])
    assert (event.kind, event.output, event.revision) == (RunEventKind.COMPLETED, "paid", row["revision"])
    # ... and handed to the engine's sink the moment it committed.
    assert [e.body for e in world.sink.events] == [completed["body"]]
    assert w.counted("intermission_runs_left_total", how="ended") == 1


async def test_a_run_that_pauses_writes_its_notice_and_its_resume_finishes_it() -> None:
    world = MemoryWorld()
    w = MemoryWorker(world, "worker-a")
    cmd = start_command(SCOPE, [{"call": [{"tool": "lookup", "arguments": {"query": "weather"}}]}, {"say": "sunny"}])
    await w.control.start(cmd, correlation_id="m-start")
    await w.drain()

    pause = await stored_pause(world, SCOPE, cmd.run_id)
    assert pause is not None
    assert pause.reason is SuspendReason.EXTERNAL_TOOL
    assert [p.name for p in pause.pending] == ["lookup"]
    assert pause.expires_at is None  # pause ttl 0: no deadline
    row = await run_row(world, SCOPE, cmd.run_id)
    assert row is not None
    # Paused, the run is nobody's: no lease to renew, nothing left in the keeper.
    assert (row["state"], row["lease_owner"]) == ("paused", None)
    assert w.fleet.keeper.held == 0
    [notice] = await outbox_of(world, SCOPE, cmd.run_id)
    assert notice["routing_key"] == notice_key(SuspendReason.EXTERNAL_TOOL, SCOPE)
    assert w.counted("intermission_runs_left_total", how="paused") == 1

    version = ClaimVersion(run_id=cmd.run_id, suspension_id=pause.id, run_revision=row["revision"])
    answer = ResumeCommand(
        scope=SCOPE, version=version, results=[ToolAnswer(call_id=pause.pending[0].id, content="rain")]
    )
    await w.control.resume(answer, correlation_id="m-resume")
    await w.drain()

    ended = await run_row(world, SCOPE, cmd.run_id)
    assert ended is not None
    assert (ended["state"], ended["output"], ended["revision"]) == ("completed", "sunny", row["revision"] + 2)
    assert await stored_pause(world, SCOPE, cmd.run_id) is None
    assert await routing_keys(world, cmd.run_id) == [
        notice_key(SuspendReason.EXTERNAL_TOOL, SCOPE),
        key(RunEventKind.RESUMED),
        key(RunEventKind.COMPLETED),
    ]
    assert await tool_messages(world, cmd.run_id) == [(pause.pending[0].id, "rain")]


async def test_the_keeper_renews_a_held_lease_by_the_store_s_clock_and_cancels_a_run_whose_lease_lapsed() -> None:
    world = MemoryWorld()
    gate = Gate()
    w = MemoryWorker(world, "worker-a", gate=gate, renew_every=AT_ONCE)
    cmd = start_command(SCOPE, CHARGE_THEN_PAY)
    await w.control.start(cmd)
    [task] = w.fleet._tasks.values()
    async with asyncio.timeout(WITHIN):
        await gate.entered.wait()
    before = await run_row(world, SCOPE, cmd.run_id)
    assert before is not None

    # Twenty seconds on, the lease (thirty) still holds: the next tick renews it from the store's now.
    now = world.memory.clock.advance(20)
    w.line.renewed.clear()
    async with asyncio.timeout(WITHIN):
        await w.line.renewed.wait()
    renewed = await run_row(world, SCOPE, cmd.run_id)
    assert renewed is not None
    assert renewed["lease_expires_at"] > before["lease_expires_at"]
    assert renewed["lease_expires_at"] >= now + timedelta(seconds=LEASE_SECONDS)
    # A renewal moves the expiry and nothing else: not the owner, the revision, or updated_at.
    assert {k: v for k, v in renewed.items() if k != "lease_expires_at"} == {
        k: v for k, v in before.items() if k != "lease_expires_at"
    }
    assert w.line.inner.connected

    # Past the ttl with no renewal in between, the lease lapsed: the keeper hears it is no longer held and
    # the fleet cancels the run mid-call, and it writes nothing more.
    world.memory.clock.advance(LEASE_SECONDS + 1)
    tables = snapshot_of(world)
    await finished(task)
    assert snapshot_of(world) == tables
    assert w.fleet.keeper.held == 0
    assert w.counted("intermission_runs_left_total", how="lease_lost") == 1
    await w.fleet.stop(grace=1)
    assert not w.line.inner.connected


async def test_a_graceful_stop_releases_the_run_at_its_boundary_for_another_worker() -> None:
    world = MemoryWorld()
    gate = Gate()
    first = MemoryWorker(world, "worker-a", gate=gate)
    cmd = start_command(SCOPE, CHARGE_THEN_PAY)
    await first.control.start(cmd)
    async with asyncio.timeout(WITHIN):
        await gate.entered.wait()

    # The gate opens and stop() begins before the run's task runs again (nothing between them yields), so
    # the call finishes, its result is saved, and the run stops at the boundary that follows.
    gate.opened.set()
    await first.fleet.stop(grace=WITHIN)

    row = await run_row(world, SCOPE, cmd.run_id)
    assert row is not None
    assert (row["state"], row["lease_owner"]) == ("running", "worker-a")
    assert row["lease_expires_at"] <= world.memory.clock.now()  # released: lapsed now, not in thirty seconds
    progress = await stored_progress(world, SCOPE, cmd.run_id)
    assert progress is not None
    assert (progress.continuation.step_index, progress.started) == (1, [])
    assert first.counted("intermission_runs_left_total", how="released") == 1
    assert first.fleet.keeper.held == 0
    assert not first.line.inner.connected

    # Another worker takes it over at once, with no clock moved, and finishes it.
    second = MemoryWorker(world, "worker-b")
    await second.drain()
    ended = await run_row(world, SCOPE, cmd.run_id)
    assert ended is not None
    assert (ended["state"], ended["output"]) == ("completed", "paid")
    assert charges(world, cmd.run_id) == {"call-0-0": 1}
    assert second.counted("intermission_runs_reclaimed_total") == 1
    await second.fleet.stop(grace=1)


async def test_the_reclaim_sweep_continues_a_lapsed_run_from_its_snapshot_and_never_charges_twice() -> None:
    world = MemoryWorld()
    gate = Gate()
    dying = MemoryWorker(world, "worker-that-died", gate=gate)
    cmd = start_command(SCOPE, CHARGE_THEN_PAY)
    await dying.control.start(cmd)
    [stuck] = dying.fleet._tasks.values()
    async with asyncio.timeout(WITHIN):
        await gate.entered.wait()
    # The charge is booked and recorded as started; its worker never gets to save the result, nor renews.
    started = await stored_progress(world, SCOPE, cmd.run_id)
    assert started is not None
    assert [c.id for c in started.started] == ["call-0-0"]
    assert charges(world, cmd.run_id) == {"call-0-0": 1}

    rescuer = MemoryWorker(world, "worker-b")
    assert await rescuer.fleet.reclaim_once() == 0  # the lease still holds: nothing to take
    world.memory.clock.advance(LEASE_SECONDS + 1)
    assert await rescuer.fleet.reclaim_once() == 1
    async with asyncio.timeout(WITHIN):
        await rescuer.fleet.wait_idle()

    row = await run_row(world, SCOPE, cmd.run_id)
    assert row is not None
    assert (row["state"], row["output"]) == ("completed", "paid")
    # The started charge was not handed to its handler again: the model was told its outcome is unknown.
    assert charges(world, cmd.run_id) == {"call-0-0": 1}
    assert gate.calls == 1
    assert await tool_messages(world, cmd.run_id) == [("call-0-0", f"error: {OUTCOME_UNKNOWN}")]
    assert await routing_keys(world, cmd.run_id) == [key(RunEventKind.COMPLETED)]
    assert rescuer.counted("intermission_runs_reclaimed_total") == 1
    assert rescuer.counted("intermission_lease_takeovers_total") == 1

    # The first worker wakes in its call: its lease is gone, so it writes nothing at all.
    tables = snapshot_of(world)
    gate.opened.set()
    await finished(stuck)
    assert snapshot_of(world) == tables
    assert dying.counted("intermission_runs_left_total", how="lease_lost") == 1
    await dying.fleet.stop(grace=1)
    await rescuer.fleet.stop(grace=1)


async def test_a_takeover_grants_the_start_of_a_reply_whose_admitter_died_before_starting() -> None:
    world = MemoryWorld()
    w = MemoryWorker(world, "worker-a")
    cmd = start_command(SCOPE, [{"call": [{"tool": "ask_agent", "arguments": {"agent": "a", "question": "q"}}]}])
    await w.control.start(cmd)
    await w.drain()
    pause = await stored_pause(world, SCOPE, cmd.run_id)
    assert pause is not None
    assert pause.reason is SuspendReason.AGENT_REPLY
    row = await run_row(world, SCOPE, cmd.run_id)
    assert row is not None
    request = await admitted_by_a_dead_worker(world, pause, row["revision"])

    # Its lease lapses; the drain takes it over, grants the start, and runs it to its end.
    world.memory.clock.advance(1)
    await w.drain(wait_for_lapsed=True)

    ended = await run_row(world, SCOPE, cmd.run_id)
    assert ended is not None
    assert (ended["state"], ended["output"]) == ("completed", '"the answer"')
    evidence = await world.engine.apply(ReadEvidence(SCOPE, cmd.run_id, pause.id))
    assert evidence.start is not None
    assert evidence.start.request_digest == request.digest()
    assert await w.fleet.store.count_running() == 0
    await w.fleet.stop(grace=1)


async def admitted_by_a_dead_worker(world: MemoryWorld, pause: Suspension, revision: int) -> ResumeAdmissionRequest:
    """The bus's reply admitted (claim, lease, snapshot) by a worker that died before the start was granted."""
    dead = Lease(owner="worker-that-died", ttl_seconds=0.2)
    version = ClaimVersion(run_id=pause.run_id, suspension_id=pause.id, run_revision=revision)
    reply_with = pause.pending[0].reply_with
    assert reply_with is not None
    first = reply_progress(pause, reply_with, '"the answer"', dead.owner)
    request = ResumeAdmissionRequest(scope=SCOPE, version=version, input=b'"the answer"')
    await world.engine.apply(AdmitResume(request, pause, dead, first))
    return request
