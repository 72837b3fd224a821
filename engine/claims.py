"""Claims of pauses, and the read every command that answers a pause is checked against.

Every claim is ONE call of the claim transition (``intermission_claim_pause_v1``, one row of
``intermission_claim_pauses_v2``): the paused -> running move and the pause read (and, for a leased claim,
the lease and the first progress snapshot, the inbox record, the decision, the ``run.resumed`` event)
cannot be split by another claimer, because every claimer contends on the run's row lock and re-checks
``state = 'paused'`` and the revision after the winner commits. A read followed by a separate write is
exactly the race a claim exists to close; a command's own read (``ReadForCommand``) only decides what to
ask of the claim, which is pinned to the pause and revision that were read. A claim that matches nothing
comes back with why, classified under the same locks (``refusal``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, NamedTuple, TypeVar

from intermission.engine.columns import lease_columns, maybe_event_fields
from intermission.engine.events import OutboxEvent
from intermission.engine.transition import Family, OfRun, only
from intermission.schemas.errors import (
    InvalidArgument,
    NotSuspended,
    RunConflict,
    RunLeaseLost,
    SuspensionExpired,
)
from intermission.schemas.run import Lease, Run
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import ClaimVersion, Progress, SuspendReason, Suspension
from intermission.store import rows
from intermission.store.inbox import Receipt, inbox_arguments
from intermission.store.rows import Out

R = TypeVar("R")


class CommandKey(NamedTuple):
    """``intermission_command_key_v1``: what a command's read names."""

    run_id: str
    app: str
    tenant: str
    message_id: str | None
    checkpoint_id: int | None


READ_FOR_COMMANDS = Family("read_for_commands", "read_for_commands", CommandKey, reads=True)


@dataclass(frozen=True)
class Recorded:
    """What the inbox holds for a command's message_id at its scope."""

    routing_key: str
    body_digest: str
    outcome: str


@dataclass(frozen=True)
class Stored:
    """The run and its live pause as a command's read found them (None where absent), what the inbox
    recorded for its message_id, and the state of the checkpoint a decision names (None when it names none
    of this run's)."""

    run: Run | None
    pause: Suspension | None
    recorded: Recorded | None = None
    checkpoint_state: str | None = None

    def pause_pinned(self, scope: Scope, version: ClaimVersion) -> Suspension:
        """The live pause ``version`` names, or why there is none to answer."""
        if self.pause is None:
            raise NotSuspended(f"no live pause for run {version.run_id} at scope {scope}")
        if self.pause.id != version.suspension_id:
            raise RunConflict(
                f"run {version.run_id} is paused on suspension {self.pause.id}, not {version.suspension_id}"
            )
        return self.pause

    def check_receipt(self, receipt: Receipt | None) -> None:
        """AlreadyApplied when the inbox recorded this very command, MessageIdConflict when it recorded
        another under its message_id; nothing when nothing is recorded."""
        if receipt is not None and self.recorded is not None:
            receipt.check_recorded(self.recorded.routing_key, self.recorded.body_digest, self.recorded.outcome)


@dataclass(frozen=True)
class ReadForCommand(OfRun[Stored]):
    """A command's first round trip, at its exact scope: the run, its pause, the inbox record of its
    message_id and the named checkpoint's state."""

    family: ClassVar[Family] = READ_FOR_COMMANDS

    message_id: str | None = None
    checkpoint_id: int | None = None

    def row(self) -> CommandKey:
        return CommandKey(self.run_id, self.scope.app, self.scope.tenant, self.message_id, self.checkpoint_id)

    def result(self, outs: Sequence[Out]) -> Stored:
        out = only(outs)
        recorded = (
            Recorded(out["i_routing_key"], out["i_body_digest"], out["i_outcome"])
            if out["i_routing_key"] is not None
            else None
        )
        return Stored(
            run=rows.run_from_row(out["run"]) if out["run"] is not None else None,
            pause=rows.suspension_from_row(out["pause"]) if out["pause"] is not None else None,
            recorded=recorded,
            checkpoint_state=out["k_state"],
        )


class ClaimRow(NamedTuple):
    """``intermission_claim_v2``: one claim's row."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int | None
    revision: int | None
    expired_by: datetime | None
    reason: str | None
    lease_owner: str | None
    lease_ttl: float | None
    first: bool
    first_continuation: str | None
    first_started: str | None
    first_done: str | None
    first_ending: str | None
    first_approved: str | None
    drop_pause: bool
    message_id: str | None
    routing_key: str | None
    digest: str | None
    checkpoint_id: int | None
    checkpoint_state: str | None
    decided_by: str | None
    decision_reason: str | None
    event_message_id: Any
    event_routing_key: str | None
    event_body: str | None
    event_correlation_id: str | None
    event_headers: str | None
    whole: bool


CLAIM = Family("claim", "claim_pauses_v2", ClaimRow, held=True, success=frozenset({"claimed"}))


@dataclass(frozen=True)
class Decided:
    """An approval decision recorded on the pause's checkpoint, with the claim it answers."""

    checkpoint_id: int
    state: str
    decided_by: str | None
    reason: str


