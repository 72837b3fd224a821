"""Agent-reply resume evidence at the caller's exact scope, as it is read: admissions, starts, expiries and
closures, the runs waiting on a reply (the original's ReplyDiscoveryStore), and the opaque cursor of the
admission history. Admission, start, expiry and closure themselves are transitions of the engine
(``engine/replies.py``), which says how each exactly-once guarantee is made; the rows they write are decoded
here, for both.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from intermission.schemas.errors import (
    InvalidArgument,
    NotSuspended,
    ResumeAdmissionNotFound,
    RunConflict,
)
from intermission.schemas.ids import RUN_ID_PATTERN
from intermission.schemas.resume import (
    DIGEST_PATTERN,
    LEGACY_SCHEMA_VERSION,
    ResumeAdmission,
    ResumeAdmissionPage,
    ResumeAdmissionRequest,
    ResumeClosure,
    ResumeClosureRequest,
    ResumeExpiry,
    ResumeStart,
)
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Suspension
from intermission.store import rows
from intermission.store.rows import Out, stored
from intermission.store.scoped import ScopedReader

# ListAgentReplyRuns returns run ids only, so a page of 256 is small.
MAX_DISCOVERY_PAGE = 256
# ListResumeAdmissions returns whole admissions, each holding up to 8 MiB of input: the page bound is what
# bounds a reader's memory (32 x 8 MiB = 256 MiB at worst), so it is deliberately smaller.
MAX_ADMISSION_PAGE = 32
# A cursor this store issues is a few hundred characters at most; anything longer is not one of ours.
MAX_CURSOR_CHARS = 512
_CURSOR_VERSION = 1

_RUN_ID = re.compile(RUN_ID_PATTERN)
_DIGEST = re.compile(DIGEST_PATTERN)


def _check_limit(limit: Any, most: int) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= most:
        raise InvalidArgument(f"limit must be between 1 and {most}, not {limit!r}")
    return limit


def check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or _RUN_ID.match(run_id) is None:
        raise InvalidArgument(f"run_id must match {RUN_ID_PATTERN}")
    return run_id


def check_suspension_id(suspension_id: Any) -> int:
    if not isinstance(suspension_id, int) or isinstance(suspension_id, bool) or suspension_id < 1:
        raise InvalidArgument("suspension_id must be a positive integer")
    return suspension_id


def check_key(run_id: Any, suspension_id: Any, digest: Any) -> None:
    """A pause's evidence key and an admission's request digest, checked before any I/O."""
    check_run_id(run_id)
    check_suspension_id(suspension_id)
    if not isinstance(digest, str) or _DIGEST.match(digest) is None:
        raise InvalidArgument("digest must be the admission's request digest (lowercase hex SHA-256)")


# --- the opaque admission cursor -------------------------------------------------------------------


def encode_cursor(scope: Scope, run_id: str, suspension_id: int) -> str:
    """The position after (run_id, suspension_id), bound to the scope it was issued for.

    It is opaque to callers but not secret or signed: nothing it says grants anything (every page is read
    at the caller's exact scope anyway). Binding the scope makes a cursor carried to another scope a clear
    error instead of a silently wrong page.
    """
    payload = {"a": scope.app, "t": scope.tenant, "r": run_id, "s": suspension_id, "v": _CURSOR_VERSION}
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(scope: Scope, cursor: Any) -> tuple[str, int] | None:
    """The position a cursor names, or None for the empty cursor (the first page).

    Only a cursor this store would issue is accepted: the decoded position is re-encoded and must give back
    the very same text, so a tampered, truncated, re-padded or hand-made cursor is InvalidArgument.
    """
    if cursor is None or cursor == "":
        return None
    bad = InvalidArgument("cursor is not one this store issued (tampered, truncated or from another scope)")
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_CHARS:
        raise bad
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        payload = json.loads(raw.decode("utf-8"))
    except (binascii.Error, ValueError) as exc:
        raise bad from exc
    if not isinstance(payload, dict) or set(payload) != {"a", "t", "r", "s", "v"}:
        raise bad
    run_id, suspension_id = payload["r"], payload["s"]
    if payload["v"] != _CURSOR_VERSION or (payload["a"], payload["t"]) != (scope.app, scope.tenant):
        raise bad
    try:
        check_run_id(run_id)
        check_suspension_id(suspension_id)
    except InvalidArgument as exc:
        raise bad from exc
    if encode_cursor(scope, run_id, suspension_id) != cursor:
        raise bad
    return run_id, suspension_id


# --- rows to records -------------------------------------------------------------------------------


def schema_version_of(row: Out) -> int:
    """A record's schema version; a row written before versions existed has none and is legacy 0."""
    version: int | None = row["schema_version"]
    return LEGACY_SCHEMA_VERSION if version is None else version


def admission_from_row(row: Out, *, fresh: bool = False) -> ResumeAdmission:
    scope = Scope(app=row["app"], tenant=row["tenant"])
    return ResumeAdmission(
        schema_version=schema_version_of(row),
        request=ResumeAdmissionRequest(
            scope=scope,
            version=ClaimVersion(
                run_id=row["run_id"], suspension_id=row["suspension_id"], run_revision=row["pinned_revision"]
            ),
            input=bytes(row["input"]),
        ),
        request_digest=row["request_digest"],
        suspension_digest=row["suspension_digest"],
        claimed_revision=row["claimed_revision"],
        admitted_at=row["admitted_at"],
        fresh=fresh,
    )


def pinned_from_row(row: Out) -> dict[str, Any]:
    """What every evidence record of a pause says of it: its schema version, the pin and the scope."""
    return {
        "schema_version": schema_version_of(row),
        "version": ClaimVersion(
            run_id=row["run_id"], suspension_id=row["suspension_id"], run_revision=row["pinned_revision"]
        ),
        "scope": Scope(app=row["app"], tenant=row["tenant"]),
        "request_digest": row["request_digest"],
    }


def start_from_row(row: Out) -> ResumeStart:
    return ResumeStart(**pinned_from_row(row), started_at=row["started_at"])


def expiry_from_row(row: Out, *, fresh: bool = False) -> ResumeExpiry:
    return ResumeExpiry(
        **pinned_from_row(row),
        event_id=row["event_id"],
        run_revision=row["run_revision"],
        expired_at=row["expired_at"],
        fresh=fresh,
    )


def closure_from_row(row: Out, *, fresh: bool = False) -> ResumeClosure:
    return ResumeClosure(
        request=rows.load_model(ResumeClosureRequest, row["request"], "closure request"),
        request_digest=row["request_digest"],
        event_id=row["event_id"],
        run_revision=row["run_revision"],
        closed_at=row["closed_at"],
        fresh=fresh,
    )


@dataclass(frozen=True)
class AdmissionState:
    """An agent reply's admission as operators see it: which pause, and what became of it."""

    suspension_id: int
    pinned_revision: int
    claimed_revision: int
    admitted_at: datetime
    started_at: datetime | None
    expired_at: datetime | None
    closed_at: datetime | None


class ResumeStore(ScopedReader):
    """Agent-reply resume evidence and the writes that make it, at one exact scope."""

    # --- admission ---------------------------------------------------------------------------------

    async def pause_for(self, version: ClaimVersion) -> Suspension:
        """The live pause ``version`` pins, read and decoded: NotSuspended when there is none, RunConflict
        when the run waits on another."""
        row = await self._found("get_suspension", version.run_id, NotSuspended, f"live pause for run {version.run_id}")
        pause = rows.suspension_from_row(row)
        if pause.id != version.suspension_id:
            raise RunConflict(f"run {version.run_id} is paused on suspension {pause.id}, not {version.suspension_id}")
        return pause

    async def _evidence(self, query: str, what: str, run_id: str, suspension_id: int) -> Out:
        """One evidence row of a pause at this scope, by its named query; ResumeAdmissionNotFound naming
        ``what`` when there is none."""
        check_run_id(run_id)
        check_suspension_id(suspension_id)
        async with self.db.connection() as con:
            row = await con.fetchrow(query, run_id, suspension_id, self.scope.app, self.scope.tenant)
        if row is None:
            raise ResumeAdmissionNotFound(
                f"no {what} for suspension {suspension_id} of run {run_id} at scope {self.scope}"
            )
        return row

    async def get_resume_admission(self, run_id: str, suspension_id: int) -> ResumeAdmission:
        return admission_from_row(await self._evidence("resume_get_admission", "admission", run_id, suspension_id))

    async def latest_resume_admission(self, run_id: str) -> ResumeAdmission:
        """The run's admission with the highest suspension id: its latest admitted pause."""
        check_run_id(run_id)
        row = await self._found(
            "resume_latest_admission", run_id, ResumeAdmissionNotFound, f"admission for run {run_id}"
        )
        return admission_from_row(row)

    async def list_resume_admissions(self, cursor: str, limit: int) -> ResumeAdmissionPage:
        """Exact-scope admission history in (run id, suspension id) order, ``limit`` (1 to
        MAX_ADMISSION_PAGE) at a time. ``cursor`` is "" for the first page, then the page's ``next``;
        ``next`` is "" on the last page."""
        bounded = _check_limit(limit, MAX_ADMISSION_PAGE)
        after = decode_cursor(self.scope, cursor)
        async with self.db.connection() as con:
            found = await con.fetch(
                "resume_list_admissions",
                self.scope.app,
                self.scope.tenant,
                after[0] if after is not None else None,
                after[1] if after is not None else None,
                # One more than asked says whether another page exists, so the last page never hands out a
                # cursor that leads to an empty one.
                bounded + 1,
            )
        page = [admission_from_row(r) for r in found[:bounded]]
        more = len(found) > bounded
        last = page[-1].request.version if page else None
        next_cursor = encode_cursor(self.scope, last.run_id, last.suspension_id) if more and last else ""
        return ResumeAdmissionPage(admissions=page, next=next_cursor)

    async def list_run_admissions(self, run_id: str) -> list[AdmissionState]:
        """Operators: the run's admissions in pause order, each with whether it was started, expired or
        closed."""
        check_run_id(run_id)
        return [stored(AdmissionState, r) for r in await self._run_rows("list_run_admissions", run_id)]

    async def get_resume_start(self, run_id: str, suspension_id: int) -> ResumeStart:
        """A recorded start, never with its suspension: reading a start grants nothing."""
        return start_from_row(await self._evidence("resume_get_start", "start", run_id, suspension_id))

    async def get_resume_expiry(self, run_id: str, suspension_id: int) -> ResumeExpiry:
        return expiry_from_row(await self._evidence("resume_get_expiry", "expiry", run_id, suspension_id))

    async def get_resume_closure(self, run_id: str, suspension_id: int) -> ResumeClosure:
        return closure_from_row(await self._evidence("resume_get_closure", "closure", run_id, suspension_id))

    # --- discovery ---------------------------------------------------------------------------------

    async def list_agent_reply_runs(self, after: str, limit: int) -> list[str]:
        """Run ids at this scope with a retained agent_reply pause (expired and already admitted ones
        included) or a running admission whose pause may be gone, ascending strictly after ``after``
        ("" for the start). ``limit`` must be 1 to 256. Hosts reconcile interrupted execution from here,
        with LatestResumeAdmission."""
        bounded = _check_limit(limit, MAX_DISCOVERY_PAGE)
        if after != "":
            try:
                check_run_id(after)
            except InvalidArgument as exc:
                raise InvalidArgument("after must be a run id, or empty for the first page") from exc
        async with self.db.connection() as con:
            found = await con.fetch("resume_list_agent_reply_runs", self.scope.app, self.scope.tenant, after, bounded)
        return [r["run_id"] for r in found]
