"""The ``intermission`` command."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any, TypeVar

import click
from aio_pika.abc import AbstractRobustConnection
from pydantic import ValidationError

from intermission.fleet.logs import configure as configure_logs
from intermission.fleet.settings import Settings
from intermission.ops.console.command import console_command
from intermission.ops.grants import BrokerGrants, rabbitmqctl_lines
from intermission.publishers.amqp import connect
from intermission.schemas.errors import IntermissionError, NotSuspended, ProgressNotFound
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.migrate import ensure_database, migrate
from intermission.wire import COMMANDS_EXCHANGE, TopologyOutdated, upgrade

T = TypeVar("T")


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        lines = [
            f"  INTERMISSION_{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
            if err["loc"]
            else f"  {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        ]
        raise click.ClickException("bad settings:\n" + "\n".join(lines)) from exc


@click.group()
def main() -> None:
    """Intermission: durable pauses and exactly-once resumes for AI agent runs."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed, else asyncio's own (None).

    A worker's time goes into many small socket reads and writes (a few PostgreSQL round trips and AMQP
    frames per command); uvloop does that bookkeeping in C, which measurably lowers the CPU a command costs
    (bench/resume.py). It is optional: everything works on asyncio's loop, which the tests use.
    """
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_or_exit(what: str, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``; a typed error or an unreachable server ends the process with a one-line reason."""
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(work)
    except IntermissionError as exc:
        click.echo(f"{what} failed ({exc.code}): {exc.detail}", err=True)
    except TopologyOutdated as exc:
        click.echo(f"{what} failed: {exc}", err=True)
    except (OSError, ConnectionError) as exc:
        click.echo(f"{what} failed: cannot reach a server ({type(exc).__name__}: {exc})", err=True)
    sys.exit(1)


async def on_broker(settings: Settings, use: Callable[[AbstractRobustConnection], Awaitable[T]]) -> T:
    """``use`` a connection of the CLI's own to the broker, closed afterwards."""
    connection = await connect(
        settings.amqp_url,
        "intermission-cli",
        reconnect_interval=settings.amqp_reconnect_seconds,
        offset=settings.amqp_first_node,
        connect_timeout=settings.amqp_connect_timeout_seconds,
    )
    try:
        return await use(connection)
    finally:
        await connection.close()


@main.command("migrate")
def migrate_command() -> None:
    """Create the database when it is missing, then apply every pending migration."""
    settings = load_settings()

    async def run() -> None:
        if await ensure_database(settings.database_url):
            click.echo("created the database")
        applied = await migrate(settings.database_url)
        for m in applied:
            click.echo(f"applied {m.version:04d}_{m.name}")
        if not applied:
            click.echo("the database is up to date")

    run_or_exit("migrate", run())


@main.command("worker")
def worker_command() -> None:
    """Run a worker until SIGTERM: consume commands, relay the outbox, run claimed runs, take over lapsed ones."""
    settings = load_settings()
    configure_logs(settings.log_level)
    from intermission.fleet.worker import serve

    run_or_exit("worker", serve(settings))


@main.command("sweeper")
def sweeper_command() -> None:
    """Run the expiry sweeper until SIGTERM: publish run.expire for every expired pause, in every scope."""
    settings = load_settings()
    configure_logs(settings.log_level)
    from intermission.fleet.worker import sweep

    run_or_exit("sweeper", sweep(settings))


@main.command("demo")
def demo_command() -> None:
    """Play runs that pause for each reason on the local servers, and tell the story as it happens."""
    settings = load_settings()
    configure_logs("WARNING")
    from intermission.ops.demo import TIMEOUT_SECONDS, play

    try:
        completed = run_or_exit("demo", play(settings, click.echo))
    except TimeoutError:
        click.echo(f"demo failed: the runs did not finish within {TIMEOUT_SECONDS:.0f} s", err=True)
        sys.exit(1)
    sys.exit(0 if completed == 3 else 1)


@main.group("topology")
def topology_group() -> None:
    """The broker's exchanges, queues and bindings."""


