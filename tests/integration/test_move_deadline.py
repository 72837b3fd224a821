"""An operator moves a live pause's deadline (``intermission_move_deadline_v1``, migration 0012): later by
so much, or to now; pinned to the live pause, on the run's record, and judged by every claim afterwards as
the pause's own deadline. A run with no live pause, or paused on another pause, is refused and nothing is
written."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from intermission.schemas.errors import InvalidArgument, NotSuspended, RunConflict, SuspensionExpired
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.retention import Pruner, Retention
from tests.support.factories import paused_run, running_run, writes
from tests.support.inspect import Inspector

HOUR = 3600.0


async def test_extend_moves_the_deadline_later_and_records_who_did(stores: Stores, db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope, ttl_seconds=HOUR)
    assert p.suspension.expires_at is not None
    before = await db.snapshot()

    moved = await writes(stores, scope).suspensions.move_deadline(
        p.run.id, p.suspension.id, extend_by=2 * HOUR, moved_by="alice"
    )

    assert moved.previous == p.suspension.expires_at
    assert moved.expires_at == p.suspension.expires_at + timedelta(hours=2)
    assert (await db.suspension(p.run.id))["expires_at"] == moved.expires_at  # type: ignore[index]
    # The run is as it was: same state, same revision (a host's pinned answer stays valid).
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"]) == ("paused", p.revision)
    (event,) = [e for e in await stores.at(scope).runs.list_run_events(p.run.id) if e["kind"] == "deadline_moved"]
    assert event["revision"] == p.revision
    # PostgreSQL writes a timestamp's fraction without its trailing zeros ("…19.25941"): compare instants.
    data = event["data"]
    assert isinstance(data, dict)
    assert datetime.fromisoformat(data.pop("previous")) == moved.previous
    assert datetime.fromisoformat(data.pop("expires_at")) == moved.expires_at
    assert data == {
        "suspension_id": p.suspension.id,
        "moved_by": "alice",
        "how": "extend",
        "extend_by_seconds": 2 * HOUR,
    }
    # Only the pause and the run event changed.
    after = await db.snapshot()
    changed = {table for table in after if after[table] != before[table]}
    assert changed == {"suspensions", "run_events"}


async def test_extend_of_a_pause_without_deadline_counts_from_now(stores: Stores, db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope, ttl_seconds=0)
    assert p.suspension.expires_at is None
    now = await db.now()
    moved = await writes(stores, scope).suspensions.move_deadline(
        p.run.id, p.suspension.id, extend_by=60, moved_by="op"
    )
    assert moved.previous is None
    assert now + timedelta(seconds=59) < moved.expires_at < now + timedelta(seconds=120)


async def test_expire_moves_the_deadline_to_now_so_a_resume_is_refused_and_an_expiry_claims(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope, ttl_seconds=HOUR)
    suspensions = writes(stores, scope).suspensions
    moved = await suspensions.move_deadline(p.run.id, p.suspension.id, extend_by=None, moved_by="op")
    assert moved.expires_at <= await db.now()
    with pytest.raises(SuspensionExpired):
        await suspensions.claim_suspension(p.run.id)
    # Expiring again never puts the deadline off.
    again = await suspensions.move_deadline(p.run.id, p.suspension.id, extend_by=None, moved_by="op")
    assert again.expires_at == moved.expires_at
    claimed = await suspensions.claim_expired_suspension(p.run.id, moved.expires_at)
    assert claimed.suspension.id == p.suspension.id


async def test_a_run_without_live_pause_or_on_another_pause_is_refused_and_nothing_is_written(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    running, _ = await running_run(stores, scope)
    p = await paused_run(stores, scope, ttl_seconds=HOUR)
    before = await db.snapshot()
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.move_deadline(running.id, 1, extend_by=60, moved_by="op")
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.move_deadline("no-such-run", 1, extend_by=60, moved_by="op")
    # Scope is exact: the run is not found at another scope.
    with pytest.raises(NotSuspended):
        await writes(stores, other_scope).suspensions.move_deadline(
            p.run.id, p.suspension.id, extend_by=60, moved_by="op"
        )
    with pytest.raises(RunConflict, match=str(p.suspension.id)):
        await writes(stores, scope).suspensions.move_deadline(
            p.run.id, p.suspension.id + 1000, extend_by=60, moved_by="op"
        )
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).suspensions.move_deadline(p.run.id, p.suspension.id, extend_by=0, moved_by="op")
    assert await db.snapshot() == before


async def test_pruning_keeps_the_notice_of_a_paused_run(stores: Stores, db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope, ttl_seconds=HOUR)
    await db.con.execute("UPDATE outbox SET sent_at = now() - interval '1 day' WHERE run_id = $1", p.run.id)
    pruner = Pruner(stores.db, Retention(runs=86400, inbox=86400, outbox=60, sessions=86400), batch=100)
    assert (await pruner.prunable())["outbox"] == 0
    await pruner.prune()
    notice = await stores.at(scope).runs.notice_of_pause(p.run.id, p.suspension.id)
    assert notice is not None
    assert notice.routing_key == f"notice.external_tool.{scope.app}.{scope.tenant}"
