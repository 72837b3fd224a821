"""The demo agent's ledger of non-retry-safe calls (``demo_charges``): one row per handler invocation, so
a call that ever ran twice shows up as two rows. It is what the demo's ``charge`` tool writes and what the
crash tests and the soak count; tools reach it through this narrow interface, never the database."""

from __future__ import annotations

from decimal import Decimal

from intermission.store.db import Database


class DemoLedger:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def charge(self, run_id: str, call_id: str, amount: Decimal) -> int:
        """Append one charge; returns its receipt number."""
        async with self.db.connection() as con:
            receipt: int = await con.fetchval("insert_demo_charge", run_id, call_id, amount)
        return receipt

    async def times_charged(self, run_id: str) -> dict[str, int]:
        """How many times each call of ``run_id`` was charged."""
        async with self.db.connection() as con:
            found = await con.fetch("count_demo_charges", run_id)
        return {r["call_id"]: r["times"] for r in found}
