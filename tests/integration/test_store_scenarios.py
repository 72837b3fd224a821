"""docs/scenarios.md, the scenarios the store owns: 1-8, 11-13, 38-46 and the store side of 23-27.

One test per scenario, named after it. Scope is EXACT (unlike the original's prefix match), so
scenario 6 is carried over as "a claim from another scope finds nothing and changes nothing", and
scenario 7's ErrNoScope is InvalidScope.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from intermission.engine.claims import ClaimedPause
from intermission.engine.core import Engine
from intermission.engine.holding import ReclaimLapsed
from intermission.engine.runs import Pause
from intermission.schemas.errors import (
    IntermissionError,
    InvalidScope,
    NotSuspended,
    ProgressNotFound,
    RunConflict,
    RunLeaseLost,
    RunNotFound,
    StoreUnavailable,
    SuspensionExpired,
    TransientError,
)
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Lease, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import (
    ClaimVersion,
    Ending,
    EndingKind,
    LeasedClaim,
    PendingCall,
    Progress,
    ProgressResult,
    SuspendReason,
    Suspension,
)
from intermission.store import Stores
from tests.conftest import MakeStores, race
from tests.support.factories import PausedRun, continuation, lease, paused_run, running_run, writes
from tests.support.fleet import readable
from tests.support.inspect import (
    FAR_FUTURE,
    Inspector,
    closed_stores,
    leased,
    pin,
    snapshot_for,
    unvalidated_scope,
    winners,
)

TINY_TTL = 0.001  # a deadline or lease a millisecond ahead of the database clock: lapsed almost at once
HOUR = 3600.0


async def expired_pause(stores: Stores, db: Inspector, scope: Scope) -> PausedRun:
    """A paused run whose deadline the database clock has already passed."""
    p = await paused_run(stores, scope, ttl_seconds=TINY_TTL)
    await db.wait_pause_expired(p.run.id)
    return p


# --- 1-8 ------------------------------------------------------------------------------------------------


async def test_scenario_01_concurrent_double_claim_wins_once(
    stores: Stores, make_stores: MakeStores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    a, b = await make_stores(2)
    results = await race(2, lambda i: writes((a, b)[i], scope).suspensions.claim_suspension(p.run.id))

    won = winners(results)
    assert len(won) == 1
    got = results[won[0]]
    assert isinstance(got, ClaimedPause)
    assert got.suspension.id == p.suspension.id
    assert got.suspension.continuation == p.suspension.continuation
    assert isinstance(results[1 - won[0]], NotSuspended)
    run = await db.run(p.run.id)
    assert run["state"] == "running"
    assert run["revision"] == p.revision + 1


async def test_scenario_02_second_claim_after_win_is_not_suspended_and_row_kept(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    await writes(stores, scope).suspensions.claim_suspension(p.run.id)
    before = await db.snapshot()

    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension(p.run.id)

    assert await db.snapshot() == before
    kept = await stores.at(scope).suspensions.get_suspension(p.run.id)
    assert kept.id == p.suspension.id


async def test_scenario_03_expired_refuses_and_leaves_run_paused(stores: Stores, db: Inspector, scope: Scope) -> None:
    p = await expired_pause(stores, db, scope)
    before = await db.snapshot()

    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).suspensions.claim_suspension(p.run.id)
    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).suspensions.claim_suspension_version(pin(p))
    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p))

    assert await db.snapshot() == before
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"]) == ("paused", p.revision, None)
    assert (await stores.at(scope).suspensions.get_suspension(p.run.id)).id == p.suspension.id


async def test_scenario_04_deadline_still_ahead_claims_normally(stores: Stores, db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope, ttl_seconds=HOUR)
    assert p.suspension.expires_at is not None

    got = await writes(stores, scope).suspensions.claim_suspension(p.run.id)

    assert got.suspension.id == p.suspension.id
    assert got.suspension.expires_at == p.suspension.expires_at
    assert got.run is not None
    assert got.run.state is RunState.RUNNING
    assert got.run.revision == p.revision + 1
    assert (await db.run(p.run.id))["state"] == "running"


async def test_scenario_05_no_suspension_is_not_suspended_and_run_unchanged(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    await writes(stores, scope).suspensions.delete_suspension(p.run.id)
    before = await db.snapshot()

    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension(p.run.id)
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p))
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_expired_suspension(p.run.id, FAR_FUTURE)
    with pytest.raises(NotSuspended):
        await stores.at(scope).suspensions.get_suspension(p.run.id)

    assert await db.snapshot() == before
    assert (await db.run(p.run.id))["state"] == "paused"


async def test_scenario_06_scope_is_exact_a_claim_from_another_scope_finds_nothing(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    # The original's prefix match is NOT carried over: another tenant, or another app with the same
    # tenant, is a different scope and finds nothing at all.
    p = await expired_pause(stores, db, scope)
    live = await paused_run(stores, scope)
    before = await db.snapshot()

    for foreign in (other_scope, Scope(app="other-app", tenant=scope.tenant)):
        with pytest.raises(NotSuspended):
            await writes(stores, foreign).suspensions.claim_suspension(live.run.id)
        with pytest.raises(NotSuspended):
            await writes(stores, foreign).suspensions.claim_suspension_version(pin(live))
        with pytest.raises(NotSuspended):
            await writes(stores, foreign).suspensions.claim_suspension_leased(leased(live))
        with pytest.raises(NotSuspended):
            await writes(stores, foreign).suspensions.claim_expired_suspension(p.run.id, FAR_FUTURE)
        with pytest.raises(NotSuspended):
            await writes(stores, foreign).suspensions.claim_suspension_leased(leased(p, expired_by=FAR_FUTURE))
        with pytest.raises(NotSuspended):
            await stores.at(foreign).suspensions.get_suspension(live.run.id)
        with pytest.raises(NotSuspended):
            await writes(stores, foreign).suspensions.delete_suspension(live.run.id)
        with pytest.raises(RunNotFound):
            await stores.at(foreign).runs.get_run(live.run.id)
        assert await stores.at(foreign).suspensions.list_expired(FAR_FUTURE, None) == []

    assert await db.snapshot() == before
    # At its own scope the same claim works, and every row keeps the scope it was created under.
    got = await writes(stores, scope).suspensions.claim_suspension_leased(leased(live))
    assert got.suspension.scope == scope
    assert got.run is not None
    assert got.run.scope == scope
    for row in (await db.run(live.run.id), await db.suspension(live.run.id), await db.progress(live.run.id)):
        assert row is not None
        assert (row["app"], row["tenant"]) == (scope.app, scope.tenant)


async def test_scenario_07_zero_scope_is_rejected_before_any_database_access(database_url: str, scope: Scope) -> None:
    dead = await closed_stores(database_url)
    version = ClaimVersion(run_id="run-1", suspension_id=1, run_revision=1)
    # The control: with a valid scope the closed pool IS reached, and says so.
    with pytest.raises(StoreUnavailable):
        await writes(dead, scope).suspensions.claim_suspension("run-1")

    zero_scopes: list[Any] = [
        None,
        unvalidated_scope(),
        unvalidated_scope(app="", tenant=""),
        unvalidated_scope(app="", tenant="x"),
        unvalidated_scope(app="x", tenant=""),
    ]
    for zero in zero_scopes:
        with pytest.raises(InvalidScope):
            await writes(dead, zero).suspensions.claim_suspension("run-1")
        with pytest.raises(InvalidScope):
            await writes(dead, zero).suspensions.claim_suspension_version(version)
        with pytest.raises(InvalidScope):
            await writes(dead, zero).suspensions.claim_expired_suspension("run-1", FAR_FUTURE)
        with pytest.raises(InvalidScope):
            await writes(dead, zero).suspensions.claim_suspension_leased(LeasedClaim(version=version, lease=lease()))


async def test_scenario_08_round_trip_keeps_arguments_new_messages_from_session_step_and_tokens(
    stores: Stores, scope: Scope
) -> None:
    call = PendingCall(id="c1", name="lookup", arguments='{"query": "q", "nested": {"x": [1, 2]}}', reply_with="r-1")
    cont = continuation(step=3, tokens_used=1234, new_messages_from=1, session_id="session-xyz")
    p = await paused_run(stores, scope, pending=[call])
    # paused_run pauses with the factory continuation; pause again with ours to check these exact values.
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, holder := lease()))
    paused = await writes(stores, scope).runs.pause_run(
        p.run.id, holder.owner, Pause(reason=SuspendReason.EXTERNAL_TOOL, pending=[call], continuation=cont)
    )

    for got in (
        await stores.at(scope).suspensions.get_suspension(p.run.id),
        (await writes(stores, scope).suspensions.claim_suspension(p.run.id)).suspension,
    ):
        assert got.id == paused.suspension.id
        assert got.pending == [call]
        assert got.pending[0].arguments == call.arguments
        assert got.continuation.new_messages_from == 1
        assert got.continuation.session_id == "session-xyz"
        assert got.continuation.step_index == 3
        assert got.continuation.tokens_used == 1234
        assert got.continuation.prepared == cont.prepared
        assert got.continuation.config.tools_restricted is True
        assert got.continuation == cont


# --- 11-13 ----------------------------------------------------------------------------------------------


async def test_scenario_11_second_resume_loses_the_race(stores: Stores, db: Inspector, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    first = lease()
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, first))
    before = await db.snapshot()

    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p))

    assert await db.snapshot() == before
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"]) == ("running", p.revision + 1, first.owner)


async def test_scenario_12_expired_suspension_is_reported_and_nothing_is_written(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await expired_pause(stores, db, scope)
    before = await db.snapshot()
    outbox_before = await db.count("outbox", p.run.id)

    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p))

    # No run update (not even updated_at), no deletion, no progress, no event.
    assert await db.snapshot() == before
    assert await db.progress(p.run.id) is None
    assert await db.count("outbox", p.run.id) == outbox_before == 1  # the pause's own Notice only


async def test_scenario_13_every_write_uses_the_runs_stored_scope(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    holder = lease()
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, holder))
    before = await db.snapshot()

    # The lease owner itself, calling with any scope but the stored one, can write nothing.
    for foreign in (other_scope, Scope(app="other-app", tenant=scope.tenant)):
        with pytest.raises(RunLeaseLost):
            await writes(stores, foreign).progress.save_progress(snapshot_for(p.run.id, holder.owner))
        with pytest.raises(RunLeaseLost):
            await stores.at(foreign).runs.renew_lease(p.run.id, holder)
        with pytest.raises(RunLeaseLost):
            await writes(stores, foreign).runs.pause_run(
                p.run.id,
                holder.owner,
                Pause(SuspendReason.EXTERNAL_TOOL, [PendingCall(id="c2", name="lookup")], continuation()),
            )
        with pytest.raises(RunLeaseLost):
            await writes(stores, foreign).runs.end_run(p.run.id, holder.owner, RunEventKind.COMPLETED, output="x")
        assert await writes(stores, foreign).runs.release_lease(p.run.id, holder.owner) is False
        with pytest.raises(RunNotFound):
            await writes(stores, foreign).runs.claim_continuation_leased(p.run.id, lease())
        with pytest.raises(ProgressNotFound):
            await stores.at(foreign).progress.get_progress(p.run.id)
        await writes(stores, foreign).progress.delete_progress(p.run.id)  # nothing there at that scope: a no-op
    assert await db.snapshot() == before

    # At the stored scope the same writes land, every row under that scope.
    saved = await writes(stores, scope).progress.save_progress(
        snapshot_for(p.run.id, holder.owner).model_copy(update={"scope": other_scope})
    )
    assert saved.scope == scope
    await stores.at(scope).runs.renew_lease(p.run.id, holder)
    await writes(stores, scope).runs.end_run(p.run.id, holder.owner, RunEventKind.COMPLETED, output="done")
    scoped = await db.con.fetch(
        "SELECT 'runs' AS t, app, tenant FROM runs WHERE id = $1"
        " UNION ALL SELECT 'outbox', app, tenant FROM outbox WHERE run_id = $1"
        " UNION ALL SELECT 'run_events', app, tenant FROM run_events WHERE run_id = $1",
        p.run.id,
    )
    assert {r["t"] for r in scoped} == {"runs", "outbox", "run_events"}
    assert {(r["app"], r["tenant"]) for r in scoped} == {(scope.app, scope.tenant)}


# --- the store side of 23-27 (the expiry sweeper's primitives) ------------------------------------------


async def sweep_claim(stores: Stores, s: Suspension, sweeper: Lease) -> ClaimedPause:
    """What the sweeper does with one listed row: rebind to the ROW's scope and claim it as expired."""
    return await writes(stores, s.scope).suspensions.claim_suspension_leased(
        LeasedClaim(
            # A read, then a claim PINNED to what was read: a change in between makes the claim fail.
            version=ClaimVersion(
                run_id=s.run_id,
                suspension_id=s.id,
                run_revision=(await stores.at(s.scope).runs.get_run(s.run_id)).revision,
            ),
            expired_by=FAR_FUTURE,
            lease=sweeper,
            first=Progress(
                run_id=s.run_id,
                owner=sweeper.owner,
                continuation=s.continuation,
                ending=Ending(kind=EndingKind.EXPIRE, reason="suspension_expired"),
            ),
        ),
    )


