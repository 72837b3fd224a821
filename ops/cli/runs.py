"""``intermission runs list|show|cancel``: the runs of every scope, one run with everything about it, and a
cancel sent through the command path with its outcome awaited."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import click
from rich.table import Table

from intermission.fleet.settings import Settings
from intermission.ops.cli.app import (
    DURATION,
    EXIT_PROBLEM,
    Problem,
    broker,
    database,
    emit_json,
    json_option,
    load_settings,
    main,
    people,
    plain,
    run_or_exit,
    say,
    scope_of,
    scope_options,
    when,
)
from intermission.ops.durations import describe_duration
from intermission.ops.run_commands import Outcome, cancel, send_and_wait, user_of
from intermission.ops.run_report import RunNotThere, RunReport, as_document, report, scope_of_run
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import SuspendReason
from intermission.store import Stores
from intermission.store.across_scopes import RunCursor, RunFilter, RunSummary

# How long `runs cancel` waits for the run's end by default: a running run ends at its next boundary.
CANCEL_WAIT_SECONDS = 30.0


@main.group("runs")
def runs_group() -> None:
    """Look at runs, and cancel one."""


async def resolve(stores: Stores, run_id: str, app: str | None, tenant: str | None) -> Scope:
    """The run's scope (``--app``/``--tenant``, or where the id is found); a Problem when there is none."""
    try:
        return await scope_of_run(stores, run_id, scope_of(app, tenant))
    except RunNotThere as exc:
        raise Problem(str(exc)) from exc


def _cursor(text: str | None) -> RunCursor | None:
    if text is None:
        return None
    # The last run's change and key: neither a time, a scope part nor a run id holds a "~".
    parts = text.split("~")
    try:
        if len(parts) != 4 or not all(parts[1:]):
            raise ValueError(text)
        moment, app, tenant, run_id = parts
        return RunCursor(datetime.fromisoformat(moment), run_id, app, tenant)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a cursor printed by runs list", param_hint="--after") from exc


def cursor_text(cursor: RunCursor) -> str:
    return f"{cursor.updated_at.isoformat()}~{cursor.app}~{cursor.tenant}~{cursor.run_id}"


