"""The OpenAI Agents SDK integration's pieces that need no servers: what an executor refuses to be built
over, the envelope's decoding, the conversions, and that only the integration imports the SDK."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, function_tool, handoff
from pydantic import BaseModel

from intermission.integrations import openai_agents
from intermission.integrations.openai_agents import OpenAIAgentsExecutor, Prepared, UnsupportedAgent
from intermission.schemas.errors import InvalidContinuation
from intermission.schemas.llm import Message, Role, ToolCall
from tests.examples.openai_agents_agent import billing_agent
from tests.examples.openai_agents_script import ScriptPlayer
from tests.support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]
# The product's folders (``intermission/`` itself holds two modules and links to these).
PRODUCT = ["schemas", "store", "consumers", "publishers", "fleet", "agent", "ops", "integrations"]


@function_tool
def ping() -> str:
    """Pings."""
    return "pong"


def agent(**changes: Any) -> Agent[Any]:
    return Agent(name="a", model=ScriptPlayer(), tools=[ping], **changes)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"tool_use_behavior": {"stop_at_tool_names": ["ping"]}}, "external tools"),
        ({"tool_use_behavior": "stop_on_first_tool"}, "external tools"),
        ({"handoffs": [handoff(Agent(name="b"))]}, "handoffs"),
    ],
)
def test_an_agent_whose_work_could_not_be_made_durable_is_refused_when_the_executor_is_built(
    changes: dict[str, Any], says: str
) -> None:
    with pytest.raises(UnsupportedAgent, match=says):
        OpenAIAgentsExecutor(agent(**changes))


def test_not_retry_safe_must_name_tools_the_agent_has() -> None:
    with pytest.raises(UnsupportedAgent, match="pnig"):
        OpenAIAgentsExecutor(agent(), not_retry_safe=["pnig"])


def test_tracing_is_always_off() -> None:
    from agents import RunConfig

    assert OpenAIAgentsExecutor(
        billing_agent(), run_config=RunConfig(tracing_disabled=False)
    ).run_config.tracing_disabled


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b'{"format": "intermission.openai_agents", "version": 2, "state": null, "turns": []}',
        b'{"format": "something.else", "version": 1}',
        b'{"format": "intermission.openai_agents", "version": 1, "state": 7}',
        b'{"format": "intermission.openai_agents", "version": 1, "surprise": true}',
    ],
)
def test_an_envelope_of_another_format_or_version_is_refused_as_invalid_continuation(raw: bytes) -> None:
    with pytest.raises(InvalidContinuation):
        Prepared.decode(raw)


def test_an_envelope_survives_its_round_trip() -> None:
    prepared = Prepared(state='{"x": 1}', history=2)
    assert Prepared.decode(prepared.encode()) == prepared


def test_messages_become_sdk_items_and_back() -> None:
    messages = [
        Message(role=Role.USER, content="hi"),
        Message(role=Role.ASSISTANT, content="let me see", tool_calls=[ToolCall(id="c1", name="ping", arguments="{}")]),
        Message(role=Role.TOOL, content="pong", tool_call_id="c1"),
        Message(role=Role.ASSISTANT, content="pong it is"),
    ]
    items = openai_agents._to_items(messages)
    assert [i.get("type", i.get("role")) for i in items] == [
        "user",
        "assistant",
        "function_call",
        "function_call_output",
        "assistant",
    ]
    back = openai_agents._from_items(items)
    assert [(m.role, m.content, [c.id for c in m.tool_calls], m.tool_call_id) for m in back] == [
        (m.role, m.content, [c.id for c in m.tool_calls], m.tool_call_id) for m in messages
    ]


class Invoice(BaseModel):
    amount: int


@dataclasses.dataclass
class Receipt:
    number: int


def test_an_output_is_its_text_or_the_json_of_a_structured_output() -> None:
    assert openai_agents._output("done") == "done"
    assert openai_agents._output(Invoice(amount=5)) == '{"amount":5}'
    assert openai_agents._output(Receipt(number=1)) == '{"number": 1}'
    assert openai_agents._output([1, 2]) == "[1, 2]"


def test_only_the_integration_imports_the_sdk() -> None:
    """The core never imports ``agents``: it is an extra, and a worker without it must still start."""
    importers = []
    paths = [*(ROOT / "intermission").glob("*.py"), *(p for f in PRODUCT for p in (ROOT / f).rglob("*.py"))]
    assert len(paths) > 50
    for path in sorted(paths):
        for node in ast.walk(parse_file(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n == "agents" or n.startswith("agents.") for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["integrations/openai_agents.py"]


def test_the_runs_temperature_and_max_tokens_go_to_the_model_settings() -> None:
    from agents import ModelSettings

    from intermission.schemas.config import RunConfig

    assert openai_agents._model_settings(None, RunConfig()) is None
    settings = openai_agents._model_settings(ModelSettings(top_p=0.5), RunConfig(temperature=0.2, max_tokens=64))
    assert settings is not None
    assert (settings.temperature, settings.max_tokens, settings.top_p) == (0.2, 64, 0.5)


def test_the_readme_shows_the_example_agent_module_the_tests_run() -> None:
    module = (ROOT / "tests" / "examples" / "openai_agents_agent.py").read_text()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## An OpenAI Agents SDK agent") : readme.index("## What the store guarantees")]
    assert f"```python\n{module}```" in section
