"""An OpenAI Agents SDK agent that Intermission runs: the README shows this module and the tests run it.

    INTERMISSION_EXECUTOR=tests.examples.openai_agents_agent:executor intermission worker

A billing assistant. ``lookup_price`` is retry-safe; ``charge`` needs a person's approval and must never
run twice (it books one row in the demo ledger, ``demo_charges``, per call it really makes);
``send_email`` needs approval, and its ``approvers`` argument narrows who may decide it. The model is an
offline script player (``tests/examples/openai_agents_script.py``): put a real one in its place (a
model name such as ``"gpt-4.1"``, or any SDK ``Model``) and nothing else changes.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from agents import Agent, function_tool

from intermission.integrations.openai_agents import OpenAIAgentsExecutor, tool_env
from tests.examples.openai_agents_script import ScriptPlayer


@function_tool
def lookup_price(item: str) -> str:
    """Looks the price of an item up."""
    return json.dumps({"item": item, "price": 5})


@function_tool(needs_approval=True)
async def charge(amount: float) -> str:
    """Charges the customer; a person approves it first. Not safe to run twice."""
    env = tool_env()  # the run and call Intermission is running, and the demo ledger
    receipt = await env.ledger.charge(env.run_id, env.call_id, Decimal(str(amount)))
    return f"receipt {receipt}: charged {amount}"


@function_tool(needs_approval=True)
def send_email(to: str, subject: str, approvers: list[str]) -> str:
    """Sends an email; a person approves it first (one of ``approvers`` when it names any)."""
    return f"sent to {to}"


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
    """The same agent, but a denied call goes back to the model as a rejection instead of failing the run."""
    return OpenAIAgentsExecutor(
        billing_agent(), not_retry_safe=["charge", "send_email"], approvers_argument="approvers", on_denial="continue"
    )
