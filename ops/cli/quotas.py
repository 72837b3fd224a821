"""``intermission quotas set|list``: each scope's own quotas on starts (live runs, runs started a second),
which the start transition enforces (``quota_exceeded``); a scope without its own has the fleet's
(``INTERMISSION_QUOTA_LIVE_RUNS``, ``INTERMISSION_QUOTA_STARTS_PER_SECOND``)."""

from __future__ import annotations

import click

from intermission.ops.cli.app import database, emit_json, json_option, load_settings, main, run_or_exit, scope_of
from intermission.store.quotas import ScopeQuota, list_quotas, set_quota


@main.group("quotas")
def quotas_group() -> None:
    """Each scope's quotas on starts."""


def _describe(quota: ScopeQuota) -> str:
    def shown(value: float | None) -> str:
        return "default" if value is None else "none" if value == 0 else f"{value:g}"

    return (
        f"{quota.scope}: live runs {shown(quota.live_runs)} ({quota.live} now), "
        f"starts a second {shown(quota.starts_per_second)}"
    )


@quotas_group.command("set")
@click.option("--app", required=True)
@click.option("--tenant", required=True)
@click.option("--live-runs", type=click.IntRange(min=0), help="runs not yet ended, at most (0: no limit)")
@click.option("--starts-per-second", type=click.FloatRange(min=0), help="runs started a second (0: no limit)")
@json_option
def quotas_set(app: str, tenant: str, live_runs: int | None, starts_per_second: float | None, as_json: bool) -> None:
    """Give one scope quotas of its own; an option left out goes back to the fleet's default."""
    scope = scope_of(app, tenant)
    assert scope is not None  # both options are required
    settings = load_settings()

    async def run() -> ScopeQuota:
        async with database(settings, max_size=1) as stores:
            return await set_quota(stores.db, scope, live_runs, starts_per_second)

    quota = run_or_exit("quotas set", run(), settings)
    if as_json:
        emit_json({"quota": quota})
        return
    click.echo(_describe(quota))


@quotas_group.command("list")
@json_option
def quotas_list(as_json: bool) -> None:
    """Every scope with quotas of its own, and its live runs now."""
    settings = load_settings()

    async def run() -> list[ScopeQuota]:
        async with database(settings, max_size=1) as stores:
            return await list_quotas(stores.db)

    found = run_or_exit("quotas list", run(), settings)
    if as_json:
        emit_json({"quotas": found})
        return
    for quota in found:
        click.echo(_describe(quota))
    if not found:
        click.echo("no scope has quotas of its own")
