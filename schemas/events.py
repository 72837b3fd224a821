"""Event bodies published on ``intermission.events`` (``docs/contracts.md``)."""

from __future__ import annotations

from enum import StrEnum

from intermission.schemas.base import Model
from intermission.schemas.ids import RunId
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Notice


class RunEventKind(StrEnum):
    """The ``run.<kind>`` events a run's changes publish."""

    RESUMED = "resumed"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


# A notice event's body is the Notice itself: it already carries run_id and run_revision.
NoticeEvent = Notice


class RunEvent(Model):
    """``run.<resumed|completed|failed|cancelled|expired>.<app>.<tenant>``."""

    kind: RunEventKind
    run_id: RunId
    revision: int
    scope: Scope
    output: str | None = None
    error: str | None = None


class CommandRejected(Model):
    """``command.rejected.<app>.<tenant>``: a refused command, and why."""

    message_id: str
    routing_key: str
    code: str
    detail: str
    scope: Scope | None = None
    run_id: str | None = None
