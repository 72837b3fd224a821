"""``intermission outbox list|retry``: the events waiting to be published, and quarantined ones sent again."""

from __future__ import annotations

import sys

import click

from intermission.engine.core import Engine
from intermission.engine.outbox import RetryQuarantined
from intermission.ops.cli.app import (
    EXIT_PROBLEM,
    database,
    emit_json,
    json_option,
    load_settings,
    main,
    run_or_exit,
    say,
    when,
)
from intermission.store.across_scopes import OutboxEntry


@main.group("outbox")
def outbox_group() -> None:
    """Look at the events waiting to be published, and send quarantined ones again."""


@outbox_group.command("list")
@click.option("--quarantined", is_flag=True, help="the rows the relay set aside, instead of those it still tries")
@click.option("--limit", type=click.IntRange(1, 10000), default=100, show_default=True)
@json_option
def outbox_list(quarantined: bool, limit: int, as_json: bool) -> None:
    """Unsent outbox rows, oldest first: id, routing key, broker refusals so far, when it was quarantined, and
    the broker's last reason. Never the body: events carry the hosts' data."""
    settings = load_settings()

    async def run() -> list[OutboxEntry]:
        async with database(settings, max_size=1) as stores:
            return await stores.across_scopes.list_outbox(quarantined=quarantined, limit=limit)

    found = run_or_exit("outbox list", run(), settings)
    if as_json:
        emit_json({"quarantined": quarantined, "rows": found})
        return
    for entry in found:
        click.echo(
            f"{entry.id:<10} {entry.routing_key:<48} attempts {entry.attempts:<3} "
            f"{when(entry.quarantined_at):<19} {entry.last_error or '-'}"
        )
    click.echo(f"{len(found)} {'quarantined' if quarantined else 'unsent'} outbox row(s)")


@outbox_group.command("retry")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "everything", is_flag=True, help="every quarantined row")
@json_option
def outbox_retry(ids: tuple[int, ...], everything: bool, as_json: bool) -> None:
    """Hand quarantined rows back to the relay (after making room for them: the subscriber queue that refused
    them, the broker's limits). Their refusals are forgotten and they go out under their own message_id, so a
    subscriber that got one after all drops the copy."""
    if bool(ids) == everything:
        raise click.UsageError("say which: one or more IDs, or --all")
    settings = load_settings()

    async def run() -> list[int]:
        # One statement hands every row back at once (--all too): there is no long work to show progress of.
        async with database(settings, max_size=1) as stores:
            wanted = [RetryQuarantined()] if everything else [RetryQuarantined(i) for i in dict.fromkeys(ids)]
            retried = await Engine.over(stores).apply_all(wanted)
        for outcome in retried:
            if isinstance(outcome, Exception):
                raise outcome
        return sorted({i for outcome in retried for i in outcome})

    retried = run_or_exit("outbox retry", run(), settings)
    left = sorted(set(ids) - set(retried))
    if as_json:
        emit_json({"retried": retried, "not_quarantined": left})
    else:
        click.echo(f"{len(retried)} outbox row(s) handed back to the relay")
    if left:
        # Sent already, never quarantined, or no such row: say so, and fail, so a script notices.
        say(f"not quarantined: {' '.join(str(i) for i in left)}")
        sys.exit(EXIT_PROBLEM)
