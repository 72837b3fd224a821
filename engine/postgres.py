"""The committer over PostgreSQL: one batch is one statement of the family's batch function.

The statement takes ONE array of the family's composite row (asyncpg encodes each ``NamedTuple`` as the
composite, and the array as the composite's array type), and the outbox hold for a family that takes one.
It autocommits, unless a transition of the batch must be decoded before its commit (``Transition.atomic``):
then the statement runs in a transaction that commits only once every result decoded, and rolls back when
one did not.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from intermission.engine.committer import Batch, Outs, group_by_position
from intermission.store.db import Conn, Database

T = TypeVar("T")


class PostgresCommitter:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def commit(self, batch: Batch, decode: Callable[[Outs], T]) -> T:
        family, rows = batch.family, list(batch.rows)
        opened: AbstractAsyncContextManager[Conn] = self.db.transaction() if batch.atomic else self.db.connection()
        async with opened as con:
            found = await (
                con.fetch(family.statement, rows, batch.hold) if family.held else con.fetch(family.statement, rows)
            )
            return decode(group_by_position(found, len(rows)))
