"""``intermission doctor``: what is wrong with a deployment, each finding with what to do about it.

Each check reads, never writes: the store's cross-scope figures (stale leases, outbox lag, quarantined
events, replication), the dead-letter queue (looked at and put back, ``ops/dead.py``), and the command
queues' consumers (RabbitMQ's management API). A check is ``ok``, ``warn`` (someone should look) or ``fail``
(something is broken); a check whose server cannot be reached fails and names the server, and the command
then exits 2 rather than 1.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import quote

import aiormq
import httpx
from aio_pika.abc import AbstractRobustConnection

from intermission.fleet.settings import ManagementAccess
from intermission.ops.durations import describe_duration
from intermission.publishers.dead_queue import dead_stats
from intermission.store.across_scopes import AcrossScopes
from intermission.wire import COMMAND_QUEUES


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    """One finding: its name, its status, what it found and what to do (empty when nothing)."""

    name: str
    status: Status
    found: str
    action: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    # The server that could not be reached, when that is why it failed.
    unreachable: str | None = None


@dataclass(frozen=True)
class Thresholds:
    # A lease that lapsed longer ago than this and was not taken over: no worker reclaims.
    lease_grace_seconds: float = 60.0
    # The oldest event waiting for a relay: older than this, the relays are behind or gone.
    outbox_lag_seconds: float = 60.0
    # A standby further behind than this many bytes of WAL, or seconds of replay.
    replica_lag_bytes: float = 16 * 1024 * 1024
    replica_lag_seconds: float = 10.0


def unreachable(name: str, server: str, where: str, reason: str) -> Check:
    return Check(
        name,
        Status.FAIL,
        f"cannot reach {server} at {where} ({reason})",
        f"start {server} or fix the setting that names it, then run doctor again",
        unreachable=server,
    )


async def stale_leases(store: AcrossScopes, thresholds: Thresholds) -> Check:
    total, oldest = await store.stale_leases(thresholds.lease_grace_seconds)
    if not total:
        return Check("stale_leases", Status.OK, "every running run's lease is held or was taken over in time")
    first = oldest[0]
    return Check(
        "stale_leases",
        Status.FAIL,
        f"{total} running run(s) whose lease lapsed over {describe_duration(thresholds.lease_grace_seconds)} ago "
        f"and was not taken over (the oldest: {first.run_id} of {first.app}/{first.tenant}, "
        f"{describe_duration(first.lapsed_seconds)} ago)",
        "start a worker, or look at the workers' /readyz (task:reclaim-sweep): no worker is taking runs over",
        # Each run by its key: a run id names a run only within its scope.
        {"total": total, "runs": [{"id": r.run_id, "app": r.app, "tenant": r.tenant} for r in oldest]},
    )


async def outbox(store: AcrossScopes, thresholds: Thresholds) -> list[Check]:
    lag = await store.outbox_lag()
    oldest = lag.oldest_seconds or 0.0
    details = {"pending": lag.pending, "oldest_seconds": lag.oldest_seconds}
    if lag.pending and oldest > thresholds.outbox_lag_seconds:
        lag_check = Check(
            "outbox_lag",
            Status.FAIL,
            f"{lag.pending} event(s) wait for the relays, the oldest written {describe_duration(oldest)} ago",
            "start a worker, or look at the workers' /readyz (task:outbox-relay, rabbitmq): nobody publishes events",
            details,
        )
    else:
        lag_check = Check(
            "outbox_lag",
            Status.OK,
            f"{lag.pending} event(s) waiting"
            + (f", the oldest {describe_duration(oldest)} old" if lag.pending else ""),
            details=details,
        )
    if lag.quarantined:
        quarantine = Check(
            "outbox_quarantine",
            Status.FAIL,
            f"{lag.quarantined} event(s) quarantined after the broker kept refusing them",
            "intermission outbox list --quarantined; mend what refused them; intermission outbox retry --all",
            {"quarantined": lag.quarantined},
        )
    else:
        quarantine = Check("outbox_quarantine", Status.OK, "no event is quarantined", details={"quarantined": 0})
    return [lag_check, quarantine]


async def replication(store: AcrossScopes, thresholds: Thresholds) -> Check:
    found = await store.replication()
    if found.in_recovery:
        return Check(
            "replicas",
            Status.FAIL,
            "INTERMISSION_DATABASE_URL reaches a standby (read-only): the fleet cannot write there",
            "point it at the primary, or list every host with target_session_attrs=read-write",
        )
    if not found.standbys:
        return Check("replicas", Status.OK, "no standby streams from this primary (none configured)")
    behind = []
    for s in found.standbys:
        name = s.name or s.address or "a standby"
        if s.state != "streaming":
            behind.append((Status.FAIL, f"{name} is {s.state or 'not streaming'}"))
        elif (s.lag_bytes or 0) > thresholds.replica_lag_bytes or (s.lag_seconds or 0) > thresholds.replica_lag_seconds:
            behind.append((Status.WARN, f"{name} is {int(s.lag_bytes or 0)} bytes, {s.lag_seconds or 0:.1f} s behind"))
    details = {"standbys": [s.__dict__ for s in found.standbys]}
    if not behind:
        return Check("replicas", Status.OK, f"{len(found.standbys)} standby(s) streaming and in step", details=details)
    status = Status.FAIL if any(st is Status.FAIL for st, _ in behind) else Status.WARN
    return Check(
        "replicas",
        status,
        "; ".join(text for _, text in behind),
        "look at the standby (its log, its network); a synchronous standby that is away holds every commit",
        details,
    )


async def dead_letters(connection: AbstractRobustConnection) -> Check:
    try:
        stats = await dead_stats(connection)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return Check(
            "dead_letters",
            Status.FAIL,
            "there is no intermission.dead queue: the topology was never declared on this vhost",
            "start a worker (it declares the topology), or check the vhost of INTERMISSION_AMQP_URL",
        )
    details = {"depth": stats.depth, "oldest_seconds": stats.oldest_seconds}
    if not stats.depth:
        return Check("dead_letters", Status.OK, "intermission.dead is empty", details=details)
    oldest = f", the oldest {describe_duration(stats.oldest_seconds)} ago" if stats.oldest_seconds else ""
    return Check(
        "dead_letters",
        Status.WARN,
        f"{stats.depth} dead-lettered command(s) in intermission.dead{oldest}",
        "intermission dead list; fix what refused them; intermission dead replay (or leave those that were right)",
        details,
    )


async def queue_consumers(access: ManagementAccess, *, request_seconds: float = 10.0) -> dict[str, int | None]:
    """Each command queue's consumers as the management API counts them (None: the queue is missing)."""
    async with httpx.AsyncClient(
        base_url=access.url, auth=(access.user, access.password), timeout=request_seconds
    ) as http:
        counted: dict[str, int | None] = {}
        for queue in COMMAND_QUEUES.values():
            response = await http.get(f"/api/queues/{quote(access.vhost, safe='')}/{quote(queue, safe='')}")
            if response.status_code == 404:
                counted[queue] = None
                continue
            response.raise_for_status()
            counted[queue] = int(response.json().get("consumers", 0))
        return counted


