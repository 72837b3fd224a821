"""The agent loop under a lease, end to end on the real database: every pause reason, both approval
outcomes, resumes that honour the stored RunConfig, max_steps, sessions, cancel and expiry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime

import pytest

from intermission.engine.commands import StaleExpiry
from intermission.schemas.answers import reply_progress
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    ToolAnswer,
)
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import (
    Forbidden,
    InvalidState,
    NotAgentReplyResumable,
    NotSuspended,
    RequiresApproval,
    ResultsMismatch,
)
from intermission.schemas.llm import Role
from intermission.schemas.resume import ResumeAdmissionRequest
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason, Suspension
from intermission.store import Stores
from tests.support.factories import writes
from tests.support.fleet import (
    Worker,
    charges,
    fast_settings,
    outbox_bodies,
    outbox_keys,
    start_command,
    suspension_count,
    worker,
)


@pytest.fixture
async def w(stores: Stores, database_url: str) -> AsyncIterator[Worker]:
    one = worker(stores, fast_settings(database_url))
    yield one
    await one.fleet.stop(grace=5)


async def pause_of(stores: Stores, scope: Scope, run_id: str) -> tuple[Suspension, int]:
    s = await stores.at(scope).suspensions.get_suspension(run_id)
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.PAUSED
    return s, run.revision


def version(s: Suspension, revision: int) -> ClaimVersion:
    return ClaimVersion(run_id=s.run_id, suspension_id=s.id, run_revision=revision)


async def test_external_tool_pause_and_resume(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(scope, [{"call": [{"tool": "lookup", "arguments": {"query": "weather"}}]}, {"say": "sunny"}])
    await w.control.start(cmd, correlation_id="m-start")
    await w.drain()

    s, revision = await pause_of(stores, scope, cmd.run_id)
    assert s.reason is SuspendReason.EXTERNAL_TOOL
    assert [(p.name, json.loads(p.arguments)) for p in s.pending] == [("lookup", {"query": "weather"})]
    assert s.expires_at is None  # pause ttl 0: no deadline
    assert await outbox_keys(stores, scope, cmd.run_id) == [f"notice.external_tool.{scope.app}.{scope.tenant}"]
    notice = (await outbox_bodies(stores, scope, cmd.run_id))[0]
    assert notice["suspension_id"] == s.id
    assert notice["run_revision"] == revision
    assert notice["checkpoint_id"] is None

    answer = ResumeCommand(
        scope=scope, version=version(s, revision), results=[ToolAnswer(call_id=s.pending[0].id, content="rain")]
    )
    await w.control.resume(answer, correlation_id="m-resume")
    await w.drain()

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.COMPLETED
    assert run.output == "sunny"
    assert run.revision == revision + 2  # the claim, then the end
    assert await suspension_count(stores, scope, cmd.run_id) == 0
    assert await outbox_keys(stores, scope, cmd.run_id) == [
        f"notice.external_tool.{scope.app}.{scope.tenant}",
        f"run.resumed.{scope.app}.{scope.tenant}",
        f"run.completed.{scope.app}.{scope.tenant}",
    ]
    # The tool result reached the model as the call's answer, in the run's session.
    history = await stores.at(scope).sessions.load(cmd.run_id)
    assert [m.content for m in history if m.role is Role.TOOL] == ["rain"]


async def test_resume_refuses_mismatched_results_and_leaves_the_run_paused(
    stores: Stores, scope: Scope, w: Worker
) -> None:
    cmd = start_command(scope, [{"call": [{"tool": "lookup", "arguments": {"query": "q"}}]}])
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    for results in ([], [ToolAnswer(call_id="nope")], [ToolAnswer(call_id=s.pending[0].id)] * 2):
        with pytest.raises(ResultsMismatch):
            await w.control.resume(ResumeCommand(scope=scope, version=version(s, revision), results=results))
    assert (await pause_of(stores, scope, cmd.run_id))[1] == revision
    assert await outbox_keys(stores, scope, cmd.run_id) == [f"notice.external_tool.{scope.app}.{scope.tenant}"]


async def test_approval_approved_runs_the_call_through_the_approval_path(
    stores: Stores, scope: Scope, w: Worker
) -> None:
    email = {"to": "cfo@example.com", "subject": "Q3", "body": "numbers", "approvers": ["alice", "bob"]}
    cmd = start_command(scope, [{"call": [{"tool": "send_email", "arguments": email}]}])
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    assert s.reason is SuspendReason.APPROVAL
    assert s.checkpoint_id is not None
    assert s.approvers == ["alice", "bob"]
    assert "cfo@example.com" in s.pending[0].note

    decide = DecideCommand(
        scope=scope, version=version(s, revision), checkpoint_id=s.checkpoint_id, decision=Decision.APPROVE
    )
    with pytest.raises(Forbidden):
        await w.control.decide(decide, principal="mallory")
    with pytest.raises(RequiresApproval):
        await w.control.resume(
            ResumeCommand(scope=scope, version=version(s, revision), results=[ToolAnswer(call_id=s.pending[0].id)])
        )
    await w.control.decide(decide, principal="bob")
    await w.drain()

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.COMPLETED
    assert run.output == "sent"  # the script ran out: the last tool result is the output
    async with stores.db.connection() as con:
        checkpoint = await con.raw.fetchrow("SELECT state, decided_by FROM checkpoints WHERE id = $1", s.checkpoint_id)
    assert checkpoint is not None
    assert (checkpoint["state"], checkpoint["decided_by"]) == ("approved", "bob")


async def test_approval_denied_fails_the_run_with_the_deciders_reason(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(scope, [{"call": [{"tool": "send_email", "arguments": {"to": "x@example.com"}}]}])
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    assert s.checkpoint_id is not None
    await w.control.decide(
        DecideCommand(
            scope=scope,
            version=version(s, revision),
            checkpoint_id=s.checkpoint_id,
            decision=Decision.DENY,
            reason="not during the audit",
        ),
        principal="anyone",  # the pause names no approvers: any host may decide
    )
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.FAILED
    assert run.error == "not during the audit"
    assert await outbox_keys(stores, scope, cmd.run_id) == [
        f"notice.approval.{scope.app}.{scope.tenant}",
        f"run.resumed.{scope.app}.{scope.tenant}",
        f"run.failed.{scope.app}.{scope.tenant}",
    ]


async def test_non_retry_safe_call_runs_once_and_local_calls_continue(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(
        scope,
        [
            {"call": [{"tool": "echo", "arguments": {"x": 1}}, {"tool": "charge", "arguments": {"amount": 5}}]},
            {"say": "paid"},
        ],
    )
    await w.control.start(cmd)
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.COMPLETED
    assert run.output == "paid"
    assert await charges(stores, scope, cmd.run_id) == {"call-0-1": 1}


async def test_one_turn_asking_for_two_kinds_pauses_for_each_in_turn(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(
        scope,
        [
            {
                "call": [
                    {"tool": "lookup", "arguments": {"query": "a"}},
                    {"tool": "send_email", "arguments": {"to": "b@example.com"}},
                    {"tool": "lookup", "arguments": {"query": "c"}},
                ]
            },
            {"say": "done"},
        ],
    )
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    assert s.reason is SuspendReason.EXTERNAL_TOOL
    assert [p.id for p in s.pending] == ["call-0-0", "call-0-2"]  # both lookups pending together
    await w.control.resume(
        ResumeCommand(
            scope=scope,
            version=version(s, revision),
            results=[ToolAnswer(call_id="call-0-2", content="C"), ToolAnswer(call_id="call-0-0", content="A")],
        )
    )
    await w.drain()
    s2, revision2 = await pause_of(stores, scope, cmd.run_id)
    assert s2.reason is SuspendReason.APPROVAL
    assert [p.id for p in s2.pending] == ["call-0-1"]
    assert s2.id != s.id
    assert await suspension_count(stores, scope, cmd.run_id) == 1  # exactly one live pause: the new one
    assert s2.checkpoint_id is not None
    await w.control.decide(
        DecideCommand(
            scope=scope, version=version(s2, revision2), checkpoint_id=s2.checkpoint_id, decision=Decision.APPROVE
        ),
        principal="host",
    )
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.COMPLETED
    # Answers went to the pending calls in pending order, whatever order they came in.
    tool_messages = [m for m in await stores.at(scope).sessions.load(cmd.run_id) if m.role is Role.TOOL]
    assert [(m.tool_call_id, m.content) for m in tool_messages] == [
        ("call-0-0", "A"),
        ("call-0-2", "C"),
        ("call-0-1", "sent"),
    ]
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert sum(k.startswith("notice.") for k in keys) == 2  # one Notice per pause


async def test_resume_runs_under_the_stored_config_only(stores: Stores, scope: Scope, w: Worker) -> None:
    # Started with an explicit allowlist that withdrew every tool but lookup.
    cmd = start_command(
        scope,
        [
            {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]},
            {"call": [{"tool": "charge", "arguments": {"amount": 1}}]},
            {"say": "end"},
        ],
        config=RunConfig(tools=["lookup"], tools_restricted=True, max_steps=5),
    )
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    assert s.continuation.config.tools == ["lookup"]
    assert s.continuation.config.tools_restricted is True
    await w.control.resume(
        ResumeCommand(scope=scope, version=version(s, revision), results=[ToolAnswer(call_id="call-0-0", content="r")])
    )
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.COMPLETED
    # charge was withdrawn before the pause, so it stays withdrawn after it: never run.
    assert await charges(stores, scope, cmd.run_id) == {}
    tool_messages = [m for m in await stores.at(scope).sessions.load(cmd.run_id) if m.role is Role.TOOL]
    assert "not available" in tool_messages[-1].content


async def test_resume_on_the_last_step_fails_as_max_steps_reached(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(
        scope, [{"call": [{"tool": "lookup", "arguments": {}}]}, {"say": "never"}], config=RunConfig(max_steps=1)
    )
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    await w.control.resume(
        ResumeCommand(scope=scope, version=version(s, revision), results=[ToolAnswer(call_id="call-0-0", content="r")])
    )
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.FAILED
    assert run.error is not None
    assert run.error.startswith("max_steps_reached")
    assert await suspension_count(stores, scope, cmd.run_id) == 0
    # The result was recorded before the run failed.
    assert [m.content for m in await stores.at(scope).sessions.load(cmd.run_id) if m.role is Role.TOOL] == ["r"]


async def test_a_resumed_run_saves_only_its_own_messages_into_its_session(
    stores: Stores, scope: Scope, w: Worker
) -> None:
    first = start_command(scope, [{"say": "hello"}], session_id="shared", input="first question")
    await w.control.start(first)
    await w.drain()
    second = start_command(
        scope,
        [{"call": [{"tool": "lookup", "arguments": {}}]}, {"say": "second answer"}],
        session_id="shared",
        input="second question",
    )
    await w.control.start(second)
    await w.drain()
    s, revision = await pause_of(stores, scope, second.run_id)
    assert s.continuation.new_messages_from == 2  # the first run's question and answer are history
    assert s.continuation.session_id == "shared"
    await w.control.resume(
        ResumeCommand(scope=scope, version=version(s, revision), results=[ToolAnswer(call_id="call-0-0", content="x")])
    )
    await w.drain()
    session = await stores.at(scope).sessions.load("shared")
    assert [m.content for m in session if m.role is not Role.TOOL] == [
        "first question",
        "hello",
        "second question",
        "",  # the assistant turn that called lookup
        "second answer",
    ]
    assert len(session) == 6  # nothing saved twice


async def test_cancel_ends_a_paused_run_and_rejects_its_checkpoint(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(scope, [{"call": [{"tool": "send_email", "arguments": {}}]}])
    await w.control.start(cmd)
    await w.drain()
    s, _ = await pause_of(stores, scope, cmd.run_id)
    await w.control.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="user gave up"))
    await w.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.CANCELLED
    assert await suspension_count(stores, scope, cmd.run_id) == 0
    async with stores.db.connection() as con:
        state = await con.raw.fetchval("SELECT state FROM checkpoints WHERE id = $1", s.checkpoint_id)
    assert state == "rejected"
    with pytest.raises(InvalidState):
        await w.control.cancel(CancelCommand(scope=scope, run_id=cmd.run_id))


async def test_expire_fails_the_run_with_a_reason_naming_the_deadline(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    w = worker(stores, fast_settings(database_url, pause_ttl_seconds=1))
    try:
        cmd = start_command(scope, [{"call": [{"tool": "lookup", "arguments": {}}]}])
        await w.control.start(cmd)
        await w.drain()
        s, revision = await pause_of(stores, scope, cmd.run_id)
        assert s.expires_at is not None
        async with stores.db.connection() as con:
            now = await con.raw.fetchval("SELECT now()")
        # Not expired by now: the expiry claim finds nothing and nothing moves (a stale expiry, which the
        # consumer acknowledges: its claim was refused NotSuspended).
        with pytest.raises(StaleExpiry) as stale:
            await w.control.expire(ExpireCommand(scope=scope, version=version(s, revision), expired_by=now))
        assert isinstance(stale.value.__cause__, NotSuspended)
        assert await pause_of(stores, scope, cmd.run_id) == (s, revision)
        await wait_for_db_clock(stores, s.expires_at)
        await w.control.expire(ExpireCommand(scope=scope, version=version(s, revision), expired_by=s.expires_at))
        await w.drain()
        run = await stores.at(scope).runs.get_run(cmd.run_id)
        assert run.state is RunState.FAILED
        assert run.error is not None
        assert "suspension_expired" in run.error
        assert s.expires_at.isoformat() in run.error
        assert (await outbox_keys(stores, scope, cmd.run_id))[-1] == f"run.expired.{scope.app}.{scope.tenant}"
    finally:
        await w.fleet.stop(grace=5)


async def wait_for_db_clock(stores: Stores, moment: datetime) -> None:
    """Wait until the database clock passes ``moment``: the database decides deadlines, not this process."""
    async with asyncio.timeout(10), stores.db.connection() as con:
        await con.raw.execute(
            "SELECT pg_sleep(GREATEST(0, extract(epoch FROM $1::timestamptz - clock_timestamp())))", moment
        )
        assert await con.raw.fetchval("SELECT clock_timestamp() > $1", moment)


async def test_agent_reply_pause_is_answered_by_the_bus_exactly_once(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(
        scope, [{"call": [{"tool": "ask_agent", "arguments": {"agent": "pricer", "question": "how much?"}}]}]
    )
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    assert s.reason is SuspendReason.AGENT_REPLY
    (asked,) = s.pending
    assert asked.reply_with.startswith("rw-")
    # A host may not answer what waits on a peer.
    with pytest.raises(NotAgentReplyResumable):
        await w.control.resume(
            ResumeCommand(scope=scope, version=version(s, revision), results=[ToolAnswer(call_id=asked.id)])
        )
    # The bus's reply input is kept and handed over byte for byte (note the escapes and the spacing).
    reply_input = '{"performative": "inform", "sender": "pricer", "content": "42 \\u20ac\\n"}'
    reply = ReplyCommand(scope=scope, version=version(s, revision), reply_with=asked.reply_with, input=reply_input)
    with pytest.raises(ResultsMismatch):
        await w.control.reply(reply.model_copy(update={"reply_with": "rw-someone-else"}))
    assert await w.control.reply(reply, correlation_id="bus-1") is not None
    assert await w.control.reply(reply, correlation_id="bus-1") is None  # redelivered: no second execution
    await w.drain()

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, reply_input)
    admission = await stores.at(scope).resume.get_resume_admission(cmd.run_id, s.id)
    assert admission.request.input == reply_input.encode()
    assert admission.claimed_revision == revision + 1
    start = await stores.at(scope).resume.get_resume_start(cmd.run_id, s.id)
    assert (start.fresh, start.suspension) == (False, None)  # a read never grants
    assert await outbox_keys(stores, scope, cmd.run_id) == [
        f"notice.agent_reply.{scope.app}.{scope.tenant}",
        f"run.resumed.{scope.app}.{scope.tenant}",
        f"run.completed.{scope.app}.{scope.tenant}",
    ]


async def test_a_reply_admitted_by_a_worker_that_died_before_starting_is_started_by_the_takeover(
    stores: Stores, scope: Scope, w: Worker
) -> None:
    cmd = start_command(scope, [{"call": [{"tool": "ask_agent", "arguments": {"agent": "a", "question": "q"}}]}])
    await w.control.start(cmd)
    await w.drain()
    s, revision = await pause_of(stores, scope, cmd.run_id)
    dead = Lease(owner="worker-that-died", ttl_seconds=0.2)
    first = reply_progress(s, s.pending[0].reply_with, '"the answer"', dead.owner)
    request = ResumeAdmissionRequest(scope=scope, version=version(s, revision), input=b'"the answer"')
    # The admission committed (claim, lease, snapshot) and then its worker died: no start was granted.
    await writes(stores, scope).resume.admit_resume_leased(request, dead, first)

    await w.drain(wait_for_lapsed=True)

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, '"the answer"')
    start = await stores.at(scope).resume.get_resume_start(cmd.run_id, s.id)
    assert start.request_digest == request.digest()