@runs_group.command("list")
@scope_options
@click.option("--state", type=click.Choice([s.value for s in RunState]), default=None, help="only runs in this state")
@click.option(
    "--reason", type=click.Choice([r.value for r in SuspendReason]), default=None, help="only runs paused for this"
)
@click.option("--older-than", type=DURATION, default=None, help="unchanged for at least this long (30m, 2h, 1d)")
@click.option(
    "--deadline-within", type=DURATION, default=None, help="paused, with a deadline at most this far ahead (or passed)"
)
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--after", "after", default=None, help="the cursor a previous page ended with")
@json_option
def runs_list(
    app: str | None,
    tenant: str | None,
    state: str | None,
    reason: str | None,
    older_than: float | None,
    deadline_within: float | None,
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """Runs of every scope (or one), most recently changed first, with their live pause."""
    scope = scope_of(app, tenant)
    cursor = _cursor(after)
    settings = load_settings()
    wanted = RunFilter(
        app=scope.app if scope else None,
        tenant=scope.tenant if scope else None,
        state=RunState(state) if state else None,
        reason=SuspendReason(reason) if reason else None,
        older_than_seconds=older_than,
        deadline_within_seconds=deadline_within,
    )

    async def run() -> list[RunSummary]:
        async with database(settings, max_size=1) as stores:
            return await stores.across_scopes.list_run_summaries(wanted, limit, cursor)

    found = run_or_exit("runs list", run(), settings)
    following = cursor_text(found[-1].cursor) if len(found) == limit else None
    if as_json:
        emit_json({"runs": found, "next": following})
        return
    table = Table("run", "scope", "state", "rev", "pause", "deadline", "changed", box=None, pad_edge=False)
    for r in found:
        table.add_row(
            r.id,
            f"{r.app}/{r.tenant}",
            r.state,
            str(r.revision),
            r.reason or "-",
            when(r.expires_at),
            when(r.updated_at),
        )
    if found:
        people().print(table)
    say(f"{len(found)} run(s)" + (f"; more with --after {following}" if following else ""))


@runs_group.command("show")
@click.argument("run_id")
@scope_options
@json_option
def runs_show(run_id: str, app: str | None, tenant: str | None, as_json: bool) -> None:
    """One run with everything about it: its row, its live pause, its progress, its resume admissions, its
    events (run events and outbox rows) and its trace id."""
    scope_of(app, tenant)  # a half scope is a usage error before anything is reached
    settings = load_settings()

    async def run() -> RunReport:
        async with database(settings) as stores:
            return await report(stores, await resolve(stores, run_id, app, tenant), run_id)

    found = run_or_exit("runs show", run(), settings)
    if as_json:
        emit_json(as_document(found))
        return
    show(found)


def show(r: RunReport) -> None:
    console = people()
    run = r.run
    summary = Table(box=None, show_header=False, pad_edge=False)
    for name, value in (
        ("run", run.id),
        ("scope", str(run.scope)),
        ("agent", run.agent_id),
        ("state", f"{run.state.value} (revision {run.revision})"),
        ("lease", f"{run.lease_owner} until {when(run.lease_expires_at)}" if run.lease_owner else "-"),
        ("steps", f"{run.step_count} ({run.tokens_used} tokens)"),
        ("created", when(run.created_at)),
        ("changed", when(run.updated_at)),
        ("error", run.error or "-"),
        ("trace", r.trace_id or "none"),
    ):
        summary.add_row(name, value)
    console.print(summary)
    pause = r.pause
    if pause is not None:
        live = "live pause" if r.live_pause is not None else "pause (admitted, kept while the run runs)"
        console.print(
            f"\n{live} {pause.id}: {pause.reason.value}, deadline {when(pause.expires_at)}"
            + (f", approvers {', '.join(pause.approvers)}" if pause.approvers else "")
        )
        for call in pause.pending:
            console.print(f"  pending {call.id} {call.name}")
    if r.progress is not None:
        p = r.progress
        console.print(
            f"\nprogress: step {p.continuation.step_index}, owner {p.owner}, {len(p.started)} started, "
            f"{len(p.done)} done" + (f", ending {p.ending.kind.value}" if p.ending else "")
        )
    if r.admissions:
        admissions = Table("pause", "admitted", "started", "expired", "closed", title="resume admissions", box=None)
        for a in r.admissions:
            admissions.add_row(
                str(a.suspension_id), when(a.admitted_at), when(a.started_at), when(a.expired_at), when(a.closed_at)
            )
        console.print(admissions)
    events = Table("at", "event", "revision", title="run events", box=None)
    for e in r.events:
        events.add_row(when(e["created_at"]), str(e["kind"]), str(e["revision"]))
    console.print(events)
    outbox = Table("id", "routing key", "written", "sent", "attempts", "message id", title="outbox", box=None)
    for o in r.outbox:
        sent = when(o.sent_at) if o.sent_at else ("quarantined" if o.quarantined_at else "pending")
        outbox.add_row(str(o.id), o.routing_key, when(o.created_at), sent, str(o.attempts), o.message_id)
    console.print(outbox)


def report_outcome(what: str, outcome: Outcome, within: float, as_json: bool, extra: dict[str, Any]) -> None:
    """Print what became of a command, and exit 1 unless the run ended as ``extra['wanted']`` or as any end."""
    wanted = extra.pop("wanted", None)
    if as_json:
        emit_json({**extra, **plain(outcome), "heard": outcome.heard})
    if not outcome.heard:
        say(
            f"{what}: sent (message_id {outcome.message_id}), but no outcome was heard within "
            f"{describe_duration(within)}; `intermission runs show` says where the run is"
        )
        sys.exit(EXIT_PROBLEM)
    if outcome.outcome == "rejected":
        say(f"{what}: refused ({outcome.code}): {outcome.detail}")
        sys.exit(EXIT_PROBLEM)
    said = f"{what}: the run ended {outcome.outcome}" + (f" ({outcome.detail})" if outcome.detail else "")
    if not as_json:
        click.echo(said)
    if wanted is not None and outcome.outcome != wanted:
        sys.exit(EXIT_PROBLEM)


@runs_group.command("cancel")
@click.argument("run_id")
@scope_options
@click.option("--reason", default="cancelled by an operator", show_default=True, help="recorded with the cancel")
@click.option(
    "--wait",
    "within",
    type=DURATION,
    default=CANCEL_WAIT_SECONDS,
    show_default=True,
    help="how long to wait for the end",
)
@json_option
def runs_cancel(run_id: str, app: str | None, tenant: str | None, reason: str, within: float, as_json: bool) -> None:
    """Cancel a run: publish run.cancel as a host would (as the user of INTERMISSION_AMQP_URL), and wait for
    the run's end or the command's refusal. A paused run ends at once, a running one at its next boundary."""
    scope_of(app, tenant)
    settings = load_settings()

    async def run() -> tuple[Scope, Outcome]:
        async with database(settings, max_size=1) as stores:
            scope = await resolve(stores, run_id, app, tenant)
        return scope, await cancelled(settings, scope, run_id, reason, within)

    scope, outcome = run_or_exit("runs cancel", run(), settings)
    report_outcome(
        "runs cancel", outcome, within, as_json, {"run_id": run_id, "scope": str(scope), "wanted": "cancelled"}
    )


async def cancelled(settings: Settings, scope: Scope, run_id: str, reason: str, within: float) -> Outcome:
    async with broker(settings) as connection:
        return await send_and_wait(
            connection,
            scope,
            run_id,
            cancel(scope, run_id, reason),
            user_id=user_of(settings.amqp_url),
            within=within,
            publish_timeout=settings.publish_timeout_seconds,
        )
