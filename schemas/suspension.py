"""A paused run and everything needed to continue it (the original's package ``suspension``)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Self

from pydantic import Field, ValidationInfo, model_validator

from intermission.schemas.base import Model, legacy_schema_version
from intermission.schemas.config import ExecutionProvenance, RunConfig
from intermission.schemas.ids import CheckpointId, Revision, RunId, SuspensionId
from intermission.schemas.llm import Message, ToolOutcome, ToolResult, Usage

# Ending lives beside Run (a running run can carry one); it is the original's suspension.Ending.
from intermission.schemas.run import Ending as Ending
from intermission.schemas.run import EndingKind as EndingKind
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope

# Bounds retained encoded resume input, JSON escaping included.
MAX_RESUME_INPUT_BYTES = 8 << 20

CONTINUATION_SCHEMA_VERSION = 1


class SuspendReason(StrEnum):
    """Why a run stopped: the loop cannot proceed until something outside it returns."""

    # A person must grant or deny before the run continues.
    APPROVAL = "approval"
    # The caller, not the fleet, executes the pending tool call and reports the result back.
    EXTERNAL_TOOL = "external_tool"
    # The run waits on another agent's answer. It is not EXTERNAL_TOOL even though both wait on something
    # outside the loop: external says the CALLER acts next; agent-reply says a peer does, and a caller
    # answering it would be forging a message that peer never sent. Only the messaging bus resumes these.
    AGENT_REPLY = "agent_reply"


class ClaimVersion(Model):
    """The pause and run revision validated before resume.

    A later suspension of the same run must never satisfy this claim: the pin is the whole identity.
    """

    model_config = Model.model_config | {"frozen": True}

    run_id: RunId
    suspension_id: SuspensionId
    run_revision: Revision


class PendingCall(Model):
    """One tool call awaiting a result from outside the fleet.

    ``arguments`` is carried here rather than left to be recovered from the continuation's last assistant
    message: a caller resuming an external tool has to execute the call, and making it cross-reference the
    history by call id would be a needless puzzle for the one consumer this type exists to serve.
    """

    # Binds an agent reply to the question this pause created; a tool-call id alone may be reused by a
    # later model response.
    reply_with: str = ""
    id: str
    name: str
    # The JSON-encoded argument object, verbatim from the model's tool call.
    arguments: str = "{}"
    # The authorizer's reason for asking for approval; empty for every other pending call.
    note: str = ""


class Continuation(Model):
    """Everything the loop needs to pick up where it stopped.

    It is validated on read, so a malformed continuation is an error at the store boundary instead of a
    half-restored run several steps later. ``system_prompt`` holds the ASSEMBLED string: a run suspended
    before its agent's prompt changed continues with the prompt it began with.
    """

    tool_results: list[ToolResult] = Field(default_factory=list)
    schema_version: int = CONTINUATION_SCHEMA_VERSION
    # Opaque executor state, returned byte for byte (base64 in JSON, never re-encoded).
    prepared: bytes = b""
    provenance: ExecutionProvenance = Field(default_factory=ExecutionProvenance)
    usage: Usage = Field(default_factory=Usage)
    messages: list[Message] = Field(default_factory=list)
    system_prompt: str = ""
    # The run row carries it as its step count (an integer column) after every boundary, so it is bounded
    # by that column: a step index nothing could store is refused here, not by a driver error mid-run.
    step_index: int = Field(default=0, ge=0, le=2**31 - 1)
    tokens_used: int = 0
    # Where this run's own messages begin in ``messages``. Everything before is history loaded at start and
    # must never be saved again: without it a resume cannot tell the two apart and its first save writes
    # the whole history back as new rows (the original shipped that bug; agents went deaf after ~6 runs).
    new_messages_from: int = 0
    # The session the run loads from and saves to. A resume cannot re-derive it: asking again after a pause
    # can land on a different session than the one the messages above came from.
    session_id: str = ""
    # The resolved configuration the run was executing under; a resume never re-merges the agent's.
    config: RunConfig = Field(default_factory=RunConfig)
    # The W3C traceparent of the span the run was in when this was written: its start's (the first
    # snapshot) or its pause's (a pause's continuation, and the snapshot a claim writes from it). The run's
    # trace outlives the process that wrote it through this: a resume links to it and the run continues
    # in it, a takeover too (intermission/tracing.py). None: the run was started without a trace and none
    # was recording. Observability only: nothing decides anything by it.
    traceparent: str | None = None

    # A stored continuation without ``schema_version`` was written before versions existed: legacy 0, not
    # the current version this model's default would make of it.
    @model_validator(mode="after")
    def _legacy(self, info: ValidationInfo) -> Self:
        return legacy_schema_version(self, info)


class Suspension(Model):
    """A paused run."""

    id: SuspensionId = 0
    run_id: RunId
    # Stored so a resume re-derives authority from the scope the run STARTED under, not from whoever calls.
    scope: Scope
    reason: SuspendReason
    pending: list[PendingCall] = Field(default_factory=list)
    continuation: Continuation = Field(default_factory=Continuation)
    expires_at: datetime | None = None
    # The decision point of an approval pause; None for every other reason.
    checkpoint_id: CheckpointId | None = None
    # Principals allowed to decide an approval pause; empty means any host may.
    approvers: list[str] = Field(default_factory=list)
    created_at: datetime | None = None


class ProgressResult(Model):
    """The checked result of one tool call that finished in the current step, as the model will see it."""

    call_id: str
    content: str = ""
    error: str = ""
    outcome: ToolOutcome = ToolOutcome.COMPLETED


class Progress(Model):
    """A running run's state at its last durable boundary, saved by the lease owner.

    A worker that reclaims the run after its owner died continues from ``continuation``, treats every call
    in ``started`` as already handed to its handler (never dispatched again), and reuses ``done``.
    """

    run_id: RunId
    # Set by the store to the scope it stored the snapshot under.
    scope: Scope | None = None
    owner: str
    continuation: Continuation = Field(default_factory=Continuation)
    # Calls that are not safe to retry and were handed to their handler since ``continuation``.
    started: list[PendingCall] = Field(default_factory=list)
    # Calls of the current step that finished.
    done: list[ProgressResult] = Field(default_factory=list)
    # The end a claim was made to write and did not get to.
    ending: Ending | None = None
    # Pending calls an approval decision granted: they run through the approval path (the authorizer is
    # not asked again). Not in the original's struct: the original's engine kept this on the checkpoint, and a
    # snapshot that is to carry "every answer the claim was made with" has to carry this one too.
    approved: list[str] = Field(default_factory=list)
    # Set by the store, by the database clock.
    updated_at: datetime | None = None


class LeasedClaim(Model):
    """A pause claim that takes the run's lease in the same transaction as the move to running, so no
    worker that claimed a pause can die holding a running run nobody owns."""

    version: ClaimVersion
    # When set, claims only a pause whose deadline passed at or before it (the expiry sweep's claim).
    # Otherwise only a pause that has not expired is claimed; an expired one is SuspensionExpired.
    expired_by: datetime | None = None
    lease: Lease
    # The first progress snapshot under the new lease, written in the same transaction; its owner must be
    # the lease owner.
    first: Progress | None = None


class Notice(Model):
    """What a host hears when a run pauses, for every reason: enough to act without a second read."""

    suspension_id: SuspensionId
    run_id: RunId
    run_revision: Revision
    reason: SuspendReason
    pending: list[PendingCall]
    # The deadline; None when the pause has none.
    expires_at: datetime | None = None
    # The checkpoint a person decides; None unless reason is approval.
    checkpoint_id: CheckpointId | None = None
    approvers: list[str] = Field(default_factory=list)
    scope: Scope
