"""The OpenAI Agents SDK integration end to end: the README's example agent
(``tests/examples/openai_agents_agent.py``, its model the SDK's ``agents.testing.ScriptedModel``) in a
whole worker, driven by a host through the test's RabbitMQ vhost, checked in PostgreSQL and in the events
the host receives. No LLM and no network.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, function_tool
from pydantic import BaseModel

from intermission.agent.executor import Executor
from intermission.agent.plugins import load_executor
from intermission.engine.runs import Pause
from intermission.fleet.runtime import Fleet
from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.integrations.openai_agents import (
    ENVELOPE_FORMAT,
    ENVELOPE_VERSION,
    OpenAIAgentsExecutor,
    Prepared,
    tool_env,
)
from intermission.publishers.clients import HostClient, Subscription, version_of
from intermission.schemas.commands import CancelCommand, DecideCommand, Decision, StartCommand
from intermission.schemas.config import RunConfig
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Role
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Continuation, Notice, PendingCall, SuspendReason
from intermission.store import Stores
from tests.examples.openai_agents_script import ScriptPlayer
from tests.support.control import LocalControl
from tests.support.factories import running_run, writes
from tests.support.fleet import charges, fast_settings, outbox_keys, suspension_count
from tests.support.waiting import eventually

WAIT = 30.0
# A pause this version of the integration stored (tests/fixtures/openai_agents/README.md says how it was made).
STORED_PAUSE_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "openai_agents" / "approval_pause_v1.json"
EXAMPLE = "tests.examples.openai_agents_agent:executor"
CONTINUING = "tests.examples.openai_agents_agent:executor_continuing_after_denial"


def start(scope: Scope, *turns: dict[str, Any], config: RunConfig | None = None) -> StartCommand:
    """A run of the example agent playing ``turns`` (one model turn each)."""
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="billing",
        input=json.dumps({"script": list(turns)}),
        config=config or RunConfig(),
    )


def charge(amount: float) -> dict[str, Any]:
    return {"call": [{"tool": "charge", "arguments": {"amount": amount}}]}


async def next_for(events: Subscription[Any], run_id: str, want: Callable[[Any], bool]) -> Any:
    """The next event of ``run_id`` that ``want`` accepts; a run event that ends the run otherwise fails."""
    async with asyncio.timeout(WAIT):
        async for received in events:
            event = received.event
            if getattr(event, "run_id", None) != run_id:
                continue
            if want(event):
                return event
            if isinstance(event, RunEvent) and event.kind in (RunEventKind.COMPLETED, RunEventKind.FAILED):
                raise AssertionError(f"the run ended unexpectedly: {event}")
    raise AssertionError("the subscription ended")


def is_approval(event: Any) -> bool:
    return isinstance(event, Notice) and event.reason is SuspendReason.APPROVAL


def ended(kind: RunEventKind) -> Callable[[Any], bool]:
    return lambda event: isinstance(event, RunEvent) and event.kind is kind


async def decide(host: HostClient, notice: Notice, decision: Decision, reason: str = "") -> str:
    assert notice.checkpoint_id is not None
    return await host.decide(
        DecideCommand(
            scope=notice.scope,
            version=version_of(notice),
            checkpoint_id=notice.checkpoint_id,
            decision=decision,
            reason=reason,
        )
    )


@pytest.fixture
def executor() -> Executor:
    return load_executor(EXAMPLE)


@pytest.fixture
async def events(host: HostClient, scope: Scope) -> AsyncIterator[Subscription[Any]]:
    async with host.subscribe(scope, exclusive=True) as subscription:
        yield subscription


@pytest.fixture
async def running(settings: Settings, stores: Stores, executor: Executor) -> AsyncIterator[None]:
    async with running_worker(settings, executor=executor, stores=stores):
        yield


@pytest.mark.usefixtures("running")
async def test_an_approved_call_pauses_then_runs_once_and_the_run_completes(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    cmd = start(scope, charge(5), {"say": "charged"})
    await host.start(cmd)
    notice = await next_for(events, cmd.run_id, is_approval)

    # The interrupted SDK call is the pending call, its arguments verbatim as the model sent them.
    assert [(p.id, p.name, p.arguments) for p in notice.pending] == [("call-0-0-charge", "charge", '{"amount":5}')]
    assert notice.pending[0].note == 'charge {"amount": 5}'
    assert notice.approvers == []
    s = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    prepared = Prepared.decode(s.continuation.prepared)
    assert (prepared.format, prepared.version) == (ENVELOPE_FORMAT, ENVELOPE_VERSION)
    assert prepared.state is not None
    assert json.loads(prepared.state)["current_turn"] == 1  # the SDK counts the turn it took
    assert await charges(stores, scope, cmd.run_id) == {}  # nothing runs before the decision

    await decide(host, notice, Decision.APPROVE)
    done = await next_for(events, cmd.run_id, ended(RunEventKind.COMPLETED))
    assert done.output == "charged"

    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output, run.step_count) == (RunState.COMPLETED, "charged", 2)
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}
    assert await suspension_count(stores, scope, cmd.run_id) == 0
    keys = await outbox_keys(stores, scope, cmd.run_id)
    tail = f"{scope.app}.{scope.tenant}"
    assert [k for k in keys if not k.startswith("run.metadata")] == [
        f"notice.approval.{tail}",
        f"run.resumed.{tail}",
        f"run.completed.{tail}",
    ]


@pytest.mark.usefixtures("running")
async def test_a_denied_call_never_runs_and_fails_the_run_with_the_deciders_reason(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    cmd = start(scope, charge(500), {"say": "charged"})
    await host.start(cmd)
    notice = await next_for(events, cmd.run_id, is_approval)
    await decide(host, notice, Decision.DENY, reason="too much")
    failed = await next_for(events, cmd.run_id, ended(RunEventKind.FAILED))
    assert failed.error == "too much"
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.error) == (RunState.FAILED, "too much")
    assert await charges(stores, scope, cmd.run_id) == {}


async def test_a_denial_can_be_handed_to_the_model_as_a_rejection(
    settings: Settings, stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    # The script runs out after the charge: the model answers with the last tool result, the rejection.
    cmd = start(scope, charge(500))
    async with running_worker(settings, executor=load_executor(CONTINUING), stores=stores):
        await host.start(cmd)
        notice = await next_for(events, cmd.run_id, is_approval)
        await decide(host, notice, Decision.DENY, reason="too much")
        done = await next_for(events, cmd.run_id, ended(RunEventKind.COMPLETED))
    assert done.output == "denied: too much"
    assert await charges(stores, scope, cmd.run_id) == {}


@pytest.mark.usefixtures("running")
async def test_the_hosts_approvers_narrowed_by_the_calls_own_decide_the_pause(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    email = {"tool": "send_email", "arguments": {"to": "cfo@example.com", "subject": "Q3", "approvers": ["bob", "eve"]}}
    cmd = start(scope, {"call": [email]}, {"say": "sent"}, config=RunConfig(approvers={"send_email": ["alice", "bob"]}))
    await host.start(cmd)
    notice = await next_for(events, cmd.run_id, is_approval)
    assert notice.approvers == ["bob"]  # the model named bob (and eve, whom the host did not)
    s = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    assert s.approvers == ["bob"]


@pytest.mark.usefixtures("running")
async def test_a_narrowed_tool_list_still_holds_after_a_resume(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    # The example's model names the tools it was offered in its last turn, after the resume.
    cmd = start(scope, charge(1), {"say": "offered: {tools}"}, config=RunConfig(tools=["charge"]))
    await host.start(cmd)
    notice = await next_for(events, cmd.run_id, is_approval)
    await decide(host, notice, Decision.APPROVE)
    done = await next_for(events, cmd.run_id, ended(RunEventKind.COMPLETED))
    assert done.output == "offered: charge"
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.config.tools == ["charge"]


@pytest.mark.usefixtures("running")
async def test_max_steps_counts_the_turns_of_the_whole_run_across_its_pauses(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    cmd = start(scope, charge(1), charge(2), {"say": "never"}, config=RunConfig(max_steps=2))
    await host.start(cmd)
    for _ in range(2):
        notice = await next_for(events, cmd.run_id, is_approval)
        await decide(host, notice, Decision.APPROVE)
    failed = await next_for(events, cmd.run_id, ended(RunEventKind.FAILED))
    assert failed.error == "max_steps_reached: the run used all 2 steps"
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 2
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1, "call-1-0-charge": 1}


@pytest.mark.usefixtures("running")
async def test_a_duplicated_decision_resumes_the_run_once(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    cmd = start(scope, charge(5), {"say": "charged"})
    await host.start(cmd)
    notice = await next_for(events, cmd.run_id, is_approval)
    assert notice.checkpoint_id is not None
    decision = DecideCommand(
        scope=scope, version=version_of(notice), checkpoint_id=notice.checkpoint_id, decision=Decision.APPROVE
    )
    first = await host.decide(decision)
    await host.decide(decision, message_id=first)
    await next_for(events, cmd.run_id, ended(RunEventKind.COMPLETED))
    assert await charges(stores, scope, cmd.run_id) == {"call-0-0-charge": 1}
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert sum(k.startswith("run.resumed.") for k in keys) == 1


@pytest.mark.usefixtures("running")
async def test_a_config_the_sdk_agent_cannot_honour_fails_the_run_before_the_agent_runs(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    cmd = start(scope, charge(5), config=RunConfig(model="gpt-4.1"))
    await host.start(cmd)
    failed = await next_for(events, cmd.run_id, ended(RunEventKind.FAILED))
    assert failed.error.startswith("unsupported_config: model:")
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.step_count == 0
    assert await charges(stores, scope, cmd.run_id) == {}


@pytest.mark.usefixtures("running")
async def test_a_pause_stored_by_version_1_of_the_integration_still_resumes(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    # Its SDK state holds a turn of two calls: the price lookup ran before the pause, the charge waits.
    stored = json.loads(STORED_PAUSE_V1.read_text())
    cont = Continuation.model_validate_json(json.dumps(stored["continuation"]))
    pending = [PendingCall.model_validate(p) for p in stored["pending"]]
    assert Prepared.decode(cont.prepared).version == 1
    run, held = await running_run(stores, scope)
    await writes(stores, scope).runs.pause_run(
        run.id, held.owner, Pause(reason=SuspendReason.APPROVAL, pending=pending, continuation=cont, ttl_seconds=0)
    )
    s = await stores.at(scope).suspensions.get_suspension(run.id)
    current = await stores.at(scope).runs.get_run(run.id)
    assert s.checkpoint_id is not None
    await host.decide(
        DecideCommand(
            scope=scope,
            version=ClaimVersion(run_id=run.id, suspension_id=s.id, run_revision=current.revision),
            checkpoint_id=s.checkpoint_id,
            decision=Decision.APPROVE,
        )
    )
    done = await next_for(events, run.id, ended(RunEventKind.COMPLETED))
    assert done.output == "charged"
    assert await charges(stores, scope, run.id) == {"call-0-1-charge": 1}
    ended_run = await stores.at(scope).runs.get_run(run.id)
    assert ended_run.step_count == 2


@pytest.mark.usefixtures("running")
async def test_a_call_of_a_tool_the_run_was_not_given_fails_the_run_and_runs_nothing(
    stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    # The narrowed agent has no charge tool: the SDK refuses the model's call of it (ModelBehaviorError).
    cmd = start(scope, charge(5), {"say": "charged"}, config=RunConfig(tools=["lookup_price"]))
    await host.start(cmd)
    failed = await next_for(events, cmd.run_id, ended(RunEventKind.FAILED))
    assert failed.error == "executor_error: ModelBehaviorError"
    assert await charges(stores, scope, cmd.run_id) == {}
    assert await suspension_count(stores, scope, cmd.run_id) == 0


async def test_a_cancel_of_a_running_sdk_run_ends_it_before_its_next_call(
    settings: Settings, stores: Stores, scope: Scope, host: HostClient, events: Subscription[Any]
) -> None:
    held, release = asyncio.Event(), asyncio.Event()

    @function_tool
    async def hold() -> str:
        """Waits until the test lets it go."""
        held.set()
        await release.wait()
        return "released"

    @function_tool
    async def book(amount: float) -> str:
        """Books a charge; not safe to run twice."""
        env = tool_env()
        await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
        return "booked"

    agent = Agent(name="holder", model=ScriptPlayer(), tools=[hold, book])
    cmd = start(scope, {"call": [{"tool": "hold"}]}, {"call": [{"tool": "book", "arguments": {"amount": 1}}]})
    async with running_worker(settings, executor=OpenAIAgentsExecutor(agent, not_retry_safe=["book"]), stores=stores):
        await host.start(cmd)
        async with asyncio.timeout(WAIT):
            await held.wait()
        await host.cancel(CancelCommand(scope=scope, run_id=cmd.run_id, reason="stop it"))

        async def asked_to_end() -> bool:
            async with stores.db.connection() as con:
                return await con.raw.fetchval("SELECT ending IS NOT NULL FROM runs WHERE id = $1", cmd.run_id) is True

        await eventually(asked_to_end, within=WAIT, what="the cancel recorded on the running run")
        release.set()
        cancelled = await next_for(events, cmd.run_id, ended(RunEventKind.CANCELLED))
    assert cancelled.error == "stop it"
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert run.state is RunState.CANCELLED
    # It ended at its next boundary (before its next model turn, or at that turn's save): the booking never ran.
    assert await charges(stores, scope, cmd.run_id) == {}


async def test_calls_that_share_no_decider_pause_one_after_the_other_and_each_runs_once_approved(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    # In-process (LocalControl) so each decision can come from the user the pause names.
    fleet = Fleet(stores, fast_settings(database_url), load_executor(EXAMPLE))
    control = LocalControl(fleet)
    to_alice = {"tool": "send_email", "arguments": {"to": "a@example.com", "subject": "1", "approvers": ["alice"]}}
    to_bob = {"tool": "send_email", "arguments": {"to": "b@example.com", "subject": "2", "approvers": ["bob"]}}
    cmd = start(scope, {"call": [to_alice, to_bob]}, {"say": "both sent"})
    try:
        await control.start(cmd)
        for decider, call_id in [("alice", "call-0-0-send_email"), ("bob", "call-0-1-send_email")]:
            await fleet.drain()
            s = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
            run = await stores.at(scope).runs.get_run(cmd.run_id)
            assert (s.approvers, [p.id for p in s.pending]) == ([decider], [call_id])
            assert s.checkpoint_id is not None
            pin = ClaimVersion(run_id=run.id, suspension_id=s.id, run_revision=run.revision)
            decision = DecideCommand(scope=scope, version=pin, checkpoint_id=s.checkpoint_id, decision=Decision.APPROVE)
            await control.decide(decision, principal=decider)
        await fleet.drain()
        run = await stores.at(scope).runs.get_run(cmd.run_id)
        # One model turn asked for both; the second pause needed no new turn.
        assert (run.state, run.output, run.step_count) == (RunState.COMPLETED, "both sent", 2)
        # Both calls ran once, each after its own decision, and the session holds both results.
        session = await stores.at(scope).sessions.load(cmd.run_id)
        assert [(m.tool_call_id, m.content) for m in session if m.role is Role.TOOL] == [
            ("call-0-0-send_email", "sent to a@example.com"),
            ("call-0-1-send_email", "sent to b@example.com"),
        ]
    finally:
        await fleet.stop(grace=1)


class Invoice(BaseModel):
    item: str
    amount: int


async def test_a_structured_output_completes_the_run_as_its_json(
    stores: Stores, scope: Scope, database_url: str
) -> None:
    agent = Agent(name="invoicer", model=ScriptPlayer(), output_type=Invoice)
    fleet = Fleet(stores, fast_settings(database_url), OpenAIAgentsExecutor(agent))
    cmd = start(scope, {"say": json.dumps({"item": "tea", "amount": 5})})
    try:
        await LocalControl(fleet).start(cmd)
        await fleet.drain()
    finally:
        await fleet.stop(grace=1)
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, '{"item":"tea","amount":5}')
