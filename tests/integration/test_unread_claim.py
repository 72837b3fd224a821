"""A host's results claim their pause UNREAD, in one statement (store/commands.py, migration 0013): every check
of the checked path is a condition of the claim, a refusal the claim classifies is the command's exactly as
the checked claim's would be, and a refusal whose error needs the pause goes the checked way, which names
it (or claims, for answers that merely came in another order than the calls). Against the real database;
the statements a command runs are read off the store's own executor."""

from __future__ import annotations

from typing import Any

import pytest

from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.errors import (
    NotSuspended,
    RequiresApproval,
    ResultsMismatch,
    RunConflict,
    SuspensionExpired,
)
from intermission.schemas.llm import ToolOutcome
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, PendingCall, SuspendReason
from intermission.store import Stores
from intermission.store.commands import Claimed
from intermission.store.db import Conn
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.wire import Command
from tests.support.factories import PausedRun, lease, paused_run
from tests.support.inspect import Inspector

TWO_CALLS = [
    PendingCall(id="c1", name="lookup", arguments='{"query": "a"}'),
    PendingCall(id="c2", name="lookup", arguments='{"query": "b"}'),
]


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the statements the store runs, in order (the executor takes names only)."""
    ran: list[str] = []
    prepare = Conn._prepare

    def recording(self: Conn, name: str, args: tuple[Any, ...], named: dict[str, Any]) -> Any:
        ran.append(name)
        return prepare(self, name, args, named)

    monkeypatch.setattr(Conn, "_prepare", recording)
    return ran


def results(*answers: tuple[str, str]) -> list[ToolAnswer]:
    return [ToolAnswer(call_id=call_id, content=content) for call_id, content in answers]


async def resume(stores: Stores, p: PausedRun, answers: list[ToolAnswer], message_id: str = "m-1") -> Claimed:
    cmd = ResumeCommand(
        scope=p.run.scope,
        version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
        results=answers,
    )
    return await stores.commands.resume(
        cmd, lease(), receipt=Receipt.of(message_id, Command.RESUME.value, cmd), correlation_id=message_id
    )


async def test_results_that_fit_claim_in_one_statement_with_what_the_checked_path_would_write(
    stores: Stores, scope: Scope, db: Inspector, statements: list[str]
) -> None:
    p = await paused_run(stores, scope, pending=TWO_CALLS)
    statements.clear()
    claimed = await resume(stores, p, results(("c1", "A"), ("c2", "B")))

    assert statements == ["claim_pause"]  # no read before it
    assert (claimed.run.state, claimed.run.revision) == (RunState.RUNNING, p.revision + 1)
    assert claimed.suspension is not None
    assert claimed.suspension.id == p.suspension.id
    assert claimed.progress.continuation == p.suspension.continuation
    assert [(d.call_id, d.content, d.outcome) for d in claimed.progress.done] == [
        ("c1", "A", ToolOutcome.COMPLETED),
        ("c2", "B", ToolOutcome.COMPLETED),
    ]
    stored = await db.con.fetchrow("SELECT done, owner FROM progress WHERE run_id = $1", p.run.id)
    assert stored is not None
    assert stored["owner"] == claimed.run.lease_owner
    assert claimed.progress.updated_at is not None
    assert await db.count("suspensions", p.run.id) == 0
    assert await db.con.fetchval("SELECT count(*) FROM inbox WHERE message_id = 'm-1'") == 1


async def test_results_in_another_order_than_the_calls_are_claimed_the_checked_way_in_the_calls_order(
    stores: Stores, scope: Scope, db: Inspector, statements: list[str]
) -> None:
    p = await paused_run(stores, scope, pending=TWO_CALLS)
    statements.clear()
    claimed = await resume(stores, p, results(("c2", "B"), ("c1", "A")))

    assert statements == ["claim_pause", "read_for_command", "claim_pause"]
    assert [d.call_id for d in claimed.progress.done] == ["c1", "c2"]
    done = await db.con.fetchval("SELECT done::text FROM progress WHERE run_id = $1", p.run.id)
    assert done.index('"c1"') < done.index('"c2"')
    assert claimed.run.revision == p.revision + 1


@pytest.mark.parametrize(
    "answers",
    [
        results(("c1", "A")),  # a call left unanswered
        results(("c1", "A"), ("c2", "B"), ("c3", "C")),  # an answer to no pending call
        results(("c1", "A"), ("c1", "A")),  # one call answered twice
    ],
    ids=["missing", "extra", "twice"],
)
async def test_results_that_do_not_fit_are_results_mismatch_and_write_nothing(
    stores: Stores, scope: Scope, db: Inspector, answers: list[ToolAnswer]
) -> None:
    p = await paused_run(stores, scope, pending=TWO_CALLS)
    before = await db.snapshot()
    with pytest.raises(ResultsMismatch):
        await resume(stores, p, answers)
    assert await db.snapshot() == before


async def test_results_for_an_approval_pause_are_requires_approval_and_write_nothing(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    p = await paused_run(stores, scope, reason=SuspendReason.APPROVAL)
    before = await db.snapshot()
    with pytest.raises(RequiresApproval):
        await resume(stores, p, results(("c1", "A")))
    assert await db.snapshot() == before


async def test_refusals_the_claim_classifies_are_the_commands_without_a_read(
    stores: Stores, scope: Scope, db: Inspector, statements: list[str]
) -> None:
    p = await paused_run(stores, scope)
    other = p.suspension.model_copy(update={"id": p.suspension.id + 1000})
    statements.clear()
    with pytest.raises(RunConflict):
        await resume(stores, PausedRun(run=p.run, suspension=other, revision=p.revision), results(("c1", "A")))
    assert statements == ["claim_pause"]

    await db.con.execute("UPDATE suspensions SET expires_at = now() - interval '1 second' WHERE run_id = $1", p.run.id)
    before = await db.snapshot()
    with pytest.raises(SuspensionExpired):
        await resume(stores, p, results(("c1", "A")), message_id="m-2")
    assert await db.snapshot() == before  # not even the inbox record stays

    gone = PausedRun(run=p.run.model_copy(update={"id": "run-nobody"}), suspension=p.suspension, revision=p.revision)
    with pytest.raises(NotSuspended):
        await resume(stores, gone, results(("c1", "A")), message_id="m-3")


async def test_the_same_message_again_is_already_applied_in_one_statement(
    stores: Stores, scope: Scope, statements: list[str]
) -> None:
    p = await paused_run(stores, scope)
    await resume(stores, p, results(("c1", "A")))
    statements.clear()
    with pytest.raises(AlreadyApplied):
        await resume(stores, p, results(("c1", "A")))
    assert statements == ["claim_pause"]
