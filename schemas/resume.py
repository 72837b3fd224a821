"""Agent-reply resumes: admission, start, expiry and closure evidence (the original's Resume* types).

A reply from another agent resumes a run in two steps, never one. The ADMISSION claims the pinned
``agent_reply`` pause and keeps the reply's exact bytes; it proves the reply was accepted and grants no
execution. The START is the single grant to execute the admitted continuation. Splitting them is what lets
a worker that crashes between the two be recovered without guessing: an admission with no start can be
started or expired, an admission with a start may have executed and can only be closed, under host proof.

Every record here is evidence bound with the one canonical digest (``schemas.digest``), so a retry after a
lost acknowledgement is recognised by content, and a changed request for the same pause is a conflict
rather than a second claim.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Any, Self

from pydantic import Field, ValidationError, ValidationInfo, model_validator

# Re-exported: resume evidence is where legacy records were first met.
from intermission.schemas.base import LEGACY_SCHEMA_VERSION as LEGACY_SCHEMA_VERSION
from intermission.schemas.base import Model, StrictModel, legacy_schema_version
from intermission.schemas.digest import digest
from intermission.schemas.errors import InputTooLarge, InvalidArgument, UnsupportedSchemaVersion
from intermission.schemas.ids import INT64_MAX, RUN_ID_PATTERN
from intermission.schemas.run import Run
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import MAX_RESUME_INPUT_BYTES, ClaimVersion, Suspension

# The version every resume record is written with. A row written before versions existed has none and
# reads as LEGACY_SCHEMA_VERSION: older evidence is still evidence, so it is never refused as invalid.
RESUME_SCHEMA_VERSION = 1

# A digest as ``schemas.digest`` writes it: lowercase hex SHA-256.
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
_DIGEST = re.compile(DIGEST_PATTERN)
_RUN_ID = re.compile(RUN_ID_PATTERN)

# Bounds on the free-text proof fields of a closure request. They name things (an actor, an issuer, a
# proof document); anything longer is not a name but a payload smuggled into evidence that is kept forever.
MAX_PROOF_FIELD_CHARS = 1024


def input_encoded_size(data: bytes) -> int:
    """The size the 8 MiB limit counts: bytes of the input's JSON-escaped encoding.

    ``data`` is the agent's reply as it travels in ``run.reply``: a JSON string, held here as its UTF-8
    bytes. What is measured is the UTF-8 length of that string's JSON escaping WITHOUT the two surrounding
    quotes, with the escaping of the canonical digest (``json.dumps(..., ensure_ascii=False)``): ``"``,
    ``\\`` and the control characters grow (``\\n`` is 2 bytes, U+0001 is 6), non-ASCII text counts its
    UTF-8 bytes, everything else one byte a character. So 8,388,608 plain ASCII bytes are exactly at the
    limit, and 4,194,304 double quotes are too.

    The limit bounds what is RETAINED and re-published, and escaping is what a reply costs once it is put
    back into JSON; measuring raw bytes would let a reply of quotes and newlines double in size past it.

    Bytes that are not UTF-8 have no JSON string form, so they are refused rather than measured.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument("resume input must be UTF-8 text (a JSON string's contents)") from exc
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8")) - 2


def check_input_size(data: bytes) -> None:
    """Refuse input over MAX_RESUME_INPUT_BYTES encoded, before anything is written."""
    if len(data) > MAX_RESUME_INPUT_BYTES:
        # Escaping never shrinks a character below its UTF-8 length, so input already over the limit raw
        # is refused without encoding it: a hostile 1 GiB reply must not cost a 6 GiB escape first.
        raise InputTooLarge(
            f"resume input is at least {len(data)} bytes encoded; the limit is {MAX_RESUME_INPUT_BYTES}"
        )
    size = input_encoded_size(data)
    if size > MAX_RESUME_INPUT_BYTES:
        raise InputTooLarge(f"resume input is {size} bytes JSON-escaped; the limit is {MAX_RESUME_INPUT_BYTES}")


