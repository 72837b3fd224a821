"""A pydantic-ai agent (tests/examples/pydantic_ai_agent.py) run by a real worker process through the real
RabbitMQ and PostgreSQL: each kind of deferred call pauses the run for the right reason and is answered by
whoever may answer it; a turn that needs all three kinds pauses three times, in the model's order, and asks
the model once more only after the last; the session, the tool allowlist and max_steps hold across pauses.
The model is pydantic-ai's FunctionModel playing the script in the run's input: no LLM, no network."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from intermission.fleet.settings import Settings
from intermission.integrations.pydantic_ai import OUTCOME_UNKNOWN, decode
from intermission.publishers.clients import BusClient, HostClient, Received, Subscription, version_of
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ResumeCommand,
    StartCommand,
    ToolAnswer,
)
from intermission.schemas.config import ContextPolicy, PublicationPolicy, RunConfig
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store import Stores
from tests.support.fleet import charges, outbox_keys, suspension_count
from tests.support.waiting import eventually
from tests.support.worker_process import WorkerProcess, worker_process

WAIT = 30.0
AGENT = "tests.examples.pydantic_ai_agent"


def plan(*turns: Any) -> str:
    """The run's input: the script the example agent's model plays (one entry per model turn)."""
    return json.dumps(list(turns))


def start(scope: Scope, prompt: str, **changes: Any) -> StartCommand:
    body: dict[str, Any] = {
        "scope": scope,
        "run_id": f"pyd-{uuid.uuid4().hex[:12]}",
        "agent_id": "pydantic-ai",
        "input": prompt,
    }
    body.update(changes)
    return StartCommand(**body)


@pytest.fixture
async def pyd_worker(
    settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[WorkerProcess]:
    """A worker process running the example agent: the factory ``executor``, or the one a test names by
    parametrizing this fixture indirectly."""
    factory = getattr(request, "param", "executor")
    async with worker_process(settings, f"{AGENT}:{factory}", tmp_path / "worker.log") as w:
        yield w


async def next_event(
    events: Subscription[Any], wanted: Callable[[Received[Any]], bool], *, within: float = WAIT
) -> Received[Any]:
    async with asyncio.timeout(within):
        async for received in events:
            if wanted(received):
                return received
    raise AssertionError("the subscription ended")


async def notice(events: Subscription[Any], run_id: str, after: Notice | None = None) -> Notice:
    """The run's next Notice (a later pause than ``after``: a host hears agent_reply Notices too)."""
    seen = after.suspension_id if after is not None else 0
    received = await next_event(
        events, lambda r: isinstance(r.event, Notice) and r.event.run_id == run_id and r.event.suspension_id > seen
    )
    assert isinstance(received.event, Notice)
    return received.event


async def ended(events: Subscription[Any], run_id: str | Callable[[str], bool]) -> RunEvent:
    """The end of the run ``run_id`` (or of the first run the predicate accepts)."""
    terminal = {RunEventKind.COMPLETED, RunEventKind.FAILED, RunEventKind.CANCELLED}
    wanted = run_id if callable(run_id) else run_id.__eq__
    received = await next_event(
        events, lambda r: isinstance(r.event, RunEvent) and wanted(r.event.run_id) and r.event.kind in terminal
    )
    assert isinstance(received.event, RunEvent)
    return received.event


async def approve(
    host: HostClient, scope: Scope, n: Notice, decision: Decision = Decision.APPROVE, reason: str = ""
) -> None:
    assert n.checkpoint_id is not None
    await host.decide(
        DecideCommand(
            scope=scope, version=version_of(n), checkpoint_id=n.checkpoint_id, decision=decision, reason=reason
        )
    )


async def answer(host: HostClient, scope: Scope, n: Notice, **contents: str) -> None:
    results = [ToolAnswer(call_id=p.id, content=contents.get(p.name, f"answer to {p.name}")) for p in n.pending]
    await host.resume(ResumeCommand(scope=scope, version=version_of(n), results=results))


async def assert_ended_cleanly(stores: Stores, scope: Scope, run_id: str, state: RunState) -> None:
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is state, (run.state, run.error)
    assert await suspension_count(stores, scope, run_id) == 0
    keys = await outbox_keys(stores, scope, run_id)
    notices = sum(k.startswith("notice.") for k in keys)
    assert notices == sum(k.startswith("run.resumed.") for k in keys), keys


