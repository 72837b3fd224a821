"""The web console's reads: what one person may see, restricted in SQL to the scopes the broker grants them.

The console (``ops/console/``) shows a person the pauses, runs and events of their scopes only. The scopes
come from RabbitMQ (``BrokerGrants.reach``: what ``intermission grant`` wrote, or every scope for a trusted
identity), and every statement here (``store/queries/granted.sql``) takes them as parameters and keeps them
in its WHERE clause: nothing is read first and filtered afterwards, so no code path between the database
and a page can show a row of another tenant by forgetting a check. A reach of no scope reads nothing.

These reads may span several scopes (a person granted two tenants sees both inboxes at once), which is why
they are not ``stores.at(scope)``; they are not ``across_scopes`` either, which is process infrastructure
with no request scope. They never write: every change the console asks for is a command published on the
person's own AMQP connection, which the broker and the workers judge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from intermission.schemas.answers import publishable
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import InvalidArgument
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Reach, Scope, require_scope
from intermission.schemas.suspension import PendingCall, SuspendReason
from intermission.store import rows
from intermission.store.db import Database
from intermission.store.rows import Out, stored

MAX_LISTED: Final = 500


@dataclass(frozen=True)
class WaitingApproval:
    """An approval pause waiting on a person, as the inbox shows it: the pending calls already as the run's
    publication policy lets them out (arguments ``"[redacted]"`` when it says so)."""

    scope: Scope
    run_id: str
    agent_id: str
    suspension_id: int
    run_revision: int
    checkpoint_id: int
    pending: list[PendingCall]
    redacted: bool
    approvers: list[str]
    expires_at: datetime | None
    created_at: datetime


@dataclass(frozen=True)
class PauseView:
    """A run's live pause, pending calls as publishable as in a Notice."""

    suspension_id: int
    reason: SuspendReason
    pending: list[PendingCall]
    redacted: bool
    checkpoint_id: int | None
    approvers: list[str]
    expires_at: datetime | None
    created_at: datetime


@dataclass(frozen=True)
class CheckpointView:
    id: int
    suspension_id: int
    approvers: list[str]
    state: str
    decided_by: str | None
    reason: str | None
    created_at: datetime
    decided_at: datetime | None


@dataclass(frozen=True)
class HistoryEntry:
    """One metadata event of a run (``run_events``): a pause or its end."""

    kind: str
    revision: int
    data: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class PublishedEvent:
    """One outbox row of a run: where it goes and how far it got, never its body."""

    message_id: str
    routing_key: str
    created_at: datetime
    sent_at: datetime | None
    quarantined_at: datetime | None
    attempts: int


@dataclass(frozen=True)
class RunView:
    run: Run
    pause: PauseView | None
    checkpoints: list[CheckpointView]
    history: list[HistoryEntry]
    events: list[PublishedEvent]


class GrantedReads:
    """The console's reads for one person, bound to their ``reach``."""

    def __init__(self, db: Database, reach: Reach) -> None:
        self.db = db
        self.reach = reach
        for scope in reach.scopes:
            require_scope(scope)
        # The three parameters every statement of granted.sql takes first.
        self._grant: tuple[bool, list[str], list[str]] = (
            reach.every_scope,
            [s.app for s in reach.scopes],
            [s.tenant for s in reach.scopes],
        )

    async def approvals(self, limit: int = 100) -> list[WaitingApproval]:
        """Approval pauses waiting on a person, oldest first."""
        if self.reach.is_empty:
            return []
        async with self.db.connection() as con:
            found = await con.fetch("granted_approvals", *self._grant, _limit(limit))
        return [
            stored(
                WaitingApproval,
                r,
                scope=Scope(app=r["app"], tenant=r["tenant"]),
                **_published(r, rows.load_model(RunConfig, r["config"], "run config")),
            )
            for r in found
        ]

    async def runs(self, states: frozenset[RunState], limit: int = 100) -> list[Run]:
        """Runs in ``states``, most recently changed first."""
        if self.reach.is_empty or not states:
            return []
        async with self.db.connection() as con:
            found = await con.fetch("granted_runs", *self._grant, sorted(s.value for s in states), _limit(limit))
        return [rows.run_from_row(r) for r in found]

    async def run(self, scope: Scope, run_id: str) -> RunView | None:
        """One run with its pause, decisions, history and events; None when there is no such run in a scope
        this person may see (the same answer as for a run that does not exist, so nobody learns which)."""
        require_scope(scope)
        if not self.reach.covers(scope):
            return None
        key = (run_id, scope.app, scope.tenant)
        async with self.db.connection() as con:
            found = await con.fetchrow("granted_run", *self._grant, *key)
            if found is None:
                return None
            run = rows.run_from_row(found)
            pause_row = await con.fetchrow("granted_run_pause", *self._grant, *key)
            checkpoints = await con.fetch("granted_run_checkpoints", *self._grant, *key)
            history = await con.fetch("granted_run_events", *self._grant, *key)
            events = await con.fetch("granted_run_outbox", *self._grant, *key)
        pause = None
        if pause_row is not None:
            pause = stored(
                PauseView,
                pause_row,
                suspension_id=pause_row["id"],
                reason=SuspendReason(pause_row["reason"]),
                **_published(pause_row, run.config),
            )
        return RunView(
            run=run,
            pause=pause,
            checkpoints=[stored(CheckpointView, k, approvers=list(k["approvers"])) for k in checkpoints],
            history=[stored(HistoryEntry, e, data=_object(e["data"])) for e in history],
            events=[stored(PublishedEvent, o) for o in events],
        )

    async def command_outcome(self, scope: Scope, message_id: str) -> str | None:
        """What the inbox recorded for the command ``message_id`` at ``scope`` (``applied``), or None: not
        applied yet, or refused (a refusal writes nothing; its ``command.rejected`` event says why)."""
        require_scope(scope)
        if not self.reach.covers(scope):
            return None
        async with self.db.connection() as con:
            outcome = await con.fetchval("granted_command_outcome", *self._grant, scope.app, scope.tenant, message_id)
        return str(outcome) if outcome is not None else None


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LISTED:
        raise InvalidArgument(f"limit must be between 1 and {MAX_LISTED}")
    return limit


def _published(pause: Out, config: RunConfig) -> dict[str, Any]:
    """What a person is shown of a pause's calls and deciders: the pending calls as the run's publication
    policy lets them out (``redacted`` says whether it held their arguments back), and its approvers."""
    return {
        "pending": publishable(rows.load_pending(pause["pending"]), config),
        "redacted": config.publication.redact_arguments,
        "approvers": list(pause["approvers"]),
    }


def _object(raw: str) -> dict[str, Any]:
    decoded = json.loads(raw)
    return decoded if isinstance(decoded, dict) else {"value": decoded}