def _check_version(version: Any) -> ClaimVersion:
    """A ClaimVersion checked again: one built with ``model_construct`` skipped pydantic entirely."""
    if not isinstance(version, ClaimVersion):
        raise InvalidArgument("a claim version is required")
    run_id = getattr(version, "run_id", None)
    if not isinstance(run_id, str) or _RUN_ID.match(run_id) is None:
        raise InvalidArgument(f"run_id must match {RUN_ID_PATTERN}")
    sid = getattr(version, "suspension_id", None)
    if not isinstance(sid, int) or isinstance(sid, bool) or not 1 <= sid <= INT64_MAX:
        raise InvalidArgument("suspension_id must be a positive integer")
    rev = getattr(version, "run_revision", None)
    if not isinstance(rev, int) or isinstance(rev, bool) or not 0 <= rev <= INT64_MAX:
        raise InvalidArgument("run_revision must be a non-negative integer")
    return version


class ResumeAdmissionRequest(Model):
    """Binds the exact agent-reply input to a validated pause.

    ``input`` is bytes, kept and returned exactly, so storage can never re-normalise the reply's JSON (key
    order, escapes, whitespace): the digest of what was admitted must still match what a host later holds.
    """

    model_config = Model.model_config | {"frozen": True}

    scope: Scope
    version: ClaimVersion
    input: bytes

    def digest(self) -> str:
        """``request_digest``: scope, pinned version and input bytes, canonically encoded."""
        return digest(self)

    def check(self, scope: Scope) -> None:
        """Everything checkable without the database, in the order a caller can fix it."""
        require_scope(self.scope)
        if self.scope != scope:
            raise InvalidArgument(f"the request is bound to scope {self.scope}, not the caller's {scope}")
        _check_version(self.version)
        if not isinstance(self.input, bytes):
            raise InvalidArgument("resume input must be bytes")
        check_input_size(self.input)


class ResumeAdmission(Model):
    """The atomic pause claim and its retained input.

    ``fresh`` says only whether THIS call wrote it; it describes the acknowledgement and never grants
    execution permission. That is StartResume's alone.
    """

    schema_version: int
    request: ResumeAdmissionRequest
    request_digest: str
    # The stored suspension as claimed (its transient claimed_run left out).
    suspension_digest: str
    # The run revision the claim produced; a start never changes it.
    claimed_revision: int
    admitted_at: datetime
    fresh: bool = Field(default=False, exclude=True)


class ResumeAdmissionPage(Model):
    """Exact-scope admission history; ``next`` is an opaque cursor, empty on the last page."""

    admissions: list[ResumeAdmission]
    next: str = ""


class ResumeStart(Model):
    """The single grant to execute an admitted resume.

    Only the fresh start a caller actually received carries ``suspension`` (the continuation to execute).
    Observing or retrying a start never hands it out again: whoever got it first is the one executor, and a
    lost acknowledgement must be settled by closure, not by a second execution.
    """

    schema_version: int
    version: ClaimVersion
    scope: Scope
    # The admission's request digest this start was granted for.
    request_digest: str
    started_at: datetime
    fresh: bool = Field(default=False, exclude=True)
    suspension: Suspension | None = Field(default=None, exclude=True)
    # With ``suspension``, on the fresh start only: the run as the grant left it, under the starter's lease.
    run: Run | None = Field(default=None, exclude=True)

    def digest(self) -> str:
        """Binds the retained start without its transient execution authority (``fresh``,
        ``suspension``, ``run``), so the digest a host recomputes from a read equals the executor's."""
        return digest(self)


class ResumeExpiry(Model):
    """Proof that an admitted continuation expired before execution started.

    It grants no execution or retry authority and releases nothing (reservations stay): it is evidence
    that forbids any later start of this admission, and nothing more.
    """

    schema_version: int
    version: ClaimVersion
    scope: Scope
    request_digest: str
    # The run_events row written in the same transaction.
    event_id: uuid.UUID
    # The run's revision when the expiry was recorded; expiry is not a state change and does not bump it.
    run_revision: int
    expired_at: datetime
    fresh: bool = Field(default=False, exclude=True)


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{name} is required")
    if len(value) > MAX_PROOF_FIELD_CHARS:
        raise InvalidArgument(f"{name} is longer than {MAX_PROOF_FIELD_CHARS} characters")


def _check_digest(name: str, value: Any) -> None:
    if not isinstance(value, str) or _DIGEST.match(value) is None:
        raise InvalidArgument(f"{name} must be a lowercase hex SHA-256 digest")


def _check_time(name: str, value: Any) -> None:
    if not isinstance(value, datetime):
        raise InvalidArgument(f"{name} is required")
    if value.tzinfo is None or value.utcoffset() is None:
        # A naive time means whatever the writer's clock zone was; evidence cannot be bound to a guess.
        raise InvalidArgument(f"{name} must carry a time zone")