@topology_group.command("upgrade")
def topology_upgrade_command() -> None:
    """Convert a broker whose intermission.commands is still direct to scoped (topic) routing, keeping
    every queued command; declare what is missing. Stop the workers of the old version first."""
    settings = load_settings()

    async def run(connection: AbstractRobustConnection) -> bool:
        return await upgrade(
            connection, delivery_limit=settings.delivery_limit, dead_max_length=settings.dead_max_length
        )

    converted = run_or_exit("topology upgrade", on_broker(settings, run))
    if converted:
        click.echo(f"converted {COMMANDS_EXCHANGE} to a topic exchange; the command queues kept their messages")
    else:
        click.echo("the topology is up to date")


@main.command("prune")
@click.option("--dry-run", is_flag=True, help="count what is past retention, removing nothing")
def prune_command(dry_run: bool) -> None:
    """Remove what is past retention now (the sweeper does it every INTERMISSION_PRUNE_INTERVAL_SECONDS):
    ended runs with everything about them, old inbox records, sent events, old session messages."""
    settings = load_settings()
    from intermission.fleet.pruning import pruner_for

    async def run() -> dict[str, int]:
        stores = await Stores.connect(settings.database_url, max_size=2)
        try:
            pruner = pruner_for(stores.db, settings)
            due = await pruner.prunable()
            if dry_run:
                return due
            with click.progressbar(length=sum(due.values()), label="pruning", file=sys.stderr) as bar:
                return await pruner.prune(on_batch=lambda kept, counts: bar.update(sum(counts.values())))
        finally:
            await stores.close()

    counts = run_or_exit("prune", run())
    verb = "would remove" if dry_run else "removed"
    for table in sorted(counts):
        if counts[table] or dry_run:
            click.echo(f"{table:<20} {verb} {counts[table]}")
    if not any(counts.values()):
        click.echo("nothing is past retention")


@main.group("runs")
def runs_group() -> None:
    """Look at runs."""


@runs_group.command("list")
@click.option("--state", type=click.Choice([s.value for s in RunState]), default=None, help="only runs in this state")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
def runs_list(state: str | None, limit: int) -> None:
    """The latest runs of every scope, newest first."""
    settings = load_settings()

    async def run() -> None:
        stores = await Stores.connect(settings.database_url, max_size=1)
        try:
            found = await stores.across_scopes.list_runs(RunState(state) if state else None, limit)
        finally:
            await stores.close()
        for r in found:
            click.echo(
                f"{r.id:<40} {r.scope!s:<30} {r.state.value:<10} rev {r.revision:<4} {r.updated_at:%Y-%m-%d %H:%M:%S}"
            )
        if not found:
            click.echo("no runs")

    run_or_exit("runs list", run())


@runs_group.command("show")
@click.argument("run_id")
@click.option("--app", required=True)
@click.option("--tenant", required=True)
def runs_show(run_id: str, app: str, tenant: str) -> None:
    """One run at its exact scope: its row, its pause, its progress and its events."""
    settings = load_settings()
    try:
        scope = Scope(app=app, tenant=tenant)
    except ValidationError as exc:
        raise click.BadParameter("app and tenant must match [A-Za-z0-9_-]{1,64}") from exc

    async def run() -> None:
        stores = await Stores.connect(settings.database_url, max_size=1)
        try:
            at = stores.at(scope)
            found = await at.runs.get_run(run_id)
            click.echo(found.model_dump_json(indent=2, exclude={"script"}))
            with contextlib.suppress(NotSuspended):
                pause = await at.suspensions.get_suspension(run_id)
                click.echo(f"paused: suspension {pause.id} ({pause.reason.value}), deadline {pause.expires_at}")
                for call in pause.pending:
                    click.echo(f"  pending {call.id} {call.name}({call.arguments})")
            with contextlib.suppress(ProgressNotFound):
                progress = await at.progress.get_progress(run_id)
                click.echo(
                    f"progress: step {progress.continuation.step_index}, owner {progress.owner}, "
                    f"{len(progress.started)} started, {len(progress.done)} done"
                )
            for event in await at.runs.list_run_events(run_id):
                click.echo(f"event {event['kind']} at revision {event['revision']}")
        finally:
            await stores.close()

    run_or_exit("runs show", run())


