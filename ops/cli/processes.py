"""The commands that run or set up the fleet: ``migrate``, ``worker``, ``sweeper``, ``demo``, ``topology
upgrade`` and ``prune``."""

from __future__ import annotations

import sys

import click
from aio_pika.abc import AbstractRobustConnection
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from intermission.fleet.logs import configure as configure_logs
from intermission.fleet.telemetry import SWEEPER_SERVICE, WORKER_SERVICE, TracingMisconfigured, install_tracing
from intermission.ops.cli.app import (
    EXIT_PROBLEM,
    database,
    emit_json,
    json_option,
    load_settings,
    main,
    on_broker,
    run_or_exit,
    say,
)
from intermission.store.migrate import ensure_database, migrate
from intermission.wire import COMMANDS_EXCHANGE, upgrade


def start_tracing(service: str) -> None:
    """Export spans when the OTEL_* variables ask for it (fleet/telemetry.py); a request that cannot be met
    stops the process at start, like a bad setting."""
    try:
        install_tracing(service)
    except TracingMisconfigured as exc:
        raise click.ClickException(f"bad settings:\n  {exc}") from exc


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

    run_or_exit("migrate", run(), settings)


@main.command("worker")
def worker_command() -> None:
    """Run a worker until SIGTERM: consume commands, relay the outbox, run claimed runs, take over lapsed ones."""
    settings = load_settings()
    configure_logs(settings.log_level)
    start_tracing(WORKER_SERVICE)
    from intermission.fleet.worker import serve

    run_or_exit("worker", serve(settings), settings)


@main.command("sweeper")
def sweeper_command() -> None:
    """Run the expiry sweeper until SIGTERM: publish run.expire for every expired pause, in every scope."""
    settings = load_settings()
    configure_logs(settings.log_level)
    start_tracing(SWEEPER_SERVICE)
    from intermission.fleet.worker import sweep

    run_or_exit("sweeper", sweep(settings), settings)


@main.command("demo")
def demo_command() -> None:
    """Play runs that pause for each reason on the local servers, and tell the story as it happens."""
    settings = load_settings()
    configure_logs("WARNING")
    from intermission.ops.demo import TIMEOUT_SECONDS, play

    try:
        completed = run_or_exit("demo", play(settings, click.echo), settings)
    except TimeoutError:
        click.echo(f"demo failed: the runs did not finish within {TIMEOUT_SECONDS:.0f} s", err=True)
        sys.exit(EXIT_PROBLEM)
    sys.exit(0 if completed == 3 else EXIT_PROBLEM)


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

    converted = run_or_exit("topology upgrade", on_broker(settings, run), settings)
    if converted:
        click.echo(f"converted {COMMANDS_EXCHANGE} to a topic exchange; the command queues kept their messages")
    else:
        click.echo("the topology is up to date")


def progress_bar() -> Progress:
    """A progress bar for long work, on stderr (stdout stays the command's answer)."""
    from rich.console import Console

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=False,
    )


@main.command("prune")
@click.option("--dry-run", is_flag=True, help="count what is past retention, removing nothing")
@json_option
def prune_command(dry_run: bool, as_json: bool) -> None:
    """Remove what is past retention now (the sweeper does it every INTERMISSION_PRUNE_INTERVAL_SECONDS):
    ended runs with everything about them, old inbox records, sent events, old session messages."""
    settings = load_settings()
    from intermission.fleet.pruning import pruner_for

    async def run() -> dict[str, int]:
        async with database(settings) as stores:
            pruner = pruner_for(stores.db, settings)
            due = await pruner.prunable()
            if dry_run:
                return due
            with progress_bar() as bar:
                task = bar.add_task("pruning", total=sum(due.values()))
                return await pruner.prune(on_batch=lambda kept, counts: bar.advance(task, sum(counts.values())))

    counts = run_or_exit("prune", run(), settings)
    if as_json:
        emit_json({"dry_run": dry_run, "rows": counts})
        return
    verb = "would remove" if dry_run else "removed"
    for table in sorted(counts):
        if counts[table] or dry_run:
            click.echo(f"{table:<20} {verb} {counts[table]}")
    if not any(counts.values()):
        say("nothing is past retention")
