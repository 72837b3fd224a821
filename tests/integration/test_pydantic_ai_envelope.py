"""A pause stored by this version of the pydantic-ai integration still resumes after it changes: the
envelope in tests/fixtures/pydantic_ai_envelope_v1.json (written by a real pause: the second of the
three a turn of ask_pricer, charge, send_payment and lookup makes) is put in place of a live pause's, and
the run resumes from it to the end. Regenerate the fixture only with a new envelope version, never in
place: stored pauses of version 1 exist wherever this version ran."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from intermission.agent.plugins import load_executor
from intermission.fleet.runtime import Fleet
from intermission.integrations.pydantic_ai import decode
from intermission.schemas.commands import DecideCommand, Decision, ReplyCommand, ResumeCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason, Suspension
from intermission.store import Stores
from tests.support.control import LocalControl
from tests.support.fleet import charges, fast_settings, start_command

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pydantic_ai_envelope_v1.json"
TURN = [
    ["ask_pricer", {"question": "price?"}],
    ["charge", {"amount": 1}],
    ["send_payment", {"to": "ann", "amount": 2}],
    ["lookup", {"query": "q"}],
]


async def pinned(stores: Stores, scope: Scope, run_id: str) -> tuple[Suspension, ClaimVersion]:
    s = await stores.at(scope).suspensions.get_suspension(run_id)
    run = await stores.at(scope).runs.get_run(run_id)
    return s, ClaimVersion(run_id=run_id, suspension_id=s.id, run_revision=run.revision)


async def test_a_stored_version_1_envelope_resumes_to_the_end(stores: Stores, scope: Scope, database_url: str) -> None:
    stored = FIXTURE.read_bytes()
    envelope = decode(stored)
    assert envelope.version == 1
    assert [(c.id, c.kind) for c in envelope.batch] == [
        ("ask_pricer-0-0", "agent_reply"),
        ("send_payment-0-2", "approval"),
        ("lookup-0-3", "external_tool"),
    ]
    assert [(a.call_id, a.outcome, a.text) for a in envelope.answers] == [("ask_pricer-0-0", "completed", "cheap")]

    settings = fast_settings(database_url, executor="tests.examples.pydantic_ai_agent:executor")
    fleet = Fleet(stores, settings, load_executor(settings.executor))
    control = LocalControl(fleet)
    cmd = start_command(scope, [], input=json.dumps([TURN, "done: {results}"]), agent_id="pydantic-ai")
    await control.start(cmd)
    await fleet.drain()
    s, version = await pinned(stores, scope, cmd.run_id)
    await control.reply(
        ReplyCommand(scope=scope, version=version, reply_with=s.pending[0].reply_with, input="live answer")
    )
    await fleet.drain()
    s, version = await pinned(stores, scope, cmd.run_id)
    assert (s.reason, [p.id for p in s.pending]) == (SuspendReason.APPROVAL, ["send_payment-0-2"])
    # The live pause's envelope is replaced by the stored one, byte for byte.
    async with stores.db.connection() as con:
        await con.raw.execute(
            "UPDATE suspensions SET continuation = jsonb_set(continuation, '{prepared}', to_jsonb($1::text)) "
            "WHERE run_id = $2",
            base64.b64encode(stored).decode(),
            cmd.run_id,
        )
    assert checkpoint_of(s) is not None
    await control.decide(
        DecideCommand(scope=scope, version=version, checkpoint_id=checkpoint_of(s), decision=Decision.APPROVE),
        principal="approver",
    )
    await fleet.drain()
    s, version = await pinned(stores, scope, cmd.run_id)
    assert (s.reason, [p.id for p in s.pending]) == (SuspendReason.EXTERNAL_TOOL, ["lookup-0-3"])
    await control.resume(
        ResumeCommand(scope=scope, version=version, results=[ToolAnswer(call_id="lookup-0-3", content="found")])
    )
    await fleet.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.COMPLETED, run.error
    # The stored answer ("cheap"), not the live one, reached the model: the run continued from the envelope.
    assert run.output is not None
    assert re.fullmatch(
        r"done: ask_pricer=cheap; charge=receipt \d+: charged 1\.0; send_payment=paid 2\.0 to ann \(receipt \d+\); "
        r"lookup=found",
        run.output,
    ), run.output
    assert await charges(stores, scope, cmd.run_id) == {"charge-0-1": 1, "send_payment-0-2": 1}
    await fleet.stop(grace=1)


def checkpoint_of(s: Suspension) -> int:
    assert s.checkpoint_id is not None
    return s.checkpoint_id


async def test_an_envelope_of_an_unknown_version_fails_the_run_as_invalid_continuation(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    settings = fast_settings(database_url, executor="tests.examples.pydantic_ai_agent:executor")
    fleet = Fleet(stores, settings, load_executor(settings.executor))
    control = LocalControl(fleet)
    cmd = start_command(scope, [], input=json.dumps([[["lookup", {"query": "q"}]], "done"]), agent_id="pydantic-ai")
    await control.start(cmd)
    await fleet.drain()
    s, version = await pinned(stores, scope, cmd.run_id)
    later = {**json.loads(s.continuation.prepared), "version": 2}
    async with stores.db.connection() as con:
        await con.raw.execute(
            "UPDATE suspensions SET continuation = jsonb_set(continuation, '{prepared}', to_jsonb($1::text)) "
            "WHERE run_id = $2",
            base64.b64encode(json.dumps(later).encode()).decode(),
            cmd.run_id,
        )
    await control.resume(
        ResumeCommand(scope=scope, version=version, results=[ToolAnswer(call_id="lookup-0-0", content="x")])
    )
    await fleet.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.FAILED
    assert run.error == "invalid_continuation: pydantic-ai envelope version 2 is not 1"
    await fleet.stop(grace=1)