@main.group("dead")
def dead_group() -> None:
    """Look at and replay dead-lettered commands."""


@dead_group.command("list")
@click.option("--limit", type=click.IntRange(1, 10000), default=100, show_default=True)
def dead_list(limit: int) -> None:
    """What is in intermission.dead, and why; nothing is taken out."""
    settings = load_settings()
    from intermission.ops.dead import dead_stats, list_dead

    async def run() -> None:
        stats = await on_broker(settings, dead_stats)
        letters = await on_broker(settings, lambda connection: list_dead(connection, limit))
        for letter in letters:
            click.echo(f"{letter.message_id or '-':<40} {letter.routing_key:<24} {letter.code:<28} {letter.detail}")
        oldest = f", the oldest dead-lettered {stats.oldest_seconds:.0f} s ago" if stats.oldest_seconds else ""
        shown = f" ({len(letters)} shown)" if len(letters) < stats.depth else ""
        click.echo(f"{stats.depth} dead-lettered command(s){shown}{oldest}")

    run_or_exit("dead list", run())


@dead_group.command("replay")
@click.option("--message-id", "message_ids", multiple=True, help="replay these (repeatable)")
@click.option("--code", "codes", multiple=True, help="replay those refused with this code (repeatable)")
@click.option("--all", "everything", is_flag=True, help="replay every dead-lettered command")
def dead_replay(message_ids: tuple[str, ...], codes: tuple[str, ...], everything: bool) -> None:
    """Send dead-lettered commands back to their queues (after fixing what refused them)."""
    if not (message_ids or codes or everything):
        raise click.UsageError("say which: --message-id, --code or --all")
    settings = load_settings()
    from intermission.ops.dead import DeadLetter, replay_dead

    def wanted(letter: DeadLetter) -> bool:
        return everything or letter.message_id in message_ids or letter.code in codes

    async def run() -> None:
        replayed = await on_broker(settings, lambda connection: replay_dead(connection, wanted))
        for letter in replayed:
            click.echo(f"replayed {letter.message_id} ({letter.routing_key}, was {letter.code})")
        click.echo(f"{len(replayed)} command(s) replayed")

    run_or_exit("dead replay", run())


@main.group("outbox")
def outbox_group() -> None:
    """Look at the events waiting to be published, and send quarantined ones again."""


def _when(moment: datetime | None) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S}" if moment is not None else "-"


@outbox_group.command("list")
@click.option("--quarantined", is_flag=True, help="the rows the relay set aside, instead of those it still tries")
@click.option("--limit", type=click.IntRange(1, 10000), default=100, show_default=True)
def outbox_list(quarantined: bool, limit: int) -> None:
    """Unsent outbox rows, oldest first: id, routing key, broker refusals so far, when it was quarantined, and
    the broker's last reason. Never the body: events carry the hosts' data."""
    settings = load_settings()

    async def run() -> None:
        stores = await Stores.connect(settings.database_url, max_size=1)
        try:
            found = await stores.across_scopes.list_outbox(quarantined=quarantined, limit=limit)
        finally:
            await stores.close()
        for entry in found:
            click.echo(
                f"{entry.id:<10} {entry.routing_key:<48} attempts {entry.attempts:<3} "
                f"{_when(entry.quarantined_at):<19} {entry.last_error or '-'}"
            )
        click.echo(f"{len(found)} {'quarantined' if quarantined else 'unsent'} outbox row(s)")

    run_or_exit("outbox list", run())


