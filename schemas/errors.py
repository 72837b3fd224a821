"""Every error Intermission names, under one root.

Each class carries the stable ``code`` that goes into ``command.rejected`` events and the
``x-intermission-error`` dead-letter header (docs/contracts.md), and its docstring is its default
message. Driver errors never leave ``store/``: they are wrapped into these, with the cause chained.

``PermanentError`` means the same input will fail the same way again: reject it, dead-letter it, tell
the sender. ``TransientError`` means the world may change (a lost connection, a serialisation
failure): retry with backoff, then hand the message back to the queue.
"""

from __future__ import annotations

from typing import Any, ClassVar


class IntermissionError(Exception):
    """Intermission failed."""

    code: ClassVar[str] = "internal"

    def __init__(self, detail: str | None = None, **fields: Any) -> None:
        self.detail = detail or (self.__doc__ or self.code).strip().splitlines()[0]
        self.fields = fields
        super().__init__(self.detail)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, detail={self.detail!r})"


class PermanentError(IntermissionError):
    """The request cannot succeed as it stands."""


class TransientError(IntermissionError):
    """A passing failure; the same request may succeed later."""

    code = "transient"


class StoreUnavailable(TransientError):
    """The database could not be reached, is shutting down or failing over, or is out of resources."""

    code = "store_unavailable"


class StoreContention(StoreUnavailable):
    """The database is up but this transaction lost to another (a serialisation failure, a deadlock, a
    lock it would not wait for): retry at once, and do not treat the database as away."""

    code = "store_contention"


# --- command and store refusals (docs/contracts.md) ---------------------------------------------


class InvalidMessage(PermanentError):
    """The message is not valid JSON of the expected shape."""

    code = "invalid_message"


class UnsupportedSchemaVersion(PermanentError):
    """This worker does not read that x-schema-version."""

    code = "unsupported_schema_version"


class InvalidScope(PermanentError):
    """The scope is missing or malformed."""

    code = "invalid_scope"


class NotSuspended(PermanentError):
    """No live pause for that run at that exact scope."""

    code = "not_suspended"


class RunConflict(PermanentError):
    """The run is paused, but on another suspension or revision than the one pinned."""

    code = "run_conflict"


class SuspensionExpired(PermanentError):
    """The pause's deadline passed."""

    code = "suspension_expired"


class ResultsMismatch(PermanentError):
    """The results do not match the pending calls one to one."""

    code = "results_mismatch"


class RequiresApproval(PermanentError):
    """An approval pause can only be answered by a decision."""

    code = "requires_approval"


class NotAgentReplyResumable(PermanentError):
    """An agent-reply pause can only be answered by the messaging bus."""

    code = "not_agent_reply_resumable"


class Forbidden(PermanentError):
    """The sender has no authority over this pause."""

    code = "forbidden"


class InputTooLarge(PermanentError):
    """The retained resume input is over 8 MiB encoded."""

    code = "input_too_large"


class ResumeAdmissionConflict(PermanentError):
    """The pause was admitted before with a different request."""

    code = "resume_admission_conflict"


class ResumeAlreadyStarted(PermanentError):
    """The admitted resume's execution may have started."""

    code = "resume_already_started"


class InvalidState(PermanentError):
    """The run is not in a state that allows this."""

    code = "invalid_state"


class RunExists(PermanentError):
    """A different run already holds that run id."""

    code = "run_exists"


class QuotaExceeded(PermanentError):
    """The scope is at one of its quotas (live runs, starts a second): the start is refused and nothing
    written; it may be sent again once runs of the scope end, or a moment later."""

    code = "quota_exceeded"


class LimitExceeded(PermanentError):
    """A start asks for more than the fleet allows a run (``INTERMISSION_MAX_STEPS_LIMIT``,
    ``INTERMISSION_MAX_TOOL_CALLS_LIMIT``): refused rather than cut down, so the host learns it now and not
    when the run fails at the smaller limit."""

    code = "limit_exceeded"


class MessageIdConflict(PermanentError):
    """That message_id was recorded for a command with a different body."""

    code = "message_id_conflict"


class RunLeaseLost(PermanentError):
    """The writer does not hold the run's lease."""

    code = "run_lease_lost"


# --- store-level errors the original names that are not command codes ---------------------------------


class RunNotFound(PermanentError):
    """No run with that id at that exact scope."""

    code = "run_not_found"


class RunNotReclaimable(PermanentError):
    """The run is not running under a lapsed lease, so nobody may take it over."""

    code = "run_not_reclaimable"


class SuspensionExists(PermanentError):
    """The run already has a live suspension."""

    code = "suspension_exists"


class ProgressNotFound(PermanentError):
    """No progress snapshot for that run at that exact scope."""

    code = "progress_not_found"


class ResumeAdmissionNotFound(PermanentError):
    """No resume admission (or start, expiry, closure) for that pause at that exact scope."""

    code = "resume_admission_not_found"


class VersionClaimUnavailable(PermanentError):
    """This storage cannot atomically claim a pinned pause."""

    code = "version_claim_unavailable"


class InvalidContinuation(PermanentError):
    """A stored continuation or progress row is malformed."""

    code = "invalid_continuation"


class MaxStepsReached(PermanentError):
    """The run has used every step its configuration allows."""

    code = "max_steps_reached"


class MaxToolCallsReached(PermanentError):
    """The run asked for more tool calls than its budget allows (``budget.max_tool_calls``)."""

    code = "max_tool_calls_reached"


class MaxTokensExceeded(PermanentError):
    """A model turn took more output tokens than the run's ``max_tokens`` allows one turn."""

    code = "max_tokens_exceeded"


class BudgetExhausted(PermanentError):
    """The run used its token budget (``budget.max_total_tokens``)."""

    code = "budget_exhausted"


class PublicationBlocked(PermanentError):
    """A model turn holds a term the run's publication policy blocks."""

    code = "publication_blocked"


class UnsupportedConfig(PermanentError):
    """The run's config asks for something this product cannot honour; the run is not started."""

    code = "unsupported_config"


class InvalidArgument(PermanentError):
    """An argument is out of range or malformed."""

    code = "invalid_argument"


ALL_ERRORS: tuple[type[IntermissionError], ...] = (
    IntermissionError,
    PermanentError,
    TransientError,
    StoreUnavailable,
    StoreContention,
    InvalidMessage,
    UnsupportedSchemaVersion,
    InvalidScope,
    NotSuspended,
    RunConflict,
    SuspensionExpired,
    ResultsMismatch,
    RequiresApproval,
    NotAgentReplyResumable,
    Forbidden,
    InputTooLarge,
    ResumeAdmissionConflict,
    ResumeAlreadyStarted,
    InvalidState,
    RunExists,
    QuotaExceeded,
    LimitExceeded,
    MessageIdConflict,
    RunLeaseLost,
    RunNotFound,
    RunNotReclaimable,
    SuspensionExists,
    ProgressNotFound,
    ResumeAdmissionNotFound,
    VersionClaimUnavailable,
    InvalidContinuation,
    MaxStepsReached,
    MaxToolCallsReached,
    MaxTokensExceeded,
    BudgetExhausted,
    PublicationBlocked,
    UnsupportedConfig,
    InvalidArgument,
)

_ABSTRACT = (IntermissionError, PermanentError, TransientError)

ERRORS_BY_CODE: dict[str, type[IntermissionError]] = {cls.code: cls for cls in ALL_ERRORS if cls not in _ABSTRACT}
