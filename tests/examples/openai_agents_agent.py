"""An OpenAI Agents SDK agent run by Intermission (the README shows this module; the tests run it).

    INTERMISSION_EXECUTOR=tests.examples.openai_agents_agent:executor intermission worker

A billing assistant: ``lookup_price`` (retry-safe), ``charge`` (needs approval, NOT retry-safe: it books
one row in the demo ledger ``demo_charges`` per call it really makes) and ``send_email`` (needs approval,
its ``approvers`` argument narrows who may decide). Swap ``ScriptPlayer()`` for a real model (a model
name such as ``"gpt-4.1"``, or any SDK ``Model``) and the rest stays as it is.

The model here is the SDK's own test double, ``agents.testing.ScriptedModel``, so nothing reaches a
network. It plays a script the run's input carries, one model turn per entry, which makes every worker
that takes the run over give the same turn the same answer:

    {"script": [{"call": [{"tool": "charge", "arguments": {"amount": 5}}]}, {"say": "charged"}]}

``{"say": TEXT}`` answers TEXT (``{tools}`` in it becomes the names of the tools the model was offered);
a script that runs out answers with the last tool result. Any other input is answered "You said: ...".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

from agents import Agent, Model, ModelResponse, ModelSettings, ModelTracing, function_tool
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
from agents.tool import Tool
from openai.types.responses.response_prompt_param import ResponsePromptParam

from intermission.integrations.openai_agents import OpenAIAgentsExecutor, tool_env


@function_tool
def lookup_price(item: str) -> str:
    """Looks the price of an item up."""
    return json.dumps({"item": item, "price": 5})


@function_tool(needs_approval=True)
async def charge(amount: float) -> str:
    """Charges the customer; a person approves it first. Not safe to run twice."""
    env = tool_env()
    receipt = await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
    return f"receipt {receipt}: charged {amount}"


@function_tool(needs_approval=True)
def send_email(to: str, subject: str, approvers: list[str]) -> str:
    """Sends an email; a person approves it first (one of ``approvers`` when it names any)."""
    return f"sent to {to}"


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


def billing_agent() -> Agent[Any]:
    return Agent(
        name="billing",
        instructions="You are a billing assistant. Look prices up, charge only what the customer asked for.",
        model=ScriptPlayer(),
        tools=[lookup_price, charge, send_email],
    )


def executor() -> OpenAIAgentsExecutor:
    """The factory INTERMISSION_EXECUTOR names."""
    return OpenAIAgentsExecutor(
        billing_agent(),
        not_retry_safe=["charge", "send_email"],
        approvers_argument="approvers",
        note=lambda tool, args: f"{tool} {json.dumps(args, sort_keys=True)}",
    )


def executor_continuing_after_denial() -> OpenAIAgentsExecutor:
    """The same agent, but a denied call is handed back to the model as a rejection instead of failing."""
    return OpenAIAgentsExecutor(
        billing_agent(), not_retry_safe=["charge", "send_email"], approvers_argument="approvers", on_denial="continue"
    )
