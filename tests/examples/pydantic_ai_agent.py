"""A pydantic-ai agent whose approvals, external tools and questions to other agents are durable
Intermission pauses. Run a worker with it:

    INTERMISSION_EXECUTOR=tests.examples.pydantic_ai_agent:executor intermission worker

``send_payment`` needs a person's approval, ``transfer`` asks for one when the amount is large, ``lookup``
and ``fetch`` are run by the caller, ``ask_pricer`` asks another agent; ``charge`` and ``send_payment``
must never run twice, and book every run of theirs in the demo ledger (``demo_charges``).
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

from pydantic import BaseModel
from pydantic_ai import Agent, ApprovalRequired, CallDeferred, RunContext
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import ExternalToolset

from intermission.integrations.pydantic_ai import NOT_RETRY_SAFE, PydanticAIExecutor, ask_agent, tool_env
from tests.examples.pydantic_ai_script import scripted_model

# Offline and deterministic for the tests; a real agent names its model: Agent("openai:gpt-5.2", ...).
MODEL = scripted_model()

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

agent: Agent[None, str] = Agent(MODEL, toolsets=[lookup_tools], instructions="Use the tools; answer briefly.")


@agent.tool_plain(metadata=NOT_RETRY_SAFE)
async def charge(amount: float) -> str:
    """Charges an amount; not safe to run twice."""
    env = tool_env()  # the run and call this is, and the ledger
    receipt = await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
    return f"receipt {receipt}: charged {amount}"


@agent.tool_plain(requires_approval=True, metadata=NOT_RETRY_SAFE)
async def send_payment(to: str, amount: float) -> str:
    """Pays someone; a person approves it first (pauses `approval`), and it never runs twice."""
    env = tool_env()
    receipt = await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
    return f"paid {amount} to {to} (receipt {receipt})"


@agent.tool
async def transfer(ctx: RunContext[None], amount: float) -> str:
    """Transfers an amount; a large one needs an approval first (pauses `approval`)."""
    if amount > 100 and not ctx.tool_call_approved:
        raise ApprovalRequired(metadata={"note": f"transfer {amount}"})
    return f"transferred {amount}"


@agent.tool_plain
async def fetch(url: str) -> str:
    """Fetches a URL; the caller does it and reports the page (pauses `external_tool`)."""
    raise CallDeferred(metadata={"url": url})


@agent.tool_plain
async def ask_pricer(question: str) -> str:
    """Asks the pricing agent; the messaging bus brings its reply (pauses `agent_reply`)."""
    raise ask_agent("pricer")


@agent.tool_plain
async def wait(seconds: float) -> str:
    """Waits up to 10 seconds (runs here, retry-safe)."""
    await asyncio.sleep(min(max(seconds, 0.0), 10.0))
    return "waited"


@agent.tool_plain
async def echo(text: str) -> str:
    """Returns its text (runs here, retry-safe)."""
    return text


def executor() -> PydanticAIExecutor:
    """The factory INTERMISSION_EXECUTOR names."""
    return PydanticAIExecutor(agent)


def lenient_executor() -> PydanticAIExecutor:
    """The same agent, told of a denial instead of failing: the model sees the reason and goes on."""
    return PydanticAIExecutor(agent, on_denial="continue")


class Quote(BaseModel):
    item: str
    price: float


quote_agent = Agent(MODEL, output_type=Quote, toolsets=[lookup_tools])


def quote_executor() -> PydanticAIExecutor:
    """An agent with a structured output: the run completes with its JSON."""
    return PydanticAIExecutor(quote_agent)