async def test_an_approval_approved_runs_the_call_once(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["send_payment", {"to": "bob", "amount": 5}]], "done: {results}"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        n = await notice(events, cmd.run_id)
        assert n.reason is SuspendReason.APPROVAL
        assert [(p.id, p.name, json.loads(p.arguments)) for p in n.pending] == [
            ("send_payment-0-0", "send_payment", {"to": "bob", "amount": 5})
        ]
        assert await charges(stores, scope, cmd.run_id) == {}  # nothing ran before the decision
        await approve(host, scope, n)
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    assert done.output is not None
    assert done.output.startswith("done: send_payment=paid 5.0 to bob (receipt ")
    assert await charges(stores, scope, cmd.run_id) == {"send_payment-0-0": 1}
    await assert_ended_cleanly(stores, scope, cmd.run_id, RunState.COMPLETED)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.output == done.output


async def test_an_approval_denied_fails_the_run_with_the_reason_and_runs_nothing(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["send_payment", {"to": "bob", "amount": 5}]], "done: {results}"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        n = await notice(events, cmd.run_id)
        await approve(host, scope, n, Decision.DENY, "not this month")
        done = await ended(events, cmd.run_id)
    assert (done.kind, done.error) == (RunEventKind.FAILED, "not this month")
    assert await charges(stores, scope, cmd.run_id) == {}
    await assert_ended_cleanly(stores, scope, cmd.run_id, RunState.FAILED)


@pytest.mark.parametrize("pyd_worker", ["lenient_executor"], indirect=True)
async def test_a_denial_can_be_handed_to_the_model_instead(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["transfer", {"amount": 500}]], "done: {results}"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        n = await notice(events, cmd.run_id)
        assert (n.reason, n.pending[0].note) == (SuspendReason.APPROVAL, "transfer 500.0")
        await approve(host, scope, n, Decision.DENY, "too large")
        done = await ended(events, cmd.run_id)
    assert (done.kind, done.output) == (RunEventKind.COMPLETED, "done: transfer=too large")


