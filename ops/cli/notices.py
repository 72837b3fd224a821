"""``intermission notices replay``: a live pause's Notice published again, as it was first published."""

from __future__ import annotations

import click

from intermission.ops.cli.app import (
    Problem,
    broker,
    database,
    emit_json,
    json_option,
    load_settings,
    main,
    run_or_exit,
    scope_of,
    scope_options,
)
from intermission.ops.cli.pauses import live_pause_id
from intermission.ops.cli.runs import resolve
from intermission.ops.run_commands import republish
from intermission.schemas.scope import Scope
from intermission.store.runs import StoredEvent


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
