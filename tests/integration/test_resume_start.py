"""StartResume, StartResumeLeased and ExpireResumeAdmission on the real database: docs/scenarios.md,
scenarios 47-49, the start-against-expiry race, and every refusal writing nothing."""

from __future__ import annotations

import pytest

from intermission.schemas.errors import (
    InvalidArgument,
    InvalidContinuation,
    InvalidScope,
    ResumeAdmissionConflict,
    ResumeAdmissionNotFound,
    ResumeAlreadyStarted,
    RunConflict,
    RunLeaseLost,
    SuspensionExpired,
)
from intermission.schemas.events import RunEventKind
from intermission.schemas.resume import RESUME_SCHEMA_VERSION, ResumeExpiry, ResumeStart
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.conftest import MakeStores, race
from tests.support.factories import lease, writes
from tests.support.resume import (
    admission_request,
    agent_reply_pause,
    count,
    first_for,
    run_row,
    snapshot,
)


async def test_a_fresh_start_carries_the_suspension_read_in_its_transaction(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))

    start = await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)

    assert start.fresh is True
    assert start.schema_version == RESUME_SCHEMA_VERSION
    assert start.version == admission.request.version
    assert start.request_digest == admission.request_digest
    assert start.suspension is not None
    assert start.suspension.id == p.suspension.id
    assert start.suspension.continuation.prepared == p.suspension.continuation.prepared
    assert start.suspension.pending == p.suspension.pending
    assert start.run is not None
    assert start.run.revision == admission.claimed_revision
    # A start is not a state change.
    assert (await run_row(stores, p.run.id))["revision"] == admission.claimed_revision


async def test_scenario_47_start_retried_after_a_lost_ack_is_the_same_record_without_the_suspension(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    first = await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)
    before = await snapshot(stores)

    again = await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)
    read = await stores.at(scope).resume.get_resume_start(p.run.id, p.suspension.id)

    for later in (again, read):
        assert later.fresh is False
        assert later.suspension is None
        assert later.digest() == first.digest()
        assert later.model_dump() == first.model_dump()
    assert await snapshot(stores) == before
    assert await count(stores, "resume_starts") == 1


async def test_race_32_starts_grant_execution_once(stores: Stores, scope: Scope, make_stores: MakeStores) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    contenders = await make_stores(32)

    results = await race(
        32,
        lambda i: writes(contenders[i], scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest),
    )

    starts = [r for r in results if isinstance(r, ResumeStart)]
    assert len(starts) == 32, results
    assert [s.fresh for s in starts].count(True) == 1
    assert [s.suspension is not None for s in starts].count(True) == 1
    assert len({s.digest() for s in starts}) == 1


async def test_scenario_48_leased_start_moves_the_lease_to_the_starter_and_keeps_the_revision(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    admitter = lease()
    admission = await writes(stores, scope).resume.admit_resume_leased(
        admission_request(p, scope), admitter, first_for(p, admitter)
    )
    starter = lease()

    start = await writes(stores, scope).resume.start_resume_leased(
        p.run.id, p.suspension.id, admission.request_digest, starter, first_for(p, starter)
    )

    assert start.fresh
    assert start.suspension is not None
    assert start.run is not None
    assert start.run.lease_owner == starter.owner
    run = await run_row(stores, p.run.id)
    assert (run["lease_owner"], run["revision"]) == (starter.owner, admission.claimed_revision)
    assert (await stores.at(scope).progress.get_progress(p.run.id)).owner == starter.owner
    # The admitter lost the run: its writes are refused from now on.
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).progress.save_progress(first_for(p, admitter))


