"""CloseResume, GetResumeClosure and ResumeCloser on the real database: docs/scenarios.md, scenario 50,
the closure-retry race, the closer's guards, and every refusal writing nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

from intermission.engine.closer import ResumeCloser
from intermission.engine.runs import Pause
from intermission.schemas.errors import (
    Forbidden,
    InvalidArgument,
    InvalidScope,
    InvalidState,
    ResumeAdmissionConflict,
    ResumeAdmissionNotFound,
    RunConflict,
    TransientError,
    UnsupportedSchemaVersion,
)
from intermission.schemas.resume import ResumeClosure, ResumeClosureRequest
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, PendingCall, SuspendReason
from intermission.store import Stores
from tests.conftest import MakeStores, race
from tests.support.factories import PausedRun, continuation, lease, writes
from tests.support.resume import (
    admission_request,
    admitted_and_started,
    agent_reply_pause,
    closure_request,
    count,
    db_now,
    first_for,
    run_row,
    snapshot,
    until_db_clock_passes,
)


async def test_closure_ends_the_run_incomplete_with_its_event_in_one_transaction(stores: Stores, scope: Scope) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    events_before = await count(stores, "run_events")

    receipt = await writes(stores, scope).resume.close_resume(req)

    assert receipt.fresh is True
    receipt.validate()
    assert receipt.request == req
    assert receipt.run_revision == req.run_revision + 1
    run = await run_row(stores, p.run.id)
    assert (run["state"], run["revision"], run["lease_owner"], run["output"]) == (
        "failed",
        receipt.run_revision,
        None,
        None,
    )
    assert run["error"].startswith("incomplete")
    # Everything a terminal run no longer has is gone with it.
    assert await count(stores, "suspensions") == 0
    assert await count(stores, "progress") == 0
    closed = [e for e in await stores.at(scope).runs.list_run_events(p.run.id) if e["kind"] == "resume_closed"]
    assert len(closed) == 1
    assert closed[0]["event_id"] == receipt.event_id
    assert closed[0]["revision"] == receipt.run_revision
    assert await count(stores, "run_events") == events_before + 1
    published = await stores.db.pool.fetch("SELECT routing_key, body FROM outbox WHERE run_id = $1", p.run.id)
    failed = [r for r in published if r["routing_key"] == f"run.failed.{scope.routing_suffix()}"]
    assert len(failed) == 1
    assert json.loads(failed[0]["body"])["revision"] == receipt.run_revision
    stored = await stores.at(scope).resume.get_resume_closure(p.run.id, p.suspension.id)
    assert stored.fresh is False
    assert stored.model_dump() == receipt.model_dump()
    stored.validate()


async def test_closure_of_a_leased_start_clears_the_lease_and_the_snapshot(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    held = lease()
    admission = await writes(stores, scope).resume.admit_resume_leased(
        admission_request(p, scope), held, first_for(p, held)
    )
    await writes(stores, scope).resume.start_resume_leased(
        p.run.id, p.suspension.id, admission.request_digest, held, first_for(p, held)
    )

    await writes(stores, scope).resume.close_resume(await closure_request(stores, scope, p))

    run = await run_row(stores, p.run.id)
    assert (run["state"], run["lease_owner"], run["lease_expires_at"]) == ("failed", None, None)
    assert await count(stores, "progress") == 0


async def test_scenario_50_identical_retry_after_the_proof_expired_returns_the_original_receipt(
    stores: Stores, scope: Scope
) -> None:
    p, _ = await admitted_and_started(stores, scope)
    # A proof that is valid for two seconds of the database clock; the retry comes after it expired.
    req = await closure_request(stores, scope, p, valid_for=timedelta(seconds=2))
    original = await writes(stores, scope).resume.close_resume(req)
    await until_db_clock_passes(stores, req.expires_at)
    before = await snapshot(stores)

    again = await writes(stores, scope).resume.close_resume(req)

    assert again.fresh is False
    assert again.model_dump() == original.model_dump()
    assert await snapshot(stores) == before


_CHANGES: list[tuple[str, Any]] = [
    ("actor", "someone-else"),
    ("issuer", "another-ca"),
    ("issuer_revision", "8"),
    ("proof_ref", "proof-other"),
    ("proof_digest", "cd" * 32),
    ("observed_at", None),
    ("expires_at", None),
    ("run_revision", None),
    ("admission_digest", "0" * 64),
    ("start_digest", "0" * 64),
]


@pytest.mark.parametrize(("field", "value"), _CHANGES, ids=[f for f, _ in _CHANGES])
async def test_scenario_50_any_changed_field_after_a_closure_is_refused(
    stores: Stores, scope: Scope, field: str, value: Any
) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    await writes(stores, scope).resume.close_resume(req)
    before = await snapshot(stores)
    if value is None:  # times and revisions move by one step
        current = getattr(req, field)
        value = current + (timedelta(microseconds=1) if field != "run_revision" else 1)
    changed = req.model_copy(update={field: value})

    with pytest.raises(ResumeAdmissionConflict):
        await writes(stores, scope).resume.close_resume(changed)

    assert await snapshot(stores) == before


async def test_scenario_50_a_stale_revision_is_refused(stores: Stores, scope: Scope) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    before = await snapshot(stores)
    for stale in (req.run_revision - 1, req.run_revision + 1):
        with pytest.raises(RunConflict):
            await writes(stores, scope).resume.close_resume(req.model_copy(update={"run_revision": stale}))
    assert await snapshot(stores) == before


async def test_race_32_identical_closures_make_one_receipt(
    stores: Stores, scope: Scope, make_stores: MakeStores
) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    revision = req.run_revision
    contenders = await make_stores(32)

    results = await race(32, lambda i: writes(contenders[i], scope).resume.close_resume(req))

    receipts = [r for r in results if isinstance(r, ResumeClosure)]
    assert len(receipts) == 32, results
    assert [r.fresh for r in receipts].count(True) == 1
    assert len({r.model_dump_json() for r in receipts}) == 1
    assert (await run_row(stores, p.run.id))["revision"] == revision + 1
    assert await count(stores, "resume_closures") == 1
    closed = [e for e in await stores.at(scope).runs.list_run_events(p.run.id) if e["kind"] == "resume_closed"]
    assert len(closed) == 1


# --- what a closure must bind ---------------------------------------------------------------------------


async def _repause(stores: Stores, scope: Scope, p: PausedRun, owner: str) -> PausedRun:
    """The started run pauses again on a new agent-reply question, as the fleet would."""
    paused = await writes(stores, scope).runs.pause_run(
        p.run.id,
        owner,
        Pause(
            reason=SuspendReason.AGENT_REPLY,
            pending=[PendingCall(id="c2", name="ask_agent", reply_with="rw-second")],
            continuation=continuation(step=3),
            ttl_seconds=0,
        ),
    )
    return PausedRun(run=p.run, suspension=paused.suspension, revision=paused.notice.run_revision)


async def _started_leased(stores: Stores, scope: Scope, p: PausedRun, owner: str) -> None:
    held = lease(owner)
    admission = await writes(stores, scope).resume.admit_resume_leased(admission_request(p, scope), held)
    await writes(stores, scope).resume.start_resume_leased(p.run.id, p.suspension.id, admission.request_digest, held)


async def test_closure_of_an_admission_that_is_not_the_latest_is_refused(stores: Stores, scope: Scope) -> None:
    owner = lease().owner
    p = await agent_reply_pause(stores, scope)
    await _started_leased(stores, scope, p, owner)
    old = await closure_request(stores, scope, p)
    second = await _repause(stores, scope, p, owner)
    await _started_leased(stores, scope, second, owner)
    current = await run_row(stores, p.run.id)
    before = await snapshot(stores)

    with pytest.raises(RunConflict):
        await writes(stores, scope).resume.close_resume(old.model_copy(update={"run_revision": current["revision"]}))

    assert await snapshot(stores) == before
    assert (
        await stores.at(scope).resume.latest_resume_admission(p.run.id)
    ).request.version.suspension_id == second.suspension.id


async def test_closure_of_a_run_that_paused_again_is_invalid_state(stores: Stores, scope: Scope) -> None:
    owner = lease().owner
    p = await agent_reply_pause(stores, scope)
    await _started_leased(stores, scope, p, owner)
    req = await closure_request(stores, scope, p)
    second = await _repause(stores, scope, p, owner)
    before = await snapshot(stores)

    with pytest.raises(InvalidState):
        await writes(stores, scope).resume.close_resume(req.model_copy(update={"run_revision": second.revision}))

    assert await snapshot(stores) == before


async def test_closure_of_an_admission_that_never_started_is_refused(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    now = await db_now(stores)
    req = ResumeClosureRequest(
        scope=scope,
        version=admission.request.version,
        admission_digest=admission.request_digest,
        start_digest="1" * 64,
        run_revision=admission.claimed_revision,
        actor="a",
        issuer="i",
        issuer_revision="1",
        proof_ref="p",
        proof_digest="2" * 64,
        observed_at=now,
        expires_at=now + timedelta(hours=1),
    )
    before = await snapshot(stores)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, scope).resume.close_resume(req)
    assert await snapshot(stores) == before


async def test_closure_with_an_expired_proof_is_forbidden(stores: Stores, scope: Scope) -> None:
    p, _ = await admitted_and_started(stores, scope)
    now = await db_now(stores)
    req = await closure_request(
        stores, scope, p, observed_at=now - timedelta(hours=2), expires_at=now - timedelta(hours=1)
    )
    before = await snapshot(stores)
    with pytest.raises(Forbidden):
        await writes(stores, scope).resume.close_resume(req)
    assert await snapshot(stores) == before


async def test_closure_from_another_scope_finds_nothing(stores: Stores, scope: Scope, other_scope: Scope) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    before = await snapshot(stores)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, other_scope).resume.close_resume(req.model_copy(update={"scope": other_scope}))
    with pytest.raises(InvalidArgument):
        await writes(stores, other_scope).resume.close_resume(req)  # bound to one scope, sent under another
    with pytest.raises(InvalidScope):
        await writes(stores, Scope.model_construct(app="", tenant="")).resume.close_resume(req)
    await writes(stores, scope).resume.close_resume(req)
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(other_scope).resume.get_resume_closure(p.run.id, p.suspension.id)
    assert await count(stores, "resume_closures") == 1
    assert before["resume_closures"] == 0


async def test_closure_of_an_unknown_run_is_not_found(stores: Stores, scope: Scope) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    before = await snapshot(stores)
    with pytest.raises(ResumeAdmissionNotFound):
        await writes(stores, scope).resume.close_resume(
            req.model_copy(update={"version": ClaimVersion(run_id="ghost", suspension_id=1, run_revision=1)})
        )
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(scope).resume.get_resume_closure(p.run.id, p.suspension.id)
    assert await snapshot(stores) == before


_MALFORMED: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("schema-version", {"schema_version": 2}, UnsupportedSchemaVersion),
    ("legacy-version", {"schema_version": 0}, UnsupportedSchemaVersion),
    ("empty-actor", {"actor": " "}, InvalidArgument),
    ("empty-proof-ref", {"proof_ref": ""}, InvalidArgument),
    ("short-digest", {"proof_digest": "ab"}, InvalidArgument),
    ("upper-digest", {"start_digest": "AB" * 32}, InvalidArgument),
    ("negative-revision", {"run_revision": -1}, InvalidArgument),
    (
        "bad-run-id",
        {"version": ClaimVersion.model_construct(run_id="a b", suspension_id=1, run_revision=1)},
        InvalidArgument,
    ),
    ("expires-before-observed", {"expires_at": None}, InvalidArgument),
]


@pytest.mark.parametrize(("changes", "error"), [(c, e) for _, c, e in _MALFORMED], ids=[n for n, _, _ in _MALFORMED])
async def test_malformed_closure_requests_are_refused_and_write_nothing(
    stores: Stores, scope: Scope, changes: dict[str, Any], error: type[Exception]
) -> None:
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    if changes.get("expires_at", 1) is None:
        changes = {"expires_at": req.observed_at}
    before = await snapshot(stores)
    with pytest.raises(error):
        await writes(stores, scope).resume.close_resume(req.model_copy(update=changes))
    assert await snapshot(stores) == before


# --- the closer ------------------------------------------------------------------------------------------


class Fence:
    def __init__(self) -> None:
        self.calls = 0
        self.swap: ResumeClosureRequest | None = None
        self.skip = False
        self.hang = False

    async def with_resume_closure(
        self, request: ResumeClosureRequest, action: Callable[[ResumeClosureRequest], Awaitable[None]]
    ) -> None:
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()  # a host port that never answers; the closer's bound cancels it
        if self.skip:
            return
        await action(self.swap or request)


class Authorizer:
    def __init__(self) -> None:
        self.allowed = True
        self.seen: list[ResumeClosureRequest] = []

    async def authorize_resume_closure(self, request: ResumeClosureRequest) -> None:
        self.seen.append(request)
        if not self.allowed:
            raise Forbidden("access revoked")


def _closer(stores: Stores, scope: Scope) -> tuple[ResumeCloser, Fence, Authorizer]:
    fence, authorizer = Fence(), Authorizer()
    return ResumeCloser(writes(stores, scope).resume, fence, authorizer), fence, authorizer


async def test_closer_requires_a_store_a_fence_and_an_authorizer(stores: Stores, scope: Scope) -> None:
    rs, fence, authorizer = writes(stores, scope).resume, Fence(), Authorizer()
    for store_, fence_, authorizer_ in [(None, fence, authorizer), (rs, None, authorizer), (rs, fence, None)]:
        with pytest.raises(InvalidArgument):
            ResumeCloser(store_, fence_, authorizer_)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ResumeCloser(rs, authorizer, fence)  # type: ignore[arg-type]
    for bound in (0.0, 31.0):
        with pytest.raises(InvalidArgument):
            ResumeCloser(rs, fence, authorizer, timeout_seconds=bound)


async def test_closer_closes_under_the_fence_after_authorizing(stores: Stores, scope: Scope) -> None:
    closer, fence, authorizer = _closer(stores, scope)
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)

    receipt = await closer.close(scope, req)

    assert receipt.fresh
    assert fence.calls == 1
    assert authorizer.seen == [req]
    assert authorizer.seen[0] is not req  # the authorizer sees the detached copy


async def test_closer_rechecks_authority_on_historical_retries(stores: Stores, scope: Scope) -> None:
    closer, fence, authorizer = _closer(stores, scope)
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    original = await closer.close(scope, req)
    before = await snapshot(stores)

    authorizer.allowed = False
    with pytest.raises(Forbidden):
        await closer.close(scope, req)  # a stored receipt is not permission
    authorizer.allowed = True
    again = await closer.close(scope, req)

    assert again.fresh is False
    assert again.model_dump() == original.model_dump()
    assert len(authorizer.seen) == 3
    assert fence.calls == 3  # historical retries go through the fence too
    assert await snapshot(stores) == before


async def test_closer_refused_by_the_authorizer_writes_nothing(stores: Stores, scope: Scope) -> None:
    closer, _, authorizer = _closer(stores, scope)
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    authorizer.allowed = False
    before = await snapshot(stores)
    with pytest.raises(Forbidden):
        await closer.close(scope, req)
    assert await snapshot(stores) == before


async def test_closer_refuses_a_fence_that_skips_or_swaps_the_request(stores: Stores, scope: Scope) -> None:
    closer, fence, authorizer = _closer(stores, scope)
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    before = await snapshot(stores)

    fence.skip = True
    with pytest.raises(Forbidden):
        await closer.close(scope, req)
    fence.skip = False
    fence.swap = req.model_copy(update={"actor": "mallory"})
    with pytest.raises(Forbidden):
        await closer.close(scope, req)

    assert authorizer.seen == []
    assert await snapshot(stores) == before


async def test_closer_bounds_each_operation(stores: Stores, scope: Scope) -> None:
    fence, authorizer = Fence(), Authorizer()
    closer = ResumeCloser(writes(stores, scope).resume, fence, authorizer, timeout_seconds=0.05)
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    fence.hang = True
    before = await snapshot(stores)
    with pytest.raises(TransientError):
        await closer.close(scope, req)
    assert await snapshot(stores) == before


async def test_closer_refuses_malformed_requests_before_asking_anyone(stores: Stores, scope: Scope) -> None:
    closer, fence, authorizer = _closer(stores, scope)
    p, _ = await admitted_and_started(stores, scope)
    req = await closure_request(stores, scope, p)
    with pytest.raises(UnsupportedSchemaVersion):
        await closer.close(scope, req.model_copy(update={"schema_version": 3}))
    with pytest.raises(InvalidScope):
        await closer.close(Scope.model_construct(app="x", tenant=""), req)
    assert (fence.calls, authorizer.seen) == (0, [])
