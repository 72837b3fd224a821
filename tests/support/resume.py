"""Shared helpers of the resume tests (no tests here; the name keeps it with the files it serves).

Tests read rows with plain SQL on purpose: they check the store from outside, so they must not go through
the statements under test. Times that must pass are judged by the DATABASE clock, never the test's.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any

from intermission.schemas.resume import ResumeAdmissionRequest, ResumeClosureRequest, ResumeStart
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, PendingCall, Progress, SuspendReason
from intermission.store import Stores
from tests.support.factories import PausedRun, continuation, paused_run, writes

# Every table a resume write may touch; "nothing written" means none of these changed.
WATCHED_TABLES = (
    "resume_admissions",
    "resume_starts",
    "resume_expiries",
    "resume_closures",
    "run_events",
    "outbox",
    "progress",
    "suspensions",
)

PROOF_DIGEST = "ab" * 32


async def agent_reply_pause(
    stores: Stores, scope: Scope, *, ttl_seconds: float | None = 0, run_id: str | None = None
) -> PausedRun:
    return await paused_run(
        stores,
        scope,
        reason=SuspendReason.AGENT_REPLY,
        ttl_seconds=ttl_seconds,
        run_id=run_id,
        pending=[
            PendingCall(
                id="c1",
                name="ask_agent",
                arguments='{"agent": "peer", "question": "q?"}',
                reply_with=f"rw-{uuid.uuid4().hex[:8]}",
            )
        ],
    )


def reply(performative: str = "inform", content: str = "the answer") -> bytes:
    """A bus reply as the bus encodes it, with an escape and non-ASCII text so exactness is visible."""
    return ('{"performative": "' + performative + '", "sender": "peer", "content": "' + content + ' \\"é\\""}').encode()


def admission_request(p: PausedRun, scope: Scope, data: bytes | None = None) -> ResumeAdmissionRequest:
    return ResumeAdmissionRequest(
        scope=scope,
        version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
        input=reply() if data is None else data,
    )


def first_for(p: PausedRun, lease: Lease) -> Progress:
    return Progress(run_id=p.run.id, owner=lease.owner, continuation=continuation(step=2))


async def snapshot(stores: Stores) -> dict[str, Any]:
    """Row counts of every watched table and every run's (state, revision, lease owner)."""
    async with stores.db.pool.acquire() as con:
        found: dict[str, Any] = {}
        for table in WATCHED_TABLES:
            found[table] = await con.fetchval(f"SELECT count(*) FROM {table}")
        found["runs"] = sorted(
            tuple(r) for r in await con.fetch("SELECT id, state::text, revision, lease_owner FROM runs")
        )
    return found


async def count(stores: Stores, table: str) -> int:
    assert table in WATCHED_TABLES
    value: int = await stores.db.pool.fetchval(f"SELECT count(*) FROM {table}")
    return value


async def run_row(stores: Stores, run_id: str) -> dict[str, Any]:
    row = await stores.db.pool.fetchrow(
        "SELECT state::text AS state, revision, lease_owner, lease_expires_at, error, output FROM runs WHERE id = $1",
        run_id,
    )
    assert row is not None
    return dict(row)


async def db_now(stores: Stores) -> datetime:
    now: datetime = await stores.db.pool.fetchval("SELECT clock_timestamp()")
    return now


async def until_db_clock_passes(stores: Stores, moment: datetime) -> None:
    """Wait until the database clock is past ``moment``: a condition on the one clock the store judges
    by, polled, not a fixed sleep."""
    async with asyncio.timeout(30):
        # No Event can say the database clock moved; polling it is the only honest wait.
        while await db_now(stores) <= moment:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def admitted_and_started(stores: Stores, scope: Scope) -> tuple[PausedRun, ResumeStart]:
    p = await agent_reply_pause(stores, scope)
    admission = await writes(stores, scope).resume.admit_resume(admission_request(p, scope))
    start = await writes(stores, scope).resume.start_resume(p.run.id, p.suspension.id, admission.request_digest)
    return p, start


async def closure_request(
    stores: Stores,
    scope: Scope,
    p: PausedRun,
    *,
    valid_for: timedelta = timedelta(hours=1),
    **changes: Any,
) -> ResumeClosureRequest:
    """A closure request binding the run's latest admission, its start and its current revision, with a
    proof observed now and expiring ``valid_for`` later, both by the database clock."""
    admission = await stores.at(scope).resume.latest_resume_admission(p.run.id)
    start = await stores.at(scope).resume.get_resume_start(p.run.id, admission.request.version.suspension_id)
    now = await db_now(stores)
    current = await run_row(stores, p.run.id)
    fields: dict[str, Any] = {
        "scope": scope,
        "version": admission.request.version,
        "admission_digest": admission.request_digest,
        "start_digest": start.digest(),
        "run_revision": current["revision"],
        "actor": "host-operator",
        "issuer": "host-ca",
        "issuer_revision": "7",
        "proof_ref": f"proof-{p.run.id}",
        "proof_digest": PROOF_DIGEST,
        "observed_at": now,
        "expires_at": now + valid_for,
    }
    fields.update(changes)
    return ResumeClosureRequest(**fields)
