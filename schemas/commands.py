"""Command bodies (docs/contracts.md). Unknown fields are refused: a command is a trust boundary."""

from __future__ import annotations

from enum import StrEnum

from pydantic import AwareDatetime, Field

from intermission.schemas.base import StrictModel
from intermission.schemas.config import RunConfig
from intermission.schemas.ids import AgentId, CheckpointId, RunId
from intermission.schemas.limits import MAX_PAUSE_TTL_SECONDS
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import ClaimVersion


class ScopedCommand(StrictModel):
    """What every command body has first: the scope it acts in, which its routing key must name too."""

    scope: Scope


class StartCommand(ScopedCommand):
    """``run.start``: the caller picks ``run_id``, so a repeated start is a no-op."""

    run_id: RunId
    agent_id: AgentId
    input: str = ""
    # Absent fields take the settings' defaults.
    config: RunConfig = Field(default_factory=RunConfig)
    # Feeds the scripted model.
    script: list[ScriptTurn] | None = None
    # None takes the settings' default; 0 means the run's pauses never expire.
    pause_ttl_seconds: int | None = Field(default=None, ge=0, le=MAX_PAUSE_TTL_SECONDS)
    # The session the run loads history from and saves into; defaults to the run id (a session of its own).
    session_id: str | None = Field(default=None, min_length=1, max_length=128)


class ToolAnswer(StrictModel):
    """One result for one pending call."""

    call_id: str = Field(min_length=1)
    content: str = ""
    error: str | None = None


class ResumeCommand(ScopedCommand):
    """``run.resume``: a host answers an ``external_tool`` pause."""

    version: ClaimVersion
    results: list[ToolAnswer]


class Decision(StrEnum):
    APPROVE = "approve"
    DENY = "deny"


class DecideCommand(ScopedCommand):
    """``run.decide``: a person's decision on an ``approval`` pause."""

    version: ClaimVersion
    checkpoint_id: CheckpointId
    decision: Decision
    reason: str = ""


class ReplyCommand(ScopedCommand):
    """``run.reply``: the messaging bus answers an ``agent_reply`` pause. ``input`` is the agent's encoded
    reply, stored and returned byte for byte."""

    version: ClaimVersion
    reply_with: str = Field(min_length=1)
    input: str


class ExpireCommand(ScopedCommand):
    """``run.expire``: the sweeper found the pause past its deadline."""

    version: ClaimVersion
    expired_by: AwareDatetime


class CancelCommand(ScopedCommand):
    """``run.cancel``: end a paused run as cancelled."""

    run_id: RunId
    reason: str = ""
