"""``intermission dead list|replay``: what is in ``intermission.dead``, and commands sent back to their
queues."""

from __future__ import annotations

import click
from aio_pika.abc import AbstractRobustConnection

from intermission.ops.cli.app import broker, emit_json, json_option, load_settings, main, run_or_exit, say
from intermission.ops.cli.processes import progress_bar
from intermission.ops.dead import DeadLetter, DeadStats


@main.group("dead")
def dead_group() -> None:
    """Look at and replay dead-lettered commands."""


@dead_group.command("list")
@click.option("--limit", type=click.IntRange(1, 10000), default=100, show_default=True)
@json_option
def dead_list(limit: int, as_json: bool) -> None:
    """What is in intermission.dead, and why; nothing is taken out."""
    settings = load_settings()
    from intermission.ops.dead import dead_stats, list_dead

    async def run() -> tuple[DeadStats, list[DeadLetter]]:
        async with broker(settings) as connection:
            return await dead_stats(connection), await list_dead(connection, limit)

    stats, letters = run_or_exit("dead list", run(), settings)
    if as_json:
        emit_json({"depth": stats.depth, "oldest_seconds": stats.oldest_seconds, "letters": letters})
        return
    for letter in letters:
        click.echo(f"{letter.message_id or '-':<40} {letter.routing_key:<24} {letter.code:<28} {letter.detail}")
    oldest = f", the oldest dead-lettered {stats.oldest_seconds:.0f} s ago" if stats.oldest_seconds else ""
    shown = f" ({len(letters)} shown)" if len(letters) < stats.depth else ""
    click.echo(f"{stats.depth} dead-lettered command(s){shown}{oldest}")


@dead_group.command("replay")
@click.option("--message-id", "message_ids", multiple=True, help="replay these (repeatable)")
@click.option("--code", "codes", multiple=True, help="replay those refused with this code (repeatable)")
@click.option("--all", "everything", is_flag=True, help="replay every dead-lettered command")
@json_option
def dead_replay(message_ids: tuple[str, ...], codes: tuple[str, ...], everything: bool, as_json: bool) -> None:
    """Send dead-lettered commands back to their queues (after fixing what refused them)."""
    if not (message_ids or codes or everything):
        raise click.UsageError("say which: --message-id, --code or --all")
    settings = load_settings()
    from intermission.ops.dead import dead_stats, replay_dead

    def wanted(letter: DeadLetter) -> bool:
        return everything or letter.message_id in message_ids or letter.code in codes

    async def replay(connection: AbstractRobustConnection) -> list[DeadLetter]:
        depth = (await dead_stats(connection)).depth
        with progress_bar() as bar:
            task = bar.add_task("replaying", total=depth)
            return await replay_dead(connection, wanted, on_looked_at=lambda: bar.advance(task))

    async def run() -> list[DeadLetter]:
        async with broker(settings) as connection:
            return await replay(connection)

    replayed = run_or_exit("dead replay", run(), settings)
    if as_json:
        emit_json({"replayed": replayed})
        return
    for letter in replayed:
        click.echo(f"replayed {letter.message_id} ({letter.routing_key}, was {letter.code})")
    say(f"{len(replayed)} command(s) replayed")