async def test_scenario_23_sweep_fails_only_the_past_deadline_run(stores: Stores, db: Inspector, scope: Scope) -> None:
    expired = await expired_pause(stores, db, scope)
    waiting = await paused_run(stores, scope, ttl_seconds=HOUR)

    listed = await stores.across_scopes.list_expired_across_scopes(FAR_FUTURE, None)
    assert [s.run_id for s in listed] == [expired.run.id]
    assert await stores.at(scope).suspensions.list_expired(FAR_FUTURE, 10) == listed

    sweeper = lease()
    claimed = await sweep_claim(stores, listed[0], sweeper)
    assert claimed.suspension.id == expired.suspension.id
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_expired_suspension(waiting.run.id, FAR_FUTURE)
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(waiting, expired_by=FAR_FUTURE))
    await writes(stores, scope).runs.end_run(
        expired.run.id, sweeper.owner, RunEventKind.EXPIRED, error=SuspensionExpired.code
    )

    failed = await stores.at(scope).runs.get_run(expired.run.id)
    assert failed.state is RunState.FAILED
    assert failed.error is not None
    assert SuspensionExpired.code in failed.error
    assert await db.suspension(expired.run.id) is None
    still = await db.run(waiting.run.id)
    assert (still["state"], still["revision"]) == ("paused", waiting.revision)
    assert await db.suspension(waiting.run.id) is not None


