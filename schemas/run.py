"""Runs, their states and leases."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from intermission.schemas.base import Model
from intermission.schemas.config import RunConfig
from intermission.schemas.ids import AgentId, RunId
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn


class RunState(StrEnum):
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        # An allowlist, not a denylist: a state this code does not know counts as live, so a newer
        # worker's state is never swept as finished by an older one.
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})


class EndingKind(StrEnum):
    """The end a claim (or a cancel of a running run) was made to write."""

    CANCEL = "cancel"  # the run ends cancelled
    EXPIRE = "expire"  # the run fails: nobody answered its pause in time


class Ending(Model):
    """The end a claim was made to write, recorded with the claim so a worker that dies before writing it
    does not leave the run to continue as if it had never been asked to end. A cancel of a RUNNING run
    records one the same way, for the run's lease holder (or whoever takes the run over) to finish."""

    kind: EndingKind
    # What the run's error says.
    reason: str = ""


class Lease(Model):
    """A claim on a running run: its owner and how long it holds before it lapses.

    The expiry is computed by the database clock (``now() + ttl``), never by a worker's, so "lapsed" and
    "held" are judged by one clock. An owner with no ttl, or a ttl with no owner, is a half lease and every
    store method refuses it with RunLeaseLost.
    """

    model_config = Model.model_config | {"frozen": True}

    owner: str = ""
    # Finite: an infinite ttl has no interval in PostgreSQL, and NaN is no duration at all.
    ttl_seconds: float = Field(default=0.0, allow_inf_nan=False)

    @property
    def is_set(self) -> bool:
        return bool(self.owner) and self.ttl_seconds > 0

    @property
    def is_half(self) -> bool:
        return bool(self.owner) != (self.ttl_seconds > 0)


class Run(Model):
    """One execution of an agent."""

    id: RunId
    scope: Scope
    agent_id: AgentId
    state: RunState
    # Bumped by every state change; a claim pins it so a later pause never satisfies an older claim.
    revision: int
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    input: str = ""
    output: str | None = None
    error: str | None = None
    session_id: str = ""
    config: RunConfig = Field(default_factory=RunConfig)
    script: list[ScriptTurn] | None = None
    # The pause deadline for this run's pauses; 0 means no deadline.
    pause_ttl_seconds: int = 0
    step_count: int = 0
    tokens_used: int = 0
    # An end asked of the run while it was running (a cancel), for its lease holder to finish; None when
    # none was. Only a running run carries one.
    ending: Ending | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None


class NewRun(Model):
    """What creating a run takes (the body of ``run.start`` without its scope)."""

    run_id: RunId
    agent_id: AgentId
    input: str = ""
    config: RunConfig = Field(default_factory=RunConfig)
    script: list[ScriptTurn] | None = None
    pause_ttl_seconds: int = Field(default=0, ge=0)
    session_id: str = ""
