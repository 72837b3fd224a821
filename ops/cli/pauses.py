"""A live pause, as operators act on it. ``intermission pauses extend|expire``: its deadline moved by an
operator, through the transition that does it (``MoveDeadline``, ``intermission_move_deadline_v1``); an expiry
then goes the way of every expiry, the sweeper's own ``run.expire`` claimed by a worker. ``intermission notices
replay``: its Notice published again, as it was first published."""

from __future__ import annotations

import getpass
import socket
from typing import Any

import click

from intermission.engine.core import Engine
from intermission.engine.pauses import MovedDeadline, MoveDeadline
from intermission.ops.cli.app import (
    DURATION,
    Problem,
    broker,
    database,
    emit_json,
    json_option,
    load_settings,
    main,
    run_or_exit,
    say,
    scope_of,
    scope_options,
    when,
)
from intermission.ops.cli.runs import report_outcome, resolve
from intermission.ops.durations import describe_duration
from intermission.ops.run_commands import Outcome, expire, republish, send_and_wait, user_of
from intermission.schemas.errors import NotSuspended
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.across_scopes import ExpiredPause
from intermission.store.runs import StoredEvent

EXPIRE_WAIT_SECONDS = 30.0


@main.group("pauses")
def pauses_group() -> None:
    """Move a live pause's deadline: give it more time, or expire it now."""


def operator() -> str:
    """Who moved a deadline, for the run's record: this login on this machine."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


async def live_pause_id(stores: Stores, scope: Scope, run_id: str) -> int:
    """The id of the run's live pause; a Problem when the run is not paused."""
    at = stores.at(scope)
    run = await at.runs.get_run(run_id)
    try:
        pause = await at.suspensions.get_suspension(run_id)
    except NotSuspended:
        pause = None
    if run.state is not RunState.PAUSED or pause is None:
        raise Problem(f"run {run_id} has no live pause (it is {run.state.value})")
    return pause.id


async def move(stores: Stores, scope: Scope, run_id: str, extend_by: float | None) -> MovedDeadline:
    pause_id = await live_pause_id(stores, scope, run_id)
    try:
        return await Engine.over(stores).apply(MoveDeadline(scope, run_id, pause_id, extend_by, operator()))
    except NotSuspended as exc:
        # Answered, expired or cancelled between the read and the move: nothing was written.
        raise Problem(f"run {run_id} has no live pause any more ({exc.detail})") from exc


def moved_document(moved: MovedDeadline, scope: Scope) -> dict[str, Any]:
    return {
        "run_id": moved.run_id,
        "scope": str(scope),
        "suspension_id": moved.suspension_id,
        "previous": moved.previous,
        "expires_at": moved.expires_at,
    }


@pauses_group.command("extend")
@click.argument("run_id")
@click.option("--by", "by", type=DURATION, required=True, help="how much longer: 30m, 2h, 1d, 1h30m")
@scope_options
@json_option
def pauses_extend(run_id: str, by: float, app: str | None, tenant: str | None, as_json: bool) -> None:
    """Give a live pause more time: its deadline moves BY later (from now if it had passed or there was
    none). The run's record says who did it; the run and its pending answers stay as they are."""
    scope_of(app, tenant)
    if by <= 0:
        raise click.BadParameter("must be longer than 0s", param_hint="--by")
    settings = load_settings()

    async def run() -> tuple[Scope, MovedDeadline]:
        async with database(settings, max_size=1) as stores:
            scope = await resolve(stores, run_id, app, tenant)
            return scope, await move(stores, scope, run_id, by)

    scope, moved = run_or_exit("pauses extend", run(), settings)
    if as_json:
        emit_json(moved_document(moved, scope))
        return
    click.echo(
        f"run {run_id}: the deadline of pause {moved.suspension_id} moved from {when(moved.previous)} to "
        f"{when(moved.expires_at)} (+{describe_duration(by)})"
    )


@pauses_group.command("expire")
@click.argument("run_id")
@scope_options
@click.option(
    "--wait",
    "within",
    type=DURATION,
    default=EXPIRE_WAIT_SECONDS,
    show_default=True,
    help="how long to wait for the run's end",
)
@json_option
def pauses_expire(run_id: str, app: str | None, tenant: str | None, within: float, as_json: bool) -> None:
    """Expire a live pause now: its deadline moves to now, and the sweeper's run.expire for it is published,
    which a worker claims as for any expiry; then wait for the run's end."""
    scope_of(app, tenant)
    settings = load_settings()

    async def run() -> tuple[Scope, MovedDeadline, Outcome]:
        # The broker first: when it is down nothing is moved.
        async with broker(settings) as connection, database(settings, max_size=1) as stores:
            scope = await resolve(stores, run_id, app, tenant)
            moved = await move(stores, scope, run_id, None)
            pause = ExpiredPause(
                scope=scope,
                run_id=run_id,
                suspension_id=moved.suspension_id,
                run_revision=moved.run_revision,
                expires_at=moved.expires_at,
            )
            outcome = await send_and_wait(
                connection,
                scope,
                run_id,
                expire(pause),
                user_id=user_of(settings.amqp_url),
                within=within,
                publish_timeout=settings.publish_timeout_seconds,
            )
            return scope, moved, outcome

    scope, moved, outcome = run_or_exit("pauses expire", run(), settings)
    if not as_json:
        say(f"run {run_id}: pause {moved.suspension_id} expired at {when(moved.expires_at)}; run.expire published")
    report_outcome("pauses expire", outcome, within, as_json, {**moved_document(moved, scope), "wanted": "expired"})


# --- a live pause's Notice, published again -------------------------------------------------------------


@main.group("notices")
def notices_group() -> None:
    """The Notices that tell hosts and the bus a run paused."""


@notices_group.command("replay")
@click.argument("run_id")
@scope_options
@json_option
def notices_replay(run_id: str, app: str | None, tenant: str | None, as_json: bool) -> None:
    """Publish the live pause's Notice again, with the message_id it was first published with, its body and
    headers as its outbox row keeps them, confirmed by the broker: a subscriber that deduplicates by
    message_id sees a copy, not a new pause; one that lost it gets it."""
    scope_of(app, tenant)
    settings = load_settings()

    async def run() -> tuple[Scope, StoredEvent]:
        async with broker(settings) as connection, database(settings, max_size=1) as stores:
            scope = await resolve(stores, run_id, app, tenant)
            pause_id = await live_pause_id(stores, scope, run_id)
            notice = await stores.at(scope).runs.notice_of_pause(run_id, pause_id)
            if notice is None:
                raise Problem(f"the Notice of pause {pause_id} of run {run_id} is not in the outbox")
            await republish(connection, notice, confirm_seconds=settings.publish_timeout_seconds)
            return scope, notice

    scope, notice = run_or_exit("notices replay", run(), settings)
    if as_json:
        emit_json(
            {"run_id": run_id, "scope": str(scope), "message_id": notice.message_id, "routing_key": notice.routing_key}
        )
        return
    click.echo(f"run {run_id}: Notice {notice.message_id} published again ({notice.routing_key})")