async def test_scenario_24_works_under_each_suspensions_own_scope(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    mine = await expired_pause(stores, db, scope)
    theirs = await expired_pause(stores, db, other_scope)

    listed = await stores.across_scopes.list_expired_across_scopes(FAR_FUTURE, 0)
    assert {(s.run_id, s.scope) for s in listed} == {(mine.run.id, scope), (theirs.run.id, other_scope)}
    assert [s.run_id for s in await stores.at(scope).suspensions.list_expired(FAR_FUTURE, None)] == [mine.run.id]
    assert [s.run_id for s in await stores.at(other_scope).suspensions.list_expired(FAR_FUTURE, None)] == [
        theirs.run.id
    ]
    # The list crosses scopes; a claim never does.
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_expired_suspension(theirs.run.id, FAR_FUTURE)
    with pytest.raises(NotSuspended):
        await writes(stores, other_scope).suspensions.claim_expired_suspension(mine.run.id, FAR_FUTURE)

    for s in listed:
        sweeper = lease()
        await sweep_claim(stores, s, sweeper)
        await writes(stores, s.scope).runs.end_run(s.run_id, sweeper.owner, RunEventKind.EXPIRED, error="expired")
    for p, own in ((mine, scope), (theirs, other_scope)):
        run = await db.run(p.run.id)
        assert (run["state"], run["app"], run["tenant"]) == ("failed", own.app, own.tenant)
        events = await db.con.fetch("SELECT app, tenant, routing_key FROM outbox WHERE run_id = $1", p.run.id)
        assert {(e["app"], e["tenant"]) for e in events} == {(own.app, own.tenant)}
        assert f"run.expired.{own.app}.{own.tenant}" in {e["routing_key"] for e in events}


async def test_scenario_25_skips_a_run_a_resume_already_claimed(stores: Stores, db: Inspector, scope: Scope) -> None:
    # The resume must win BEFORE the deadline and the deadline must pass after; a short deadline that
    # doubles whenever the machine was too slow to claim in time keeps that true without timing luck.
    resumer = lease()
    ttl = 0.2
    for _ in range(6):
        p = await paused_run(stores, scope, ttl_seconds=ttl)
        try:
            await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, resumer))
            break
        except SuspensionExpired:
            ttl *= 4
    else:
        pytest.fail("could not claim a pause before its deadline")
    await db.wait_pause_expired(p.run.id)
    before = await db.snapshot()

    listed = await stores.across_scopes.list_expired_across_scopes(FAR_FUTURE, None)
    row = next(s for s in listed if s.run_id == p.run.id)
    with pytest.raises(NotSuspended):
        await writes(stores, row.scope).suspensions.claim_expired_suspension(row.run_id, FAR_FUTURE)
    with pytest.raises(NotSuspended):
        await sweep_claim(stores, row, lease())

    assert await db.snapshot() == before
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"]) == ("running", p.revision + 1, resumer.owner)
    assert await db.suspension(p.run.id) is not None


