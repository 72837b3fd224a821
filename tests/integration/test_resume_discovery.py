"""ListAgentReplyRuns and LatestResumeAdmission on the real database: docs/scenarios.md, scenario 51,
and the recovery reads a restarted worker reconciles from."""

from __future__ import annotations

import pytest

from intermission.engine.runs import Pause
from intermission.schemas.errors import InvalidArgument, InvalidScope, ResumeAdmissionNotFound
from intermission.schemas.events import RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import PendingCall, SuspendReason
from intermission.store import Stores
from tests.support.factories import PausedRun, continuation, lease, paused_run, writes
from tests.support.resume import (
    admission_request,
    agent_reply_pause,
    snapshot,
    until_db_clock_passes,
)


@pytest.mark.parametrize("limit", [0, -1, 257, 10**6])
async def test_scenario_51_limit_out_of_range_is_refused(stores: Stores, scope: Scope, limit: int) -> None:
    before = await snapshot(stores)
    with pytest.raises(InvalidArgument):
        await stores.at(scope).resume.list_agent_reply_runs("", limit)
    assert await snapshot(stores) == before


async def test_scenario_51_limits_at_the_bounds_are_accepted(stores: Stores, scope: Scope) -> None:
    assert await stores.at(scope).resume.list_agent_reply_runs("", 1) == []
    assert await stores.at(scope).resume.list_agent_reply_runs("", 256) == []


async def test_scenario_51_refuses_a_malformed_cursor_and_scope(stores: Stores, scope: Scope) -> None:
    with pytest.raises(InvalidArgument):
        await stores.at(scope).resume.list_agent_reply_runs("not a run id", 10)
    with pytest.raises(InvalidScope):
        await stores.at(Scope.model_construct(app="a", tenant="")).resume.list_agent_reply_runs("", 10)


async def test_scenario_51_discovery_includes_every_kind_of_agent_reply_run_and_nothing_else(
    stores: Stores, scope: Scope, other_scope: Scope
) -> None:
    # A live, unadmitted agent-reply pause.
    waiting = await agent_reply_pause(stores, scope, run_id="r-01-waiting")
    # An expired one, never admitted.
    expired = await agent_reply_pause(stores, scope, run_id="r-02-expired", ttl_seconds=0.001)
    assert expired.suspension.expires_at is not None
    # An admitted one, its pause retained.
    admitted = await agent_reply_pause(stores, scope, run_id="r-03-admitted")
    await writes(stores, scope).resume.admit_resume(admission_request(admitted, scope))
    # A running admission whose pause row is gone (the fleet deleted it after the start).
    gone = await agent_reply_pause(stores, scope, run_id="r-04-pause-gone")
    held = lease()
    a = await writes(stores, scope).resume.admit_resume_leased(admission_request(gone, scope), held)
    await writes(stores, scope).resume.start_resume(gone.run.id, gone.suspension.id, a.request_digest)
    await writes(stores, scope).suspensions.delete_suspension(gone.run.id)
    # Not agent replies, or not this scope, or no longer held by their admission.
    await paused_run(stores, scope, reason=SuspendReason.EXTERNAL_TOOL, run_id="r-05-external")
    await paused_run(stores, scope, reason=SuspendReason.APPROVAL, run_id="r-06-approval")
    await agent_reply_pause(stores, other_scope, run_id="r-07-other-scope")
    await agent_reply_pause(stores, Scope(app="acme", tenant="t1-child"), run_id="r-08-child-scope")
    ended = await agent_reply_pause(stores, scope, run_id="r-09-ended")
    held_ended = lease()
    await writes(stores, scope).resume.admit_resume_leased(admission_request(ended, scope), held_ended)
    await writes(stores, scope).runs.end_run(ended.run.id, held_ended.owner, RunEventKind.COMPLETED, output="ok")
    moved_on = await agent_reply_pause(stores, scope, run_id="r-10-moved-on")
    held_moved = lease()
    await writes(stores, scope).resume.admit_resume_leased(admission_request(moved_on, scope), held_moved)
    await writes(stores, scope).runs.pause_run(
        moved_on.run.id,
        held_moved.owner,
        Pause(
            reason=SuspendReason.EXTERNAL_TOOL,
            pending=[PendingCall(id="c9", name="lookup")],
            continuation=continuation(step=4),
            ttl_seconds=0,
        ),
    )
    await until_db_clock_passes(stores, expired.suspension.expires_at)

    found = await stores.at(scope).resume.list_agent_reply_runs("", 256)

    assert found == [waiting.run.id, expired.run.id, admitted.run.id, gone.run.id]


async def test_scenario_51_pages_strictly_after_the_cursor_in_ascending_order(stores: Stores, scope: Scope) -> None:
    # Mixed case and punctuation: the order is bytewise, whatever the database's collation.
    ids = ["B-run", "a-run", "a.run", "a_run", "Z:9", "0-first"]
    for run_id in ids:
        await agent_reply_pause(stores, scope, run_id=run_id)
    expected = sorted(ids)

    pages: list[list[str]] = []
    after = ""
    while True:
        page = await stores.at(scope).resume.list_agent_reply_runs(after, 4)
        if not page:
            break
        pages.append(page)
        assert all(run_id > after for run_id in page)
        after = page[-1]

    assert [run_id for page in pages for run_id in page] == expected
    assert [len(page) for page in pages] == [4, 2]
    assert await stores.at(scope).resume.list_agent_reply_runs(expected[2], 256) == expected[3:]
    assert await stores.at(scope).resume.list_agent_reply_runs(expected[-1], 256) == []


async def test_latest_admission_is_the_highest_suspension_id(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    held = lease()
    first = await writes(stores, scope).resume.admit_resume_leased(admission_request(p, scope), held)
    await writes(stores, scope).resume.start_resume_leased(p.run.id, p.suspension.id, first.request_digest, held)
    assert (await stores.at(scope).resume.latest_resume_admission(p.run.id)).request_digest == first.request_digest
    paused = await writes(stores, scope).runs.pause_run(
        p.run.id,
        held.owner,
        Pause(
            reason=SuspendReason.AGENT_REPLY,
            pending=[PendingCall(id="c2", name="ask_agent", reply_with="rw-2")],
            continuation=continuation(step=3),
            ttl_seconds=0,
        ),
    )
    assert paused.suspension.id > p.suspension.id
    second_pause = PausedRun(run=p.run, suspension=paused.suspension, revision=paused.notice.run_revision)
    second = await writes(stores, scope).resume.admit_resume(admission_request(second_pause, scope))

    latest = await stores.at(scope).resume.latest_resume_admission(p.run.id)

    assert latest.request.version.suspension_id == paused.suspension.id
    assert latest.request_digest == second.request_digest
    # The first admission is retained after its pause was replaced.
    assert (
        await stores.at(scope).resume.get_resume_admission(p.run.id, p.suspension.id)
    ).request_digest == first.request_digest


async def test_latest_admission_of_a_run_with_none_is_not_found(stores: Stores, scope: Scope) -> None:
    p = await agent_reply_pause(stores, scope)
    with pytest.raises(ResumeAdmissionNotFound):
        await stores.at(scope).resume.latest_resume_admission(p.run.id)
    with pytest.raises(InvalidArgument):
        await stores.at(scope).resume.latest_resume_admission("")