def refusal(
    outcome: str,
    out: Out,
    scope: Scope,
    run_id: str,
    *,
    version: ClaimVersion | None = None,
    expired_by: datetime | None = None,
) -> Exception:
    """The typed error for a claim that matched nothing, from the outcome and the run and pause as they
    stood when the claim function looked again (``revision``, ``suspension_id``, ``expires_at``)."""
    if outcome == "run_conflict":
        pinned = f"{version.suspension_id} at {version.run_revision}" if version is not None else "the pinned one"
        return RunConflict(
            f"run {run_id} is paused on suspension {out['suspension_id']} at revision {out['revision']}, not {pinned}"
        )
    if outcome == "suspension_expired":
        return SuspensionExpired(f"the pause of run {run_id} expired at {out['expires_at'].isoformat()}")
    if outcome == "not_expired" and expired_by is not None:
        return NotSuspended(f"the pause of run {run_id} had not expired by {expired_by.isoformat()}")
    if outcome == "lost":
        return NotSuspended(f"run {run_id} was claimed by another caller")
    return NotSuspended(f"run {run_id} has no live pause at scope {scope}")


def check_first(first: Progress, owner: str, run_id: str) -> None:
    """A first snapshot must be the claimer's own, and of the run claimed."""
    if first.owner != owner:
        raise RunLeaseLost("the first progress snapshot is owned by someone other than the lease owner")
    if first.run_id != run_id:
        raise InvalidArgument("the first progress snapshot is for another run")


def check_lease(lease: Lease) -> None:
    if not lease.is_set:
        raise RunLeaseLost("a lease needs both an owner and a ttl")


@dataclass(frozen=True)
class _Claim(OfRun[R]):
    """One claim (see the module docstring).

    ``version`` pins the pause and revision (None: whatever pause the run has); ``expired_by`` claims only a
    pause whose deadline passed by then (and by the database clock); ``lease`` and ``first`` take the run's
    lease and write its first snapshot (with ``answers_only`` the snapshot's continuation is the claimed
    pause's own, plus the answers); ``drop_pause`` removes the answered pause; ``receipt`` records the
    command in the inbox; ``decision`` records an approval decision on the pause's checkpoint; ``event`` is
    the ``run.resumed`` it announces; ``whole`` hands back the run and pause rows."""

    family: ClassVar[Family] = CLAIM

    version: ClaimVersion | None = None
    expired_by: datetime | None = None
    lease: Lease | None = None
    first: Progress | None = None
    answers_only: bool = False
    drop_pause: bool = False
    receipt: Receipt | None = None
    decision: Decided | None = None
    event: OutboxEvent | None = None
    whole: bool = False
    reason: SuspendReason | None = None

    def __post_init__(self) -> None:
        require_scope(self.scope)
        if self.lease is not None:
            check_lease(self.lease)
            if self.first is not None:
                check_first(self.first, self.lease.owner, self.run_id)

    def row(self) -> ClaimRow:
        first = self.first
        snapshot = rows.progress_arguments(first, continuation=not self.answers_only) if first is not None else {}
        decision, lease = self.decision, self.lease
        inbox = inbox_arguments(self.receipt, self.scope)
        return ClaimRow(
            self.run_id,
            self.scope.app,
            self.scope.tenant,
            self.version.suspension_id if self.version is not None else None,
            self.version.run_revision if self.version is not None else None,
            self.expired_by,
            self.reason.value if self.reason is not None else None,
            *lease_columns(lease),
            first is not None,
            snapshot.get("continuation"),
            snapshot.get("started"),
            snapshot.get("done"),
            snapshot.get("ending"),
            snapshot.get("approved"),
            self.drop_pause,
            inbox["message_id"],
            inbox["routing_key"],
            inbox["digest"],
            decision.checkpoint_id if decision is not None else None,
            decision.state if decision is not None else None,
            decision.decided_by if decision is not None else None,
            decision.reason if decision is not None else None,
            whole=self.whole,
            **maybe_event_fields(self.event),
        )

    def events(self) -> Sequence[OutboxEvent]:
        return (self.event,) if self.event is not None else ()

    def claimed(self, outs: Sequence[Out]) -> Out:
        """The claim's output row, once the claim won; its refusal raised otherwise."""
        out = only(outs)
        outcome = out["outcome"]
        if self.receipt is not None:
            self.receipt.refuse(outcome)
        if outcome != "claimed":
            raise refusal(outcome, out, self.scope, self.run_id, version=self.version, expired_by=self.expired_by)
        return out


@dataclass(frozen=True)
class ClaimPause(_Claim[Out]):
    """A claim whose result is its output row (the run's new revision and lease, the first snapshot's time)."""

    def result(self, outs: Sequence[Out]) -> Out:
        return self.claimed(outs)


@dataclass(frozen=True)
class ClaimedPause:
    """What a claim of the original's store API won: the pause it claimed, and the run as the claim left it
    (running, its revision bumped, under the claimer's lease if it took one)."""

    suspension: Suspension
    run: Run


@dataclass(frozen=True)
class ClaimWhole(_Claim[ClaimedPause]):
    """A claim that hands back the pause and run it claimed, decoded before its commit: a pause that cannot
    be read rolls its claim back rather than leaving the run running with nobody holding it."""

    atomic: ClassVar[bool] = True
    whole: bool = True

    def result(self, outs: Sequence[Out]) -> ClaimedPause:
        out = self.claimed(outs)
        return ClaimedPause(suspension=rows.suspension_from_row(out["pause"]), run=rows.run_from_row(out["run"]))