async def test_scenario_26_clears_a_row_left_on_a_terminal_run_and_keeps_one_on_a_running_run(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    past = (await db.now()) - timedelta(hours=1)
    terminal: dict[str, RunState] = {}
    for kind in (RunEventKind.COMPLETED, RunEventKind.FAILED, RunEventKind.CANCELLED):
        run, held = await running_run(stores, scope)
        await writes(stores, scope).runs.end_run(run.id, held.owner, kind, output="o", error="e")
        # A row left behind on a run that already ended (the original's crash window).
        await writes(stores, scope).suspensions.create_suspension(
            Suspension(run_id=run.id, scope=scope, reason=SuspendReason.EXTERNAL_TOOL, expires_at=past)
        )
        terminal[run.id] = (await stores.at(scope).runs.get_run(run.id)).state
    running = await paused_run(stores, scope, ttl_seconds=HOUR)
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(running))
    await writes(stores, scope).suspensions.delete_suspension(running.run.id)
    await writes(stores, scope).suspensions.create_suspension(
        Suspension(run_id=running.run.id, scope=scope, reason=SuspendReason.EXTERNAL_TOOL, expires_at=past)
    )
    assert set(terminal.values()) == {RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED}

    # The sweeper's primitives: list across scopes, then per row at the row's scope.
    for s in await stores.across_scopes.list_expired_across_scopes(FAR_FUTURE, None):
        with pytest.raises(NotSuspended):  # nothing to claim on a run that is not paused
            await writes(stores, s.scope).suspensions.claim_expired_suspension(s.run_id, FAR_FUTURE)
        state = (await stores.at(s.scope).runs.get_run(s.run_id)).state
        if state.is_terminal:
            await writes(stores, s.scope).suspensions.delete_suspension(s.run_id)

    for run_id, state in terminal.items():
        assert await db.suspension(run_id) is None
        assert (await db.run(run_id))["state"] == state.value
    assert await db.suspension(running.run.id) is not None
    assert (await db.run(running.run.id))["state"] == "running"


