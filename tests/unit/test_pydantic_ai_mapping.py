"""The pydantic-ai integration's pure parts: the envelope's decoding, the deferred batch's order, and the
projection between pydantic-ai's messages and Intermission's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic_ai import CallDeferred, DeferredToolRequests
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart, UserPromptPart

from intermission.integrations.pydantic_ai import (
    AGENT_REPLY,
    MARKER,
    Envelope,
    _batch,
    ask_agent,
    decode,
    encode,
    from_native,
    to_native,
    tool_env,
)
from intermission.schemas.errors import InvalidContinuation
from intermission.schemas.llm import Message, Role, ToolCall

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pydantic_ai_envelope_v1.json"


def test_the_stored_version_1_envelope_decodes_with_its_native_history() -> None:
    envelope = decode(FIXTURE.read_bytes())
    native = envelope.native()
    assert isinstance(native[envelope.turn], ModelResponse)
    ids = [p.tool_call_id for p in native[envelope.turn].parts if isinstance(p, ToolCallPart)]
    assert [c.id for c in envelope.batch] == [i for i in ids if i != "charge-0-1"]
    assert decode(encode(envelope)) == envelope


@pytest.mark.parametrize(
    "prepared",
    [
        b"not json",
        b"[]",
        json.dumps({"format": "something else", "version": 1}).encode(),
        json.dumps({"format": "intermission.pydantic_ai", "version": 2, "history": [], "own_from": 0}).encode(),
        json.dumps({"format": "intermission.pydantic_ai", "version": 1, "history": [], "own_from": "x"}).encode(),
    ],
)
def test_an_envelope_that_is_not_this_versions_is_an_invalid_continuation(prepared: bytes) -> None:
    with pytest.raises(InvalidContinuation):
        decode(prepared)


def test_the_batch_follows_the_models_order_not_the_requests_grouping() -> None:
    parts = [
        ToolCallPart("lookup", {"q": 1}, tool_call_id="a"),
        ToolCallPart("pay", {}, tool_call_id="b"),
        ToolCallPart("ask", {}, tool_call_id="c"),
    ]
    requests = DeferredToolRequests(
        calls=[parts[0], parts[2]], approvals=[parts[1]], metadata={"c": {MARKER: AGENT_REPLY, "agent": "x"}}
    )
    batch = _batch(requests, [ModelRequest(parts=[UserPromptPart("hi")]), ModelResponse(parts=parts)])
    assert [(c.id, c.kind) for c in batch] == [("a", "external_tool"), ("b", "approval"), ("c", "agent_reply")]
    assert batch[0].arguments == '{"q":1}'


def test_ask_agent_marks_the_deferral_as_a_question_to_an_agent() -> None:
    deferral = ask_agent("pricer", topic="tea")
    assert isinstance(deferral, CallDeferred)
    assert deferral.metadata == {MARKER: AGENT_REPLY, "agent": "pricer", "topic": "tea"}


def test_history_round_trips_through_pydantic_ais_messages() -> None:
    history = [
        Message(role=Role.USER, content="hello"),
        Message(role=Role.ASSISTANT, content="", tool_calls=[ToolCall(id="c1", name="lookup", arguments='{"q":1}')]),
        Message(role=Role.TOOL, content="42", tool_call_id="c1", name="lookup"),
        Message(role=Role.ASSISTANT, content="the answer is 42"),
    ]
    native = to_native(history)
    assert isinstance(native[1], ModelResponse)
    assert isinstance(native[2].parts[0], ToolReturnPart)
    assert isinstance(native[3].parts[0], TextPart)
    assert from_native(native) == history


def test_tool_env_outside_a_call_says_so() -> None:
    with pytest.raises(LookupError):
        tool_env()


def test_a_fresh_envelope_has_no_batch() -> None:
    envelope = Envelope(history=[], own_from=0)
    assert (envelope.turn, envelope.batch, envelope.answers) == (-1, [], [])


def test_nothing_but_the_integration_imports_pydantic_ai() -> None:
    # pydantic-ai is an extra: the core must import and run without it.
    root = Path(__file__).resolve().parents[2]
    allowed = {root / "integrations" / "pydantic_ai.py"}
    core = ["intermission", "schemas", "store", "consumers", "publishers", "fleet", "agent", "ops", "integrations"]
    offenders = [
        str(path.relative_to(root))
        for folder in core
        for path in (root / folder).rglob("*.py")
        if path.resolve() not in allowed
        and any(
            line.lstrip().startswith(("import pydantic_ai", "from pydantic_ai"))
            for line in path.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_the_readme_shows_the_example_agent_module_the_tests_run() -> None:
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    section = readme.split("## A pydantic-ai agent\n", 1)[1].split("\n## ", 1)[0]
    module = (root / "tests" / "examples" / "pydantic_ai_agent.py").read_text()
    assert f"```python\n{module}```\n" in section
