"""The agent loop's pure parts: the scripted model, open turns, tool declarations and RunConfig."""

from __future__ import annotations

import json

from intermission.agent.loop import _open_turn
from intermission.agent.model import ModelRequest, ScriptedModel
from intermission.agent.tools import ToolKind, demo_tools
from intermission.schemas.config import RunConfig
from intermission.schemas.llm import Message, Role, ToolCall
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn


def run_with(script: list[dict[str, object]] | None) -> Run:
    return Run(
        id="r1",
        scope=Scope(app="a", tenant="t"),
        agent_id="demo",
        state=RunState.RUNNING,
        revision=1,
        input="question",
        script=None if script is None else [ScriptTurn.model_validate(t) for t in script],
    )


def request(run: Run, step: int, messages: list[Message] | None = None) -> ModelRequest:
    return ModelRequest(
        run=run, system_prompt="", messages=messages or [], tools=[], config=RunConfig(max_steps=5), step_index=step
    )


async def test_the_scripted_model_plays_one_turn_per_step() -> None:
    run = run_with([{"call": [{"tool": "echo", "arguments": {"a": 1}}, {"tool": "lookup"}]}, {"say": "bye"}])
    model = ScriptedModel()
    first = await model.next_turn(request(run, 0))
    assert [(c.id, c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        ("call-0-0", "echo", {"a": 1}),
        ("call-0-1", "lookup", {}),
    ]
    assert (await model.next_turn(request(run, 0))).tool_calls == first.tool_calls  # deterministic ids
    second = await model.next_turn(request(run, 1))
    assert (second.content, second.tool_calls) == ("bye", [])


async def test_a_script_that_runs_out_answers_with_the_last_tool_result() -> None:
    run = run_with([{"call": [{"tool": "echo"}]}])
    messages = [Message(role=Role.TOOL, content="first"), Message(role=Role.TOOL, content="last")]
    turn = await ScriptedModel().next_turn(request(run, 1, messages))
    assert (turn.content, turn.tool_calls) == ("last", [])


def test_an_open_turn_is_the_last_assistant_turn_with_unanswered_calls() -> None:
    calls = [ToolCall(id="a", name="echo"), ToolCall(id="b", name="lookup")]
    messages = [
        Message(role=Role.USER, content="q"),
        Message(role=Role.ASSISTANT, tool_calls=calls),
        Message(role=Role.TOOL, content="x", tool_call_id="a"),
    ]
    opened = _open_turn(messages)
    assert opened is not None
    assert [c.id for c in opened[1]] == ["b"]
    messages.append(Message(role=Role.TOOL, content="y", tool_call_id="b"))
    assert _open_turn(messages) is None


def test_demo_tools_declare_how_they_may_run() -> None:
    tools = demo_tools()
    declared = {t.name: (t.kind, t.retry_safe) for t in tools.all()}
    assert declared == {
        "ask_agent": (ToolKind.AGENT, True),
        "charge": (ToolKind.LOCAL, False),
        "echo": (ToolKind.LOCAL, True),
        "lookup": (ToolKind.EXTERNAL, True),
        "send_email": (ToolKind.APPROVAL, False),
        "sleep": (ToolKind.LOCAL, True),
    }


def test_tools_allowlist_and_restriction() -> None:
    assert RunConfig().allows_tool("charge")  # nothing listed, not restricted: every tool
    assert not RunConfig(tools_restricted=True).allows_tool("charge")  # an explicit empty allowlist
    assert RunConfig(tools=["echo"]).allows_tool("echo")
    assert not RunConfig(tools=["echo"]).allows_tool("charge")
    assert not RunConfig(all_tools_restricted=True).allows_tool("echo")
    assert RunConfig.model_validate_json('{"tools": []}').tools_restricted is False