class ResumeClosureRequest(StrictModel):
    """Closes an uncertain start as incomplete.

    The host must have authenticated permanent quiescence of every original worker and tool, delayed
    actions included, for THIS admission, start and current run revision. A deadline, a stopped local
    process or a digest alone does not prove external work stopped. Closure never accepts output, refunds
    usage, clears effects or permits replay. Unknown fields are refused: this crosses a trust boundary.
    """

    model_config = StrictModel.model_config | {"frozen": True}

    schema_version: int = RESUME_SCHEMA_VERSION
    scope: Scope
    version: ClaimVersion
    # The latest admission's request_digest.
    admission_digest: str
    # ResumeStart.digest() of that admission's start.
    start_digest: str
    # The run's revision as the host observed it; a closure against anything newer is stale.
    run_revision: int
    actor: str
    issuer: str
    issuer_revision: str
    proof_ref: str
    proof_digest: str
    observed_at: datetime
    expires_at: datetime

    # A stored request written before versions existed reads as legacy 0 (and ``freeze`` refuses to close
    # anything new with it), never as the current version.
    @model_validator(mode="after")
    def _legacy(self, info: ValidationInfo) -> Self:
        return legacy_schema_version(self, info)

    def freeze(self) -> tuple[ResumeClosureRequest, str]:
        """Check structure and detach the request; returns the detached copy and its digest.

        It does NOT authenticate the proof: that is the authorizer's job, with the issuer's keys. Checks
        run on the fields as they are, so a request assembled with ``model_construct`` is caught too.
        """
        schema_version = getattr(self, "schema_version", None)
        if schema_version != RESUME_SCHEMA_VERSION:
            raise UnsupportedSchemaVersion(
                f"closure request schema_version {schema_version!r}; this worker reads {RESUME_SCHEMA_VERSION}"
            )
        require_scope(getattr(self, "scope", None))
        _check_version(getattr(self, "version", None))
        _check_digest("admission_digest", getattr(self, "admission_digest", None))
        _check_digest("start_digest", getattr(self, "start_digest", None))
        _check_digest("proof_digest", getattr(self, "proof_digest", None))
        rev = getattr(self, "run_revision", None)
        if not isinstance(rev, int) or isinstance(rev, bool) or not 0 <= rev <= INT64_MAX:
            raise InvalidArgument("run_revision must be a non-negative integer")
        for name in ("actor", "issuer", "issuer_revision", "proof_ref"):
            _check_text(name, getattr(self, name, None))
        _check_time("observed_at", getattr(self, "observed_at", None))
        _check_time("expires_at", getattr(self, "expires_at", None))
        if not self.expires_at > self.observed_at:
            raise InvalidArgument("expires_at must be after observed_at")
        # Re-validating from a dump builds new objects all the way down: the copy shares nothing with the
        # caller's, so what was checked and digested is what gets stored.
        try:
            detached = ResumeClosureRequest.model_validate(self.model_dump())
        except ValidationError as exc:
            raise InvalidArgument(f"closure request is malformed: {exc.error_count()} error(s)") from exc
        return detached, digest(detached)


class ResumeClosure(Model):
    """Immutable evidence of an incomplete terminal transition.

    Its metadata event (``event_id`` in run_events) commits in the same transaction as the run's terminal
    state. ``fresh`` only says whether this call wrote it.
    """

    request: ResumeClosureRequest
    request_digest: str
    event_id: uuid.UUID
    # The run's revision AFTER the closure: the revision of the terminal state it wrote.
    run_revision: int
    closed_at: datetime
    fresh: bool = Field(default=False, exclude=True)

    # pydantic v2 keeps a deprecated v1 classmethod named ``validate``; the original names this check
    # Validate, and nothing in pydantic v2 calls the old one, so the name is taken back on purpose.
    def validate(self) -> None:  # type: ignore[override]
        """Check receipt integrity. It grants no access and no new execution: a receipt that checks out
        is consistent evidence, not permission."""
        _, recomputed = self.request.freeze()
        if recomputed != self.request_digest:
            raise InvalidArgument("closure receipt: request_digest does not match its request")
        if self.run_revision != self.request.run_revision + 1:
            raise InvalidArgument("closure receipt: run_revision must be the revision after the one the request bound")
        if self.event_id.int == 0:
            raise InvalidArgument("closure receipt: event_id is missing")
        _check_time("closed_at", self.closed_at)