async def test_external_calls_are_answered_by_the_host_in_the_models_order(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    # ``fetch`` defers itself (CallDeferred); ``lookup`` belongs to an ExternalToolset; ``echo`` runs here.
    turn = [["fetch", {"url": "u"}], ["echo", {"text": "hi"}], ["lookup", {"query": "q"}]]
    cmd = start(scope, plan(turn, "done: {results}"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        n = await notice(events, cmd.run_id)
        assert n.reason is SuspendReason.EXTERNAL_TOOL
        assert [p.name for p in n.pending] == ["fetch", "lookup"]
        await answer(host, scope, n, fetch="page", lookup="42")
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    # echo ran before the pause and its result was kept by it; the model sees every result in its order.
    assert done.output == "done: fetch=page; echo=hi; lookup=42"
    await assert_ended_cleanly(stores, scope, cmd.run_id, RunState.COMPLETED)


async def test_a_question_to_another_agent_is_answered_by_the_bus(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient, bus: BusClient
) -> None:
    cmd = start(scope, plan([["ask_pricer", {"question": "price of tea?"}]], "done: {results}"))
    reply = json.dumps({"performative": "inform", "sender": "pricer", "content": "2.50"})
    async with host.subscribe(scope) as events, bus.subscribe() as asks:
        await host.start(cmd)
        n = await notice(asks, cmd.run_id)
        assert n.reason is SuspendReason.AGENT_REPLY
        assert n.pending[0].name == "ask_pricer"
        assert n.pending[0].reply_with.startswith("rw-")
        await bus.reply(scope, version_of(n), n.pending[0].reply_with, reply)
        done = await ended(events, cmd.run_id)
    assert (done.kind, done.output) == (RunEventKind.COMPLETED, f"done: ask_pricer={reply}")
    await assert_ended_cleanly(stores, scope, cmd.run_id, RunState.COMPLETED)


async def test_one_turn_needing_all_three_kinds_pauses_three_times_then_asks_the_model_once(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient, bus: BusClient
) -> None:
    turn = [
        ["ask_pricer", {"question": "price?"}],
        ["charge", {"amount": 1}],
        ["send_payment", {"to": "ann", "amount": 2}],
        ["lookup", {"query": "q"}],
    ]
    cmd = start(scope, plan(turn, "done: {results}"))
    async with host.subscribe(scope) as events, bus.subscribe() as asks:
        await host.start(cmd)
        first = await notice(asks, cmd.run_id)
        assert (first.reason, [p.name for p in first.pending]) == (SuspendReason.AGENT_REPLY, ["ask_pricer"])
        await bus.reply(scope, version_of(first), first.pending[0].reply_with, "cheap")
        second = await notice(events, cmd.run_id, first)
        assert (second.reason, [p.name for p in second.pending]) == (SuspendReason.APPROVAL, ["send_payment"])
        # Nothing was handed to pydantic-ai yet: it takes a turn's answers all at once.
        assert await charges(stores, scope, cmd.run_id) == {"charge-0-1": 1}
        await approve(host, scope, second)
        third = await notice(events, cmd.run_id, second)
        assert (third.reason, [p.name for p in third.pending]) == (SuspendReason.EXTERNAL_TOOL, ["lookup"])
        assert await charges(stores, scope, cmd.run_id) == {"charge-0-1": 1}
        await answer(host, scope, third, lookup="found")
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    # Every result of the turn, in the model's order, handed over together after the last pause.
    assert done.output is not None
    assert re.fullmatch(
        r"done: ask_pricer=cheap; charge=receipt \d+: charged 1\.0; send_payment=paid 2\.0 to ann \(receipt \d+\); "
        r"lookup=found",
        done.output,
    ), done.output
    assert set(await charges(stores, scope, cmd.run_id)) == {"charge-0-1", "send_payment-0-2"}
    assert all(times == 1 for times in (await charges(stores, scope, cmd.run_id)).values())
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 2  # one model call for the turn, one after the last answer
    await assert_ended_cleanly(stores, scope, cmd.run_id, RunState.COMPLETED)
    session = await stores.at(scope).sessions.load(cmd.run_id)
    assert [m.role for m in session].count(Role.ASSISTANT) == 2


async def test_a_sessions_loaded_history_is_never_saved_twice(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    first = start(scope, "hello", session_id=session)
    second = start(scope, plan([["lookup", {"query": "q"}]], "done: {results}"), session_id=session)
    async with host.subscribe(scope) as events:
        await host.start(first)
        assert (await ended(events, first.run_id)).output == "You said: hello"
        await host.start(second)
        n = await notice(events, second.run_id)
        await answer(host, scope, n, lookup="42")
        done = await ended(events, second.run_id)
    assert done.output == "done: lookup=42"
    kept = await stores.at(scope).sessions.load(session)
    assert [(m.role, m.content) for m in kept] == [
        (Role.USER, "hello"),
        (Role.ASSISTANT, "You said: hello"),
        (Role.USER, second.input),
        (Role.ASSISTANT, ""),
        (Role.TOOL, "42"),
        (Role.ASSISTANT, "done: lookup=42"),
    ]
    # The second run's pause carried the first run's messages as history, not as its own.
    async with stores.db.connection() as con:
        rows = await con.raw.fetchval("SELECT count(*) FROM session_messages WHERE session_id = $1", session)
    assert rows == len(kept)


async def test_a_narrowed_tool_list_still_holds_after_a_resume(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    config = RunConfig(tools=["lookup", "echo"], tools_restricted=True)
    cmd = start(
        scope, plan([["lookup", {"query": "q"}]], [["charge", {"amount": 9}]], "done: {results}"), config=config
    )
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        n = await notice(events, cmd.run_id)
        await answer(host, scope, n, lookup="42")
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    # pydantic-ai never saw ``charge`` offered, and refused the call as an unknown tool.
    assert done.output == """done: charge={"error":"Unknown tool name: 'charge'. Available tools: 'echo', 'lookup'"}"""
    assert await charges(stores, scope, cmd.run_id) == {}


async def test_an_empty_restricted_tool_list_offers_no_tool(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["charge", {"amount": 9}]], "done: {results}"), config=RunConfig(tools_restricted=True))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    assert done.output == """done: charge={"error":"Unknown tool name: 'charge'. No tools available."}"""
    assert await charges(stores, scope, cmd.run_id) == {}


async def test_max_steps_holds_across_pauses(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    lookup = [["lookup", {"query": "q"}]]
    cmd = start(scope, plan(lookup, lookup, [["echo", {"text": "x"}]], "done"), config=RunConfig(max_steps=3))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        for _ in range(2):
            await answer(host, scope, await notice(events, cmd.run_id))
        done = await ended(events, cmd.run_id)
    assert (done.kind, done.error) == (RunEventKind.FAILED, "max_steps_reached: the run used all 3 steps")
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 3
    await assert_ended_cleanly(stores, scope, cmd.run_id, RunState.FAILED)


@pytest.mark.parametrize("pyd_worker", ["quote_executor"], indirect=True)
async def test_a_structured_output_completes_the_run_as_its_json(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["lookup", {"query": "tea"}]], '{"item": "tea", "price": 2.5}'))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        await answer(host, scope, await notice(events, cmd.run_id), lookup="2.5")
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    assert done.output is not None
    assert json.loads(done.output) == {"item": "tea", "price": 2.5}


async def test_the_pause_stores_a_versioned_envelope_and_the_projected_messages(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["echo", {"text": "hi"}], ["lookup", {"query": "q"}]], "done"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        await notice(events, cmd.run_id)
    s = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    env = decode(s.continuation.prepared)
    assert (env.version, env.own_from, env.turn) == (1, 0, 1)
    assert [(c.id, c.kind) for c in env.batch] == [("lookup-0-1", "external_tool")]
    assert env.answers == []
    assert [m.role for m in s.continuation.messages] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert s.continuation.step_index == 1
    assert OUTCOME_UNKNOWN not in json.dumps(env.history)


async def test_the_same_decision_sent_twice_has_one_effect(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["send_payment", {"to": "bob", "amount": 5}]], "done: {results}"))
    async with host.subscribe(scope) as events:
        start_id = await host.start(cmd)
        assert await host.start(cmd, message_id=start_id) == start_id  # a re-sent start: no second run
        n = await notice(events, cmd.run_id)
        assert n.checkpoint_id is not None
        decision = DecideCommand(
            scope=scope, version=version_of(n), checkpoint_id=n.checkpoint_id, decision=Decision.APPROVE
        )
        decide_id = await host.decide(decision)
        await host.decide(decision, message_id=decide_id)
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.COMPLETED, done
    assert await charges(stores, scope, cmd.run_id) == {"send_payment-0-0": 1}
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 1
    assert keys.count(f"run.completed.{scope.app}.{scope.tenant}") == 1
    async with stores.db.connection() as con:
        recorded = await con.raw.fetch("SELECT message_id FROM inbox WHERE run_id = $1", cmd.run_id)
    assert sorted(r["message_id"] for r in recorded) == sorted([start_id, decide_id])


