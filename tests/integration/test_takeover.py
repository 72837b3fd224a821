"""Takeovers take lapsed leases only: a run the original's plain claim moved to running holds no lease
(``lease_expires_at`` NULL) and belongs to its claimer, so neither the reclaim sweep nor
ClaimContinuationLeased adopts it, however long it waits (docs/store.md, ``intermission_take_over_v1``)."""

from __future__ import annotations

import pytest

from intermission.engine.core import Engine
from intermission.engine.holding import ReclaimLapsed
from intermission.schemas.errors import RunNotReclaimable
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.factories import lease, paused_run, running_run, writes
from tests.support.fleet import fast_settings, readable, worker
from tests.support.inspect import Inspector, snapshot_for


async def test_a_plain_claim_is_never_taken_over_as_a_lapsed_lease(
    stores: Stores, engine: Engine, scope: Scope, db: Inspector, database_url: str
) -> None:
    plain = await paused_run(stores, scope)
    claimed = await writes(stores, scope).suspensions.claim_suspension(plain.run.id)
    assert (claimed.run.state, claimed.run.lease_owner, claimed.run.lease_expires_at) == (RunState.RUNNING, None, None)
    # Beside it, a run whose lease did lapse: the sweep takes that one, so it did look.
    dead = Lease(owner="worker-that-died", ttl_seconds=30)
    lapsed, _ = await running_run(stores, scope, holder=dead)
    await writes(stores, scope).progress.save_progress(snapshot_for(lapsed.id, dead.owner))
    await db.con.execute("UPDATE runs SET lease_expires_at = now() WHERE id = $1", lapsed.id)
    before = await db.run(plain.run.id)

    taken = readable(await engine.apply(ReclaimLapsed(lease(), 32)))

    assert [t.run.id for t in taken] == [lapsed.id]
    assert await db.run(plain.run.id) == before
    with pytest.raises(RunNotReclaimable):
        await writes(stores, scope).runs.claim_continuation_leased(plain.run.id, lease())
    assert await db.run(plain.run.id) == before

    # A whole worker draining (reclaim sweeps included) leaves it to its claimer too.
    w = worker(stores, fast_settings(database_url))
    try:
        await w.drain()
    finally:
        await w.fleet.stop(grace=1)
    assert await db.run(plain.run.id) == before
    assert await db.progress(plain.run.id) is None
