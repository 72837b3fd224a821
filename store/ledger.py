"""The demo agent's ledger of non-retry-safe calls (``demo_charges``): one row per handler invocation, so
a call that ever ran twice shows up as two rows. It is what the demo's ``charge`` tool writes and what the
crash tests and the soak count; tools reach it through this narrow interface, never the database.

A ledger is bound to one scope (``ScopedStores.ledger``), like every other store: a run id names a run only
within its scope, so a charge is booked, and counted, under the scope of the run that made it."""

from __future__ import annotations

from decimal import Decimal

from intermission.schemas.scope import Scope
from intermission.store.db import Database


class DemoLedger:
    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def charge(self, run_id: str, call_id: str, amount: Decimal) -> int:
        """Append one charge of run ``run_id`` of this scope; returns its receipt number."""
        async with self.db.connection() as con:
            receipt: int = await con.fetchval(
                "insert_demo_charge", self.scope.app, self.scope.tenant, run_id, call_id, amount
            )
        return receipt

    async def times_charged(self, run_id: str) -> dict[str, int]:
        """How many times each call of run ``run_id`` of this scope was charged."""
        async with self.db.connection() as con:
            found = await con.fetch("count_demo_charges", self.scope.app, self.scope.tenant, run_id)
        return {r["call_id"]: r["times"] for r in found}