async def consumers(access: ManagementAccess) -> Check:
    try:
        counted = await queue_consumers(access)
    except httpx.HTTPStatusError as exc:
        return Check(
            "consumers",
            Status.FAIL,
            f"the management API answered {exc.response.status_code} to {access.user} (vhost {access.vhost})",
            "set INTERMISSION_MANAGEMENT_USER and INTERMISSION_MANAGEMENT_PASSWORD to an administrator of the"
            " broker (the AMQP URL's user by default)",
        )
    idle = sorted(q for q, n in counted.items() if not n)
    if not idle:
        return Check("consumers", Status.OK, "every command queue has a consumer", details={"consumers": counted})
    return Check(
        "consumers",
        Status.FAIL,
        f"no worker consumes {', '.join(idle)}",
        "start a worker (intermission worker), or look at why the workers' /readyz says consumers: false",
        {"consumers": counted},
    )


@dataclass(frozen=True)
class Findings:
    checks: list[Check]

    @property
    def healthy(self) -> bool:
        return all(c.status is Status.OK for c in self.checks)

    @property
    def unreachable(self) -> list[str]:
        return sorted({c.unreachable for c in self.checks if c.unreachable is not None})


async def guarded(
    names: list[str], server: str, where: str, check: Callable[[], Awaitable[list[Check]]]
) -> list[Check]:
    """``check``'s findings, or each of ``names`` failed as unreachable when its server cannot be reached."""
    try:
        return await check()
    except (OSError, TimeoutError, httpx.TransportError) as exc:
        return [unreachable(name, server, where, f"{type(exc).__name__}: {exc}") for name in names]
