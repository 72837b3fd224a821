"""A pydantic-ai agent run by Intermission (the README's "A pydantic-ai agent" shows this module).

    INTERMISSION_EXECUTOR=tests.examples.pydantic_ai_agent:executor intermission worker

The agent is an ordinary pydantic-ai ``Agent``; the three Intermission lines are the import, the wrap
(``PydanticAIExecutor(agent)``) and the factory the setting names. Its tools show each kind of pause:
``send_payment`` needs an approval (``requires_approval=True``), ``transfer`` asks for one when it must
(``ApprovalRequired``), ``lookup`` is run by the caller (an ``ExternalToolset``), ``fetch`` defers itself
(``CallDeferred``), and ``ask_pricer`` asks another agent (``ask_agent``). ``charge`` and ``send_payment``
must never run twice (``NOT_RETRY_SAFE``); both book each run of theirs in the ``demo_charges`` ledger, so a
call that ran twice shows up as two rows.

The model plays offline and deterministically: ``FunctionModel`` reads the run's input as a script, a JSON
list with one entry per model turn, each a list of ``[tool, arguments]`` calls or a final text, in which
``{results}`` stands for what the previous turn's calls returned:

    [[["charge", {"amount": 5}], ["lookup", {"query": "q"}]], "done: {results}"]

Any other input is answered ``You said: <input>``. A real agent names a real model instead
(``Agent("openai:gpt-5.2", ...)``); nothing else changes.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent, ApprovalRequired, CallDeferred, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import ExternalToolset

from intermission.integrations.pydantic_ai import NOT_RETRY_SAFE, PydanticAIExecutor, ask_agent, tool_env


def _turn_index(messages: list[ModelMessage]) -> int:
    """How many model turns this run has taken since its prompt (a session's earlier runs excluded)."""
    start = 0
    for index, message in enumerate(messages):
        if isinstance(message, ModelRequest) and any(isinstance(p, UserPromptPart) for p in message.parts):
            start = index
    return sum(isinstance(m, ModelResponse) for m in messages[start:])


def _prompt(messages: list[ModelMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


def _results(messages: list[ModelMessage]) -> str:
    """What the calls of the last turn returned, in the order they were answered."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, ModelResponse)), default=-1)
    seen: list[str] = []
    for message in messages[last + 1 :]:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, ToolReturnPart):
                    seen.append(f"{part.tool_name}={part.model_response_str()}")
                elif isinstance(part, RetryPromptPart) and part.tool_name:
                    seen.append(f"{part.tool_name}!{part.model_response()}")
    return "; ".join(seen)


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt = _prompt(messages)
    try:
        script: Any = json.loads(prompt)
    except json.JSONDecodeError:
        script = None
    if not isinstance(script, list):
        return ModelResponse(parts=[TextPart(f"You said: {prompt}")])
    n = _turn_index(messages)
    turn: Any = script[n] if n < len(script) else "done"
    if isinstance(turn, str):
        text = turn.replace("{results}", _results(messages))
        if info.output_tools:  # a structured output: the model answers through pydantic-ai's output tool
            return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, text, tool_call_id=f"out-{n}")])
        return ModelResponse(parts=[TextPart(text)])
    return ModelResponse(
        parts=[
            ToolCallPart(name, json.dumps(arguments), tool_call_id=f"{name}-{n}-{k}")
            for k, (name, arguments) in enumerate(turn)
        ]
    )


# Run by the caller: the run pauses `external_tool` and the host reports the result.
lookup_tools = ExternalToolset(
    [
        ToolDefinition(
            name="lookup",
            description="Looks a query up; the caller runs it.",
            parameters_json_schema={"type": "object", "properties": {"query": {"type": "string"}}},
        )
    ]
)

agent: Agent[None, str] = Agent(
    FunctionModel(scripted), toolsets=[lookup_tools], instructions="Use the tools; answer briefly."
)


@agent.tool_plain(metadata=NOT_RETRY_SAFE)
async def charge(amount: float) -> str:
    """Charges an amount; not safe to run twice."""
    env = tool_env()
    receipt = await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
    return f"receipt {receipt}: charged {amount}"


@agent.tool_plain(requires_approval=True, metadata=NOT_RETRY_SAFE)
async def send_payment(to: str, amount: float) -> str:
    """Pays someone; a person approves it first, and it never runs twice."""
    env = tool_env()
    receipt = await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
    return f"paid {amount} to {to} (receipt {receipt})"


@agent.tool
async def transfer(ctx: RunContext[None], amount: float) -> str:
    """Transfers an amount; a large one needs an approval first."""
    if amount > 100 and not ctx.tool_call_approved:
        raise ApprovalRequired(metadata={"note": f"transfer {amount}"})
    return f"transferred {amount}"


@agent.tool_plain
async def fetch(url: str) -> str:
    """Fetches a URL; the caller does it and reports the page."""
    raise CallDeferred(metadata={"url": url})


@agent.tool_plain
async def ask_pricer(question: str) -> str:
    """Asks the pricing agent; the messaging bus brings its reply."""
    raise ask_agent("pricer")


@agent.tool_plain
async def echo(text: str) -> str:
    """Returns its text."""
    return text


def executor() -> PydanticAIExecutor:
    """The factory INTERMISSION_EXECUTOR names."""
    return PydanticAIExecutor(agent)


def lenient_executor() -> PydanticAIExecutor:
    """The same agent, told of a denial instead of failing: the model sees ``ToolDenied`` and goes on."""
    return PydanticAIExecutor(agent, on_denial="continue")


class Quote(BaseModel):
    item: str
    price: float


quote_agent = Agent(FunctionModel(scripted), output_type=Quote, toolsets=[lookup_tools])


def quote_executor() -> PydanticAIExecutor:
    """An agent with a structured output: the run completes with its JSON."""
    return PydanticAIExecutor(quote_agent)
