"""The transitions a command and an end run as (store/migrations/0005_transitions.sql) write exactly the
rows they describe, and everything unusual writes nothing: a duplicate, a message_id conflict, a malformed
row, a lost lease, a race."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from intermission.engine.commands import Claimed, Resume, Start
from intermission.engine.core import Engine
from intermission.engine.starts import RunDefaults
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.errors import InvalidContinuation, MessageIdConflict, NotSuspended, RunConflict, RunLeaseLost
from intermission.schemas.events import RunEventKind
from intermission.schemas.llm import Message, Role
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.inbox import AlreadyApplied, Receipt
from tests.conftest import MakeStores, race
from tests.support.factories import PausedRun, lease, paused_run, running_run, writes
from tests.support.inspect import Inspector, pin, unexpected, winners


def answer(p: PausedRun, content: str = "sunny") -> ResumeCommand:
    return ResumeCommand(
        scope=p.run.scope,
        version=pin(p),
        results=[ToolAnswer(call_id=c.id, content=content) for c in p.suspension.pending],
    )


def receipt(cmd: ResumeCommand, message_id: str | None = None) -> Receipt:
    return Receipt.of(message_id or str(uuid.uuid4()), "run.resume", cmd)


async def resume(
    stores: Stores, cmd: ResumeCommand, held: Lease, *, receipt: Receipt, correlation_id: str | None = None
) -> Claimed:
    """The resume command as a worker's handler applies it: through an engine over ``stores``, under ``held``."""
    engine = Engine.over(stores).under(lease=held)
    return await engine.apply(Resume(cmd, receipt=receipt, correlation_id=correlation_id))


async def written(db: Inspector, run_id: str) -> dict[str, Any]:
    """What a resume left for ``run_id``, without the values that differ from run to run."""
    run = await db.con.fetchrow(
        "SELECT state::text, revision, lease_owner IS NOT NULL AS leased, lease_expires_at > now() AS live"
        "  FROM runs WHERE id = $1",
        run_id,
    )
    progress = await db.con.fetchrow(
        "SELECT continuation, started, done, ending, approved FROM progress WHERE run_id = $1", run_id
    )
    inbox = await db.con.fetch("SELECT routing_key, outcome FROM inbox WHERE run_id = $1", run_id)
    events = await db.con.fetch(
        "SELECT routing_key, body, correlation_id, headers FROM outbox"
        " WHERE run_id = $1 AND routing_key LIKE 'run.%' ORDER BY id",
        run_id,
    )
    assert progress is not None
    return {
        "run": dict(run) if run is not None else None,
        "pause": await db.suspension(run_id),
        "progress": {k: json.loads(v) if v is not None else None for k, v in progress.items()},
        "inbox": [dict(r) for r in inbox],
        "events": [
            {**dict(e), "body": {k: v for k, v in json.loads(e["body"]).items() if k != "run_id"}} for e in events
        ],
    }


