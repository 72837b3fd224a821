"""``intermission dead list|replay``: what is in ``intermission.dead``, and commands sent back to their
queues."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import click
from aio_pika.abc import AbstractRobustConnection

from intermission.ops.cli.app import broker, emit_json, json_option, load_settings, main, run_or_exit, say
from intermission.ops.cli.processes import progress_bar
from intermission.ops.dead import DeadLetter, Kept, Replay
from intermission.publishers.dead_queue import DeadStats


@main.group("dead")
def dead_group() -> None:
    """Look at and replay dead-lettered commands."""


@dead_group.command("list")
@click.option("--limit", type=click.IntRange(1, 10000), default=100, show_default=True)
@json_option
def dead_list(limit: int, as_json: bool) -> None:
    """What is in intermission.dead, and why; nothing is taken out."""
    settings = load_settings()
    from intermission.ops.dead import list_dead
    from intermission.publishers.dead_queue import dead_stats

    async def run() -> tuple[DeadStats, list[DeadLetter]]:
        async with broker(settings) as connection:
            return await dead_stats(connection), await list_dead(connection, limit)

    stats, letters = run_or_exit("dead list", run(), settings)
    if as_json:
        emit_json({"depth": stats.depth, "oldest_seconds": stats.oldest_seconds, "letters": letters})
        return
    for letter in letters:
        # Who dead-lettered it (the broker's key is always the delivery's own); "unverified" when its refusal
        # is not one a worker or the broker wrote, and then no code or detail is shown as fact.
        source = letter.source.value if letter.verified else "unverified"
        click.echo(
            f"{letter.message_id or '-':<40} {letter.routing_key:<24} {source:<10} {letter.code:<28} {letter.detail}"
        )
    oldest = f", the oldest dead-lettered {stats.oldest_seconds:.0f} s ago" if stats.oldest_seconds else ""
    shown = f" ({len(letters)} shown)" if len(letters) < stats.depth else ""
    click.echo(f"{stats.depth} dead-lettered command(s){shown}{oldest}")


@dead_group.command("replay")
@click.option("--message-id", "message_ids", multiple=True, help="replay these (repeatable)")
@click.option("--code", "codes", multiple=True, help="replay those refused with this code (repeatable)")
@click.option("--all", "everything", is_flag=True, help="replay every dead-lettered command")
@click.option(
    "--yes",
    "agreed",
    is_flag=True,
    help="replay, as the operator's own user, commands that were not sent by it, without asking",
)
@json_option
def dead_replay(
    message_ids: tuple[str, ...], codes: tuple[str, ...], everything: bool, agreed: bool, as_json: bool
) -> None:
    """Send dead-lettered commands back to their queues (after fixing what refused them). A command goes
    back only under a key naming the scope its body acts in; one that would go out as the operator's user
    rather than its sender's is replayed only once the operator agreed (asked, or --yes)."""
    if not (message_ids or codes or everything):
        raise click.UsageError("say which: --message-id, --code or --all")
    settings = load_settings()
    from intermission.ops.dead import connection_user, list_dead, replay_dead, republished_as_another
    from intermission.publishers.dead_queue import dead_stats

    def wanted(letter: DeadLetter) -> bool:
        return everything or letter.message_id in message_ids or letter.code in codes

    async def others(connection: AbstractRobustConnection) -> list[DeadLetter]:
        me = connection_user(connection)
        return [d for d in await list_dead(connection, 1000) if wanted(d) and republished_as_another(d, me)]

    async def replay(connection: AbstractRobustConnection, as_another: Callable[[DeadLetter], bool]) -> Replay:
        depth = (await dead_stats(connection)).depth
        with progress_bar() as bar:
            task = bar.add_task("replaying", total=depth)
            return await replay_dead(connection, wanted, on_looked_at=lambda: bar.advance(task), as_another=as_another)

    async def run() -> Replay:
        async with broker(settings) as connection:
            if agreed:
                return await replay(connection, lambda _letter: True)
            foreign = await others(connection)
            if foreign:
                for letter in foreign:
                    sender = letter.user_id or "no user_id"
                    say(f"{letter.message_id} ({letter.routing_key}) was sent by {sender}")
                if not click.confirm(
                    f"{len(foreign)} command(s) would go out as {connection_user(connection)}, "
                    "which may act for more scopes than their senders: replay them as that user?",
                    err=True,
                    default=False,
                ):
                    foreign = []
            # Only the letters shown were agreed to: one dead-lettered while the question was asked is kept.
            shown = {_identity(d) for d in foreign}
            return await replay(connection, lambda letter: _identity(letter) in shown)

    done = run_or_exit("dead replay", run(), settings)
    if as_json:
        emit_json({"replayed": done.replayed, "kept": [{"letter": d, "why": why} for d, why in done.kept]})
        return
    for letter in done.replayed:
        click.echo(f"replayed {letter.message_id} ({letter.routing_key}, was {letter.code})")
    for letter, why in done.kept:
        click.echo(f"kept {letter.message_id} ({letter.routing_key}): {_KEPT_BECAUSE[why]}")
    say(f"{len(done.replayed)} command(s) replayed" + (f", {len(done.kept)} kept" if done.kept else ""))


def _identity(letter: DeadLetter) -> tuple[str | None, str, str | None, int]:
    """What tells a letter listed before the question from one that arrived after it."""
    return (letter.message_id, letter.routing_key, letter.user_id, letter.size)


_KEPT_BECAUSE: Final = {
    Kept.NOT_A_COMMAND: "its routing key is no command's",
    Kept.SCOPE_MISMATCH: "its body acts in a scope its routing key does not name",
    Kept.ANOTHER_IDENTITY: "it would go out as this user, not as its sender (not agreed)",
}