async def test_leased_start_of_an_unleased_admission_takes_the_lease(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    starter = lease()
    await writes(stores, scope).resume.start_resume_leased(p.run.id, p.suspension.id, admission.request_digest, starter)
    assert (await run_row(stores, p.run.id))["lease_owner"] == starter.owner


async def test_leased_start_recorded_before_is_returned_as_it_is_and_takes_nothing(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    starter = lease()
    first = await writes(stores, scope).resume.start_resume_leased(
        p.run.id, p.suspension.id, admission.request_digest, starter, first_for(p, starter)
    )
    before = await snapshot(stores)

    late = lease()
    again = await writes(stores, scope).resume.start_resume_leased(
        p.run.id, p.suspension.id, admission.request_digest, late, first_for(p, late)
    )

    assert again.fresh is False
    assert again.suspension is None
    assert again.digest() == first.digest()
    assert await snapshot(stores) == before
    assert (await run_row(stores, p.run.id))["lease_owner"] == starter.owner


@pytest.mark.parametrize(
    "bad_lease",
    [Lease(owner="w", ttl_seconds=0), Lease(owner="", ttl_seconds=30)],
    ids=["owner-without-ttl", "ttl-without-owner"],
)
async def test_leased_start_with_a_half_lease_is_lease_lost(stores: Stores, scope: Scope, bad_lease: Lease) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    before = await snapshot(stores)
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).resume.start_resume_leased(
            p.run.id, p.suspension.id, admission.request_digest, bad_lease
        )
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).resume.start_resume_leased(
            p.run.id, p.suspension.id, admission.request_digest, lease(), first_for(p, lease())
        )
    assert await snapshot(stores) == before


async def test_a_start_whose_pause_cannot_be_read_grants_nothing(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    await stores.db.pool.execute(
        "UPDATE suspensions SET continuation = '{\"messages\": 5}' WHERE id = $1", p.suspension.id
    )
    before = await snapshot(stores)

    with pytest.raises(InvalidContinuation):
        await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)

    assert await snapshot(stores) == before  # no start row: nobody holds a grant nobody received


# --- scenario 49: expiry and start exclude each other ----------------------------------------------------


async def test_expiry_records_evidence_and_its_event_and_changes_nothing_else(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    run_before = await run_row(stores, p.run.id)

    expiry = await writes(stores, scope).resume.expire_resume_admission(
        p.run.id, p.suspension.id, admission.request_digest
    )

    assert expiry.fresh is True
    assert expiry.version == admission.request.version
    assert expiry.request_digest == admission.request_digest
    assert expiry.run_revision == admission.claimed_revision
    assert await run_row(stores, p.run.id) == run_before  # evidence, not an end: nothing released
    events = await stores.at(scope).runs.list_run_events(p.run.id)
    expired = [e for e in events if e["kind"] == "resume_expired"]
    assert len(expired) == 1
    assert expired[0]["event_id"] == expiry.event_id
    assert expired[0]["revision"] == expiry.run_revision
    stored = await stores.at(scope).resume.get_resume_expiry(p.run.id, p.suspension.id)
    assert stored.fresh is False
    assert stored.model_dump() == expiry.model_dump()


async def test_expiry_is_idempotent(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    first = await writes(stores, scope).resume.expire_resume_admission(
        p.run.id, p.suspension.id, admission.request_digest
    )
    before = await snapshot(stores)

    again = await writes(stores, scope).resume.expire_resume_admission(
        p.run.id, p.suspension.id, admission.request_digest
    )

    assert again.fresh is False
    assert again.model_dump() == first.model_dump()
    assert await snapshot(stores) == before


async def test_scenario_49_expire_after_start_is_already_started(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)
    before = await snapshot(stores)

    with pytest.raises(ResumeAlreadyStarted):
        await writes(stores, scope).resume.expire_resume_admission(p.run.id, p.suspension.id, admission.request_digest)

    assert await snapshot(stores) == before


async def test_scenario_49_start_after_expiry_is_refused(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    await writes(stores, scope).resume.expire_resume_admission(p.run.id, p.suspension.id, admission.request_digest)
    before = await snapshot(stores)

    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)
    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).resume.start_resume_leased(
            p.run.id, p.suspension.id, admission.request_digest, lease()
        )

    assert await snapshot(stores) == before


@pytest.mark.parametrize("round_", range(3))
async def test_scenario_49_race_of_starts_and_expiries_exactly_one_wins(
    stores: Stores, scope: Scope, make_stores: MakeStores, round_: int
) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    contenders = await make_stores(32)
    digest = admission.request_digest

    async def contend(i: int) -> ResumeStart | ResumeExpiry:
        if (i + round_) % 2 == 0:
            return await writes(contenders[i], scope).resume.start_resume(p.run.id, p.suspension.id, digest)
        return await writes(contenders[i], scope).resume.expire_resume_admission(p.run.id, p.suspension.id, digest)

    results = await race(32, contend)

    fresh = [r for r in results if isinstance(r, ResumeStart | ResumeExpiry) and r.fresh]
    assert len(fresh) == 1, results
    if isinstance(fresh[0], ResumeStart):
        assert all(isinstance(r, ResumeStart | ResumeAlreadyStarted) for r in results), results
        assert (await count(stores, "resume_starts"), await count(stores, "resume_expiries")) == (1, 0)
    else:
        assert all(isinstance(r, ResumeExpiry | SuspensionExpired) for r in results), results
        assert (await count(stores, "resume_starts"), await count(stores, "resume_expiries")) == (0, 1)


# --- refusals ---------------------------------------------------------------------------------------------


async def test_start_with_another_digest_is_a_conflict_and_writes_nothing(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    before = await snapshot(stores)
    with pytest.raises(ResumeAdmissionConflict):
        await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, "0" * 64)
    with pytest.raises(ResumeAdmissionConflict):
        await writes(stores, scope).resume.expire_resume_admission(p.run.id, p.suspension.id, "0" * 64)
    assert await snapshot(stores) == before


async def test_start_and_expiry_without_an_admission_are_not_found(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    digest = admission_request(p, scope).digest()
    before = await snapshot(stores)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, digest)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, scope).resume.expire_resume_admission(p.run.id, p.suspension.id, digest)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, scope).resume.start_resume("no-such-run", 1, digest)
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(scope).resume.get_resume_start(p.run.id, p.suspension.id)
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(scope).resume.get_resume_expiry(p.run.id, p.suspension.id)
    assert await snapshot(stores) == before


