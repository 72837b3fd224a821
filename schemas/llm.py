"""Minimal but real versions of the conversation types the original borrows (llm, verification, execution)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from intermission.schemas.base import Model


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ToolCall(Model):
    """One tool call in an assistant turn. ``arguments`` is the JSON-encoded argument object, verbatim."""

    id: str
    name: str
    arguments: str = "{}"


class Message(Model):
    """One message of a conversation, as the model sees it."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # Set on a tool message: the call it answers.
    tool_call_id: str = ""
    name: str = ""


class ToolOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    DENIED = "denied"


class ToolResult(Model):
    """A checked tool result carried by a continuation (the original's verification.ToolResult)."""

    call_id: str
    name: str = ""
    content: str = ""
    error: str = ""
    outcome: ToolOutcome = ToolOutcome.COMPLETED


class Usage(Model):
    """Tokens a run has consumed so far (the original's execution.Usage)."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    tool_calls: int = 0

    def plus(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
            tool_calls=self.tool_calls + other.tool_calls,
        )
