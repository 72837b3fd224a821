"""Bad input to every store method gets its typed error, and nothing is written.

A bad scope must be refused BEFORE any database access: those calls go to stores whose pool is already
closed, where any statement would surface as StoreUnavailable (the control shows it does). Everything
else runs against the live database and compares every row of every table before and after.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from intermission.engine.core import Engine
from intermission.engine.holding import ReclaimLapsed, Unreadable
from intermission.engine.runs import Pause
from intermission.schemas.errors import (
    InvalidArgument,
    InvalidContinuation,
    InvalidScope,
    NotSuspended,
    ProgressNotFound,
    RunLeaseLost,
    RunNotFound,
    StoreUnavailable,
)
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Lease, NewRun
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, LeasedClaim, PendingCall, Progress, SuspendReason, Suspension
from intermission.store import Stores
from tests.support.factories import continuation, lease, paused_run, running_run, writes
from tests.support.inspect import (
    FAR_FUTURE,
    Inspector,
    closed_stores,
    leased,
    pin,
    snapshot_for,
    unvalidated_scope,
)

NOW = datetime(2030, 1, 1, tzinfo=UTC)
RUN = "run-bad-input"
VERSION = ClaimVersion(run_id=RUN, suspension_id=1, run_revision=1)

Call = Callable[[Stores, Any], Awaitable[object]]


def _pause() -> Pause:
    return Pause(SuspendReason.EXTERNAL_TOOL, [PendingCall(id="c1", name="lookup")], continuation())


# Every store method that takes a scope, called with arguments that are fine in every other respect.
SCOPED_CALLS: dict[str, Call] = {
    "create_suspension": lambda s, sc: writes(s, sc).suspensions.create_suspension(
        Suspension(run_id=RUN, scope=Scope(app="a", tenant="t"), reason=SuspendReason.APPROVAL)
    ),
    "get_suspension": lambda s, sc: s.at(sc).suspensions.get_suspension(RUN),
    "delete_suspension": lambda s, sc: writes(s, sc).suspensions.delete_suspension(RUN),
    "list_expired": lambda s, sc: s.at(sc).suspensions.list_expired(NOW, 10),
    "claim_suspension": lambda s, sc: writes(s, sc).suspensions.claim_suspension(RUN),
    "claim_expired_suspension": lambda s, sc: writes(s, sc).suspensions.claim_expired_suspension(RUN, NOW),
    "claim_suspension_version": lambda s, sc: writes(s, sc).suspensions.claim_suspension_version(VERSION),
    "claim_suspension_leased": lambda s, sc: writes(s, sc).suspensions.claim_suspension_leased(
        LeasedClaim(version=VERSION, lease=Lease(owner="w", ttl_seconds=30))
    ),
    "save_progress": lambda s, sc: writes(s, sc).progress.save_progress(Progress(run_id=RUN, owner="w")),
    "get_progress": lambda s, sc: s.at(sc).progress.get_progress(RUN),
    "delete_progress": lambda s, sc: writes(s, sc).progress.delete_progress(RUN),
    "create_run": lambda s, sc: writes(s, sc).runs.create_run(NewRun(run_id=RUN, agent_id="demo")),
    "get_run": lambda s, sc: s.at(sc).runs.get_run(RUN),
    "renew_lease": lambda s, sc: s.at(sc).runs.renew_lease(RUN, Lease(owner="w", ttl_seconds=30)),
    "release_lease": lambda s, sc: writes(s, sc).runs.release_lease(RUN, "w"),
    "claim_continuation_leased": lambda s, sc: writes(s, sc).runs.claim_continuation_leased(
        RUN, Lease(owner="w", ttl_seconds=30)
    ),
    "pause_run": lambda s, sc: writes(s, sc).runs.pause_run(RUN, "w", _pause()),
    "end_run": lambda s, sc: writes(s, sc).runs.end_run(RUN, "w", RunEventKind.COMPLETED),
    "list_run_events": lambda s, sc: s.at(sc).runs.list_run_events(RUN),
}

BAD_SCOPES: dict[str, object] = {
    "none": None,
    "zero": unvalidated_scope(),
    "empty-app": unvalidated_scope(app="", tenant="t1"),
    "empty-tenant": unvalidated_scope(app="acme", tenant=""),
    "space": unvalidated_scope(app="ac me", tenant="t1"),
    "dot": unvalidated_scope(app="acme", tenant="t.1"),
    "too-long": unvalidated_scope(app="a" * 65, tenant="t1"),
    "non-ascii": unvalidated_scope(app="acmé", tenant="t1"),
    "trailing-newline": unvalidated_scope(app="acme\n", tenant="t1"),
    "not-a-string": unvalidated_scope(app=7, tenant="t1"),
    "a-dict": {"app": "acme", "tenant": "t1"},
}


@pytest.fixture
async def dead(pg_server: str) -> Stores:
    # Any database will do for a pool that is closed before it is used (no fresh database needed).
    return await closed_stores(pg_server)


@pytest.mark.parametrize("method", sorted(SCOPED_CALLS))
async def test_the_closed_pool_control_proves_a_valid_scope_reaches_the_database(
    dead: Stores, scope: Scope, method: str
) -> None:
    with pytest.raises(StoreUnavailable):
        await SCOPED_CALLS[method](dead, scope)


@pytest.mark.parametrize("bad", sorted(BAD_SCOPES))
async def test_every_scoped_method_refuses_a_bad_scope_before_any_database_access(dead: Stores, bad: str) -> None:
    not_refused: list[str] = []
    for method, call in SCOPED_CALLS.items():
        try:
            await call(dead, BAD_SCOPES[bad])
        except InvalidScope:
            continue
        except Exception as exc:  # a StoreUnavailable here means the database WAS reached
            not_refused.append(f"{method}: {exc!r}")
        else:
            not_refused.append(f"{method}: returned")
    assert not_refused == []


async def test_bad_limits_and_ttls_and_half_leases_are_refused_before_any_database_access(
    dead: Stores, scope: Scope
) -> None:
    for limit in (-1, -100):
        with pytest.raises(InvalidArgument):
            await dead.at(scope).suspensions.list_expired(NOW, limit)
        with pytest.raises(InvalidArgument):
            await dead.across_scopes.list_expired_across_scopes(NOW, limit)
    for limit in (0, -1):
        with pytest.raises(InvalidArgument):
            await Engine.over(dead).apply(ReclaimLapsed(lease(), limit))
    s = Suspension(run_id=RUN, scope=scope, reason=SuspendReason.APPROVAL)
    for ttl in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument):
            await writes(dead, scope).suspensions.create_suspension(s, ttl_seconds=ttl)
    for half in (Lease(owner="w"), Lease(ttl_seconds=30), Lease(), Lease(owner="w", ttl_seconds=-5)):
        with pytest.raises(RunLeaseLost):
            await writes(dead, scope).suspensions.claim_suspension_leased(LeasedClaim(version=VERSION, lease=half))
        with pytest.raises(RunLeaseLost):
            await writes(dead, scope).runs.claim_continuation_leased(RUN, half)
        with pytest.raises(RunLeaseLost):
            await dead.at(scope).runs.renew_lease(RUN, half)
        with pytest.raises(RunLeaseLost):
            await writes(dead, scope).runs.create_run(NewRun(run_id=RUN, agent_id="demo"), half)
        with pytest.raises(RunLeaseLost):
            await Engine.over(dead).apply(ReclaimLapsed(half, 10))
    with pytest.raises(RunLeaseLost):
        await writes(dead, scope).progress.save_progress(Progress(run_id=RUN, owner=""))


async def test_a_missing_run_gets_its_typed_error_and_nothing_is_written(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    await paused_run(stores, scope)
    await running_run(stores, scope)
    before = await db.snapshot()
    missing = "run-that-does-not-exist"
    version = ClaimVersion(run_id=missing, suspension_id=1, run_revision=1)
    held = lease()
    claim = LeasedClaim(version=version, lease=held)

    refusals: list[tuple[type[Exception], Callable[[], Awaitable[object]]]] = [
        (RunNotFound, lambda: stores.at(scope).runs.get_run(missing)),
        (NotSuspended, lambda: stores.at(scope).suspensions.get_suspension(missing)),
        (NotSuspended, lambda: writes(stores, scope).suspensions.delete_suspension(missing)),
        (NotSuspended, lambda: writes(stores, scope).suspensions.claim_suspension(missing)),
        (NotSuspended, lambda: writes(stores, scope).suspensions.claim_expired_suspension(missing, FAR_FUTURE)),
        (NotSuspended, lambda: writes(stores, scope).suspensions.claim_suspension_version(version)),
        (NotSuspended, lambda: writes(stores, scope).suspensions.claim_suspension_leased(claim)),
        (
            RunNotFound,
            lambda: writes(stores, scope).suspensions.create_suspension(
                Suspension(run_id=missing, scope=scope, reason=SuspendReason.APPROVAL)
            ),
        ),
        (RunNotFound, lambda: writes(stores, scope).runs.claim_continuation_leased(missing, held)),
        (ProgressNotFound, lambda: stores.at(scope).progress.get_progress(missing)),
        (RunLeaseLost, lambda: writes(stores, scope).progress.save_progress(snapshot_for(missing, held.owner))),
        (RunLeaseLost, lambda: stores.at(scope).runs.renew_lease(missing, held)),
        (RunLeaseLost, lambda: writes(stores, scope).runs.pause_run(missing, held.owner, _pause())),
        (RunLeaseLost, lambda: writes(stores, scope).runs.end_run(missing, held.owner, RunEventKind.FAILED, error="x")),
    ]
    for error, call in refusals:
        with pytest.raises(error):
            await call()
    assert await writes(stores, scope).runs.release_lease(missing, held.owner) is False
    assert await stores.at(scope).runs.list_run_events(missing) == []
    await writes(stores, scope).progress.delete_progress(missing)

    assert await db.snapshot() == before


async def test_bad_arguments_on_live_runs_are_refused_and_nothing_is_written(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope)
    run, held = await running_run(stores, scope)
    before = await db.snapshot()
    other = lease()

    # A first snapshot for another run than the one claimed or created.
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).suspensions.claim_suspension_leased(
            LeasedClaim(version=pin(p), lease=other, first=snapshot_for(run.id, other.owner))
        )
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).runs.create_run(
            NewRun(run_id="run-new", agent_id="demo"), other, snapshot_for(run.id, other.owner)
        )
    # A first snapshot owned by someone other than the lease owner.
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).suspensions.claim_suspension_leased(
            LeasedClaim(version=pin(p), lease=other, first=snapshot_for(p.run.id, "someone-else"))
        )
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).runs.create_run(
            NewRun(run_id="run-new", agent_id="demo"), other, snapshot_for("run-new", "someone-else")
        )
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).runs.claim_continuation_leased(run.id, other, snapshot_for(run.id, "someone-else"))
    # A pause with nothing pending, or with a deadline that is no duration.
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).runs.pause_run(
            run.id, held.owner, Pause(SuspendReason.APPROVAL, [], continuation())
        )
    for ttl in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument):
            await writes(stores, scope).runs.pause_run(
                run.id,
                held.owner,
                Pause(SuspendReason.APPROVAL, [PendingCall(id="c", name="n")], continuation(), ttl_seconds=ttl),
            )
    # "resumed" is an event, not an end.
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).runs.end_run(run.id, held.owner, RunEventKind.RESUMED)
    # An empty owner never holds a lease.
    for call in (
        lambda: writes(stores, scope).progress.save_progress(snapshot_for(run.id, "")),
        lambda: writes(stores, scope).runs.pause_run(run.id, "", _pause()),
        lambda: writes(stores, scope).runs.end_run(run.id, "", RunEventKind.COMPLETED),
    ):
        with pytest.raises(RunLeaseLost):
            await call()
    assert await writes(stores, scope).runs.release_lease(run.id, "") is False

    assert await db.snapshot() == before


async def test_a_first_snapshot_for_another_run_is_refused_by_a_continuation_claim(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    """The takeover's first snapshot must be the taken run's: one the same worker happens to hold a lease on
    must not be written instead."""
    run, _ = await running_run(stores, scope, holder=lease(ttl=0.001))
    await db.wait_lease_lapsed(run.id)
    heir = lease()
    elsewhere, _ = await running_run(stores, scope, holder=heir)  # the heir also holds this one
    before = await db.snapshot()

    with pytest.raises(InvalidArgument):
        await writes(stores, scope).runs.claim_continuation_leased(run.id, heir, snapshot_for(elsewhere.id, heir.owner))

    assert await db.snapshot() == before


# --- malformed rows -------------------------------------------------------------------------------------

BAD_CONTINUATIONS = [
    '"not an object"',
    "[]",
    "null",
    '{"prepared": "!!! not base64 !!!"}',
    '{"messages": [{"role": "robot", "content": "hi"}]}',
    '{"step_index": "three"}',
    '{"config": {"tools_restricted": "maybe"}}',
    '{"tool_results": [{"outcome": "completed"}]}',
]


@pytest.mark.parametrize("bad", BAD_CONTINUATIONS)
async def test_a_malformed_suspension_row_is_invalid_continuation_and_a_claim_writes_nothing(
    stores: Stores, db: Inspector, scope: Scope, bad: str
) -> None:
    p = await paused_run(stores, scope)
    await db.con.execute("UPDATE suspensions SET continuation = $2::jsonb WHERE run_id = $1", p.run.id, bad)
    before = await db.snapshot()

    with pytest.raises(InvalidContinuation):
        await stores.at(scope).suspensions.get_suspension(p.run.id)
    # A claim that cannot read the pause it would claim must not claim it: the run stays paused.
    with pytest.raises(InvalidContinuation):
        await writes(stores, scope).suspensions.claim_suspension(p.run.id)
    with pytest.raises(InvalidContinuation):
        await writes(stores, scope).suspensions.claim_suspension_version(pin(p))
    with pytest.raises(InvalidContinuation):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p))

    assert await db.snapshot() == before
    assert (await db.run(p.run.id))["state"] == "paused"


async def test_a_malformed_expired_row_is_invalid_continuation_for_the_sweepers_list_and_claim(
    stores: Stores, db: Inspector, scope: Scope
) -> None:
    p = await paused_run(stores, scope, ttl_seconds=0.001)
    await db.wait_pause_expired(p.run.id)
    await db.con.execute('UPDATE suspensions SET pending = \'{"not": "a list"}\' WHERE run_id = $1', p.run.id)
    before = await db.snapshot()

    with pytest.raises(InvalidContinuation):
        await stores.at(scope).suspensions.list_expired(FAR_FUTURE, None)
    with pytest.raises(InvalidContinuation):
        await stores.across_scopes.list_expired_across_scopes(FAR_FUTURE, None)
    with pytest.raises(InvalidContinuation):
        await writes(stores, scope).suspensions.claim_expired_suspension(p.run.id, FAR_FUTURE)
    with pytest.raises(InvalidContinuation):
        await writes(stores, scope).suspensions.claim_suspension_leased(leased(p, expired_by=FAR_FUTURE))

    assert await db.snapshot() == before


BAD_PROGRESS_COLUMNS = [
    ("continuation", '{"usage": {"input_tokens": "many"}}'),
    ("started", '[{"name": "no id"}]'),
    ("done", '{"call_id": "c1"}'),
    ("ending", '{"kind": "explode"}'),
    ("approved", "[1, 2]"),
]


@pytest.mark.parametrize(("column", "bad"), BAD_PROGRESS_COLUMNS)
async def test_a_malformed_progress_row_is_invalid_continuation_and_a_reclaim_hands_it_over_unread(
    stores: Stores, db: Inspector, scope: Scope, column: str, bad: str
) -> None:
    run, held = await running_run(stores, scope)
    await writes(stores, scope).progress.save_progress(snapshot_for(run.id, held.owner))
    await stores.at(scope).runs.renew_lease(run.id, held.model_copy(update={"ttl_seconds": 0.001}))
    await db.wait_lease_lapsed(run.id)
    quoted = await db.con.fetchval("SELECT quote_ident($1)", column)
    await db.con.execute(f"UPDATE progress SET {quoted} = $2::jsonb WHERE run_id = $1", run.id, bad)
    before = await db.snapshot()

    with pytest.raises(InvalidContinuation):
        await stores.at(scope).progress.get_progress(run.id)
    assert await db.snapshot() == before

    # The takeover commits (so the caller, holding the run, can end it) and says the row did not decode;
    # the row itself is left as it was found.
    heir = lease()
    (taken,) = await Engine.over(stores).apply(ReclaimLapsed(heir, 10))
    assert isinstance(taken, Unreadable)
    assert (taken.run_id, taken.scope) == (run.id, scope)
    assert taken.detail.startswith("stored progress")
    assert (await db.run(run.id))["lease_owner"] == heir.owner
    stored = await db.con.fetchval(f"SELECT {quoted}::text FROM progress WHERE run_id = $1", run.id)
    assert json.loads(stored) == json.loads(bad)


async def test_a_malformed_run_config_is_invalid_continuation(stores: Stores, db: Inspector, scope: Scope) -> None:
    run, _ = await running_run(stores, scope)
    await db.con.execute('UPDATE runs SET config = \'{"tools": "all"}\' WHERE id = $1', run.id)

    with pytest.raises(InvalidContinuation):
        await stores.at(scope).runs.get_run(run.id)