@outbox_group.command("retry")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "everything", is_flag=True, help="every quarantined row")
def outbox_retry(ids: tuple[int, ...], everything: bool) -> None:
    """Hand quarantined rows back to the relay (after making room for them: the subscriber queue that refused
    them, the broker's limits). Their refusals are forgotten and they go out under their own message_id, so a
    subscriber that got one after all drops the copy."""
    if bool(ids) == everything:
        raise click.UsageError("say which: one or more IDs, or --all")
    settings = load_settings()

    async def run() -> list[int]:
        stores = await Stores.connect(settings.database_url, max_size=1)
        try:
            return await stores.across_scopes.retry_quarantined_outbox(None if everything else ids)
        finally:
            await stores.close()

    retried = run_or_exit("outbox retry", run())
    click.echo(f"{len(retried)} outbox row(s) handed back to the relay")
    left = sorted(set(ids) - set(retried))
    if left:
        # Sent already, never quarantined, or no such row: say so, and fail, so a script notices.
        click.echo(f"not quarantined: {' '.join(str(i) for i in left)}", err=True)
        sys.exit(1)


def _scope_option(app: str, tenant: str) -> Scope:
    try:
        return Scope(app=app, tenant=tenant)
    except ValidationError as exc:
        raise click.BadParameter("app and tenant must match [A-Za-z0-9_-]{1,64}") from exc


async def _with_grants(settings: Settings, use: Callable[[BrokerGrants], Awaitable[T]]) -> T:
    access = settings.management()
    grants = BrokerGrants.connect(access.url, access.user, access.password, access.vhost)
    try:
        return await use(grants)
    finally:
        await grants.close()


def _print_scopes(user: str, scopes: list[Scope]) -> None:
    click.echo(f"{user}: {', '.join(str(s) for s in scopes) if scopes else 'no scope'}")


@main.group("users")
def users_group() -> None:
    """RabbitMQ users for hosts and for the fleet's own identities."""


@users_group.command("add")
@click.argument("user")
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True, help="asked for when not given")
@click.option("--trusted", is_flag=True, help="every scope: for workers, sweepers and the bus, never a host")
def users_add_command(user: str, password: str, trusted: bool) -> None:
    """Create the RabbitMQ user USER with no rights (a host, to be granted scopes with `grant`), or with
    every right (--trusted). An existing user gets the new password and keeps its rights, unless --trusted."""
    settings = load_settings()

    async def run(grants: BrokerGrants) -> None:
        created = await grants.add_user(user, password)
        if trusted:
            await grants.trust(user)
        rights = "every scope" if trusted else "no scope yet (intermission grant)"
        click.echo(f"{'created' if created else 'updated'} {user}: {rights}")

    run_or_exit("users add", _with_grants(settings, run))


@main.command("grant")
@click.argument("user")
@click.option("--app", required=True)
@click.option("--tenant", required=True)
@click.option("--print", "print_only", is_flag=True, help="print the rabbitmqctl commands instead of applying them")
def grant_command(user: str, app: str, tenant: str, print_only: bool) -> None:
    """Let the RabbitMQ user USER act as a host for one more scope, and for nothing else."""
    scope = _scope_option(app, tenant)
    settings = load_settings()
    if print_only:
        for line in rabbitmqctl_lines(user, [scope], settings.management().vhost):
            click.echo(line)
        return

    async def run() -> None:
        _print_scopes(user, await _with_grants(settings, lambda g: g.grant(user, scope)))

    run_or_exit("grant", run())


@main.command("revoke")
@click.argument("user")
@click.option("--app", required=True)
@click.option("--tenant", required=True)
def revoke_command(user: str, app: str, tenant: str) -> None:
    """Take one scope away from the RabbitMQ user USER; with none left it may do nothing at all."""
    scope = _scope_option(app, tenant)
    settings = load_settings()

    async def run() -> None:
        _print_scopes(user, await _with_grants(settings, lambda g: g.revoke(user, scope)))

    run_or_exit("revoke", run())


@main.command("grants")
@click.argument("user", required=False)
def grants_command(user: str | None) -> None:
    """The scopes each confined host user (or USER) may act for."""
    settings = load_settings()

    async def run() -> None:
        if user is not None:
            _print_scopes(user, await _with_grants(settings, lambda g: g.scopes(user)))
            return
        everyone = await _with_grants(settings, lambda g: g.all_grants())
        for name in sorted(everyone):
            _print_scopes(name, everyone[name])
        if not everyone:
            click.echo("no confined users")

    run_or_exit("grants", run())


main.add_command(console_command)

if __name__ == "__main__":
    main()