async def test_start_and_expiry_from_another_scope_find_nothing(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    before = await snapshot(stores)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, other_scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, other_scope).resume.start_resume_leased(
            p.run.id, p.suspension.id, admission.request_digest, lease()
        )
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, other_scope).resume.expire_resume_admission(
            p.run.id, p.suspension.id, admission.request_digest
        )
    with pytest.raises(InvalidScope):
        await writes(stores, Scope.model_construct(app="a", tenant="no/slash")).resume.start_resume(
            p.run.id, 1, "0" * 64
        )
    assert await snapshot(stores) == before


@pytest.mark.parametrize(
    ("run_id", "suspension_id", "digest"),
    [("bad id", 1, "0" * 64), ("r", 0, "0" * 64), ("r", 1, "not-a-digest"), ("r", 1, "A" * 64)],
)
async def test_start_and_expiry_refuse_malformed_arguments(
    stores: Stores, scope: Scope, run_id: str, suspension_id: int, digest: str
) -> None:
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).resume.start_resume(run_id, suspension_id, digest)
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).resume.expire_resume_admission(run_id, suspension_id, digest)


async def test_start_of_an_admission_whose_run_moved_on_is_refused_but_a_retry_still_reads(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    q = await agent_reply_pause(stores, scope)
    held = lease()
    pa = await writes(stores, scope).resume.admit_resume_leased(admission_request(p, scope), held)
    qa = await writes(stores, scope).resume.admit_resume_leased(admission_request(q, scope), held)
    started = await writes(stores, scope).resume.start_resume(q.run.id, q.suspension.id, qa.request_digest)
    # Both runs end under their lease: one never started, one started.
    await writes(stores, scope).runs.end_run(p.run.id, held.owner, RunEventKind.FAILED, error="gave up")
    await writes(stores, scope).runs.end_run(q.run.id, held.owner, RunEventKind.COMPLETED, output="done")
    before = await snapshot(stores)

    with pytest.raises(RunConflict):
        await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, pa.request_digest)
    retry = await writes(stores, scope).resume.start_resume(q.run.id, q.suspension.id, qa.request_digest)

    assert retry.fresh is False
    assert retry.digest() == started.digest()
    assert await snapshot(stores) == before
