"""What operators look at: where a run id lives, a run with everything about it (``runs show``), and its
trace id.

Every read here goes through the store's own readers (``stores.at(scope)`` for one run, ``across_scopes``
to find which scope a run id is in); nothing is written.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from intermission.schemas.errors import NotSuspended, ProgressNotFound
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, Progress, Suspension
from intermission.store import Stores
from intermission.store.resume import AdmissionState
from intermission.store.runs import RunOutboxRow
from intermission.wire import TRACEPARENT_HEADER


class RunNotThere(Exception):
    """No run has that id (at the scope given), or it names runs in several scopes: the message says which."""


async def scope_of_run(stores: Stores, run_id: str, given: Scope | None) -> Scope:
    """The scope of ``run_id``: the one given, if the run is there; else the one it is found in."""
    found = await stores.across_scopes.find_run_scopes(run_id)
    if given is not None:
        if given not in found:
            raise RunNotThere(f"no run {run_id} at scope {given}")
        return given
    if not found:
        raise RunNotThere(f"no run {run_id}")
    if len(found) > 1:
        named = ", ".join(str(s) for s in found)
        raise RunNotThere(f"run {run_id} is in several scopes ({named}): say which with --app and --tenant")
    return found[0]


def trace_id(outbox: list[RunOutboxRow], *recorded: Continuation | None) -> str | None:
    """The run's trace: the ``traceparent`` of its latest outbox row that carries one, else the one the run
    recorded with its snapshot or its pause (``recorded``, in that order: a running run's events may be
    pruned already), None when there is none (the run was started without one and nothing recorded)."""
    for row in reversed(outbox):
        value = row.headers.get(TRACEPARENT_HEADER)
        if isinstance(value, str) and value:
            return value
    return next((c.traceparent for c in recorded if c is not None and c.traceparent), None)


@dataclass(frozen=True)
class RunReport:
    run: Run
    # The run's pause: live when the run is paused (an admitted agent reply keeps its pause while it runs).
    pause: Suspension | None
    progress: Progress | None
    admissions: list[AdmissionState]
    events: list[dict[str, Any]]
    outbox: list[RunOutboxRow]
    trace_id: str | None

    @property
    def live_pause(self) -> Suspension | None:
        return self.pause if self.run.state is RunState.PAUSED else None


async def report(stores: Stores, scope: Scope, run_id: str) -> RunReport:
    at = stores.at(scope)
    run = await at.runs.get_run(run_id)
    pause: Suspension | None = None
    with contextlib.suppress(NotSuspended):
        pause = await at.suspensions.get_suspension(run_id)
    progress: Progress | None = None
    with contextlib.suppress(ProgressNotFound):
        progress = await at.progress.get_progress(run_id)
    outbox = await at.runs.list_outbox(run_id)
    return RunReport(
        run=run,
        pause=pause,
        progress=progress,
        admissions=await at.resume.list_run_admissions(run_id),
        events=await at.runs.list_run_events(run_id),
        outbox=outbox,
        trace_id=trace_id(
            outbox,
            progress.continuation if progress is not None else None,
            pause.continuation if pause is not None else None,
        ),
    )


def as_document(r: RunReport) -> dict[str, Any]:
    """The report as ``runs show --json`` prints it: the run without its script, the pause with its pending
    calls' ids and names (not their arguments), progress as counts, outbox rows without their bodies."""
    pause = r.pause
    return {
        "run": r.run.model_dump(mode="json", exclude={"script"}),
        "pause": None
        if pause is None
        else {
            "live": r.live_pause is not None,
            "suspension_id": pause.id,
            "reason": pause.reason.value,
            "pending": [{"id": c.id, "name": c.name} for c in pause.pending],
            "expires_at": pause.expires_at,
            "created_at": pause.created_at,
            "checkpoint_id": pause.checkpoint_id,
            "approvers": pause.approvers,
        },
        "progress": None
        if r.progress is None
        else {
            "owner": r.progress.owner,
            "step": r.progress.continuation.step_index,
            "started": len(r.progress.started),
            "done": len(r.progress.done),
            "ending": r.progress.ending.kind.value if r.progress.ending is not None else None,
        },
        "admissions": r.admissions,
        "events": r.events,
        "outbox": r.outbox,
        "trace_id": r.trace_id,
    }
