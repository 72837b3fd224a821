"""AdmitResume and AdmitResumeLeased on the real database: docs/scenarios.md, scenarios 33-37, the
identical-admission race, and every refusal writing nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from intermission.schemas.digest import digest
from intermission.schemas.errors import (
    InputTooLarge,
    InvalidArgument,
    InvalidScope,
    NotAgentReplyResumable,
    NotSuspended,
    ResumeAdmissionConflict,
    ResumeAdmissionNotFound,
    RunConflict,
    RunLeaseLost,
    SuspensionExpired,
)
from intermission.schemas.resume import (
    LEGACY_SCHEMA_VERSION,
    RESUME_SCHEMA_VERSION,
    ResumeAdmission,
    ResumeAdmissionRequest,
)
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import MAX_RESUME_INPUT_BYTES, ClaimVersion, SuspendReason
from intermission.store import Stores
from tests.conftest import MakeStores, race
from tests.support.factories import lease, paused_run, writes
from tests.support.resume import (
    admission_request,
    agent_reply_pause,
    count,
    first_for,
    reply,
    run_row,
    snapshot,
    until_db_clock_passes,
)


async def test_admission_claims_the_pause_and_keeps_the_input_exactly(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    req = admission_request(p, scope)

    got = await writes(stores, scope).resume.admit_resume(req)

    assert got.fresh is True
    assert got.schema_version == RESUME_SCHEMA_VERSION
    assert got.claimed_revision == p.revision + 1
    assert got.request_digest == req.digest()
    run = await run_row(stores, p.run.id)
    assert (run["state"], run["revision"]) == ("running", p.revision + 1)
    # The pause is retained: the fleet deletes it, not the admission.
    assert await count(stores, "suspensions") == 1
    stored = await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id)
    assert stored.request.input == req.input
    assert stored.fresh is False
    assert stored.model_dump() == got.model_dump()
    # The suspension digest binds the stored pause: a host recomputes it from a plain read.
    assert got.suspension_digest == digest(await stores.at(scope).suspensions.get_suspension(p.run.id))


async def test_scenario_34_a_failure_reply_is_admitted_byte_for_byte(stores: Stores, scope: Scope) -> None:
    # refuse/failure replies resume the run with a failure payload; to the store it is input like any other,
    # and its bytes (escapes, key order, spacing, non-ASCII) must come back exactly.
    p = await agent_reply_pause(stores, scope)
    payload = '{"performative":"failure",  "sender":"peer","content":"timeout\\n\\u00e9 é"}'.encode()

    got = await writes(stores, scope).resume.admit_resume(admission_request(p, scope, payload))

    assert got.fresh
    assert (await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id)).request.input == payload


async def test_scenario_35_identical_admission_again_returns_the_record_and_claims_nothing(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    first = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    before = await snapshot(stores)

    again = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))

    assert again.fresh is False
    assert again.model_dump() == first.model_dump()
    assert await snapshot(stores) == before  # no second revision bump, no second row


async def test_a_recorded_admission_takes_nothing_even_if_its_pause_is_claimable_again(
    stores: Stores, scope: Scope
) -> None:
    # Whatever put the run back on this very pause (a bug elsewhere, a hand edit), the recorded admission
    # is the answer: the claim is never attempted again.
    p = await agent_reply_pause(stores, scope)
    first = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    await stores.db.pool.execute("UPDATE runs SET state = 'paused', revision = $2 WHERE id = $1", p.run.id, p.revision)
    before = await snapshot(stores)

    again = await writes(stores, scope).resume.admit_resume_leased(admission_request(p, scope), lease())

    assert again.fresh is False
    assert again.model_dump() == first.model_dump()
    assert await snapshot(stores) == before


async def test_scenario_36_changed_input_for_the_same_pause_is_a_conflict(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    original = await writes(stores, scope).resume.admit_resume(admission_request(p, scope, reply(content="one")))
    before = await snapshot(stores)

    with pytest.raises(ResumeAdmissionConflict):
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope, reply(content="two")))

    assert await snapshot(stores) == before
    kept = await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id)
    assert kept.request.input == reply(content="one")
    assert kept.request_digest == original.request_digest


async def test_scenario_36_a_changed_pin_for_the_same_pause_is_a_conflict(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    moved = ResumeAdmissionRequest(
        scope=scope,
        version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision + 1),
        input=reply(),
    )
    with pytest.raises(ResumeAdmissionConflict):
        await writes(stores, scope).resume.admit_resume(moved)


async def test_scenario_37_exactly_8_mib_encoded_is_accepted(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    data = b"a" * MAX_RESUME_INPUT_BYTES

    got = await writes(stores, scope).resume.admit_resume(admission_request(p, scope, data))

    assert got.fresh
    assert (await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id)).request.input == data


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"a" * (MAX_RESUME_INPUT_BYTES + 1), id="8MiB+1-plain"),
        # Half as many raw bytes, but each quote escapes to two: JSON escaping counts.
        pytest.param(b'"' * (MAX_RESUME_INPUT_BYTES // 2) + b"a", id="8MiB+1-escaped"),
    ],
)
async def test_scenario_37_one_byte_over_8_mib_encoded_is_refused_and_nothing_is_written(
    stores: Stores, scope: Scope, data: bytes
) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)

    with pytest.raises(InputTooLarge):
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope, data))

    assert await snapshot(stores) == before
    assert (await run_row(stores, p.run.id))["state"] == "paused"


async def test_exactly_8_mib_of_escapes_is_accepted(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    data = b"\n" * (MAX_RESUME_INPUT_BYTES // 2)  # each newline is two bytes escaped
    assert (await writes(stores, scope).resume.admit_resume(admission_request(p, scope, data))).fresh


async def test_race_32_identical_admissions_one_fresh_one_revision_bump(
    stores: Stores, scope: Scope, make_stores: MakeStores
) -> None:
    p = await agent_reply_pause(stores, scope)
    contenders = await make_stores(32)
    req = admission_request(p, scope)

    results = await race(32, lambda i: writes(contenders[i], scope).resume.admit_resume(req))

    assert all(isinstance(r, ResumeAdmission) for r in results), results
    admissions = [r for r in results if isinstance(r, ResumeAdmission)]
    assert sum(a.fresh for a in admissions) == 1
    assert len({a.model_dump_json() for a in admissions}) == 1  # every caller holds the same record
    assert (await run_row(stores, p.run.id))["revision"] == p.revision + 1
    assert await count(stores, "resume_admissions") == 1


async def test_scenario_33_race_of_two_different_replies_one_wins_the_other_conflicts(
    stores: Stores, scope: Scope, make_stores: MakeStores
) -> None:
    # Two replies answer the same question (the bus's scenario 33 at the store): 16 callers carry each.
    p = await agent_reply_pause(stores, scope)
    contenders = await make_stores(32)
    replies = [admission_request(p, scope, reply(content="A")), admission_request(p, scope, reply(content="B"))]

    results = await race(32, lambda i: writes(contenders[i], scope).resume.admit_resume(replies[i % 2]))

    admissions = [r for r in results if isinstance(r, ResumeAdmission)]
    conflicts = [r for r in results if isinstance(r, ResumeAdmissionConflict)]
    assert len(admissions) + len(conflicts) == 32, results
    assert sum(a.fresh for a in admissions) == 1
    winner = next(a for a in admissions if a.fresh)
    # Everyone who carried the winning reply got the winner's record; everyone else a conflict.
    assert len(admissions) == 16
    assert len(conflicts) == 16
    assert {a.request_digest for a in admissions} == {winner.request_digest}
    assert (await run_row(stores, p.run.id))["revision"] == p.revision + 1
    assert await count(stores, "resume_admissions") == 1


async def test_leased_admission_takes_the_lease_and_writes_the_first_snapshot(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    held = lease()

    got = await writes(stores, scope).resume.admit_resume_leased(admission_request(p, scope), held, first_for(p, held))

    assert got.fresh
    assert got.claimed_revision == p.revision + 1
    run = await run_row(stores, p.run.id)
    assert (run["state"], run["lease_owner"]) == ("running", held.owner)
    progress = await stores.at(scope).progress.get_progress(p.run.id)
    assert progress.owner == held.owner
    assert progress.continuation.step_index == 2


async def test_leased_admission_recorded_before_is_returned_as_it_is_and_takes_nothing(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    held = lease()
    first = await writes(stores, scope).resume.admit_resume_leased(
        admission_request(p, scope), held, first_for(p, held)
    )
    before = await snapshot(stores)
    progress_before = await stores.at(scope).progress.get_progress(p.run.id)

    other = lease()
    again = await writes(stores, scope).resume.admit_resume_leased(
        admission_request(p, scope), other, first_for(p, other)
    )

    assert again.fresh is False
    assert again.model_dump() == first.model_dump()
    assert await snapshot(stores) == before
    assert (await stores.at(scope).progress.get_progress(p.run.id)) == progress_before


@pytest.mark.parametrize(
    "bad_lease",
    [
        pytest.param(Lease(owner="w", ttl_seconds=0), id="owner-without-ttl"),
        pytest.param(Lease(owner="", ttl_seconds=30), id="ttl-without-owner"),
        pytest.param(Lease(), id="no-lease"),
    ],
)
async def test_leased_admission_with_a_half_lease_is_lease_lost_and_writes_nothing(
    stores: Stores, scope: Scope, bad_lease: Lease
) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).resume.admit_resume_leased(admission_request(p, scope), bad_lease)
    assert await snapshot(stores) == before


async def test_leased_admission_with_a_first_owned_by_someone_else_is_lease_lost(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)
    with pytest.raises(RunLeaseLost):
        await writes(stores, scope).resume.admit_resume_leased(
            admission_request(p, scope), lease(), first_for(p, lease())
        )
    assert await snapshot(stores) == before


# --- refusals: typed, and nothing written --------------------------------------------------------------


async def test_admission_from_another_scope_finds_nothing_and_writes_nothing(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)

    with pytest.raises(NotSuspended):
        await writes(stores, other_scope).resume.admit_resume(admission_request(p, other_scope))

    assert await snapshot(stores) == before


async def test_admission_whose_request_names_another_scope_is_refused(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).resume.admit_resume(admission_request(p, other_scope))
    assert await snapshot(stores) == before


async def test_admission_without_a_valid_scope_fails_before_the_database(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)
    with pytest.raises(InvalidScope):
        await writes(stores, Scope.model_construct(app="", tenant="t1")).resume.admit_resume(
            admission_request(p, scope)
        )
    assert await snapshot(stores) == before


async def test_admission_without_a_request_is_invalid(stores: Stores, scope: Scope) -> None:
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).resume.admit_resume(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).resume.admit_resume_leased({"scope": scope}, lease())  # type: ignore[arg-type]


async def test_admission_of_an_unknown_run_is_not_suspended(stores: Stores, scope: Scope) -> None:
    before = await snapshot(stores)
    req = ResumeAdmissionRequest(
        scope=scope, version=ClaimVersion(run_id="no-such-run", suspension_id=1, run_revision=1), input=reply()
    )
    with pytest.raises(NotSuspended):
        await writes(stores, scope).resume.admit_resume(req)
    assert await snapshot(stores) == before


@pytest.mark.parametrize("reason", [SuspendReason.EXTERNAL_TOOL, SuspendReason.APPROVAL])
async def test_admission_of_a_pause_that_is_not_an_agent_reply_is_refused(
    stores: Stores, scope: Scope, reason: SuspendReason
) -> None:
    p = await paused_run(stores, scope, reason=reason)
    before = await snapshot(stores)
    with pytest.raises(NotAgentReplyResumable):
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    assert await snapshot(stores) == before


@pytest.mark.parametrize(("suspension_delta", "revision_delta"), [(0, 1), (0, -1), (1000, 0)])
async def test_admission_pinned_to_another_pause_or_revision_is_run_conflict(
    stores: Stores, scope: Scope, suspension_delta: int, revision_delta: int
) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)
    req = ResumeAdmissionRequest(
        scope=scope,
        version=ClaimVersion(
            run_id=p.run.id,
            suspension_id=p.suspension.id + suspension_delta,
            run_revision=p.revision + revision_delta,
        ),
        input=reply(),
    )
    with pytest.raises(RunConflict):
        await writes(stores, scope).resume.admit_resume(req)
    assert await snapshot(stores) == before


async def test_admission_of_an_expired_pause_is_refused_and_the_run_stays_paused(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope, ttl_seconds=0.001)
    assert p.suspension.expires_at is not None
    await until_db_clock_passes(stores, p.suspension.expires_at)
    before = await snapshot(stores)

    with pytest.raises(SuspensionExpired):
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope))

    assert await snapshot(stores) == before


async def test_admission_input_that_is_not_utf8_is_refused(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    before = await snapshot(stores)
    with pytest.raises(InvalidArgument):
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope, b"\xff\xfe"))
    assert await snapshot(stores) == before


async def test_a_refused_admission_grants_nothing(stores: Stores, scope: Scope) -> None:
    # A caller whose admission failed holds no record, so it has nothing to start.
    p = await agent_reply_pause(stores, scope)
    req = admission_request(p, scope, b"a" * (MAX_RESUME_INPUT_BYTES + 1))
    with pytest.raises(InputTooLarge):
        await writes(stores, scope).resume.admit_resume(req)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, req.digest())


# --- schema versions -----------------------------------------------------------------------------------


async def test_a_row_without_a_schema_version_reads_as_legacy_and_still_matches_retries(
    stores: Stores, scope: Scope
) -> None:
    p = await agent_reply_pause(stores, scope)
    await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    await stores.db.pool.execute("UPDATE resume_admissions SET schema_version = NULL")

    legacy = await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id)
    again = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))

    assert legacy.schema_version == LEGACY_SCHEMA_VERSION
    assert again.fresh is False
    assert again.schema_version == LEGACY_SCHEMA_VERSION


# --- reads -----------------------------------------------------------------------------------------------


async def test_get_admission_is_exact_scope(stores: Stores, scope: Scope, other_scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(other_scope).resume.get_resume_admission(p.run.id, p.suspension.id)
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id + 1)
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(other_scope).resume.latest_resume_admission(p.run.id)
    with pytest.raises(InvalidArgument):
        await stores.at(scope).resume.get_resume_admission("not a run id!", p.suspension.id)
    with pytest.raises(InvalidArgument):
        await stores.at(scope).resume.get_resume_admission(p.run.id, 0)


async def test_list_admissions_pages_exact_scope_history_with_an_opaque_cursor(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    ours = []
    for _ in range(5):
        p = await agent_reply_pause(stores, scope)
        ours.append((p.run.id, p.suspension.id))
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    theirs = await agent_reply_pause(stores, other_scope)
    await writes(stores, other_scope).resume.admit_resume(admission_request(theirs, other_scope))

    seen: list[tuple[str, int]] = []
    cursor = ""
    pages = 0
    while True:
        page = await stores.at(scope).resume.list_resume_admissions(cursor, 2)
        pages += 1
        seen.extend((a.request.version.run_id, a.request.version.suspension_id) for a in page.admissions)
        assert all(a.request.scope == scope for a in page.admissions)
        if not page.next:
            break
        cursor = page.next
    assert seen == sorted(ours)
    assert pages == 3
    whole = await stores.at(scope).resume.list_resume_admissions("", 32)
    assert len(whole.admissions) == 5
    assert whole.next == ""


@pytest.mark.parametrize("limit", [0, -1, 33, 10**9])
async def test_list_admissions_refuses_a_limit_out_of_range(stores: Stores, scope: Scope, limit: int) -> None:
    with pytest.raises(InvalidArgument):
        await stores.at(scope).resume.list_resume_admissions("", limit)


async def test_list_admissions_refuses_a_tampered_or_foreign_cursor(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    for _ in range(3):
        p = await agent_reply_pause(stores, scope)
        await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    cursor = (await stores.at(scope).resume.list_resume_admissions("", 1)).next
    assert cursor
    flipped = cursor[:-2] + ("A" if cursor[-2] != "A" else "B") + cursor[-1]
    for bad in [flipped, cursor + "=", cursor[:-3], "not base64!", "x" * 600, "e30", cursor + cursor]:
        with pytest.raises(InvalidArgument, match="cursor"):
            await stores.at(scope).resume.list_resume_admissions(bad, 2)
    with pytest.raises(InvalidArgument, match="cursor"):
        await stores.at(other_scope).resume.list_resume_admissions(cursor, 2)


async def test_admissions_are_counted_per_pause(stores: Stores, scope: Scope, make_stores: MakeStores) -> None:
    # Distinct pauses do not contend with each other: 32 runs admitted at once, 32 fresh admissions.
    pauses = [await agent_reply_pause(stores, scope) for _ in range(32)]
    contenders = await make_stores(32)
    results = await race(
        32, lambda i: writes(contenders[i], scope).resume.admit_resume(admission_request(pauses[i], scope))
    )
    assert Counter(type(r).__name__ for r in results) == {"ResumeAdmission": 32}
    assert all(isinstance(r, ResumeAdmission) and r.fresh for r in results)