async def test_scenario_27_a_failing_write_is_reported_and_the_row_is_kept(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await expired_pause(stores, db, scope)
    sweeper = lease()
    await sweep_claim(stores, (await stores.at(scope).suspensions.list_expired(FAR_FUTURE, None))[0], sweeper)
    before = await db.snapshot()
    # The failure write dies at its LAST statement (the outbox row), after its run update, deletes and
    # metadata event already ran in the same transaction.
    await db.fail_inserts_into("outbox")

    with pytest.raises(IntermissionError) as failure:
        await writes(stores, scope).runs.end_run(p.run.id, sweeper.owner, RunEventKind.EXPIRED, error="expired")

    assert not isinstance(failure.value, TransientError)
    assert await db.snapshot() == before
    run = await db.run(p.run.id)
    assert (run["state"], run["lease_owner"]) == ("running", sweeper.owner)
    assert await db.suspension(p.run.id) is not None
    assert (await stores.at(scope).progress.get_progress(p.run.id)).ending == Ending(
        kind=EndingKind.EXPIRE, reason="suspension_expired"
    )


# --- 38-46 ----------------------------------------------------------------------------------------------


async def test_scenario_38_version_claim_after_a_repause_is_refused(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    holder = lease()
    await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, holder))
    again = await writes(stores, scope).runs.pause_run(
        p.run.id, holder.owner, Pause(SuspendReason.APPROVAL, [PendingCall(id="c9", name="pay")], continuation())
    )
    assert again.notice.run_revision == p.revision + 2
    assert again.suspension.id != p.suspension.id
    before = await db.snapshot()

    stale_pins = [
        pin(p),  # the old pause at the old revision
        ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=again.notice.run_revision),
        ClaimVersion(run_id=p.run.id, suspension_id=again.suspension.id, run_revision=p.revision),
    ]
    for stale in stale_pins:
        with pytest.raises(RunConflict):
            await writes(stores, scope).suspensions.claim_suspension_version(stale)
        with pytest.raises(RunConflict):
            await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, version=stale))

    assert await db.snapshot() == before
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"]) == ("paused", again.notice.run_revision)
    current = await db.suspension(p.run.id)
    assert current is not None
    assert current["id"] == again.suspension.id


