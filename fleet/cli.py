"""The ``intermission`` command."""

from __future__ import annotations

import asyncio
import sys

import click
from pydantic import ValidationError

from fleet.logs import configure as configure_logs
from fleet.settings import Settings
from schemas.errors import IntermissionError
from store.migrate import ensure_database, migrate


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


@main.command("migrate")
def migrate_command() -> None:
    """Create the database when it is missing, then apply every pending migration."""
    settings = load_settings()

    async def run() -> None:
        created = await ensure_database(settings.database_url)
        if created:
            click.echo("created the database")
        applied = await migrate(settings.database_url)
        if applied:
            for m in applied:
                click.echo(f"applied {m.version:04d}_{m.name}")
        else:
            click.echo("the database is up to date")

    try:
        asyncio.run(run())
    except IntermissionError as exc:
        click.echo(f"migrate failed ({exc.code}): {exc.detail}", err=True)
        sys.exit(1)


@main.command("worker")
def worker_command() -> None:
    """Run a worker until SIGTERM: continue claimed runs under leases, take over lapsed ones."""
    settings = load_settings()
    configure_logs(settings.log_level)
    from fleet.worker import serve

    try:
        asyncio.run(serve(settings))
    except IntermissionError as exc:
        click.echo(f"worker failed ({exc.code}): {exc.detail}", err=True)
        sys.exit(1)


@main.command("sweeper")
def sweeper_command() -> None:
    """Run the expiry sweeper until SIGTERM: publish run.expire for every expired pause, in every scope."""
    settings = load_settings()
    configure_logs(settings.log_level)
    from fleet.worker import sweep

    try:
        asyncio.run(sweep(settings))
    except IntermissionError as exc:
        click.echo(f"sweeper failed ({exc.code}): {exc.detail}", err=True)
        sys.exit(1)


@main.command("demo")
def demo_command() -> None:
    """Play runs that pause for each reason on the local servers, and tell the story as it happens."""
    settings = load_settings()
    configure_logs("WARNING")
    from fleet.demo import play

    try:
        completed = asyncio.run(play(settings, click.echo))
    except IntermissionError as exc:
        click.echo(f"demo failed ({exc.code}): {exc.detail}", err=True)
        sys.exit(1)
    except (OSError, ConnectionError) as exc:
        click.echo(f"demo failed: cannot reach a server ({type(exc).__name__}: {exc})", err=True)
        sys.exit(1)
    except TimeoutError:
        click.echo("demo failed: the runs did not finish within a minute", err=True)
        sys.exit(1)
    sys.exit(0 if completed == 3 else 1)


if __name__ == "__main__":
    main()
