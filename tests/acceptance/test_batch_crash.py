"""A worker SIGKILLed after a BATCH of commands' claims committed together in one statement and before any
of them was acknowledged (group commit, engine/committer.py): every command of the batch is delivered
again, each redelivery is a duplicate, and a survivor finishes every run with its non-retry-safe charge
made exactly once. The dead worker never published the run.resumed events it would have handed over from
memory: the relays publish their held rows once the hold ends, under the rows' own message_ids."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

from intermission import points
from intermission.agent.loop import default_executor
from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from tests.support.fleet import outbox_keys
from tests.support.waiting import eventually
from tests.support.worker_process import worker_process

WAIT = 60.0
RUNS = 12
LOOKUP_THEN_CHARGE = [
    {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]},
    {"call": [{"tool": "charge", "arguments": {"amount": 3}}]},
    {"say": "done"},
]


def start(scope: Scope) -> StartCommand:
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="demo",
        input="hi",
        script=[ScriptTurn.model_validate(t) for t in LOOKUP_THEN_CHARGE],
    )


async def test_a_worker_killed_between_a_batch_commit_and_its_acks_loses_nothing_and_charges_once(
    stores: Stores, scope: Scope, settings: Settings, host: HostClient, tmp_path: Path
) -> None:
    commands = [start(scope) for _ in range(RUNS)]
    run_ids = [c.run_id for c in commands]
    notices: dict[str, Notice] = {}
    subscription = f"test-batch-crash-{uuid.uuid4().hex[:8]}"
    async with (
        running_worker(settings, executor=default_executor(), stores=stores),
        host.subscribe(scope, durable_queue=subscription) as events,
    ):
        for cmd in commands:
            await host.start(cmd)
        async with asyncio.timeout(WAIT):
            async for received in events:
                if isinstance(received.event, Notice):
                    notices[received.event.run_id] = received.event
                    if len(notices) == RUNS:
                        break
    # No worker consumes now: the resumes wait in their queue, and reach the next worker together.
    resume_ids = [
        await host.resume(
            ResumeCommand(
                scope=scope,
                version=version_of(notices[run_id]),
                results=[ToolAnswer(call_id=notices[run_id].pending[0].id, content="42")],
            )
        )
        for run_id in run_ids
    ]
    async with worker_process(
        settings,
        "intermission.agent.loop:default_executor",
        tmp_path / "crashed.log",
        crash_at=points.AFTER_BATCH_COMMIT,
    ) as crashing:
        code = await crashing.died(within=WAIT)
        assert code == -signal.SIGKILL, crashing.stderr()

    # What the batch committed stays: its runs are claimed (running, under the dead worker's lease: the kill
    # came before any of them was handed over), each with its inbox record.
    async with stores.db.connection() as con:
        states = await con.raw.fetch(
            "SELECT r.state::text AS state, count(*) AS n FROM runs r JOIN inbox i ON i.run_id = r.id"
            " WHERE i.message_id = ANY($1) GROUP BY r.state",
            resume_ids,
        )
    by_state = {r["state"]: r["n"] for r in states}
    assert by_state.get("running", 0) >= 2  # a batch: more than one command committed together
    assert "paused" not in by_state  # a recorded command's claim committed with it

    async with running_worker(settings, executor=default_executor(), stores=stores) as survivor:

        async def all_completed() -> bool:
            async with stores.db.connection() as con:
                done = await con.raw.fetchval(
                    "SELECT count(*) FROM runs WHERE id = ANY($1) AND state = 'completed'", run_ids
                )
            return bool(done == RUNS)

        await eventually(all_completed, within=WAIT, what="every run completed by the survivor")
        await survivor.drain()
        # Every run.resumed reached subscribers, each under its row's message_id: the dead worker's held rows
        # through the survivor's relay once their hold ended.
        resumed_key = f"run.resumed.{scope.app}.{scope.tenant}"
        async with stores.db.connection() as con:
            rows = await con.raw.fetch(
                "SELECT run_id, message_id::text AS message_id FROM outbox WHERE run_id = ANY($1) AND routing_key = $2",
                run_ids,
                resumed_key,
            )
        expected = {r["message_id"]: r["run_id"] for r in rows}
        heard: dict[str, str] = {}
        async with host.subscribe(scope, durable_queue=subscription) as events, asyncio.timeout(WAIT):
            async for received in events:
                event = received.event
                if isinstance(event, RunEvent) and event.kind is RunEventKind.RESUMED and received.message_id:
                    heard[received.message_id] = event.run_id
                    if heard.keys() >= expected.keys():
                        break
        assert heard == expected

    async with stores.db.connection() as con:
        per_message = await con.raw.fetch(
            "SELECT message_id, count(*) AS n FROM inbox WHERE message_id = ANY($1) GROUP BY message_id", resume_ids
        )
        charges = await con.raw.fetch(
            "SELECT run_id, count(*) AS n FROM demo_charges"
            " WHERE app = $1 AND tenant = $2 AND run_id = ANY($3) GROUP BY run_id",
            scope.app,
            scope.tenant,
            run_ids,
        )
    assert sorted(r["message_id"] for r in per_message) == sorted(resume_ids)
    assert {r["n"] for r in per_message} == {1}
    assert {r["run_id"]: r["n"] for r in charges} == dict.fromkeys(run_ids, 1)  # the charge ran once per run
    for run_id in run_ids:
        keys = await outbox_keys(stores, scope, run_id)
        assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1  # one effect for two deliveries
        assert (await stores.at(scope).runs.get_run(run_id)).state is RunState.COMPLETED