async def test_a_resume_writes_its_claim_lease_snapshot_inbox_record_and_event_and_removes_the_pause(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    held = lease()
    claimed = await resume(stores, answer(p), held, receipt=receipt(answer(p)), correlation_id="m")

    wrote = await written(db, p.run.id)
    assert wrote["run"] == {"state": "running", "revision": p.revision + 1, "leased": True, "live": True}
    assert wrote["pause"] is None
    assert wrote["inbox"] == [{"routing_key": "run.resume", "outcome": "applied"}]
    assert wrote["progress"]["continuation"] == json.loads(p.suspension.continuation.model_dump_json())
    assert [(r["call_id"], r["content"]) for r in wrote["progress"]["done"]] == [("c1", "sunny")]
    (resumed,) = wrote["events"]
    assert resumed["routing_key"] == f"run.resumed.{scope.app}.{scope.tenant}"
    assert resumed["body"] == {
        "kind": "resumed",
        "revision": p.revision + 1,
        "scope": scope.model_dump(),
        "output": None,
        "error": None,
    }
    assert resumed["correlation_id"] == "m"
    # What the fleet is handed matches the rows.
    stored = await stores.at(scope).runs.get_run(p.run.id)
    assert claimed.run == stored
    assert claimed.progress.continuation == p.suspension.continuation
    assert [(r.call_id, r.content) for r in claimed.progress.done] == [("c1", "sunny")]
    assert claimed.progress.scope == scope
    assert claimed.correlation_id == "m"


async def test_a_message_id_recorded_for_another_command_is_a_conflict_and_the_resume_writes_nothing(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    start = StartCommand(scope=scope, run_id=f"run-{uuid.uuid4().hex[:8]}", agent_id="demo")
    defaults = RunDefaults(pause_ttl_seconds=0, max_steps=8)
    starter = Engine.over(stores).under(lease=lease(), defaults=defaults)
    await starter.apply(Start(start, Receipt.of("taken", "run.start", start)))
    before = await db.snapshot()

    with pytest.raises(MessageIdConflict):
        await resume(stores, answer(p), lease(), receipt=receipt(answer(p), "taken"))
    assert await db.snapshot() == before


async def test_a_resume_delivered_again_after_it_applied_is_a_duplicate_and_writes_nothing(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    cmd = answer(p)
    once = receipt(cmd)
    await resume(stores, cmd, lease(), receipt=once)
    before = await db.snapshot()
    with pytest.raises(AlreadyApplied):
        await resume(stores, cmd, lease(), receipt=once)
    assert await db.snapshot() == before


async def test_the_same_resume_delivered_twice_at_once_has_one_effect(
    make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    contenders = await make_stores(2)

    async def one_round() -> tuple[PausedRun, list[Any]]:
        p = await paused_run(contenders[0], scope)
        cmd = answer(p)
        once = receipt(cmd)
        return p, await race(2, lambda i: resume(contenders[i], cmd, lease(), receipt=once))

    for _ in range(5):
        p, results = await one_round()
        assert len(winners(results)) == 1
        assert unexpected(results, (AlreadyApplied,)) == []
        assert await db.count("inbox", p.run.id) == 1
        assert await db.count("outbox", p.run.id) == 2  # the pause's notice and one run.resumed
        assert (await db.run(p.run.id))["revision"] == p.revision + 1


async def test_different_resumes_of_one_pause_at_once_claim_it_once(
    make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    contenders = await make_stores(16)
    p = await paused_run(contenders[0], scope)
    results = await race(
        16,
        lambda i: resume(contenders[i], answer(p, f"answer {i}"), lease(), receipt=receipt(answer(p))),
    )
    assert len(winners(results)) == 1
    assert unexpected(results, (NotSuspended, RunConflict)) == []
    assert await db.count("inbox", p.run.id) == 1
    assert await db.count("progress", p.run.id) == 1
    assert (await db.run(p.run.id))["revision"] == p.revision + 1


@pytest.mark.parametrize(
    ("column", "bad"),
    [("suspensions.continuation", '{"step_index": "three"}'), ("runs.config", '{"tools_restricted": "maybe"}')],
)
async def test_a_resume_of_a_row_that_does_not_decode_is_invalid_continuation_and_writes_nothing(
    stores: Stores, db: Inspector, scope: Scope, column: str, bad: str
) -> None:
    p = await paused_run(stores, scope)
    table, field = column.split(".")
    key = "run_id" if table == "suspensions" else "id"
    await db.con.execute(f"UPDATE {table} SET {field} = $2::jsonb WHERE {key} = $1", p.run.id, bad)
    before = await db.snapshot()
    with pytest.raises(InvalidContinuation):
        await resume(stores, answer(p), lease(), receipt=receipt(answer(p)))
    assert await db.snapshot() == before
    assert (await db.run(p.run.id))["state"] == "paused"


# --- ends -----------------------------------------------------------------------------------------------


async def ended_rows(db: Inspector, run_id: str) -> dict[str, Any]:
    run = await db.con.fetchrow(
        "SELECT state::text, revision, lease_owner, output, error, ended_at IS NOT NULL AS ended"
        "  FROM runs WHERE id = $1",
        run_id,
    )
    assert run is not None
    events = await db.con.fetch("SELECT kind, revision, data FROM run_events WHERE run_id = $1 ORDER BY id", run_id)
    outbox = await db.con.fetch("SELECT routing_key, body, headers FROM outbox WHERE run_id = $1 ORDER BY id", run_id)
    session = await db.con.fetch("SELECT message FROM session_messages WHERE run_id = $1 ORDER BY id", run_id)
    checkpoints = await db.con.fetch("SELECT state, reason FROM checkpoints WHERE run_id = $1", run_id)
    return {
        "run": dict(run),
        "events": [(e["kind"], e["revision"], json.loads(e["data"])) for e in events],
        "outbox": [
            (o["routing_key"], {k: v for k, v in json.loads(o["body"]).items() if k != "run_id"}, o["headers"])
            for o in outbox
        ],
        "session": [json.loads(m["message"]) for m in session],
        "checkpoints": [dict(c) for c in checkpoints],
        "progress": await db.count("progress", run_id),
        "pause": await db.count("suspensions", run_id),
    }


async def test_an_end_writes_its_state_session_checkpoints_and_events_and_removes_progress_and_pause(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    own = [Message(role=Role.USER, content="hi"), Message(role=Role.ASSISTANT, content="done, héllo")]
    run, held = await running_run(stores, scope)
    await db.con.execute(
        "INSERT INTO checkpoints (run_id, suspension_id, app, tenant) VALUES ($1, 0, $2, $3)",
        run.id,
        scope.app,
        scope.tenant,
    )
    event = await writes(stores, scope).runs.end_run(
        run.id, held.owner, RunEventKind.COMPLETED, output="out", own_messages=own, correlation_id="c"
    )
    assert event.revision == run.revision + 1
    rows = await ended_rows(db, run.id)
    assert rows["run"] == {
        "state": "completed",
        "revision": run.revision + 1,
        "lease_owner": None,
        "output": "out",
        "error": None,
        "ended": True,
    }
    assert rows["events"] == [("completed", run.revision + 1, {"output": "out", "error": None})]
    ((key, body, _headers),) = rows["outbox"]
    assert key == f"run.completed.{scope.app}.{scope.tenant}"
    assert body == {
        "kind": "completed",
        "revision": run.revision + 1,
        "scope": scope.model_dump(),
        "output": "out",
        "error": None,
    }
    assert rows["checkpoints"] == [{"state": "rejected", "reason": "completed"}]
    assert [m["content"] for m in rows["session"]] == ["hi", "done, héllo"]
    assert (rows["progress"], rows["pause"]) == (0, 0)


async def test_an_end_by_a_worker_that_does_not_hold_the_run_writes_nothing(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    run, _held = await running_run(stores, scope)
    before = await db.snapshot()
    for intruder in ("somebody-else", ""):
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).runs.end_run(run.id, intruder, RunEventKind.COMPLETED)
    assert await db.snapshot() == before
