"""Where a soak runs, and what it can break there.

The soak's workload, actors, checker and report are the same everywhere; a ``Site`` gives them the
servers to run against and the server faults that can be injected on them:

- ``LocalSite`` (``python -m bench.soak``): the machine's own PostgreSQL and RabbitMQ, with a RabbitMQ
  ``stop_app``/``start_app``, PostgreSQL stops and starts and backend terminations (``bench/soak/servers.py``).
- the cluster site (``python -m bench.cluster``, ``bench/cluster/site.py``): three RabbitMQ nodes and a
  PostgreSQL primary with a synchronous standby, booted for the run, with node losses and failovers.

A site may add environment to the fleet's processes, faults to the light and heavy decks, and invariants
of its own, checked after the soak's (``verify``).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.soak.checker import CheckResult
from bench.soak.env import SoakEnv, amqp_admin_url, rabbitmqctl_argv, server_dsn
from bench.soak.ledger import Ledger
from bench.soak.observe import Observer
from bench.soak.procs import ProcessPool
from bench.soak.profile import Profile
from bench.soak.servers import ServerFaults, find_pg_cluster

# One server fault: what it did (for the report), or None when it found nothing to act on.
FaultAction = Callable[[], Awaitable[str | None]]


@dataclass(frozen=True)
class Endpoints:
    """The servers a soak makes its database and vhost on."""

    # A server-level PostgreSQL DSN (several hosts allowed); the soak's database is made beside it.
    server_dsn: str
    # An administrator's AMQP URL or node list.
    admin_url: str
    # How to run rabbitmqctl against the broker (import_definitions, delete_vhost).
    ctl: list[str]


@dataclass
class SoakRun:
    """What a site's faults and checks get to work with, once the soak's fleet is up."""

    profile: Profile
    env: SoakEnv
    ledger: Ledger
    pool: ProcessPool
    observer: Observer
    rng: random.Random
    logdir: Path


@dataclass
class FaultPlan:
    # Site faults added to every light deck (each once per ``light_per_deck``), and the heavy ones, one
    # per deck in turn.
    light: tuple[str, ...]
    heavy: tuple[str, ...]
    actions: dict[str, FaultAction] = field(default_factory=dict)
    # Heavy faults per deck (taken in turn): as many as there are kinds, for a short run that must see
    # every kind within its first deck.
    heavy_per_deck: int = 1


class Site(Protocol):
    name: str

    @property
    def endpoints(self) -> Endpoints: ...

    def fleet_env(self) -> dict[str, str]:
        """Environment added to every worker's and sweeper's."""
        ...

    def fault_plan(self, run: SoakRun) -> FaultPlan: ...

    async def verify(self, run: SoakRun, result: CheckResult) -> dict[str, Any]:
        """Check the site's own invariants into ``result``; returns figures for the report."""
        ...


class LocalSite:
    """The machine's own servers (``bench/soak/env.py`` says which)."""

    name = "local"

    def __init__(self) -> None:
        self._endpoints = Endpoints(server_dsn(), amqp_admin_url(), rabbitmqctl_argv())

    @property
    def endpoints(self) -> Endpoints:
        return self._endpoints

    def fleet_env(self) -> dict[str, str]:
        return {}

    def fault_plan(self, run: SoakRun) -> FaultPlan:
        e = self._endpoints
        servers = ServerFaults(e.ctl, e.server_dsn, run.env.database, find_pg_cluster(e.server_dsn))
        if servers.pg_cluster is None:
            run.ledger.notes.append("no local PostgreSQL cluster found: pg_restart faults are skipped")

        async def rabbit_restart() -> str:
            down = await servers.rabbit_outage(run.rng.uniform(*run.profile.rabbit_down))
            return f"stop_app .. start_app, {down:.1f} s"

        def pg_outage(long: bool) -> FaultAction:
            async def act() -> str | None:
                if servers.pg_cluster is None:
                    return None
                hold = run.profile.pg_long_down if long else run.rng.uniform(*run.profile.pg_down)
                down = await servers.pg_outage(hold)
                return f"pg_ctlcluster stop .. start, {down:.1f} s until it answered"

            return act

        async def terminate() -> str:
            return f"{await servers.pg_terminate()} backends terminated"

        # The long outage is as long as a managed database's failover (30 s): commands that arrive
        # meanwhile must be held and applied once it is back, never dead-lettered.
        return FaultPlan(
            light=("pg_terminate_backends",),
            heavy=("rabbitmq_restart", "pg_outage_long", "pg_restart"),
            actions={
                "pg_terminate_backends": terminate,
                "rabbitmq_restart": rabbit_restart,
                "pg_outage_long": pg_outage(True),
                "pg_restart": pg_outage(False),
            },
        )

    async def verify(self, run: SoakRun, result: CheckResult) -> dict[str, Any]:
        return {}