async def test_a_paused_run_cancelled_ends_cancelled_with_its_own_messages(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["lookup", {"query": "q"}]], "done"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        await notice(events, cmd.run_id)
        await host.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="no longer needed"))
        done = await ended(events, cmd.run_id)
    assert (done.kind, done.error) == (RunEventKind.CANCELLED, "no longer needed")
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.CANCELLED
    assert [m.role for m in await stores.at(scope).sessions.load(cmd.run_id)] == [Role.USER, Role.ASSISTANT]


async def test_the_runs_publication_policy_and_max_tokens_hold(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    blocked = start(
        scope,
        plan([["echo", {"text": "x"}]], "the secret plan"),
        config=RunConfig(publication=PublicationPolicy(blocked_terms=["SECRET"])),
    )
    wordy = start(scope, plan("one two three four five six seven eight"), config=RunConfig(max_tokens=3))
    async with host.subscribe(scope) as events:
        await host.start(blocked)
        await host.start(wordy)
        # Whichever ends first: one subscription hears both, so neither end may be skipped over.
        seen: dict[str, RunEvent] = {}
        while len(seen) < 2:
            event = await ended(events, lambda run_id: run_id in {blocked.run_id, wordy.run_id})
            seen[event.run_id] = event
        refused, long = seen[blocked.run_id], seen[wordy.run_id]
    assert refused.kind is RunEventKind.FAILED
    assert refused.error is not None
    assert refused.error.startswith("publication_blocked: ")
    assert refused.output is None
    kept = await stores.at(scope).sessions.load(blocked.run_id)
    assert all("secret" not in m.content for m in kept if m.role is Role.ASSISTANT)  # the refused turn is not kept
    assert [m.role for m in kept] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert long.kind is RunEventKind.FAILED
    assert long.error is not None
    assert long.error.startswith("max_tokens_exceeded: the model's turn took ")


async def test_a_context_window_is_refused_rather_than_ignored(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, "hello", config=RunConfig(context=ContextPolicy(max_messages=4)))
    async with host.subscribe(scope) as events:
        await host.start(cmd)
        done = await ended(events, cmd.run_id)
    assert done.kind is RunEventKind.FAILED
    assert done.error is not None
    assert done.error.startswith("unsupported_config: context.max_messages")


async def test_a_running_run_cancelled_ends_at_its_next_boundary_before_its_next_call(
    stores: Stores, scope: Scope, pyd_worker: WorkerProcess, host: HostClient
) -> None:
    cmd = start(scope, plan([["wait", {"seconds": 3}]], [["charge", {"amount": 1}]], "done"))
    async with host.subscribe(scope) as events:
        await host.start(cmd)

        async def turn_saved() -> bool:
            async with stores.db.connection() as con:
                return bool(await con.raw.fetchval("SELECT count(*) FROM progress WHERE run_id = $1", cmd.run_id))

        # The first turn is saved and its wait is running: the cancel reaches a running run.
        await eventually(turn_saved, within=WAIT, what="the first turn saved")
        await host.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="stop now"))
        done = await ended(events, cmd.run_id)
    assert (done.kind, done.error) == (RunEventKind.CANCELLED, "stop now")
    assert await charges(stores, scope, cmd.run_id) == {}  # the next turn's call never ran
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.CANCELLED
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys.count(f"run.cancelled.{scope.app}.{scope.tenant}") == 1
