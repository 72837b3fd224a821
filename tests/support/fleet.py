"""Helpers for tests that run the fleet: settings for fast leases, a worker in this process, and reads of
what a run left behind."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from intermission.agent.loop import default_executor
from intermission.engine.holding import Reclaimed, Unreadable
from intermission.fleet.runtime import Fleet
from intermission.fleet.settings import Settings
from intermission.schemas.commands import StartCommand
from intermission.schemas.run import Run
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.store import Stores
from tests.support.control import LocalControl

DRAIN_TIMEOUT = 30.0


def fast_settings(database_url: str, **changes: Any) -> Settings:
    """Short leases so a dead worker's runs lapse in about a second."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "lease_seconds": 1.5,
        "lease_renew_seconds": 0.4,
        "reclaim_interval_seconds": 0.2,
        "pause_ttl_seconds": 0,
        "shutdown_grace_seconds": 5.0,
    }
    values.update(changes)
    return Settings(**values)


@dataclass
class Worker:
    fleet: Fleet
    control: LocalControl

    async def drain(self, *, wait_for_lapsed: bool = False) -> None:
        async with asyncio.timeout(DRAIN_TIMEOUT):
            await self.fleet.drain(wait_for_lapsed=wait_for_lapsed)


def worker(stores: Stores, settings: Settings) -> Worker:
    fleet = Fleet(stores, settings, default_executor())
    return Worker(fleet=fleet, control=LocalControl(fleet))


def start_command(scope: Scope, script: list[dict[str, Any]], **changes: Any) -> StartCommand:
    body: dict[str, Any] = {
        "scope": scope,
        "run_id": f"run-{uuid.uuid4().hex[:12]}",
        "agent_id": "demo",
        "input": "please help",
        "script": [ScriptTurn.model_validate(t) for t in script],
    }
    body.update(changes)
    return StartCommand(**body)


async def run_row(stores: Stores, scope: Scope, run_id: str) -> Run:
    return await stores.at(scope).runs.get_run(run_id)


async def outbox_keys(stores: Stores, scope: Scope, run_id: str) -> list[str]:
    async with stores.db.connection() as con:
        found = await con.fetch("list_outbox_for_run", run_id, scope.app, scope.tenant)
    return [r["routing_key"] for r in found]


async def outbox_bodies(stores: Stores, scope: Scope, run_id: str) -> list[dict[str, Any]]:
    async with stores.db.connection() as con:
        found = await con.fetch("list_outbox_for_run", run_id, scope.app, scope.tenant)
    return [json.loads(r["body"]) for r in found]


async def charges(stores: Stores, scope: Scope, run_id: str) -> dict[str, int]:
    return await stores.at(scope).ledger.times_charged(run_id)


async def suspension_count(stores: Stores, scope: Scope, run_id: str) -> int:
    async with stores.db.connection() as con:
        return int(
            await con.raw.fetchval(
                "SELECT count(*) FROM suspensions WHERE app = $1 AND tenant = $2 AND run_id = $3",
                scope.app,
                scope.tenant,
                run_id,
            )
        )


def readable(taken: list[Reclaimed | Unreadable]) -> list[Reclaimed]:
    """A reclaim batch in which every run decoded (a test that corrupts no row expects exactly that)."""
    unreadable = [t for t in taken if isinstance(t, Unreadable)]
    assert not unreadable, unreadable
    return [t for t in taken if isinstance(t, Reclaimed)]
