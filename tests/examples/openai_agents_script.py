"""The offline model of the OpenAI Agents SDK example agent (``tests/examples/openai_agents_agent.py``).

It is the SDK's own test double, ``agents.testing.ScriptedModel``, so nothing reaches a network. It plays
a script the run's input carries, one model turn per entry, which makes every worker that takes a run over
give the same turn the same answer:

    {"script": [{"call": [{"tool": "charge", "arguments": {"amount": 5}}]}, {"say": "charged"}]}

``{"say": TEXT}`` answers TEXT (``{tools}`` in it becomes the names of the tools the model was offered);
a script that runs out answers with the last tool result. Any other input is answered "You said: ...".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from agents import Model, ModelResponse, ModelSettings, ModelTracing
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
from agents.tool import Tool
from openai.types.responses.response_prompt_param import ResponsePromptParam


def _turns_taken(items: list[dict[str, Any]]) -> tuple[int, str]:
    """How many tool-calling turns the model took since the last user message, and the last tool result."""
    taken, last_result, in_calls = 0, "", False
    for item in items:
        kind = item.get("type")
        if item.get("role") == "user":
            taken, in_calls = 0, False
        elif kind == "function_call":
            if not in_calls:
                taken += 1
            in_calls = True
            continue
        elif kind == "function_call_output":
            last_result = str(item.get("output", ""))
        in_calls = False
    return taken, last_result


def play(call: ModelCall) -> list[TResponseOutputItem]:
    """The next turn of the script the run's input carries (see the module's docstring)."""
    items = [dict(i) for i in call.input] if isinstance(call.input, list) else [{"role": "user", "content": call.input}]
    question = next(str(i.get("content", "")) for i in reversed(items) if i.get("role") == "user")
    try:
        script = json.loads(question)["script"]
    except (ValueError, KeyError, TypeError):
        return [assistant_message(f"You said: {question}")]
    taken, last_result = _turns_taken(items)
    if taken >= len(script):
        return [assistant_message(last_result)]
    turn = script[taken]
    if "say" in turn:
        offered = ",".join(sorted(tool.name for tool in call.tools))
        return [assistant_message(str(turn["say"]).replace("{tools}", offered))]
    return [
        # Call ids follow from the turn, so a replayed or repeated turn names the same calls.
        function_call(c["tool"], c.get("arguments", {}), call_id=f"call-{taken}-{n}-{c['tool']}")
        for n, c in enumerate(turn["call"])
    ]


class ScriptPlayer(Model):
    """``agents.testing.ScriptedModel`` answering every call with ``play``: a ScriptedModel consumes one
    step per call, so each call gets a fresh one-step script whose step derives the turn from the call."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        model = ScriptedModel([ModelStep.respond(play)])
        return await model.get_response(
            system_instructions,
            input,
            model_settings,
            tools,
            output_schema,
            handoffs,
            tracing,
            previous_response_id=previous_response_id,
            conversation_id=conversation_id,
            prompt=prompt,
        )

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("Intermission runs agents with Runner.run")
