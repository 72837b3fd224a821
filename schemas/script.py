"""The scripted model's script: what `run.start` may carry so the fleet runs with no LLM."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from intermission.schemas.base import Model
from intermission.schemas.ids import INT64_MAX


def _storable(value: Any, where: str) -> None:
    """A JSON value PostgreSQL's jsonb and every reader downstream can hold: the JSON parser accepts NaN
    and Infinity, which jsonb refuses (the command would fail in the database, not be refused), and
    integers past 64 bits, which a tool reading them as numbers cannot take."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: numbers must be finite")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError(f"{where} does not fit in 64 bits")
    if isinstance(value, dict):
        for key, item in value.items():
            _storable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _storable(item, f"{where}[{index}]")


class ScriptCall(Model):
    """One tool call the scripted model makes."""

    tool: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments")
    @classmethod
    def _numbers_storable(cls, arguments: dict[str, Any]) -> dict[str, Any]:
        _storable(arguments, "arguments")
        return arguments


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