async def test_scenario_39_half_lease_or_foreign_first_owner_is_lease_lost(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    running, held = await running_run(stores, scope, holder=lease(ttl=TINY_TTL))
    await db.wait_lease_lapsed(running.id)
    before = await db.snapshot()

    half_leases = [Lease(owner="worker-a"), Lease(ttl_seconds=30), Lease(), Lease(owner="worker-a", ttl_seconds=-1)]
    for half in half_leases:
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).suspensions.claim_suspension_leased(LeasedClaim(version=pin(p), lease=half))
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).runs.claim_continuation_leased(running.id, half)
    whole = lease()
    foreign_first = snapshot_for(p.run.id, "somebody-else")
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).suspensions.claim_suspension_leased(
            LeasedClaim(version=pin(p), lease=whole, first=foreign_first)
        )
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).runs.claim_continuation_leased(
            running.id, whole, snapshot_for(running.id, "somebody-else")
        )

    assert await db.snapshot() == before
    assert (await db.run(p.run.id))["state"] == "paused"
    assert (await db.run(running.id))["lease_owner"] == held.owner


async def test_scenario_40_save_progress_after_takeover_or_with_empty_owner_is_lease_lost(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    run, old = await running_run(stores, scope, holder=lease(ttl=TINY_TTL))
    await db.wait_lease_lapsed(run.id)
    new = lease()
    await writes(stores, scope).runs.claim_continuation_leased(run.id, new, snapshot_for(run.id, new.owner))
    # A run that is running with NO lease at all (an unleased version claim) is no help to an empty owner.
    bare = await paused_run(stores, scope)
    await writes(stores, scope).suspensions.claim_suspension_version(pin(bare))
    assert (await db.run(bare.run.id))["lease_owner"] is None
    before = await db.snapshot()

    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).progress.save_progress(snapshot_for(run.id, old.owner, step=9))
    for run_id in (run.id, bare.run.id):
        with pytest.raises(RunLeaseLost):
            await writes(stores, scope).progress.save_progress(snapshot_for(run_id, "", step=9))

    assert await db.snapshot() == before
    assert (await stores.at(scope).progress.get_progress(run.id)).owner == new.owner


