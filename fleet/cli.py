"""The ``intermission`` command."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from fleet.logs import configure as configure_logs
from fleet.settings import Settings
from schemas.errors import IntermissionError
from store.migrate import ensure_database, migrate

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


def run_or_exit(what: str, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``; a typed error or an unreachable server ends the process with a one-line reason."""
    try:
        return asyncio.run(work)
    except IntermissionError as exc:
        click.echo(f"{what} failed ({exc.code}): {exc.detail}", err=True)
    except (OSError, ConnectionError) as exc:
        click.echo(f"{what} failed: cannot reach a server ({type(exc).__name__}: {exc})", err=True)
    sys.exit(1)


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
    from fleet.worker import serve

    run_or_exit("worker", serve(settings))


@main.command("sweeper")
def sweeper_command() -> None:
    """Run the expiry sweeper until SIGTERM: publish run.expire for every expired pause, in every scope."""
    settings = load_settings()
    configure_logs(settings.log_level)
    from fleet.worker import sweep

    run_or_exit("sweeper", sweep(settings))


@main.command("demo")
def demo_command() -> None:
    """Play runs that pause for each reason on the local servers, and tell the story as it happens."""
    settings = load_settings()
    configure_logs("WARNING")
    from fleet.demo import TIMEOUT_SECONDS, play

    try:
        completed = run_or_exit("demo", play(settings, click.echo))
    except TimeoutError:
        click.echo(f"demo failed: the runs did not finish within {TIMEOUT_SECONDS:.0f} s", err=True)
        sys.exit(1)
    sys.exit(0 if completed == 3 else 1)


if __name__ == "__main__":
    main()
