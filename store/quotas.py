"""Per-scope quotas on starts (migration 0014): each scope's own, as operators set them; enforced by the
start transition itself (``intermission_start_run_v2``), not here."""

from __future__ import annotations

from dataclasses import dataclass

from intermission.schemas.scope import Scope
from intermission.store.db import Database


@dataclass(frozen=True)
class ScopeQuota:
    """A scope's own quotas (None: the fleet's default; 0: no limit), and its live runs now."""

    scope: Scope
    live_runs: int | None
    starts_per_second: float | None
    live: int = 0


async def set_quota(db: Database, scope: Scope, live_runs: int | None, starts_per_second: float | None) -> ScopeQuota:
    async with db.connection() as con:
        row = await con.fetchrow("set_quota", scope.app, scope.tenant, live_runs, starts_per_second)
    assert row is not None
    return ScopeQuota(scope, row["live_runs"], row["starts_per_second"])


async def list_quotas(db: Database) -> list[ScopeQuota]:
    async with db.connection() as con:
        found = await con.fetch("list_quotas")
    return [
        ScopeQuota(Scope(app=r["app"], tenant=r["tenant"]), r["live_runs"], r["starts_per_second"], r["live"])
        for r in found
    ]
