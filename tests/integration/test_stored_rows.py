"""Stored rows decode strictly: a value of the wrong JSON type is a typed scan error at the store's boundary,
never coerced; a record written before schema versions existed reads as legacy version 0, never as current
(docs/seed.md, Continuation; docs/store.md, "Digests")."""

from __future__ import annotations

import pytest

from intermission.schemas.base import LEGACY_SCHEMA_VERSION
from intermission.schemas.errors import InvalidContinuation
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import CONTINUATION_SCHEMA_VERSION, Progress
from intermission.store import Stores
from tests.support.factories import continuation, paused_run, running_run, writes
from tests.support.inspect import Inspector

# (path in the continuation document, a value of the wrong JSON type that lax decoding would coerce)
COERCIBLE = [
    (["step_index"], '"3"'),
    (["tokens_used"], '"42"'),
    (["config", "tools_restricted"], '"true"'),
    (["config", "max_steps"], "8.0"),
    (["usage", "total_tokens"], '"7"'),
    (["new_messages_from"], "true"),
]


@pytest.mark.parametrize(("path", "value"), COERCIBLE)
async def test_a_pause_whose_continuation_holds_a_coercible_value_is_a_scan_error(
    stores: Stores, scope: Scope, db: Inspector, path: list[str], value: str
) -> None:
    p = await paused_run(stores, scope)
    await db.con.execute(
        "UPDATE suspensions SET continuation = jsonb_set(continuation, $1::text[], $2::jsonb) WHERE run_id = $3",
        path,
        value,
        p.run.id,
    )
    with pytest.raises(InvalidContinuation):
        await stores.at(scope).suspensions.get_suspension(p.run.id)


@pytest.mark.parametrize(("path", "value"), COERCIBLE)
async def test_a_snapshot_whose_continuation_holds_a_coercible_value_is_a_scan_error(
    stores: Stores, scope: Scope, db: Inspector, path: list[str], value: str
) -> None:
    run, held = await running_run(stores, scope)
    snapshot = Progress(run_id=run.id, owner=held.owner, continuation=continuation())
    await writes(stores, scope).progress.save_progress(snapshot)
    await db.con.execute(
        "UPDATE progress SET continuation = jsonb_set(continuation, $1::text[], $2::jsonb) WHERE run_id = $3",
        path,
        value,
        run.id,
    )
    with pytest.raises(InvalidContinuation):
        await stores.at(scope).progress.get_progress(run.id)


async def test_a_run_config_holding_a_string_for_a_boolean_is_a_scan_error(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    run, _ = await running_run(stores, scope)
    await db.con.execute("""UPDATE runs SET config = '{"tools_restricted": "true"}' WHERE id = $1""", run.id)
    with pytest.raises(InvalidContinuation):
        await stores.at(scope).runs.get_run(run.id)


async def test_a_continuation_written_without_a_schema_version_reads_as_legacy_zero(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    current = await paused_run(stores, scope)
    assert (await stores.at(scope).suspensions.get_suspension(current.run.id)).continuation.schema_version == (
        CONTINUATION_SCHEMA_VERSION
    )
    legacy = await paused_run(stores, scope)
    await db.con.execute(
        "UPDATE suspensions SET continuation = continuation - 'schema_version' WHERE run_id = $1", legacy.run.id
    )
    read = await stores.at(scope).suspensions.get_suspension(legacy.run.id)
    # Not an error, and not silently the current version either.
    assert read.continuation.schema_version == LEGACY_SCHEMA_VERSION
    assert read.continuation.step_index == legacy.suspension.continuation.step_index
    assert read.continuation.prepared == legacy.suspension.continuation.prepared
