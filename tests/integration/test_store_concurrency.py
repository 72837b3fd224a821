"""Invariants 1-3 and 5 under real contention: at least 32 contenders, each its own Postgres session,
released at the same instant. Every test asserts exactly one winner AND the rows the race left.

Each race runs for a few rounds on fresh runs over the same sessions, so a lost-update bug that a single
round might dodge by scheduling luck has several chances to show.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from intermission.engine.claims import ClaimedPause
from intermission.engine.core import Engine
from intermission.engine.holding import Reclaimed, ReclaimLapsed
from intermission.engine.runs import Pause
from intermission.schemas.errors import (
    NotSuspended,
    RunConflict,
    RunLeaseLost,
    RunNotReclaimable,
    SuspensionExpired,
)
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Lease, Run
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, PendingCall, SuspendReason
from intermission.store import Stores
from tests.conftest import MakeStores, race
from tests.support.factories import PausedRun, continuation, lease, paused_run, running_run, writes
from tests.support.fleet import readable
from tests.support.inspect import (
    FAR_FUTURE,
    Inspector,
    leased,
    pin,
    snapshot_for,
    unexpected,
    winners,
)

CONTENDERS = 32
ROUNDS = 3


async def assert_claimed_once(
    db: Inspector, p: PausedRun, *, owner: str | None, progress_owner: str | None, outbox: int = 1
) -> None:
    """The rows one claim of ``p`` leaves: running, revision + 1 exactly once, the winner's lease and
    snapshot (or none), the pause row kept, no event written by the claim."""
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"]) == ("running", p.revision + 1, owner)
    progress = await db.progress(p.run.id)
    assert (progress["owner"] if progress is not None else None) == progress_owner
    assert await db.count("progress", p.run.id) == (1 if progress_owner else 0)
    kept = await db.suspension(p.run.id)
    assert kept is not None
    assert kept["id"] == p.suspension.id
    assert await db.count("outbox", p.run.id) == outbox  # the pause's Notice; a claim adds none
    assert await db.count("run_events", p.run.id) == 1  # the pause's metadata event


# --- (a) the double claim -------------------------------------------------------------------------------


async def test_double_claim_32_leased_claimers_exactly_one_wins(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    sessions = await make_stores(CONTENDERS)
    for _ in range(ROUNDS):
        await double_claim_leased_round(stores, sessions, db, scope)


async def double_claim_leased_round(stores: Stores, sessions: list[Stores], db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    leases = [lease() for _ in range(CONTENDERS)]

    results = await race(
        CONTENDERS, lambda i: writes(sessions[i], scope).suspensions.claim_suspension_leased(leased(p, leases[i]))
    )

    won = winners(results)
    assert len(won) == 1, results
    assert unexpected(results, (NotSuspended,)) == []
    got: ClaimedPause = results[won[0]]
    assert got.suspension.id == p.suspension.id
    assert got.run.revision == p.revision + 1
    assert got.run.lease_owner == leases[won[0]].owner
    await assert_claimed_once(db, p, owner=leases[won[0]].owner, progress_owner=leases[won[0]].owner)


async def test_double_claim_32_mixed_claimers_exactly_one_wins(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    """Unpinned, pinned, leased with and without a first snapshot: every kind of claim against the others."""
    sessions = await make_stores(CONTENDERS)
    for _ in range(ROUNDS):
        await double_claim_mixed_round(stores, sessions, db, scope)


async def double_claim_mixed_round(stores: Stores, sessions: list[Stores], db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    leases = [lease() for _ in range(CONTENDERS)]

    async def claim(i: int) -> ClaimedPause:
        s = writes(sessions[i], scope).suspensions
        match i % 4:
            case 0:
                return await s.claim_suspension(p.run.id)
            case 1:
                return await s.claim_suspension_version(pin(p))
            case 2:
                return await s.claim_suspension_leased(leased(p, leases[i]))
            case _:
                return await s.claim_suspension_leased(leased(p, leases[i], with_first=False))

    results = await race(CONTENDERS, claim)

    won = winners(results)
    assert len(won) == 1, results
    assert unexpected(results, (NotSuspended,)) == []
    w = won[0]
    owner = leases[w].owner if w % 4 >= 2 else None
    await assert_claimed_once(db, p, owner=owner, progress_owner=owner if w % 4 == 2 else None)


# --- (b) a resume against an expiry claim at the deadline -----------------------------------------------


async def test_resume_against_expiry_claims_at_the_deadline_exactly_one_wins_by_the_database_clock(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    """Resumers and sweepers race for a pause whose deadline falls inside the race.

    Both sides judge the same stored ``expires_at`` by the database clock, so whoever wins, its kind must
    agree with that clock at the instant it claimed (its transaction's ``now()``, which the claim writes to
    ``updated_at``): a resume only before the deadline, an expiry only at or after it. The deadline is set
    a few milliseconds ahead and adapted each round (shorter after a resume won, longer after an expiry
    won), so it keeps landing where the contenders arrive and both kinds of win do happen.
    """
    sessions = await make_stores(CONTENDERS)
    ttl = 0.004
    seen: Counter[str] = Counter()
    for _ in range(16):
        kind = await deadline_round(stores, sessions, db, scope, ttl)
        seen[kind] += 1
        ttl = ttl / 2 if kind == "resume" else ttl * 2
    assert seen["resume"] > 0, seen
    assert seen["expiry"] > 0, seen


async def deadline_round(stores: Stores, sessions: list[Stores], db: Inspector, scope: Scope, ttl: float) -> str:
    p = await paused_run(stores, scope, ttl_seconds=ttl)
    deadline = p.suspension.expires_at
    assert deadline is not None
    leases = [lease() for _ in range(CONTENDERS)]

    async def contend(i: int) -> ClaimedPause:
        s = writes(sessions[i], scope).suspensions
        match i % 4:
            case 0:  # a resume
                return await s.claim_suspension(p.run.id)
            case 1:  # a leased resume
                return await s.claim_suspension_leased(leased(p, leases[i]))
            case 2:  # the original's sweep claim
                return await s.claim_expired_suspension(p.run.id, FAR_FUTURE)
            case _:  # the leased sweep claim
                return await s.claim_suspension_leased(leased(p, leases[i], expired_by=FAR_FUTURE))

    results = await race(CONTENDERS, contend)

    won = winners(results)
    assert len(won) == 1, results
    w = won[0]
    got: ClaimedPause = results[w]
    claimed_at = got.run.updated_at
    assert claimed_at is not None
    resumers = [r for i, r in enumerate(results) if i % 4 < 2 and i != w]
    sweepers = [r for i, r in enumerate(results) if i % 4 >= 2 and i != w]
    assert unexpected(resumers, (NotSuspended, SuspensionExpired)) == []
    assert unexpected(sweepers, (NotSuspended,)) == []
    owner = leases[w].owner if w % 2 == 1 else None
    await assert_claimed_once(db, p, owner=owner, progress_owner=owner)
    if w % 4 < 2:
        assert claimed_at < deadline, "a resume claimed a pause whose deadline had passed"
        return "resume"
    assert claimed_at >= deadline, "an expiry claimed a pause whose deadline had not passed"
    return "expiry"


# --- (c) a pinned claim against a re-pause --------------------------------------------------------------


def repause() -> Pause:
    return Pause(SuspendReason.APPROVAL, [PendingCall(id="c2", name="transfer", note="big amount")], continuation(2))


async def test_pinned_claims_racing_a_repause_never_claim_the_new_pause(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    """32 claimers pinned to the pause they read race the run's holder pausing it AGAIN: whatever the
    order, not one of them may claim the new pause (invariant 2)."""
    sessions = await make_stores(CONTENDERS)
    for _ in range(ROUNDS):
        await pins_against_repause_round(stores, sessions, db, scope)


async def pins_against_repause_round(stores: Stores, sessions: list[Stores], db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    holder = lease()
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, holder))
    # What a claimer may have read: the old pause at its paused revision, or at the running one.
    stale = [pin(p), ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision + 1)]

    async def contend(i: int) -> Any:
        if i == CONTENDERS:
            return await writes(stores, scope).runs.pause_run(p.run.id, holder.owner, repause())
        return await writes(sessions[i], scope).suspensions.claim_suspension_leased(leased(p, version=stale[i % 2]))

    results = await race(CONTENDERS + 1, contend)

    assert winners(results) == [CONTENDERS], results  # only the re-pause succeeded
    assert unexpected(results[:CONTENDERS], (NotSuspended, RunConflict)) == []
    new = results[CONTENDERS].suspension
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"]) == ("paused", p.revision + 2, None)
    current = await db.suspension(p.run.id)
    assert current is not None
    assert current["id"] == new.id != p.suspension.id
    assert await db.progress(p.run.id) is None
    assert await db.count("outbox", p.run.id) == 2  # one Notice per pause


async def test_old_and_new_pins_after_a_repause_only_one_new_pin_wins(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    """32 claimers pinned to the OLD pause race 8 pinned to the NEW one: every old pin fails, exactly one
    new pin wins."""
    sessions = await make_stores(CONTENDERS + NEW_PINS)
    for _ in range(ROUNDS):
        await old_and_new_pins_round(stores, sessions, db, scope)


NEW_PINS = 8


async def old_and_new_pins_round(stores: Stores, sessions: list[Stores], db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    holder = lease()
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, holder))
    again = await writes(stores, scope).runs.pause_run(p.run.id, holder.owner, repause())
    new = again.suspension
    new_version = ClaimVersion(run_id=p.run.id, suspension_id=new.id, run_revision=again.notice.run_revision)
    leases = [lease() for _ in range(CONTENDERS + NEW_PINS)]

    async def contend(i: int) -> ClaimedPause:
        version = pin(p) if i < CONTENDERS else new_version
        return await writes(sessions[i], scope).suspensions.claim_suspension_leased(
            leased(p, leases[i], version=version)
        )

    results = await race(CONTENDERS + NEW_PINS, contend)

    won = winners(results)
    assert len(won) == 1, results
    assert won[0] >= CONTENDERS, "a claim pinned to the old pause claimed the new one"
    assert unexpected(results[:CONTENDERS], (RunConflict, NotSuspended)) == []
    assert unexpected(results[CONTENDERS:], (NotSuspended,)) == []
    got: ClaimedPause = results[won[0]]
    assert got.suspension.id == new.id
    assert got.suspension.reason is SuspendReason.APPROVAL
    run = await db.run(p.run.id)
    winner = leases[won[0]].owner
    assert (run["state"], run["revision"], run["lease_owner"]) == ("running", new_version.run_revision + 1, winner)
    progress = await db.progress(p.run.id)
    assert progress is not None
    assert progress["owner"] == winner
    current = await db.suspension(p.run.id)
    assert current is not None
    assert current["id"] == new.id


async def test_unpinned_claim_waiting_behind_a_claim_and_repause_does_not_take_the_new_pause(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    """The unpinned claim's ABA: it reads the old pause, waits on the run's row lock while another
    transaction claims the run and pauses it again (here on an already-expired approval pause), and then
    finds the run ``paused`` once more. It must not claim that new pause with the old pause's checks, nor
    hand back the old pause it read."""
    p = await paused_run(stores, scope)
    holder = db.con.transaction()
    await holder.start()
    try:
        await db.con.execute("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", p.run.id)
        waiting = asyncio.create_task(writes(stores, scope).suspensions.claim_suspension(p.run.id))
        # The claim statement (store/queries/engine.sql, claim_pauses_v2) waiting on the row lock; matched by
        # the batch function it calls, within the first track_activity_query_size bytes pg_stat_activity keeps.
        await db.wait_until(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%intermission_claim_pauses_v2%')"
        )
        # Another claimer wins, and its run pauses again before the waiter gets the row.
        await db.con.execute("UPDATE runs SET state = 'running', revision = revision + 1 WHERE id = $1", p.run.id)
        await db.con.execute("DELETE FROM suspensions WHERE run_id = $1", p.run.id)
        new_id = await db.con.fetchval(
            "INSERT INTO suspensions (run_id, app, tenant, reason, continuation, expires_at)"
            " VALUES ($1, $2, $3, 'approval', '{}', now() - interval '1 hour') RETURNING id",
            p.run.id,
            scope.app,
            scope.tenant,
        )
        await db.con.execute("UPDATE runs SET state = 'paused', revision = revision + 1 WHERE id = $1", p.run.id)
        await holder.commit()
    except BaseException:
        await holder.rollback()
        raise

    (outcome,) = await asyncio.gather(waiting, return_exceptions=True)

    assert isinstance(outcome, NotSuspended | SuspensionExpired), outcome
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"]) == ("paused", p.revision + 2)
    current = await db.suspension(p.run.id)
    assert current is not None
    assert current["id"] == new_id


# --- (d) workers reclaiming one lapsed lease ------------------------------------------------------------


async def test_workers_reclaiming_one_lapsed_lease_exactly_one_takes_it_and_the_old_worker_writes_nothing(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    sessions = await make_stores(CONTENDERS)
    for _ in range(ROUNDS):
        await reclaim_round(stores, sessions, db, scope)


async def reclaim_round(stores: Stores, sessions: list[Stores], db: Inspector, scope: Scope) -> None:
    run, old = await running_run(stores, scope)
    await writes(stores, scope).progress.save_progress(snapshot_for(run.id, old.owner))
    # Shorten the live lease to a millisecond, then wait for the DATABASE clock to pass it.
    await stores.at(scope).runs.renew_lease(run.id, old.model_copy(update={"ttl_seconds": 0.001}))
    await db.wait_lease_lapsed(run.id)
    leases = [lease() for _ in range(CONTENDERS)]

    async def take(i: int) -> Run | list[Reclaimed]:
        if i % 2 == 0:
            return await writes(sessions[i], scope).runs.claim_continuation_leased(
                run.id, leases[i], snapshot_for(run.id, leases[i].owner, step=3)
            )
        return readable(await Engine.over(sessions[i]).apply(ReclaimLapsed(leases[i], 8)))

    results = await race(CONTENDERS, take)

    takers = [i for i in winners(results) if results[i] != []]
    assert len(takers) == 1, results
    assert unexpected(results, (RunNotReclaimable,)) == []
    taker = leases[takers[0]].owner
    row = await db.run(run.id)
    assert (row["state"], row["revision"], row["lease_owner"]) == ("running", run.revision, taker)
    progress = await db.progress(run.id)
    assert progress is not None
    assert progress["owner"] == taker

    # The worker whose lease was taken over, and the losers, can write nothing at all.
    before = await db.snapshot()
    losers = [leases[i].owner for i in range(CONTENDERS) if i != takers[0]]
    for who in (old.owner, *losers[:3]):
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).progress.save_progress(snapshot_for(run.id, who, step=7))
        with pytest.raises(RunLeaseLost):
            await stores.at(scope).runs.renew_lease(run.id, Lease(owner=who, ttl_seconds=30))
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).runs.pause_run(run.id, who, repause())
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).runs.end_run(run.id, who, RunEventKind.COMPLETED, output="mine")
        assert await writes(stores, scope).runs.release_lease(run.id, who) is False
    assert await db.snapshot() == before
