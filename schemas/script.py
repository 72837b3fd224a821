"""The scripted model's script: what `run.start` may carry so the fleet runs with no LLM."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from intermission.schemas.base import Model


class ScriptCall(Model):
    """One tool call the scripted model makes."""

    tool: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ScriptTurn(Model):
    """One step: either tool calls (``call``) or a final answer (``say``), never both."""

    call: list[ScriptCall] | None = None
    say: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ScriptTurn:
        if (self.call is None) == (self.say is None):
            raise ValueError("a script turn has exactly one of 'call' or 'say'")
        if self.call is not None and not self.call:
            raise ValueError("a 'call' turn names at least one tool call")
        return self
