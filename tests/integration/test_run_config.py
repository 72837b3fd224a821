"""Every RunConfig field the schema accepts is enforced, or refused at start when this product cannot honour
it: nothing is accepted and silently ignored (schemas/config.py). Each test runs the real fleet on the real
database and asserts what the run did, what it published and what it stored."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from intermission.agent.loop import AgentLoop
from intermission.agent.model import ModelRequest, ModelTurn, ScriptedModel
from intermission.agent.tools import demo_tools
from intermission.fleet.runtime import Fleet
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.config import REDACTED_ARGUMENTS, ContextPolicy, PublicationPolicy, RunConfig
from intermission.schemas.errors import UnsupportedConfig
from intermission.schemas.llm import Role, Usage
from intermission.schemas.run import NewRun, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores
from tests.support.control import LocalControl
from tests.support.factories import lease, writes
from tests.support.fleet import Worker, fast_settings, outbox_bodies, outbox_keys, start_command
from tests.support.inspect import Inspector


@dataclass
class RecordingModel:
    """The scripted model, keeping every request it was sent; ``extra_output`` makes it report more output
    tokens than it was allowed (a client that ignored max_tokens)."""

    requests: list[ModelRequest] = field(default_factory=list)
    extra_output: int = 0
    inner: ScriptedModel = field(default_factory=ScriptedModel)

    async def next_turn(self, request: ModelRequest) -> ModelTurn:
        self.requests.append(request)
        turn = await self.inner.next_turn(request)
        if not self.extra_output:
            return turn
        usage = turn.usage.plus(Usage(output_tokens=self.extra_output, total_tokens=self.extra_output))
        return ModelTurn(content=turn.content, tool_calls=turn.tool_calls, usage=usage)


@pytest.fixture
def model() -> RecordingModel:
    return RecordingModel()


@pytest.fixture
async def w(stores: Stores, database_url: str, model: RecordingModel) -> AsyncIterator[Worker]:
    fleet = Fleet(stores, fast_settings(database_url), AgentLoop(model, demo_tools()))
    yield Worker(fleet=fleet, control=LocalControl(fleet))
    await fleet.stop(grace=5)


async def run_to_rest(w: Worker, cmd: StartCommand) -> None:
    await w.control.start(cmd)
    await w.drain()


async def test_redacted_arguments_leave_the_notice_and_stay_in_the_pause(
    stores: Stores, scope: Scope, w: Worker
) -> None:
    lookup: list[dict[str, Any]] = [
        {"call": [{"tool": "lookup", "arguments": {"query": "account 4711"}}]},
        {"say": "ok"},
    ]
    redacted = start_command(scope, lookup, config=RunConfig(publication=PublicationPolicy(redact_arguments=True)))
    plain = start_command(scope, lookup)
    for cmd in (redacted, plain):
        await run_to_rest(w, cmd)

    (notice,) = await outbox_bodies(stores, scope, redacted.run_id)
    assert [p["arguments"] for p in notice["pending"]] == [REDACTED_ARGUMENTS]
    assert "4711" not in json.dumps(notice)
    (shown,) = await outbox_bodies(stores, scope, plain.run_id)
    assert [json.loads(p["arguments"]) for p in shown["pending"]] == [{"query": "account 4711"}]
    # The pause itself keeps them: whoever executes the call needs them, and the resume works as ever.
    pause = await stores.at(scope).suspensions.get_suspension(redacted.run_id)
    assert json.loads(pause.pending[0].arguments) == {"query": "account 4711"}
    run = await stores.at(scope).runs.get_run(redacted.run_id)
    version = ClaimVersion(run_id=run.id, suspension_id=pause.id, run_revision=run.revision)
    await w.control.resume(ResumeCommand(scope=scope, version=version, results=[ToolAnswer(call_id="call-0-0")]))
    await w.drain()
    assert (await stores.at(scope).runs.get_run(redacted.run_id)).state is RunState.COMPLETED


async def test_a_model_turn_holding_a_blocked_term_fails_the_run_and_publishes_nothing_of_it(
    stores: Stores, scope: Scope, w: Worker
) -> None:
    policy = RunConfig(publication=PublicationPolicy(blocked_terms=["hunter2"]))
    answer = start_command(scope, [{"say": "the password is HUNTER2, obviously"}], config=policy)
    asks = start_command(scope, [{"call": [{"tool": "lookup", "arguments": {"q": "Hunter2"}}]}], config=policy)
    clean = start_command(scope, [{"say": "nothing to hide"}], config=policy)
    for cmd in (answer, asks, clean):
        await run_to_rest(w, cmd)

    for cmd in (answer, asks):
        run = await stores.at(scope).runs.get_run(cmd.run_id)
        assert run.state is RunState.FAILED
        assert run.error is not None
        assert run.error.startswith("publication_blocked:")
        assert run.output is None
        # Nothing of the turn went out: no Notice, and the failure names no term.
        assert await outbox_keys(stores, scope, cmd.run_id) == [f"run.failed.{scope.app}.{scope.tenant}"]
        assert "hunter2" not in json.dumps(await outbox_bodies(stores, scope, cmd.run_id)).casefold()
        # Nor into the session.
        assert [m.role for m in await stores.at(scope).sessions.load(cmd.run_id)] == [Role.USER]
    assert (await stores.at(scope).runs.get_run(clean.run_id)).output == "nothing to hide"


def test_an_empty_blocked_term_would_block_everything_and_is_refused() -> None:
    with pytest.raises(ValidationError):
        PublicationPolicy(blocked_terms=["fine", ""])


async def test_max_tokens_temperature_and_model_reach_the_model_and_max_tokens_holds(
    stores: Stores, scope: Scope, w: Worker, model: RecordingModel
) -> None:
    config = RunConfig(model="demo-large", temperature=0.2, max_tokens=3)
    cmd = start_command(scope, [{"say": "a rather long answer that does not fit"}], config=config)
    await run_to_rest(w, cmd)
    (request,) = model.requests
    assert (request.model, request.temperature, request.max_tokens) == ("demo-large", 0.2, 3)
    # The scripted model cuts its answer at the limit, as a provider does.
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "a rather lon")

    # A client that ignored the limit: its turn is not used, and the run fails saying why.
    model.extra_output = 50
    greedy = start_command(scope, [{"say": "ok"}], config=config)
    await run_to_rest(w, greedy)
    run = await stores.at(scope).runs.get_run(greedy.run_id)
    assert run.state is RunState.FAILED
    assert run.error is not None
    assert run.error.startswith("max_tokens_exceeded:")
    assert run.output is None


async def test_the_model_is_shown_the_recent_messages_its_context_policy_allows(
    stores: Stores, scope: Scope, w: Worker, model: RecordingModel
) -> None:
    turns: list[dict[str, Any]] = [
        {"call": [{"tool": "echo", "arguments": {"n": i}}, {"tool": "echo", "arguments": {"m": i}}]} for i in range(4)
    ]
    cmd = start_command(
        scope, [*turns, {"say": "done"}], config=RunConfig(context=ContextPolicy(max_messages=4, strategy="recent"))
    )
    await run_to_rest(w, cmd)
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED
    shown = [r.messages for r in model.requests]
    assert len(shown[0]) == 1  # the input alone
    for messages in shown:
        assert len(messages) <= 4
        assert messages[0].role is not Role.TOOL  # never a result whose call was cut off
    # The last request saw the last turn and its two results: the most recent messages, in order.
    assert [m.role for m in shown[-1]] == [Role.ASSISTANT, Role.TOOL, Role.TOOL]
    assert json.loads(shown[-1][0].tool_calls[0].arguments) == {"n": 3}
    # The run itself keeps (and saves) its whole conversation.
    assert len(await stores.at(scope).sessions.load(cmd.run_id)) == 1 + 4 * 3 + 1


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (RunConfig(context=ContextPolicy(max_messages=5, strategy="summarise")), "context.strategy"),
        (RunConfig(reasoning_loop="tree_of_thought"), "reasoning_loop"),
        (RunConfig(persona_ref="pirate-captain"), "persona_ref"),
    ],
)
async def test_a_config_this_product_cannot_honour_is_refused_at_start_and_nothing_is_written(
    stores: Stores, scope: Scope, w: Worker, db: Inspector, config: RunConfig, named: str
) -> None:
    before = await db.snapshot()
    cmd = start_command(scope, [{"say": "hi"}], config=config)
    with pytest.raises(UnsupportedConfig, match=named):
        await w.control.start(cmd)
    with pytest.raises(UnsupportedConfig, match=named):
        await writes(stores, scope).runs.create_run(NewRun(run_id=cmd.run_id, agent_id="demo", config=config), lease())
    assert await db.snapshot() == before


async def test_the_reasoning_loop_this_product_runs_may_be_named(stores: Stores, scope: Scope, w: Worker) -> None:
    cmd = start_command(scope, [{"say": "hi"}], config=RunConfig(reasoning_loop="react"))
    await run_to_rest(w, cmd)
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": 2.5},
        {"temperature": -0.1},
        {"max_tokens": -1},
        {"max_steps": -3},
        # Approvers: RabbitMQ user names per tool, each list naming somebody (anyone is: leave the tool out).
        {"approvers": {"send_email": []}},
        {"approvers": {"send_email": [""]}},
        {"approvers": {"send_email": ["a" * 256]}},
        {"approvers": {"send_email": ["é" * 128]}},  # 128 characters, 256 bytes
        {"approvers": {"send_email": ["alice\nbob"]}},
        {"approvers": {"send_email": ["alice\u0000"]}},
        {"approvers": {"": ["alice"]}},
        {"approvers": {"send\temail": ["alice"]}},
        {"approvers": {f"tool{i}": ["alice"] for i in range(65)}},
        {"approvers": {"send_email": [f"user{i}" for i in range(65)]}},
        {"approvers": {"send_email": "alice"}},
        {"approvers": ["alice"]},
    ],
)
def test_values_no_model_can_honour_are_refused_when_the_command_is_parsed(bad: dict[str, Any]) -> None:
    body = {"scope": {"app": "a", "tenant": "t"}, "run_id": "r", "agent_id": "demo", "config": bad}
    with pytest.raises(ValidationError):
        StartCommand.model_validate_json(json.dumps(body))
