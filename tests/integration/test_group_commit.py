"""Group commit (engine/committer.py): commands that arrive together are applied in one statement, and
every guarantee of a single command still holds per command.

To put many commands into ONE batch deterministically, a test holds the row lock of a "blocker" run: the
worker's only batch of claims (``command_batches_in_flight = 1``) waits on it, and the claims of the
commands published meanwhile gather for the next batch. The test waits until the worker holds all of them,
then lets the lock go.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from intermission.engine.claims import CLAIM, ClaimRow
from intermission.engine.commands import Claimed, Resume
from intermission.engine.committer import Batch
from intermission.engine.postgres import PostgresCommitter
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient, Received, Subscription
from intermission.schemas.commands import StartCommand
from intermission.schemas.errors import NotSuspended, RunConflict
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import ClaimVersion, Notice
from intermission.store import Stores
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.wire import Command
from tests.support.batches import answer, held_back, one_batch_at_a_time
from tests.support.fleet import outbox_keys

WAIT = 30.0
LOOKUP = [{"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}, {"say": "done"}]


def start(scope: Scope) -> StartCommand:
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="demo",
        input="hi",
        script=[ScriptTurn.model_validate(t) for t in LOOKUP],
    )


class Heard:
    """Every event a subscription hears, kept, so that a test can wait for several kinds in any order."""

    def __init__(self, events: Subscription[Any]) -> None:
        self.events = events
        self.all: list[Received[Any]] = []

    def of(self, wanted: Callable[[Received[Any]], bool]) -> list[Received[Any]]:
        return [r for r in self.all if wanted(r)]

    async def until(self, wanted: Callable[[Received[Any]], bool], count: int) -> list[Received[Any]]:
        """The events ``wanted`` picks, once there are ``count`` of them."""
        async with asyncio.timeout(WAIT):
            while len(found := self.of(wanted)) < count:
                self.all.append(await anext(aiter(self.events)))
        return found


def completed_of(run_ids: set[str]) -> Callable[[Received[Any]], bool]:
    return lambda r: (
        isinstance(r.event, RunEvent) and r.event.kind is RunEventKind.COMPLETED and r.event.run_id in run_ids
    )


def rejected_of(message_ids: set[str]) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, CommandRejected) and r.event.message_id in message_ids


async def pause_all(host: HostClient, heard: Heard, scope: Scope, n: int) -> list[Notice]:
    commands = [start(scope) for _ in range(n)]
    for cmd in commands:
        await host.start(cmd)
    ids = {c.run_id for c in commands}
    found = await heard.until(lambda r: isinstance(r.event, Notice) and r.event.run_id in ids, n)
    by_run = {r.event.run_id: r.event for r in found}
    return [by_run[c.run_id] for c in commands]


async def test_thirty_two_resumes_of_one_pause_in_one_batch_claim_it_once(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    async with one_batch_at_a_time(settings, stores) as w, host.subscribe(scope) as subscription:
        events = Heard(subscription)
        blocker, target = await pause_all(host, events, scope, 2)
        contenders = [answer(target, content=f"answer {i}") for i in range(32)]
        async with held_back(stores, w, host, blocker) as gathered:
            ids = [await host.resume(c) for c in contenders]
            await gathered(len(ids))
        rejected = await events.until(rejected_of(set(ids)), len(ids) - 1)
        await events.until(completed_of({target.run_id}), 1)
        await w.drain()
        assert max(w.fleet.engine.scheduler.sizes(CLAIM)) == 32  # the contenders went together

    assert {r.event.code for r in rejected} <= {"not_suspended", "run_conflict"}
    winners = set(ids) - {r.event.message_id for r in rejected}
    assert len(winners) == 1
    (winner,) = winners
    async with stores.db.connection() as con:
        recorded = await con.raw.fetch("SELECT message_id FROM inbox WHERE message_id = ANY($1)", ids)
        progress_rows = await con.raw.fetchval("SELECT count(*) FROM progress WHERE run_id = $1", target.run_id)
    assert [r["message_id"] for r in recorded] == [winner]  # the refused left no inbox record
    assert progress_rows == 0  # the run ended: its progress went with it
    keys = await outbox_keys(stores, scope, target.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1
    assert keys[-1] == f"run.completed.{scope.app}.{scope.tenant}"
    run = await stores.at(scope).runs.get_run(target.run_id)
    assert run.state is RunState.COMPLETED


async def test_one_message_delivered_many_times_within_one_batch_has_one_effect_and_no_refusal(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    async with one_batch_at_a_time(settings, stores) as w, host.subscribe(scope) as subscription:
        events = Heard(subscription)
        blocker, target = await pause_all(host, events, scope, 2)
        resume = answer(target)
        message_id = str(uuid.uuid4())
        async with held_back(stores, w, host, blocker) as gathered:
            for _ in range(10):
                await host.resume(resume, message_id=message_id)
            await gathered(10)
        await events.until(completed_of({target.run_id}), 1)
        await w.drain()
        assert max(w.fleet.engine.scheduler.sizes(CLAIM)) == 10

    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", message_id) == 1
        rejected = await con.raw.fetchval(
            "SELECT count(*) FROM outbox WHERE routing_key LIKE 'command.rejected.%' AND body LIKE '%' || $1 || '%'",
            message_id,
        )
    assert rejected == 0  # a duplicate is acknowledged, never refused
    keys = await outbox_keys(stores, scope, target.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1


async def test_a_batch_with_refusals_applies_every_other_command(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    async with one_batch_at_a_time(settings, stores) as w, host.subscribe(scope) as subscription:
        events = Heard(subscription)
        blocker, *targets = await pause_all(host, events, scope, 9)
        good = [answer(n) for n in targets]
        stale = targets[0].model_copy(update={"suspension_id": targets[0].suspension_id + 1000})
        wrong_pause = answer(stale)  # pinned to a pause the run never had
        unknown = answer(targets[1].model_copy(update={"run_id": "run-nobody"}))
        async with held_back(stores, w, host, blocker) as gathered:
            bad_ids = {await host.resume(wrong_pause), await host.resume(unknown)}
            for cmd in good:
                await host.resume(cmd)
            # The two refused ones are refused by their own checks, against what their reads found: only the
            # good ones get as far as a claim, and those wait together.
            await gathered(len(good))
        rejected = await events.until(rejected_of(bad_ids), len(bad_ids))
        await events.until(completed_of({n.run_id for n in targets}), len(targets))
        await w.drain()
        assert max(w.fleet.engine.scheduler.sizes(CLAIM)) == len(good)

    assert sorted(r.event.code for r in rejected) == ["not_suspended", "run_conflict"]
    for n in targets:
        keys = await outbox_keys(stores, scope, n.run_id)
        assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1
        assert (await stores.at(scope).runs.get_run(n.run_id)).state is RunState.COMPLETED
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM inbox WHERE message_id = ANY($1)", list(bad_ids)) == 0


async def test_a_batch_acknowledges_its_applied_deliveries_with_one_frame(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient
) -> None:
    async with one_batch_at_a_time(settings, stores) as w, host.subscribe(scope) as subscription:
        events = Heard(subscription)
        blocker, *targets = await pause_all(host, events, scope, 7)
        async with held_back(stores, w, host, blocker) as gathered:
            for n in targets:
                await host.resume(answer(n))
            await gathered(len(targets))
            acks = w.consumers.policy.acks
            frames, acknowledged = acks.frames, acks.acknowledged
        await events.until(completed_of({n.run_id for n in targets}), len(targets))
        await w.drain()
        # Once the lock goes, the blocker's claim commits alone and its delivery is acknowledged (one frame);
        # the six's claims go in the next statement (one batch at a time), so every earlier delivery of the
        # channel (the starts, the blocker's resume) was settled before theirs, and the six were its lowest
        # unsettled tags: one frame for all six.
        assert acks.acknowledged - acknowledged == len(targets) + 1
        assert acks.frames - frames == 2


async def test_apply_all_decides_each_command_on_its_own_in_one_statement(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient
) -> None:
    async with host.subscribe(scope) as subscription:
        events = Heard(subscription)
        first, second, third = await pause_all(host, events, scope, 3)
    engine = worker.fleet.engine
    lease = engine.lease
    claims_before = len(engine.scheduler.sizes(CLAIM))

    def resume(notice: Notice, message_id: str, **version: Any) -> Resume:
        cmd = answer(notice)
        if version:
            cmd = cmd.model_copy(update={"version": ClaimVersion(**(cmd.version.model_dump() | version))})
        receipt = Receipt.of(message_id, Command.RESUME.value, cmd)
        return Resume(cmd, receipt=receipt, correlation_id=message_id)

    requests = [
        resume(first, "m-first"),
        resume(second, "m-second"),
        resume(first, "m-first-again"),  # the same pause once more: the first took it
        resume(second, "m-second"),  # the same message twice in one batch: a duplicate
        resume(third, "m-third", suspension_id=third.suspension_id + 1000),  # pinned to another pause
    ]
    outcomes = await engine.apply_all(requests)
    # The four that passed their checks were claimed together, in one statement.
    assert engine.scheduler.sizes(CLAIM)[claims_before:] == [4]
    claimed = [o for o in outcomes if isinstance(o, Claimed)]
    assert [c.run.id for c in claimed] == [first.run_id, second.run_id]
    assert isinstance(outcomes[2], NotSuspended | RunConflict)
    assert isinstance(outcomes[3], AlreadyApplied)
    assert isinstance(outcomes[4], RunConflict)
    for c in claimed:
        assert c.run.state is RunState.RUNNING
        assert c.run.lease_owner == lease.owner
    async with stores.db.connection() as con:
        recorded = await con.raw.fetch(
            "SELECT message_id FROM inbox WHERE app = $1 AND tenant = $2 AND message_id LIKE 'm-%' ORDER BY 1",
            scope.app,
            scope.tenant,
        )
        third_run = await con.raw.fetchrow("SELECT state, revision FROM runs WHERE id = $1", third.run_id)
    assert [r["message_id"] for r in recorded] == ["m-first", "m-second"]
    assert third_run is not None
    assert third_run["state"] == "paused"
    assert third_run["revision"] == third.run_revision


def claim_row(notice: Notice, message_id: str, owner: str, ttl: float) -> ClaimRow:
    """A command's claim of ``notice``'s pause as the committer sends it, with its inbox record."""
    cmd = answer(notice)
    receipt = Receipt.of(message_id, Command.RESUME.value, cmd)
    return ClaimRow(
        notice.run_id, notice.scope.app, notice.scope.tenant, notice.suspension_id, notice.run_revision, None,
        None, owner, ttl, False, None, None, None, None, None, True, receipt.message_id, receipt.routing_key,
        receipt.body_digest, None, None, None, None, None, None, None, None, None, False,
    )  # fmt: skip


@pytest.mark.parametrize("size", [2, 24])
async def test_a_claim_statement_that_raises_writes_nothing_and_each_claim_then_goes_alone(
    stores: Stores, scope: Scope, worker: Worker, host: HostClient, size: int
) -> None:
    """A claim that raises (here: a lease with a ttl the database refuses) fails the whole statement, and
    nothing of any claim in it stays; the committer then applies each alone, so only that one fails."""
    async with host.subscribe(scope) as subscription:
        events = Heard(subscription)
        notices = await pause_all(host, events, scope, size)
    lease = worker.fleet.lease()
    rows = [claim_row(n, f"m-{i}", lease.owner, lease.ttl_seconds) for i, n in enumerate(notices)]
    rows[0] = rows[0]._replace(lease_ttl=float("inf"))
    with pytest.raises(Exception):  # noqa: B017, PT011 - the database's error, whatever its class
        await PostgresCommitter(stores.db).commit(Batch(CLAIM, rows), lambda outs: outs)
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM inbox WHERE message_id LIKE 'm-%'") == 0
        states = await con.raw.fetch("SELECT state FROM runs WHERE id = ANY($1)", [n.run_id for n in notices])
    assert {r["state"] for r in states} == {"paused"}

    # Through the engine, the same batch: the statement fails, then each claim goes alone, with its own
    # outcome (the bad lease's error; every other one claimed).
    engine = worker.fleet.engine
    bad = lease.model_copy(update={"ttl_seconds": float("inf")})
    operations = [
        engine.under(lease=bad if i == 0 else lease).apply(
            Resume(answer(n), receipt=Receipt.of(f"m-{i}", Command.RESUME.value, answer(n)))
        )
        for i, n in enumerate(notices)
    ]
    outcomes = await asyncio.gather(*operations, return_exceptions=True)
    assert isinstance(outcomes[0], Exception)
    assert all(isinstance(o, Claimed) for o in outcomes[1:])
    async with stores.db.connection() as con:
        recorded = await con.raw.fetch("SELECT message_id FROM inbox WHERE message_id LIKE 'm-%'")
    assert {r["message_id"] for r in recorded} == {f"m-{i}" for i in range(1, size)}
