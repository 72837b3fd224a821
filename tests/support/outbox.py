"""Outbox rows for the relay's and the clients' tests.

``insert`` writes rows as a foreign writer would (plain SQL in one transaction of a pool connection, so the
``outbox_notify`` trigger fires as for any writer that is not a relayed worker): the relay publishes
whatever is in the table, whoever wrote it. ``ended_run_event`` writes a row the way the fleet does, through
a transition of the engine (a run's end).
"""

from __future__ import annotations

import json

from intermission.engine.core import Engine
from intermission.engine.events import OutboxEvent
from intermission.schemas.events import RunEventKind
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.factories import running_run, writes


async def insert(stores: Stores, scope: Scope, *events: OutboxEvent, run_id: str | None = None) -> list[str]:
    """The events as outbox rows, in ONE transaction (one NOTIFY); their message ids."""
    async with stores.db.transaction() as con:
        for event in events:
            await con.raw.execute(
                "INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)"
                " VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8)",
                event.message_id,
                event.routing_key,
                event.body,
                event.correlation_id,
                json.dumps(event.headers),
                scope.app,
                scope.tenant,
                run_id,
            )
    return [str(e.message_id) for e in events]


async def ended_run_event(stores: Stores, scope: Scope, through: Engine | None = None) -> str:
    """A run started and ended through the engine (``through``, or one of its own over ``stores``): the
    message id of its ``run.completed`` row."""
    run, held = await running_run(stores, scope, through=through)
    await writes(stores, scope, through).runs.end_run(run.id, held.owner, RunEventKind.COMPLETED, output="done")
    async with stores.db.connection() as con:
        found = await con.fetch("list_outbox_for_run", run.id, scope.app, scope.tenant)
    return str(found[-1]["message_id"])