async def test_scenario_41_saved_progress_comes_back_byte_for_byte_with_scope_and_time_set_by_the_store(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    run, held = await running_run(stores, scope)
    prepared = bytes(range(256)) + b"\x00\xff" * 64
    bogus_time = datetime.fromisoformat("2000-01-01T00:00:00+00:00")
    p = Progress(
        run_id=run.id,
        owner=held.owner,
        scope=other_scope,  # whatever the caller says, the store sets the scope
        continuation=continuation(prepared=prepared),
        started=[PendingCall(id="c1", name="charge", arguments='{"amount": 5}')],
        done=[ProgressResult(call_id="c0", content="ok")],
        updated_at=bogus_time,  # and the time
    )
    clock_before = await db.now()

    saved = await writes(stores, scope).progress.save_progress(p)

    clock_after = await db.now()
    got = await stores.at(scope).progress.get_progress(run.id)
    assert got.continuation.prepared == prepared
    assert got.scope == saved.scope == scope
    assert got.updated_at == saved.updated_at
    assert got.updated_at is not None
    assert clock_before <= got.updated_at <= clock_after
    assert got == saved
    assert got.model_copy(update={"scope": other_scope, "updated_at": bogus_time}) == p


async def test_scenario_42_progress_from_another_scope_is_not_found_and_deleting_nothing_is_fine(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope
) -> None:
    run, held = await running_run(stores, scope)
    await writes(stores, scope).progress.save_progress(snapshot_for(run.id, held.owner))

    for foreign in (other_scope, Scope(app="other-app", tenant=scope.tenant)):
        with pytest.raises(ProgressNotFound):
            await stores.at(foreign).progress.get_progress(run.id)
        await writes(stores, foreign).progress.delete_progress(run.id)
    assert await db.progress(run.id) is not None  # a foreign delete removed nothing

    await writes(stores, scope).progress.delete_progress(run.id)
    assert await db.progress(run.id) is None
    await writes(stores, scope).progress.delete_progress(run.id)  # missing: returns None, raises nothing
    await writes(stores, scope).progress.delete_progress("no-such-run")
    with pytest.raises(ProgressNotFound):
        await stores.at(scope).progress.get_progress(run.id)


async def test_scenario_43_worker_dies_after_a_leased_claim_and_the_sweep_reclaims_reusing_done(
    stores: Stores, engine: Engine, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    dead = lease(ttl=TINY_TTL)
    claim = leased(p, dead)
    await writes(stores, scope).suspensions.claim_suspension_leased(claim)
    await db.wait_lease_lapsed(p.run.id)

    sweep = lease()
    taken = readable(await engine.apply(ReclaimLapsed(sweep, 10)))

    assert [t.run.id for t in taken] == [p.run.id]
    assert taken[0].run.lease_owner == sweep.owner
    assert taken[0].run.revision == p.revision + 1  # a takeover is not a state change
    assert taken[0].progress is not None
    assert claim.first is not None
    assert taken[0].progress.done == claim.first.done
    assert taken[0].progress.owner == sweep.owner
    assert (await stores.at(scope).progress.get_progress(p.run.id)).done == claim.first.done
    assert await engine.apply(ReclaimLapsed(lease(), 10)) == []  # held again: nobody else takes it
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).progress.save_progress(snapshot_for(p.run.id, dead.owner))


async def test_scenario_44_a_started_call_survives_the_death_of_its_worker(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    run, dead = await running_run(stores, scope)
    charge = PendingCall(id="c-charge", name="charge", arguments='{"amount": 100}')
    await writes(stores, scope).progress.save_progress(
        Progress(run_id=run.id, owner=dead.owner, continuation=continuation(), started=[charge])
    )
    await stores.at(scope).runs.renew_lease(run.id, dead.model_copy(update={"ttl_seconds": TINY_TTL}))
    await db.wait_lease_lapsed(run.id)

    heir = lease()
    taken = await writes(stores, scope).runs.claim_continuation_leased(run.id, heir)

    assert taken.lease_owner == heir.owner
    inherited = await stores.at(scope).progress.get_progress(run.id)
    assert inherited.started == [charge]  # the new worker knows the charge was handed over already
    kept = await writes(stores, scope).progress.save_progress(inherited.model_copy(update={"owner": heir.owner}))
    assert kept.started == [charge]


async def test_scenario_45_a_reclaimed_cancel_ending_ends_the_run_cancelled(
    stores: Stores, engine: Engine, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    canceller = lease(ttl=TINY_TTL)
    await writes(stores, scope).suspensions.claim_suspension_leased(
        LeasedClaim(
            version=pin(p),
            lease=canceller,
            first=Progress(
                run_id=p.run.id,
                owner=canceller.owner,
                continuation=p.suspension.continuation,
                ending=Ending(kind=EndingKind.CANCEL),
            ),
        ),
    )
    await db.wait_lease_lapsed(p.run.id)

    heir = lease()
    (taken,) = readable(await engine.apply(ReclaimLapsed(heir, 10)))
    assert taken.progress is not None
    assert taken.progress.ending == Ending(kind=EndingKind.CANCEL)
    await writes(stores, scope).runs.end_run(p.run.id, heir.owner, RunEventKind.CANCELLED)

    run = await db.run(p.run.id)
    assert (run["state"], run["lease_owner"]) == ("cancelled", None)
    assert await db.suspension(p.run.id) is None
    assert await db.progress(p.run.id) is None
    keys = [r["routing_key"] for r in await db.con.fetch("SELECT routing_key FROM outbox WHERE run_id = $1", p.run.id)]
    assert keys.count(f"run.cancelled.{scope.app}.{scope.tenant}") == 1


async def test_scenario_46_expired_by_before_deadline_claims_nothing_and_normal_claim_on_expired_pause_is_expired(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    ahead = await paused_run(stores, scope, ttl_seconds=HOUR)
    assert ahead.suspension.expires_at is not None
    expired = await expired_pause(stores, db, scope)
    assert expired.suspension.expires_at is not None
    before = await db.snapshot()

    # ExpiredBy = T with the deadline after T: no claim. Nor with T far ahead while the database clock
    # has not reached the deadline.
    for by in (ahead.suspension.expires_at - timedelta(seconds=1), FAR_FUTURE):
        with pytest.raises(NotSuspended):
            await writes(stores, scope).suspensions.claim_suspension_leased(leased(ahead, expired_by=by))
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension_leased(
            leased(expired, expired_by=expired.suspension.expires_at - timedelta(microseconds=1))
        )
    # A normal (unexpired-only) leased claim on the expired pause.
    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(expired))
    assert await db.snapshot() == before

    # ExpiredBy exactly at the deadline claims it: "at or before".
    got = await writes(stores, scope).suspensions.claim_suspension_leased(
        leased(expired, expired_by=expired.suspension.expires_at)
    )
    assert got.run is not None
    assert got.run.revision == expired.revision + 1


# --- invariant 4: claim, lease and first snapshot commit together or not at all -------------------------


async def test_leased_claim_commits_the_claim_the_lease_and_the_first_snapshot_together_or_not_at_all(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    before = await db.snapshot()
    await db.fail_inserts_into("progress")

    with pytest.raises(IntermissionError):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p))

    assert await db.snapshot() == before
    run = await db.run(p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"]) == ("paused", p.revision, None)
    # Without a first snapshot the same claim (no progress insert) goes through.
    got = await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, with_first=False))
    assert got.run is not None
    assert got.run.lease_owner is not None
