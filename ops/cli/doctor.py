"""``intermission doctor``: every check of ``ops/doctor.py``, a table (or ``--json``), and an exit code that
says whether all is well (0), something is wrong (1), or a server could not be reached (2)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable

import click
from rich.table import Table
from rich.text import Text

from intermission.fleet.settings import Settings
from intermission.ops import doctor
from intermission.ops.cli.app import (
    DURATION,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_SERVER_DOWN,
    MANAGEMENT_API,
    POSTGRESQL,
    RABBITMQ,
    ServerDown,
    broker,
    database,
    emit_json,
    json_option,
    load_settings,
    loop_factory,
    main,
    people,
    say,
)
from intermission.ops.doctor import Check, Findings, Status, Thresholds, guarded, unreachable
from intermission.publishers.amqp import safe_url

DATABASE_CHECKS = ["stale_leases", "outbox_lag", "outbox_quarantine", "replicas"]
COLOURS = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "red"}


async def examine(settings: Settings, thresholds: Thresholds) -> Findings:
    checks: list[Check] = []
    where = safe_url(settings.database_url)
    try:
        async with database(settings, max_size=1) as stores:
            store = stores.across_scopes

            async def from_database() -> list[Check]:
                return [
                    await doctor.stale_leases(store, thresholds),
                    *await doctor.outbox(store, thresholds),
                    await doctor.replication(store, thresholds),
                ]

            checks += await guarded(DATABASE_CHECKS, POSTGRESQL, where, from_database)
    except ServerDown as exc:
        checks += [unreachable(name, POSTGRESQL, where, exc.reason) for name in DATABASE_CHECKS]
    amqp = safe_url(settings.amqp_url)
    try:
        async with broker(settings) as connection:
            checks += await guarded(["dead_letters"], RABBITMQ, amqp, lambda: _one(doctor.dead_letters(connection)))
    except ServerDown as exc:
        checks.append(unreachable("dead_letters", RABBITMQ, amqp, exc.reason))
    access = settings.management()
    checks += await guarded(["consumers"], MANAGEMENT_API, safe_url(access.url), lambda: _one(doctor.consumers(access)))
    return Findings(checks)


async def _one(check: Awaitable[Check]) -> list[Check]:
    return [await check]


@main.command("doctor")
@click.option("--lease-grace", type=DURATION, default=60.0, show_default=True, help="a lapsed lease not taken over")
@click.option("--outbox-lag", type=DURATION, default=60.0, show_default=True, help="the oldest event still unsent")
@click.option("--replica-lag", type=DURATION, default=10.0, show_default=True, help="a standby's replay lag")
@json_option
def doctor_command(lease_grace: float, outbox_lag: float, replica_lag: float, as_json: bool) -> None:
    """Check the deployment: stale leases, outbox lag, quarantined events, dead letters, command queues
    without consumers, standbys out of step. Exits 0 when every check is ok, 1 when one is not, 2 when a
    server could not be reached."""
    settings = load_settings()
    thresholds = Thresholds(
        lease_grace_seconds=lease_grace, outbox_lag_seconds=outbox_lag, replica_lag_seconds=replica_lag
    )
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        findings = runner.run(examine(settings, thresholds))
    if as_json:
        emit_json({"healthy": findings.healthy, "unreachable": findings.unreachable, "checks": findings.checks})
    else:
        table = Table("status", "check", "found, and what to do", box=None, pad_edge=False)
        for c in findings.checks:
            said = Text(c.found)
            if c.action:
                said.append(f"\n-> {c.action}", style="dim")
            table.add_row(Text(c.status.value, style=COLOURS[c.status]), c.name, said)
        people().print(table)
    if findings.unreachable:
        say(f"doctor: cannot reach {', '.join(findings.unreachable)}")
        sys.exit(EXIT_SERVER_DOWN)
    if not findings.healthy:
        bad = [c.name for c in findings.checks if c.status is not Status.OK]
        say(f"doctor: {len(bad)} check(s) need attention: {', '.join(bad)}")
        sys.exit(EXIT_PROBLEM)
    say("doctor: all is well")
    sys.exit(EXIT_OK)
