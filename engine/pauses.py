"""Pauses written or moved from outside a run: the original package's plain CreateSuspension and the
removals of its store API, and an operator's move of a live pause's deadline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, NamedTuple

from intermission.engine.holding import RunKeyRow
from intermission.engine.transition import Family, OfRun, RunKey, Transition, only
from intermission.schemas.errors import InvalidArgument, NotSuspended, RunConflict, RunNotFound, SuspensionExists
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Suspension
from intermission.store import rows
from intermission.store.rows import Out


class CreatePauseRow(NamedTuple):
    """``intermission_create_pause_v2``."""

    run_id: str
    app: str
    tenant: str
    reason: str
    pending: str
    continuation: str
    expires_at: datetime | None
    ttl: float | None
    checkpoint_id: int | None
    approvers: list[str]


CREATE_PAUSE = Family("create_pause", "create_pauses_v2", CreatePauseRow)


@dataclass(frozen=True)
class CreatePause(Transition[Suspension]):
    """Write a new pause for a run at ``scope`` (the stored scope is this one, whatever ``pause`` says):
    the original's CreateSuspension. With ``ttl_seconds`` the deadline is the database clock plus it;
    otherwise ``pause.expires_at``. SuspensionExists when the run has a live one already."""

    family: ClassVar[Family] = CREATE_PAUSE

    scope: Scope
    pause: Suspension
    ttl_seconds: float | None = None

    def __post_init__(self) -> None:
        require_scope(self.scope)
        if self.ttl_seconds is not None and not (math.isfinite(self.ttl_seconds) and self.ttl_seconds >= 0):
            raise InvalidArgument("ttl_seconds must be a finite, non-negative number of seconds")

    def key(self) -> RunKey:
        return (self.scope.app, self.scope.tenant, self.pause.run_id)

    def row(self) -> CreatePauseRow:
        s = self.pause
        return CreatePauseRow(
            s.run_id,
            self.scope.app,
            self.scope.tenant,
            s.reason.value,
            rows.dump_list(rows.PENDING, s.pending),
            rows.dump(s.continuation),
            s.expires_at,
            self.ttl_seconds,
            s.checkpoint_id,
            s.approvers,
        )

    def result(self, outs: Sequence[Out]) -> Suspension:
        out = only(outs)
        if out["outcome"] == "exists":
            raise SuspensionExists(f"run {self.pause.run_id} already has a live suspension")
        written = out["pause"]
        if written is None or written["id"] is None:
            raise RunNotFound(f"no run {self.pause.run_id} at scope {self.scope}")
        return self.pause.model_copy(
            update={
                "id": written["id"],
                "scope": self.scope,
                "expires_at": written["expires_at"],
                "created_at": written["created_at"],
            }
        )


DELETE_PAUSE = Family("delete_pause", "delete_pauses_v1", RunKeyRow)
DELETE_PROGRESS = Family("delete_progress", "delete_progresses_v1", RunKeyRow)


@dataclass(frozen=True)
class DeletePause(OfRun[None]):
    """Remove a run's pause (the original's DeleteSuspension); NotSuspended when it has none here."""

    family: ClassVar[Family] = DELETE_PAUSE

    def row(self) -> RunKeyRow:
        return RunKeyRow(self.run_id, self.scope.app, self.scope.tenant, None)

    def result(self, outs: Sequence[Out]) -> None:
        if not only(outs)["found"]:
            raise NotSuspended(f"no suspension for run {self.run_id} at scope {self.scope}")


@dataclass(frozen=True)
class DeleteProgress(OfRun[None]):
    """Remove a run's snapshot; nothing to remove is not an error."""

    family: ClassVar[Family] = DELETE_PROGRESS

    def row(self) -> RunKeyRow:
        return RunKeyRow(self.run_id, self.scope.app, self.scope.tenant, None)

    def result(self, outs: Sequence[Out]) -> None:
        return None


@dataclass(frozen=True)
class MovedDeadline:
    """A live pause whose deadline an operator moved: the deadline before (None: it had none) and after."""

    run_id: str
    suspension_id: int
    run_revision: int
    previous: datetime | None
    expires_at: datetime


class DeadlineRow(NamedTuple):
    """``intermission_deadline_v2``."""

    run_id: str
    app: str
    tenant: str
    suspension_id: int
    extend_by: float | None
    moved_by: str


DEADLINE = Family("deadline", "move_deadlines_v2", DeadlineRow, success=frozenset({"moved"}))


@dataclass(frozen=True)
class MoveDeadline(OfRun[MovedDeadline]):
    """An operator moves the deadline of the live pause ``suspension_id`` of ``run_id``: ``extend_by``
    seconds later (from now when it passed already or there was none), or to now with ``extend_by`` None (a
    deadline that passed already stays). The run event ``deadline_moved`` records it, ``moved_by`` says who.
    NotSuspended when the run is not paused here; RunConflict when it is paused on another pause."""

    family: ClassVar[Family] = DEADLINE

    suspension_id: int
    extend_by: float | None
    moved_by: str

    def __post_init__(self) -> None:
        require_scope(self.scope)
        if self.extend_by is not None and not (math.isfinite(self.extend_by) and self.extend_by > 0):
            raise InvalidArgument("extend_by must be a positive, finite number of seconds")

    def row(self) -> DeadlineRow:
        return DeadlineRow(
            self.run_id, self.scope.app, self.scope.tenant, self.suspension_id, self.extend_by, self.moved_by
        )

    def result(self, outs: Sequence[Out]) -> MovedDeadline:
        out = only(outs)
        if out["outcome"] == "not_paused":
            raise NotSuspended(f"run {self.run_id} has no live pause at scope {self.scope}")
        if out["outcome"] == "pause_changed":
            raise RunConflict(
                f"run {self.run_id} is paused on suspension {out['suspension_id']}, not {self.suspension_id}"
            )
        return MovedDeadline(
            run_id=self.run_id,
            suspension_id=out["suspension_id"],
            run_revision=out["run_revision"],
            previous=out["previous"],
            expires_at=out["expires_at"],
        )
