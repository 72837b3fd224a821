"""Tools, and the demo agent's tools (docs/contracts.md, "The demo agent").

A tool declares how it may be run, because that is what decides what a crash may do to it:

- ``LOCAL`` tools run in the worker. A retry-safe one may run again after a takeover; one that is NOT
  retry-safe is recorded as ``started`` before its handler is called, and a worker that takes the run over
  never calls it again (the model is told its outcome is unknown).
- ``EXTERNAL`` tools are run by the caller: the run pauses with reason ``external_tool``.
- ``APPROVAL`` tools pause with reason ``approval``; once a person approves, they run here, through the
  approval path (the authorizer is not asked again).
- ``AGENT`` tools ask another agent: the run pauses with reason ``agent_reply`` and a fresh ``reply_with``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Any, ClassVar, Protocol

from intermission.schemas.scope import Scope

MAX_SLEEP_SECONDS = 60.0


class ToolKind(StrEnum):
    LOCAL = "local"
    EXTERNAL = "external"
    APPROVAL = "approval"
    AGENT = "agent"


class ToolFailed(Exception):
    """A tool's handler failed; the model sees the message as the call's error."""


class Ledger(Protocol):
    """Where the demo's ``charge`` tool books a charge (``store.ledger.DemoLedger``): one row per call, under
    the scope of the run the tool runs for (the ledger a tool is given is bound to it)."""

    async def charge(self, run_id: str, call_id: str, amount: Decimal) -> int: ...


@dataclass(frozen=True)
class ToolEnv:
    """What a tool handler may use: the call it is running, and the demo ledger. Never the database."""

    run_id: str
    call_id: str
    scope: Scope
    ledger: Ledger


class Tool:
    """A tool: a name, a kind, whether it is safe to run twice, and (for tools that run here) a handler."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    kind: ClassVar[ToolKind] = ToolKind.LOCAL
    retry_safe: ClassVar[bool] = True

    async def run(self, arguments: dict[str, Any], env: ToolEnv) -> str:
        raise ToolFailed(f"{self.name} does not run inside the worker")

    def approvers(self, arguments: dict[str, Any]) -> list[str]:
        """Who the call's own arguments name to decide its approval: the model's word, so it can only
        narrow the host's list for the tool (``RunConfig.approvers``), never widen it (the agent loop's
        ``_approval_group``); empty names nobody and narrows nothing."""
        return []

    def note(self, arguments: dict[str, Any]) -> str:
        """Why this call needs an approval, for the person deciding."""
        return ""


class Echo(Tool):
    name = "echo"
    description = "Returns its arguments as the result."

    async def run(self, arguments: dict[str, Any], env: ToolEnv) -> str:
        return json.dumps(arguments, sort_keys=True)


class Sleep(Tool):
    name = "sleep"
    description = "Waits {seconds} (at most 60), then returns 'slept'."

    async def run(self, arguments: dict[str, Any], env: ToolEnv) -> str:
        try:
            seconds = float(arguments.get("seconds", 0))
        except (TypeError, ValueError) as exc:
            raise ToolFailed("seconds must be a number") from exc
        await asyncio.sleep(max(0.0, min(seconds, MAX_SLEEP_SECONDS)))
        return "slept"


class Charge(Tool):
    """NOT retry-safe: every handler call appends one ledger row, so a call that ran twice shows up as two
    rows in ``demo_charges``."""

    name = "charge"
    description = "Charges {amount}; not safe to run twice."
    retry_safe = False

    async def run(self, arguments: dict[str, Any], env: ToolEnv) -> str:
        try:
            amount = Decimal(str(arguments.get("amount")))
        except (InvalidOperation, ValueError) as exc:
            raise ToolFailed("amount must be a number") from exc
        receipt = await env.ledger.charge(env.run_id, env.call_id, amount)
        return f"receipt {receipt}: charged {amount}"


class Lookup(Tool):
    name = "lookup"
    description = "Looks {query} up; the caller runs it and reports the result."
    kind = ToolKind.EXTERNAL


class SendEmail(Tool):
    name = "send_email"
    description = "Sends an email {to, subject, body}; a person approves it first."
    kind = ToolKind.APPROVAL
    retry_safe = False

    async def run(self, arguments: dict[str, Any], env: ToolEnv) -> str:
        return "sent"

    def approvers(self, arguments: dict[str, Any]) -> list[str]:
        named = arguments.get("approvers") or []
        if not isinstance(named, list) or not all(isinstance(a, str) for a in named):
            return []
        return [str(a) for a in named]

    def note(self, arguments: dict[str, Any]) -> str:
        return f"send an email to {arguments.get('to', '?')}: {arguments.get('subject', '')}"


class AskAgent(Tool):
    name = "ask_agent"
    description = "Asks another agent {agent, question}; the messaging bus brings the reply."
    kind = ToolKind.AGENT


class ToolRegistry:
    def __init__(self, tools: list[Tool]) -> None:
        self._tools = {tool.name: tool for tool in tools}

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def all(self) -> list[Tool]:
        return [self._tools[n] for n in self.names()]


def demo_tools() -> ToolRegistry:
    return ToolRegistry([Echo(), Sleep(), Charge(), Lookup(), SendEmail(), AskAgent()])
