"""The committer over Python dictionaries: the fast tier of tests (procrastinate's InMemoryConnector habit).

``InMemoryCommitter`` runs a family's batch the way its statement does (``store/queries/engine.sql``): each
family's handler is a rendering, line for line, of the plpgsql batch function the statement calls and of
the functions that one calls into (``store/migrations/0016_one_committer.sql`` and the earlier migrations it
builds on), over one dictionary per table. It hands back output rows with the same columns and the same
value types asyncpg yields for them (no codec is installed, ``store/db.py``): jsonb as its text in
PostgreSQL's own output form, timestamptz as an aware UTC ``datetime``, uuid as ``uuid.UUID``, text[] as a
list, bytea as ``bytes``, a composite as a mapping of its columns, and a composite variable a SELECT INTO
found nothing for as a row of NULLs (not NULL: that is what plpgsql returns, and what the decoders see).

What a batch is, as the database makes it:

- its rows apply in order, each seeing what the rows before it wrote;
- a row whose function would raise makes the whole batch raise with what ``store/db.py`` would translate
  the error to, and nothing of the batch stays (the scheduler then runs its transitions one at a time);
- ``atomic``: the output is decoded before the batch commits, and a decode that raises rolls it back;
- ``now()`` is the batch's transaction time, from a ``Clock`` the tests advance (deadlines, leases); every
  batch moves it on by a microsecond, as two transactions never share a start;
- ids come from counters that, like sequences, are not given back by a rollback.

Beside the committer, the few things a worker does to the store outside any transition, over the same
tables, for the fleet's fast tier (``InMemoryFleetStore``): the lease keeper's renewals (``InMemoryLeaseLine``,
the ``renew_leases`` statement of ``store/queries/leases.sql``), the demo ledger (``InMemoryLedger``,
``store/queries/ledger.sql``) and the count of running runs (``count_running``). They match the fleet's
protocols (``fleet/lease.py``'s ``LeaseLine``, ``fleet/runtime.py``'s ``FleetStore``) by their shape: the
engine may not import the fleet.

The conformance suite (``tests/support/conformance.py``) runs the same cases against this committer and
against ``PostgresCommitter``, so that it cannot drift from the real thing. No guarantee about races,
crashes or the broker rests on it: here nothing runs concurrently, nothing crashes, nothing is sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final, NamedTuple, TypeVar

from intermission.engine.committer import Batch, Outs, group_by_position
from intermission.engine.core import Engine
from intermission.engine.transition import Family
from intermission.schemas.errors import InvalidArgument, InvalidState
from intermission.schemas.run import Ending
from intermission.schemas.scope import Scope, require_scope
from intermission.store.db import StoreError
from intermission.store.leases import HeldRun, Renewed
from intermission.store.rows import Out, load_model

T = TypeVar("T")

# One row of a table, or one output row: column name to value. Stored rows are never changed in place
# (an update puts a new dict in their slot), so a batch's snapshot is a shallow copy of each table.
Row = dict[str, Any]
# A run's key, as the tables key everything that names a run: (app, tenant, run id).
Key = tuple[str, str, str]
# An agent-reply pause's evidence key: (app, tenant, run id, suspension id).
EvidenceKey = tuple[str, str, str, int]

# --- the columns of each table, in their order (store/schema.sql) -------------------------------------

RUN_COLUMNS: Final = (
    "id",
    "app",
    "tenant",
    "agent_id",
    "state",
    "revision",
    "lease_owner",
    "lease_expires_at",
    "input",
    "output",
    "error",
    "session_id",
    "config",
    "script",
    "pause_ttl_seconds",
    "start_digest",
    "step_count",
    "tokens_used",
    "created_at",
    "updated_at",
    "ended_at",
    "ending",
)
SUSPENSION_COLUMNS: Final = (
    "id",
    "run_id",
    "app",
    "tenant",
    "reason",
    "pending",
    "continuation",
    "checkpoint_id",
    "approvers",
    "expires_at",
    "created_at",
)
PROGRESS_COLUMNS: Final = (
    "run_id",
    "app",
    "tenant",
    "owner",
    "continuation",
    "started",
    "done",
    "ending",
    "updated_at",
    "approved",
)
ADMISSION_COLUMNS: Final = (
    "run_id",
    "suspension_id",
    "app",
    "tenant",
    "schema_version",
    "pinned_revision",
    "input",
    "request_digest",
    "suspension_digest",
    "claimed_revision",
    "admitted_at",
)
START_COLUMNS: Final = (
    "run_id",
    "suspension_id",
    "app",
    "tenant",
    "schema_version",
    "pinned_revision",
    "request_digest",
    "started_at",
)
EXPIRY_COLUMNS: Final = (
    "run_id",
    "suspension_id",
    "app",
    "tenant",
    "schema_version",
    "pinned_revision",
    "request_digest",
    "event_id",
    "run_revision",
    "expired_at",
)
CLOSURE_COLUMNS: Final = (
    "run_id",
    "suspension_id",
    "app",
    "tenant",
    "schema_version",
    "request",
    "request_digest",
    "event_id",
    "run_revision",
    "closed_at",
)

RUN_STATES: Final = frozenset({"created", "running", "paused", "completed", "failed", "cancelled"})
SUSPEND_REASONS: Final = frozenset({"approval", "external_tool", "agent_reply"})
CHECKPOINT_STATES: Final = frozenset({"pending", "approved", "denied", "rejected"})

_RUN_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SCOPE_PART = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The 8 MiB a resume admission's input may hold (resume_admissions_input_check).
_MAX_ADMISSION_INPUT: Final = 8_388_608
# Two transactions never start at the same instant: every batch moves the clock on by this much.
_TICK: Final = timedelta(microseconds=1)


def _nulls(columns: Iterable[str]) -> Row:
    """What a plpgsql composite variable holds after a SELECT INTO that found nothing: a row whose every
    column is NULL. It is returned as such (asyncpg decodes it as a record of Nones), never as NULL."""
    return dict.fromkeys(columns)


def _into(found: Row | None, columns: Iterable[str]) -> Row:
    """``SELECT x.* INTO v``: the row found (a copy), or a row of NULLs."""
    return _copy(found) if found is not None else _nulls(columns)


def _copy(row: Row) -> Row:
    """A row as handed out: its own dict, and its own list for an array column."""
    return {k: list(v) if isinstance(v, list) else v for k, v in row.items()}


def _maybe(row: Row | None) -> Row | None:
    return _copy(row) if row is not None else None


# --- errors as store/db.py translates the database's ------------------------------------------------


def _sqlstate(code: str, what: str) -> StoreError:
    """What ``store/db.py`` makes of an error it has no typed translation for."""
    return StoreError(f"database error {code} ({what}, in memory)")


def _invalid_state(message: str) -> InvalidState:
    """A transition function's RAISE ... ERRCODE 'IM409' (``store/db.py``: InvalidState)."""
    return InvalidState(message)


def _bad_text() -> InvalidArgument:
    return InvalidArgument("text must be valid UTF-8 without U+0000 (NUL)")


# --- jsonb, as PostgreSQL reads and writes it -------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise _sqlstate("22P02", f"invalid input syntax for type json: {name}")


def _last_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # jsonb keeps the last of duplicate keys.
    return dict(pairs)


def parse_jsonb(text: str) -> Any:
    """``text::jsonb``: numbers kept exactly (as ``Decimal`` when they are not integers), or the error the
    database raises. PostgreSQL refuses NaN and Infinity, and the escape of U+0000 (22P05, which
    ``store/db.py`` translates to InvalidArgument)."""
    _check_text(text)
    try:
        value = json.loads(text, parse_float=Decimal, parse_constant=_reject_constant, object_pairs_hook=_last_wins)
    except json.JSONDecodeError as exc:
        raise _sqlstate("22P02", "invalid input syntax for type json") from exc
    _check_json_text(value)
    return value


def _check_json_text(value: Any) -> None:
    waiting = [value]
    while waiting:
        item = waiting.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_text(key)
                waiting.append(inner)
        elif isinstance(item, list):
            waiting.extend(item)


def _check_text(text: str) -> None:
    # What store/db.py makes of 22021 (a NUL in text) and 22P05 (the escape of one in jsonb) alike.
    if "\x00" in text:
        raise _bad_text()
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        # A lone surrogate is no UTF-8: the database refuses it.
        raise _bad_text()


def _key_order(key: str) -> tuple[int, bytes]:
    # jsonb keeps an object's keys shorter first, then by their bytes.
    encoded = key.encode()
    return (len(encoded), encoded)


def render_jsonb(value: Any) -> str:
    """A parsed JSON value as ``jsonb::text`` writes it: keys shorter first then by bytes, ``", "`` and
    ``": "`` between items, numbers in ``numeric``'s form, strings escaped as ``escape_json`` does."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _numeric(value)
    if isinstance(value, Decimal):
        return format(value.copy_abs() if value.is_zero() else value, "f")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, datetime):
        return json.dumps(json_timestamp(value))
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda item: _key_order(item[0]))
        return "{" + ", ".join(f"{render_jsonb(k)}: {render_jsonb(v)}" for k, v in items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(render_jsonb(v) for v in value) + "]"
    raise TypeError(f"no jsonb for {type(value).__name__}")


def jsonb(text: str) -> str:
    """``text::jsonb::text``: the text the database hands back for ``text`` stored as jsonb."""
    return render_jsonb(parse_jsonb(text))


def _numeric(value: float) -> str:
    """A float8 as jsonb_build_object stores it: its shortest text, read as numeric."""
    if value != value or value in (float("inf"), float("-inf")):
        raise _sqlstate("22P02", "NaN and Infinity are no json numbers")
    if value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f")


def json_timestamp(value: datetime) -> str:
    """A timestamptz as to_json writes it in a UTC session: ISO 8601, fractional seconds without their
    trailing zeros, ``+00:00``."""
    at = value.astimezone(UTC)
    text = at.strftime("%Y-%m-%dT%H:%M:%S")
    if at.microsecond:
        text += f".{at.microsecond:06d}".rstrip("0")
    return text + "+00:00"


# --- the clock ----------------------------------------------------------------------------------------


class Clock:
    """The database clock of an in-memory store: it moves only when told (``advance``), and by a
    microsecond at the start of every batch."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = _utc(start) if start is not None else datetime.now(UTC)

    def now(self) -> datetime:
        """``now()`` as a statement started at this moment would see it."""
        return self._now

    def advance(self, seconds: float) -> datetime:
        """Let ``seconds`` pass (leases lapse, deadlines pass); the new time."""
        if seconds < 0:
            raise ValueError("the clock does not go back")
        self._now += timedelta(seconds=seconds)
        return self._now

    def transaction(self) -> datetime:
        """The start of a new transaction: ``now()`` for the whole of it."""
        self._now += _TICK
        return self._now


def _utc(value: datetime) -> datetime:
    # asyncpg sends a naive datetime for timestamptz as UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _interval(seconds: float | None) -> timedelta | None:
    """``make_interval(secs => seconds)``: NULL for NULL."""
    return None if seconds is None else timedelta(seconds=seconds)


def _plus(at: datetime, seconds: float | None) -> datetime | None:
    delta = _interval(seconds)
    return None if delta is None else at + delta


# --- the tables ----------------------------------------------------------------------------------------


@dataclass
class Tables:
    """Every table a batch function touches, keyed by its primary key; and ``demo_charges``, which the demo's
    ``charge`` tool writes outside any transition (``InMemoryLedger``)."""

    runs: dict[Key, Row] = field(default_factory=dict)
    suspensions: dict[int, Row] = field(default_factory=dict)
    checkpoints: dict[int, Row] = field(default_factory=dict)
    progress: dict[Key, Row] = field(default_factory=dict)
    run_events: dict[int, Row] = field(default_factory=dict)
    outbox: dict[int, Row] = field(default_factory=dict)
    inbox: dict[tuple[str, str, str], Row] = field(default_factory=dict)
    session_messages: dict[int, Row] = field(default_factory=dict)
    resume_admissions: dict[EvidenceKey, Row] = field(default_factory=dict)
    resume_starts: dict[EvidenceKey, Row] = field(default_factory=dict)
    resume_expiries: dict[EvidenceKey, Row] = field(default_factory=dict)
    resume_closures: dict[EvidenceKey, Row] = field(default_factory=dict)
    scope_quotas: dict[tuple[str, str], Row] = field(default_factory=dict)
    scope_start_buckets: dict[tuple[str, str], Row] = field(default_factory=dict)
    demo_charges: dict[int, Row] = field(default_factory=dict)

    def copy(self) -> Tables:
        """What a rollback goes back to: rows are never changed in place, so copying each table's dict is
        enough."""
        return Tables(**{f.name: dict(getattr(self, f.name)) for f in fields(self)})

    def restore(self, snapshot: Tables) -> None:
        """Go back to ``snapshot`` (a rollback), in place: whoever holds a table's dict sees it rolled back."""
        for f in fields(self):
            table: dict[Any, Row] = getattr(self, f.name)
            table.clear()
            table.update(getattr(snapshot, f.name))

    def pause_of(self, key: Key) -> Row | None:
        """The run's live pause (at most one: suspensions_one_per_run)."""
        app, tenant, run_id = key
        for pause in self.suspensions.values():
            if pause["run_id"] == run_id and pause["app"] == app and pause["tenant"] == tenant:
                return pause
        return None


@dataclass
class Sequences:
    """The sequences and identity columns: what they hand out is never given back, rollback or not."""

    suspension_ids: int = 0
    checkpoints: int = 0
    outbox: int = 0
    run_events: int = 0
    session_messages: int = 0
    demo_charges: int = 0

    def next(self, name: str) -> int:
        value: int = getattr(self, name) + 1
        setattr(self, name, value)
        return value


@dataclass
class _Txn:
    """One batch's transaction: its ``now()`` and the outbox hold its statement set (migration 0009)."""

    now: datetime
    hold: float | None


# --- what each family's composite takes (the rest is text, numbers, booleans) ------------------------

_JSONB: Final[dict[str, frozenset[str]]] = {
    "claim": frozenset(
        {"first_continuation", "first_started", "first_done", "first_ending", "first_approved", "event_headers"}
    ),
    "start": frozenset({"config", "script", "first_continuation"}),
    "save": frozenset({"continuation", "started", "done", "ending", "approved"}),
    "pause": frozenset({"pending", "continuation", "event_headers"}),
    "end": frozenset({"messages", "run_event_data", "event_headers"}),
    "ending": frozenset({"ending"}),
    "admit": frozenset({"first_continuation", "first_done", "event_headers"}),
    "start_resume": frozenset({"first_continuation", "first_done"}),
    "close": frozenset({"request", "run_event_data", "event_headers"}),
    "take_over": frozenset({"first_continuation", "first_started", "first_done", "first_ending", "first_approved"}),
    "create_pause": frozenset({"pending", "continuation"}),
}
_ENUMS: Final[dict[str, dict[str, frozenset[str]]]] = {
    "claim": {"reason": SUSPEND_REASONS},
    "pause": {"reason": SUSPEND_REASONS},
    "create_pause": {"reason": SUSPEND_REASONS},
    "end": {"state": RUN_STATES},
}
_UUIDS: Final = frozenset({"event_message_id", "run_event_id", "event_id"})


def _encoded(family: Family, row: NamedTuple) -> Row:
    """A composite row as the database receives it, or the error it refuses it with (before anything of the
    batch runs: asyncpg sends the whole array at once)."""
    jsonb_fields = _JSONB.get(family.name, frozenset())
    enums = _ENUMS.get(family.name, {})
    values: Row = {}
    for name, value in row._asdict().items():
        if value is None:
            values[name] = None
        elif name in jsonb_fields:
            values[name] = jsonb(value)
        elif name in enums:
            if value not in enums[name]:
                raise _sqlstate("22P02", f"invalid input value for enum: {value!r}")
            values[name] = value
        elif name in _UUIDS:
            values[name] = value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
        elif isinstance(value, str):
            _check_text(value)
            values[name] = value
        elif isinstance(value, datetime):
            values[name] = _utc(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    _check_text(item)
            values[name] = list(value)
        else:
            values[name] = value
    return values


# A family's handler: one encoded input row to the output rows it produces (without ``n``).
Handler = Callable[[_Txn, Row], list[Row]]


def _record_evidence(table: dict[Any, Row], table_name: str, key: Any, p: Row, **columns: Any) -> Row:
    """Insert one record of a reply's evidence (an expiry, a closure): the pause it is about, at its scope,
    in the record format it was written in, then ``columns``; its event id unique in its table, as the
    table's unique key makes it."""
    if any(row["event_id"] == columns["event_id"] for row in table.values()):
        raise _sqlstate("23505", f"{table_name}_event_id_key")
    record = {name: p[name] for name in ("run_id", "suspension_id", "app", "tenant", "schema_version")}
    record.update(columns)
    table[key] = record
    return record


class InMemoryCommitter:
    """The ``Committer`` over dictionaries (see the module docstring). ``tables`` is the store's state, for
    tests to read (never to write behind a transition's back, but for what no transition does: an
    operator's quota, a relay's quarantine)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.tables = Tables()
        self.sequences = Sequences()
        # How many statements each family ran, and how many of them raised (for tests).
        self.statements: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self._handlers: dict[str, Handler] = {
            "read_for_commands": self._read_for_commands,
            "read_evidence": self._read_evidence,
            "read_session": self._read_session,
            "draw": self._draw,
            "claim": self._claim,
            "start": self._start,
            "save": self._save,
            "pause": self._pause,
            "end": self._end,
            "ending": self._ending,
            "admit": self._admit,
            "start_resume": self._start_resume,
            "expire_admission": self._expire_admission,
            "close": self._close,
            "deadline": self._deadline,
            "take_over": self._take_over,
            "create_pause": self._create_pause,
            "delete_pause": self._delete_pause,
            "delete_progress": self._delete_progress,
            "release": self._release,
            "retry_outbox": self._retry_outbox,
        }

    @property
    def families(self) -> frozenset[str]:
        """The names of the families this committer runs."""
        return frozenset(self._handlers)

    async def commit(self, batch: Batch, decode: Callable[[Outs], T]) -> T:
        family, rows, hold, atomic = batch.family, batch.rows, batch.hold, batch.atomic
        handler = self._handlers.get(family.name)
        if handler is None:
            raise NotImplementedError(
                f"the in-memory committer does not run family {family.name!r} (statement {family.statement!r})"
            )
        # A statement is a round trip: whatever else is submitted meanwhile waits for the next batch.
        await asyncio.sleep(0)
        self.statements[family.name] = self.statements.get(family.name, 0) + 1
        before = self.tables.copy()
        txn = _Txn(self.clock.transaction(), hold if family.held else None)
        try:
            encoded = [_encoded(family, row) for row in rows]
            found: list[Out] = []
            for n, values in enumerate(encoded, start=1):
                found.extend({"n": n, **out} for out in handler(txn, values))
            outs = group_by_position(found, len(rows))
        except BaseException:
            self.failed[family.name] = self.failed.get(family.name, 0) + 1
            self.tables.restore(before)
            raise
        if not atomic:
            # Autocommitted before its rows are decoded: a decode that fails changes nothing written.
            return decode(outs)
        try:
            return decode(outs)
        except BaseException:
            self.tables.restore(before)
            raise

    # --- what no transition does: an operator's quotas, a relay's work ----------------------------------

    def set_quota(self, app: str, tenant: str, live_runs: int | None, starts_per_second: float | None) -> None:
        """A scope's own quotas (``set_quota``; None: the fleet's default)."""
        self.tables.scope_quotas[(app, tenant)] = {
            "app": app,
            "tenant": tenant,
            "live_runs": live_runs,
            # double precision: a float, whatever number it was given as.
            "starts_per_second": None if starts_per_second is None else float(starts_per_second),
            "updated_at": self.clock.now(),
        }

    def quarantine(self, outbox_id: int, error: str = "refused") -> None:
        """Set an outbox row aside as a relay does once the broker refused it too often."""
        row = self.tables.outbox[outbox_id]
        self.tables.outbox[outbox_id] = {
            **row,
            "attempts": row["attempts"] + 1,
            "quarantined_at": self.clock.now(),
            "last_error": error,
        }

    def mark_sent(self, outbox_id: int) -> None:
        """Mark an outbox row sent, as a relay does after the broker's confirm."""
        self.tables.outbox[outbox_id] = {**self.tables.outbox[outbox_id], "sent_at": self.clock.now()}

    # --- what a worker runs outside the committer: renewals, the demo ledger, a count ------------------

    def renew_leases(self, owner: str, ttl_seconds: float, held: Iterable[HeldRun]) -> list[Row]:
        """``renew_leases`` (``store/queries/leases.sql``) in a transaction of its own: each run of ``held``
        still running under ``owner``'s live lease gets ``now() + ttl``; a row (id, app, tenant, ending as
        jsonb text) per run renewed. Nothing else of the run changes (not even ``updated_at``)."""
        # Text reaches the database as text: what it refuses, it refuses before anything is read.
        _check_text(owner)
        wanted = {(h.scope.app, h.scope.tenant, h.run_id) for h in held}
        for key in wanted:
            for part in key:
                _check_text(part)
        now = self.clock.transaction()
        before = self.tables.copy()
        renewed: list[Row] = []
        try:
            # The statement locks and renews in key order; nothing runs beside it here, but its answer keeps
            # that order too.
            for key in sorted(wanted):
                run = self.tables.runs.get(key)
                if run is None or not self._renewable(run, owner, now):
                    continue
                self._put_run({**run, "lease_expires_at": _plus(now, ttl_seconds)})
                renewed.append({"id": run["id"], "app": run["app"], "tenant": run["tenant"], "ending": run["ending"]})
        except BaseException:
            self.tables.restore(before)
            raise
        return renewed

    @staticmethod
    def _renewable(run: Row, owner: str, now: datetime) -> bool:
        # WHERE r.state = 'running' AND $1 <> '' AND r.lease_owner = $1 AND r.lease_expires_at > now(): a
        # lease that lapsed is not renewed even for its own holder (another worker may be taking it).
        expires: datetime | None = run["lease_expires_at"]
        return (
            run["state"] == "running"
            and owner != ""
            and run["lease_owner"] == owner
            and expires is not None
            and expires > now
        )

    def charge(self, scope: Scope, run_id: str, call_id: str, amount: Decimal) -> int:
        """``insert_demo_charge``: one row per call, never refused for a repeat (a call that ran twice must
        show as two rows); its id, the receipt."""
        for text in (scope.app, scope.tenant, run_id, call_id):
            _check_text(text)
        receipt = self.sequences.next("demo_charges")
        self.tables.demo_charges[receipt] = {
            "id": receipt,
            "app": scope.app,
            "tenant": scope.tenant,
            "run_id": run_id,
            "call_id": call_id,
            "amount": amount,
            # clock_timestamp(): the statement's own moment, which no transaction here has begun.
            "charged_at": self.clock.now(),
        }
        return receipt

    def times_charged(self, scope: Scope, run_id: str) -> dict[str, int]:
        """``count_demo_charges``: how many times each call of the run was charged, at its exact scope."""
        counts: dict[str, int] = {}
        for row in self.tables.demo_charges.values():
            if (row["app"], row["tenant"], row["run_id"]) == (scope.app, scope.tenant, run_id):
                counts[row["call_id"]] = counts.get(row["call_id"], 0) + 1
        return dict(sorted(counts.items()))

    def count_running(self) -> int:
        """``count_running``'s ``running``: the runs running in any scope, under a live lease or not."""
        return sum(1 for run in self.tables.runs.values() if run["state"] == "running")

    # --- the reads ------------------------------------------------------------------------------------

    def _read_for_commands(self, t: _Txn, a: Row) -> list[Row]:
        key = (a["app"], a["tenant"], a["run_id"])
        run = self.tables.runs.get(key)
        pause = self.tables.pause_of(key) if run is not None else None
        recorded = (
            self.tables.inbox.get((a["app"], a["tenant"], a["message_id"])) if a["message_id"] is not None else None
        )
        checkpoint = self.tables.checkpoints.get(a["checkpoint_id"]) if a["checkpoint_id"] is not None else None
        if checkpoint is not None and (
            run is None or (checkpoint["app"], checkpoint["tenant"], checkpoint["run_id"]) != key
        ):
            checkpoint = None
        return [
            {
                "run": _maybe(run),
                "pause": _maybe(pause),
                "i_routing_key": recorded["routing_key"] if recorded is not None else None,
                "i_body_digest": recorded["body_digest"] if recorded is not None else None,
                "i_outcome": recorded["outcome"] if recorded is not None else None,
                "k_state": checkpoint["state"] if checkpoint is not None else None,
            }
        ]

    def _read_evidence(self, t: _Txn, a: Row) -> list[Row]:
        key = (a["app"], a["tenant"], a["run_id"], a["suspension_id"])
        of_run = [
            row
            for (app, tenant, run_id, _), row in self.tables.resume_admissions.items()
            if (app, tenant, run_id) == key[:3]
        ]
        latest = max(of_run, key=lambda row: row["suspension_id"]) if of_run else None
        return [
            {
                "admission": _maybe(self.tables.resume_admissions.get(key)),
                "latest": _maybe(latest),
                "start": _maybe(self.tables.resume_starts.get(key)),
            }
        ]

    def _read_session(self, t: _Txn, a: Row) -> list[Row]:
        most = a["most"]
        if most is not None and most < 0:
            raise _sqlstate("2201W", "LIMIT must not be negative")
        found = sorted(
            (
                row
                for row in self.tables.session_messages.values()
                if (row["app"], row["tenant"], row["session_id"]) == (a["app"], a["tenant"], a["session_id"])
            ),
            key=lambda row: row["id"],
        )
        recent = found if most is None else found[max(0, len(found) - most) :]
        return [{"message": row["message"]} for row in recent]

    def _draw(self, t: _Txn, a: Row) -> list[Row]:
        suspension_id = self.sequences.next("suspension_ids")
        checkpoint_id = self.sequences.next("checkpoints") if a["approval"] else None
        return [{"suspension_id": suspension_id, "checkpoint_id": checkpoint_id, "db_now": t.now}]

    # --- the rows every transition writes ------------------------------------------------------------

    def _check_run(self, row: Row) -> Row:
        """The runs table's constraints (store/migrations/0001, 0005), as the database checks a row it is
        about to write."""
        for column in ("id", "app", "tenant", "agent_id", "state", "revision", "input", "session_id", "config"):
            if row[column] is None:
                raise _sqlstate("23502", f"runs.{column} must not be NULL")
        checks = (
            _RUN_ID.fullmatch(row["id"]) is not None,
            _SCOPE_PART.fullmatch(row["app"]) is not None,
            _SCOPE_PART.fullmatch(row["tenant"]) is not None,
            1 <= len(row["agent_id"]) <= 128,
            row["pause_ttl_seconds"] >= 0,
            (row["lease_owner"] is None) == (row["lease_expires_at"] is None),
            row["lease_owner"] is None or row["state"] == "running",
            row["lease_owner"] is None or row["lease_owner"] != "",
            row["ending"] is None or row["state"] == "running",
        )
        if not all(checks):
            raise _sqlstate("23514", "a check constraint of runs")
        return row

    def _put_run(self, row: Row) -> Row:
        self.tables.runs[(row["app"], row["tenant"], row["id"])] = self._check_run(row)
        return row

    def _record_inbox(self, t: _Txn, a: Row) -> bool:
        """``INSERT INTO inbox ... ON CONFLICT (app, tenant, message_id) DO NOTHING RETURNING 1``: whether it
        was recorded (False: a record was there)."""
        if a["routing_key"] is None or a["digest"] is None:
            raise _sqlstate("23502", "inbox.routing_key and body_digest must not be NULL")
        key = (a["app"], a["tenant"], a["message_id"])
        if key in self.tables.inbox:
            return False
        self.tables.inbox[key] = {
            "message_id": a["message_id"],
            "routing_key": a["routing_key"],
            "body_digest": a["digest"],
            "outcome": "applied",
            "app": a["app"],
            "tenant": a["tenant"],
            "run_id": a["run_id"],
            "recorded_at": t.now,
        }
        return True

    def _recorded_command(self, app: str, tenant: str, message_id: str, routing_key: str, digest: str) -> str:
        """``intermission_recorded_command_v1`` (migration 0005)."""
        before = self.tables.inbox.get((app, tenant, message_id))
        if before is not None and before["body_digest"] == digest and before["routing_key"] == routing_key:
            return "duplicate"
        return "message_id_conflict"

    def _forget_inbox(self, app: str, tenant: str, message_id: str) -> None:
        self.tables.inbox.pop((app, tenant, message_id), None)

    def _write_progress(
        self,
        t: _Txn,
        key: Key,
        owner: str | None,
        continuation: str | None,
        started: str | None,
        done: str | None,
        ending: str | None,
        approved: str | None,
    ) -> datetime:
        """``intermission_write_progress_v1`` (migration 0015): the snapshot upserted, an ending it holds
        kept."""
        if owner is None or continuation is None:
            raise _sqlstate("23502", "progress.owner and continuation must not be NULL")
        if owner == "":
            raise _sqlstate("23514", "progress_owner_check")
        if key not in self.tables.runs:
            raise _sqlstate("23503", "progress_run_fkey")
        before = self.tables.progress.get(key)
        app, tenant, run_id = key
        self.tables.progress[key] = {
            "run_id": run_id,
            "app": app,
            "tenant": tenant,
            "owner": owner,
            "continuation": continuation,
            "started": started if started is not None else "[]",
            "done": done if done is not None else "[]",
            "ending": before["ending"] if before is not None and before["ending"] is not None else ending,
            "updated_at": t.now,
            "approved": approved if approved is not None else "[]",
        }
        return t.now

    def _add_outbox(self, t: _Txn, a: Row, key: Key) -> None:
        """An event's outbox row, held for the sink when the statement set a hold (migration 0009)."""
        outbox_id = self.sequences.next("outbox")
        for column in ("event_message_id", "event_routing_key", "event_body", "event_headers"):
            if a[column] is None:
                raise _sqlstate("23502", f"outbox: {column} must not be NULL")
        if any(row["message_id"] == a["event_message_id"] for row in self.tables.outbox.values()):
            raise _sqlstate("23505", "outbox_message_id_key")
        app, tenant, run_id = key
        self.tables.outbox[outbox_id] = {
            "id": outbox_id,
            "message_id": a["event_message_id"],
            "routing_key": a["event_routing_key"],
            "body": a["event_body"],
            "correlation_id": a["event_correlation_id"],
            "headers": a["event_headers"],
            "app": app,
            "tenant": tenant,
            "run_id": run_id,
            "created_at": t.now,
            "sent_at": None,
            "attempts": 0,
            "next_attempt_at": _plus(t.now, t.hold),
            "quarantined_at": None,
            "last_error": None,
        }

    def _add_run_event(
        self, t: _Txn, event_id: uuid.UUID | None, key: Key, kind: str, revision: int, data: str | None
    ) -> None:
        row_id = self.sequences.next("run_events")
        if event_id is None or data is None:
            raise _sqlstate("23502", "run_events.event_id and data must not be NULL")
        if any(row["event_id"] == event_id for row in self.tables.run_events.values()):
            raise _sqlstate("23505", "run_events_event_id_key")
        app, tenant, run_id = key
        self.tables.run_events[row_id] = {
            "id": row_id,
            "event_id": event_id,
            "run_id": run_id,
            "app": app,
            "tenant": tenant,
            "kind": kind,
            "revision": revision,
            "data": data,
            "created_at": t.now,
        }

    def _insert_pause(self, row: Row) -> Row:
        """A suspensions row, under its primary key and at most one per run (suspensions_one_per_run)."""
        for column in ("run_id", "app", "tenant", "reason", "pending", "continuation", "approvers"):
            if row[column] is None:
                raise _sqlstate("23502", f"suspensions.{column} must not be NULL")
        key = (row["app"], row["tenant"], row["run_id"])
        if row["id"] in self.tables.suspensions or self.tables.pause_of(key) is not None:
            raise _UniqueViolation("suspensions_pkey or suspensions_one_per_run")
        if key not in self.tables.runs:
            raise _sqlstate("23503", "suspensions_run_fkey")
        self.tables.suspensions[row["id"]] = row
        return row

    def _drop_pause(self, key: Key) -> bool:
        """``DELETE FROM suspensions`` of the run: whether there was one."""
        pause = self.tables.pause_of(key)
        if pause is None:
            return False
        del self.tables.suspensions[pause["id"]]
        return True

    # --- claims: intermission_claim_pause_v1 (migration 0015) -----------------------------------------

    def _claim(self, t: _Txn, c: Row) -> list[Row]:
        return [self._claim_pause(t, c)]

    def _claim_pause(self, t: _Txn, c: Row) -> Row:
        key = (c["app"], c["tenant"], c["run_id"])
        v_revision = c["revision"]
        if c["suspension_id"] is None:
            current = self.tables.runs.get(key)
            v_revision = current["revision"] if current is not None else None
        # The statement's parts all see the tables as they stood when it began (one snapshot), but for the
        # inbox record, whose RETURNING the claim reads.
        recorded = self._record_inbox(t, c) if c["message_id"] is not None else False
        run = self.tables.runs.get(key)
        pause = self.tables.pause_of(key)
        if (
            run is not None
            and run["state"] == "paused"
            and v_revision is not None
            and run["revision"] == v_revision
            and (c["message_id"] is None or recorded)
            and pause is not None
            and (c["suspension_id"] is None or pause["id"] == c["suspension_id"])
            and (c["reason"] is None or pause["reason"] == c["reason"])
            and self._claimable(t, pause, c["expired_by"])
        ):
            return self._claimed(t, c, key, run, pause)
        if c["message_id"] is not None:
            if not recorded:
                return _claim_out(
                    self._recorded_command(c["app"], c["tenant"], c["message_id"], c["routing_key"], c["digest"])
                )
            # Refused: nothing of this command stays, not even its inbox record.
            self._forget_inbox(c["app"], c["tenant"], c["message_id"])
        found_run = _into(self.tables.runs.get(key), RUN_COLUMNS)
        found_pause = _into(self.tables.pause_of(key), SUSPENSION_COLUMNS)
        return _claim_out(
            _claim_refusal(t, c, found_run, found_pause),
            revision=found_run["revision"],
            suspension_id=found_pause["id"],
            expires_at=found_pause["expires_at"],
            run=found_run,
            pause=found_pause,
        )

    @staticmethod
    def _claimable(t: _Txn, pause: Row, expired_by: datetime | None) -> bool:
        expires_at: datetime | None = pause["expires_at"]
        if expired_by is None:
            return expires_at is None or expires_at > t.now
        return expires_at is not None and expires_at <= min(expired_by, t.now)

    def _claimed(self, t: _Txn, c: Row, key: Key, run: Row, pause: Row) -> Row:
        owner = c["lease_owner"]
        moved = self._put_run(
            {
                **run,
                "state": "running",
                "revision": run["revision"] + 1,
                "updated_at": t.now,
                "lease_owner": owner,
                "lease_expires_at": None if owner is None else _plus(t.now, c["lease_ttl"]),
            }
        )
        first_updated_at = None
        if c["first"]:
            first_updated_at = self._write_progress(
                t,
                key,
                owner,
                c["first_continuation"] if c["first_continuation"] is not None else pause["continuation"],
                c["first_started"],
                c["first_done"],
                c["first_ending"],
                c["first_approved"],
            )
        if c["drop_pause"]:
            self._drop_pause(key)
        decided = False
        checkpoint = self.tables.checkpoints.get(c["checkpoint_id"]) if c["checkpoint_id"] is not None else None
        if (
            checkpoint is not None
            and (checkpoint["app"], checkpoint["tenant"], checkpoint["run_id"]) == key
            and checkpoint["state"] == "pending"
        ):
            if c["checkpoint_state"] not in CHECKPOINT_STATES:
                raise _sqlstate("23514", "checkpoints_state_check")
            self.tables.checkpoints[checkpoint["id"]] = {
                **checkpoint,
                "state": c["checkpoint_state"],
                "decided_by": c["decided_by"],
                "reason": c["decision_reason"],
                "decided_at": t.now,
            }
            decided = True
        if c["event_message_id"] is not None:
            self._add_outbox(t, c, key)
        if c["checkpoint_id"] is not None and not decided:
            raise _invalid_state(f"checkpoint {c['checkpoint_id']} is not pending")
        return _claim_out(
            "claimed",
            revision=moved["revision"],
            lease_owner=moved["lease_owner"],
            lease_expires_at=moved["lease_expires_at"],
            updated_at=moved["updated_at"],
            suspension_id=pause["id"],
            expires_at=pause["expires_at"],
            first_updated_at=first_updated_at,
            run=_copy(moved) if c["whole"] else None,
            pause=_copy(pause) if c["whole"] else None,
        )

    # --- starts: intermission_start_run_v2 (migration 0014) over _v1 (migration 0015) ------------------

    def _start(self, t: _Txn, c: Row) -> list[Row]:
        scope = (c["app"], c["tenant"])
        quota = self.tables.scope_quotas.get(scope)
        live_limit = _coalesce(quota["live_runs"] if quota else None, c["default_live_runs"], 0)
        rate = _coalesce(quota["starts_per_second"] if quota else None, c["default_starts_per_second"], 0)
        recorded_before = c["message_id"] is not None and (c["app"], c["tenant"], c["message_id"]) in self.tables.inbox
        if (live_limit > 0 or rate > 0) and not recorded_before:
            bucket = self.tables.scope_start_buckets.setdefault(
                scope, {"app": c["app"], "tenant": c["tenant"], "tokens": float(max(rate, 1)), "refilled_at": t.now}
            )
            if live_limit > 0:
                live = sum(
                    1
                    for (app, tenant, _), run in self.tables.runs.items()
                    if (app, tenant) == scope and run["ended_at"] is None
                )
                if live >= live_limit:
                    return [{"outcome": "quota_live_runs", "run": None, "first_updated_at": None}]
            if rate > 0:
                # The bucket refills at the rate, up to one second's worth (at least one start).
                elapsed = (t.now - bucket["refilled_at"]).total_seconds()
                tokens = min(float(max(rate, 1)), bucket["tokens"] + elapsed * rate)
                if tokens < 1:
                    return [{"outcome": "quota_starts_per_second", "run": None, "first_updated_at": None}]
                self.tables.scope_start_buckets[scope] = {**bucket, "tokens": tokens - 1, "refilled_at": t.now}
        return [self._start_run(t, c)]

    def _start_run(self, t: _Txn, c: Row) -> Row:
        key = (c["app"], c["tenant"], c["run_id"])
        recorded = self._record_inbox(t, c) if c["message_id"] is not None else False
        if (c["message_id"] is None or recorded) and key not in self.tables.runs:
            owner = c["lease_owner"]
            created = self._put_run(
                {
                    "id": c["run_id"],
                    "app": c["app"],
                    "tenant": c["tenant"],
                    "agent_id": c["agent_id"],
                    "state": "created" if owner is None else "running",
                    "revision": 0,
                    "lease_owner": owner,
                    "lease_expires_at": None if owner is None else _plus(t.now, c["lease_ttl"]),
                    "input": c["input"],
                    "output": None,
                    "error": None,
                    "session_id": c["session_id"],
                    "config": c["config"],
                    "script": c["script"],
                    "pause_ttl_seconds": c["pause_ttl_seconds"],
                    "start_digest": c["start_digest"],
                    "step_count": 0,
                    "tokens_used": 0,
                    "created_at": t.now,
                    "updated_at": t.now,
                    "ended_at": None,
                    "ending": None,
                }
            )
            first_updated_at = None
            if c["first_continuation"] is not None:
                first_updated_at = self._write_progress(t, key, owner, c["first_continuation"], None, None, None, None)
            return {"outcome": "created", "run": _copy(created), "first_updated_at": first_updated_at}
        if c["message_id"] is not None and not recorded:
            outcome = self._recorded_command(c["app"], c["tenant"], c["message_id"], c["routing_key"], c["digest"])
            return {"outcome": outcome, "run": None, "first_updated_at": None}
        run = _into(self.tables.runs.get(key), RUN_COLUMNS)
        if run["start_digest"] is not None and run["start_digest"] == c["start_digest"]:
            return {"outcome": "exists_same", "run": run, "first_updated_at": None}
        if c["message_id"] is not None:
            self._forget_inbox(c["app"], c["tenant"], c["message_id"])
        return {"outcome": "run_exists", "run": None, "first_updated_at": None}

    # --- a running run's own transitions ---------------------------------------------------------------

    def _held(self, t: _Txn, key: Key, owner: str | None) -> Row | None:
        """The run while ``owner`` holds its live lease (an empty owner never does)."""
        run = self.tables.runs.get(key)
        if (
            run is None
            or run["state"] != "running"
            or owner is None
            or owner == ""
            or run["lease_owner"] != owner
            or run["lease_expires_at"] is None
            or not run["lease_expires_at"] > t.now
        ):
            return None
        return run

    def _save(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_save_progress_v1`` (migration 0005)."""
        key = (c["app"], c["tenant"], c["run_id"])
        run = self._held(t, key, c["owner"])
        if run is None:
            return [{"saved_at": None, "ending": None}]
        self._put_run({**run, "step_count": c["step_count"], "tokens_used": c["tokens_used"]})
        saved_at = self._write_progress(
            t, key, c["owner"], c["continuation"], c["started"], c["done"], c["ending"], c["approved"]
        )
        return [{"saved_at": saved_at, "ending": run["ending"]}]

    def _pause(self, t: _Txn, p: Row) -> list[Row]:
        """``intermission_pause_run_v3`` (migration 0016)."""
        key = (p["app"], p["tenant"], p["run_id"])
        run = self._held(t, key, p["owner"])
        if run is None or run["ending"] is not None or run["revision"] != p["revision"]:
            if run is None:
                return [{"outcome": "not_held", "revision": None, "pause": None, "ending": None}]
            if run["ending"] is not None:
                return [{"outcome": "ending_requested", "revision": None, "pause": None, "ending": run["ending"]}]
            return [{"outcome": "revision_moved", "revision": run["revision"], "pause": None, "ending": None}]
        moved = self._put_run(
            {
                **run,
                "state": "paused",
                "revision": run["revision"] + 1,
                "lease_owner": None,
                "lease_expires_at": None,
                "step_count": p["step_count"],
                "tokens_used": p["tokens_used"],
                "updated_at": t.now,
            }
        )
        # At most one pause per run (a unique index): the old one goes first.
        self._drop_pause(key)
        approval = p["reason"] == "approval"
        if approval:
            self._insert_checkpoint(t, p, key)
        pause = self._insert_pause(
            {
                "id": p["suspension_id"],
                "run_id": p["run_id"],
                "app": p["app"],
                "tenant": p["tenant"],
                "reason": p["reason"],
                "pending": p["pending"],
                "continuation": p["continuation"],
                "checkpoint_id": p["checkpoint_id"] if approval else None,
                "approvers": p["approvers"],
                "expires_at": p["expires_at"],
                "created_at": t.now,
            }
        )
        self.tables.progress.pop(key, None)
        self._add_run_event(
            t, uuid.uuid4(), key, "paused", moved["revision"], render_jsonb({"suspension_id": p["suspension_id"]})
        )
        self._add_outbox(t, p, key)
        return [{"outcome": "paused", "revision": moved["revision"], "pause": _copy(pause), "ending": None}]

    def _insert_checkpoint(self, t: _Txn, p: Row, key: Key) -> None:
        # The id the worker drew from the checkpoints' own identity sequence (draw_pause_keys).
        checkpoint_id = p["checkpoint_id"]
        if checkpoint_id is None or p["suspension_id"] is None or p["approvers"] is None:
            raise _sqlstate("23502", "checkpoints: id, suspension_id and approvers must not be NULL")
        if checkpoint_id in self.tables.checkpoints:
            raise _sqlstate("23505", "checkpoints_pkey")
        app, tenant, run_id = key
        self.tables.checkpoints[checkpoint_id] = {
            "id": checkpoint_id,
            "run_id": run_id,
            "suspension_id": p["suspension_id"],
            "app": app,
            "tenant": tenant,
            "approvers": list(p["approvers"]),
            "state": "pending",
            "decided_by": None,
            "reason": None,
            "created_at": t.now,
            "decided_at": None,
        }

    def _end(self, t: _Txn, p: Row) -> list[Row]:
        return [self._end_run(t, p)]

    def _end_run(self, t: _Txn, p: Row) -> Row:
        """``intermission_end_run_v3`` (migration 0016)."""
        key = (p["app"], p["tenant"], p["run_id"])
        run = self.tables.runs.get(key)
        owner = p["owner"]
        ends = (
            run is not None
            and run["state"] == "running"
            and run["revision"] == p["revision"]
            and (
                owner is None
                or (self._held(t, key, owner) is not None and (run["ending"] is None or p["state"] == "cancelled"))
            )
        )
        if not ends or run is None:
            if owner is None:
                return {"outcome": "not_at_revision", "revision": None, "ending": None}
            held = self._held(t, key, owner)
            if held is None:
                return {"outcome": "not_held", "revision": None, "ending": None}
            if held["ending"] is not None and p["state"] != "cancelled":
                return {"outcome": "ending_requested", "revision": None, "ending": held["ending"]}
            return {"outcome": "revision_moved", "revision": held["revision"], "ending": None}
        ended = self._put_run(
            {
                **run,
                "state": p["state"],
                "revision": run["revision"] + 1,
                "lease_owner": None,
                "lease_expires_at": None,
                "output": p["output"],
                "error": p["error"],
                "updated_at": t.now,
                "ended_at": t.now,
                "ending": None,
                "step_count": _coalesce(p["step_count"], run["step_count"]),
                "tokens_used": _coalesce(p["tokens_used"], run["tokens_used"]),
            }
        )
        if p["messages"] is not None:
            messages = parse_jsonb(p["messages"])
            if not isinstance(messages, list):
                raise _sqlstate("22023", "cannot extract elements from a scalar or an object")
            for message in messages:
                row_id = self.sequences.next("session_messages")
                self.tables.session_messages[row_id] = {
                    "id": row_id,
                    "session_id": ended["session_id"],
                    "app": p["app"],
                    "tenant": p["tenant"],
                    "run_id": p["run_id"],
                    "message": render_jsonb(message),
                    "created_at": t.now,
                }
        self.tables.progress.pop(key, None)
        self._drop_pause(key)
        for checkpoint_id, checkpoint in list(self.tables.checkpoints.items()):
            if (checkpoint["app"], checkpoint["tenant"], checkpoint["run_id"]) == key and checkpoint[
                "state"
            ] == "pending":
                self.tables.checkpoints[checkpoint_id] = {
                    **checkpoint,
                    "state": "rejected",
                    "reason": p["checkpoint_reason"],
                    "decided_at": t.now,
                }
        self._add_run_event(t, p["run_event_id"], key, p["run_event_kind"], ended["revision"], p["run_event_data"])
        self._add_outbox(t, p, key)
        return {"outcome": "ended", "revision": ended["revision"], "ending": None}

    def _ending(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_request_ending_v1`` (migration 0015)."""
        key = (c["app"], c["tenant"], c["run_id"])
        recorded = self._record_inbox(t, c) if c["message_id"] is not None else False
        run = self.tables.runs.get(key)
        snapshot = self.tables.progress.get(key)
        if (
            run is not None
            and run["state"] == "running"
            and run["lease_owner"] is not None
            and run["ending"] is None
            and not (snapshot is not None and snapshot["ending"] is not None)
            and (c["message_id"] is None or recorded)
        ):
            self._put_run({**run, "ending": c["ending"]})
            if snapshot is not None:
                self.tables.progress[key] = {**snapshot, "ending": c["ending"]}
            return [{"outcome": "requested", "revision": run["revision"], "lease_owner": run["lease_owner"]}]
        if c["message_id"] is not None and not recorded:
            outcome = self._recorded_command(c["app"], c["tenant"], c["message_id"], c["routing_key"], c["digest"])
            return [{"outcome": outcome, "revision": None, "lease_owner": None}]
        found = _into(run, RUN_COLUMNS)
        if found["id"] is None or found["state"] != "running":
            outcome = "not_running"
        elif found["lease_owner"] is None:
            outcome = "not_leased"
        else:
            outcome = "ending_before"
        if outcome != "ending_before" and c["message_id"] is not None:
            # Refused: nothing of this command stays, not even its inbox record.
            self._forget_inbox(c["app"], c["tenant"], c["message_id"])
        return [{"outcome": outcome, "revision": found["revision"], "lease_owner": found["lease_owner"]}]

    # --- agent replies ----------------------------------------------------------------------------------

    def _admit(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_admit_resume_v1`` (migration 0005)."""
        ev_key = (c["app"], c["tenant"], c["run_id"], c["suspension_id"])
        out: Row = {"outcome": None, "admission": None, "revision": None, "suspension_id": None, "expires_at": None}
        if (
            c["message_id"] is not None
            and (c["app"], c["tenant"], c["message_id"]) in self.tables.inbox
            and self._recorded_command(c["app"], c["tenant"], c["message_id"], c["routing_key"], c["digest"])
            == "message_id_conflict"
        ):
            out["outcome"] = "message_id_conflict"
            return [out]
        claim: Row | None = None
        for attempt in (1, 2):
            admission = self.tables.resume_admissions.get(ev_key)
            out["admission"] = _into(admission, ADMISSION_COLUMNS)
            if admission is not None:
                same = admission["request_digest"] == c["request_digest"]
                out["outcome"] = "admitted_before" if same else "resume_admission_conflict"
                return [out]
            if attempt == 2:
                # The claim matched nothing and no rival admitted this pause: the claim's refusal stands.
                return [out]
            claim = self._claim_pause(
                t,
                {
                    "run_id": c["run_id"],
                    "app": c["app"],
                    "tenant": c["tenant"],
                    "suspension_id": c["suspension_id"],
                    "revision": c["revision"],
                    "expired_by": None,
                    "reason": "agent_reply",
                    "lease_owner": c["lease_owner"],
                    "lease_ttl": c["lease_ttl"],
                    "first": c["first_continuation"] is not None,
                    "first_continuation": c["first_continuation"],
                    "first_started": None,
                    "first_done": c["first_done"],
                    "first_ending": None,
                    "first_approved": None,
                    "drop_pause": False,
                    "message_id": c["message_id"],
                    "routing_key": c["routing_key"],
                    "digest": c["digest"],
                    "checkpoint_id": None,
                    "checkpoint_state": None,
                    "decided_by": None,
                    "decision_reason": None,
                    "event_message_id": c["event_message_id"],
                    "event_routing_key": c["event_routing_key"],
                    "event_body": c["event_body"],
                    "event_correlation_id": c["event_correlation_id"],
                    "event_headers": c["event_headers"],
                    "whole": False,
                },
            )
            out.update(
                outcome=claim["outcome"],
                revision=claim["revision"],
                suspension_id=claim["suspension_id"],
                expires_at=claim["expires_at"],
            )
            if claim["outcome"] == "claimed":
                break
            if claim["outcome"] == "message_id_conflict":
                return [out]
        assert claim is not None
        for column in ("input", "request_digest", "suspension_digest"):
            if c[column] is None:
                raise _sqlstate("23502", f"resume_admissions.{column} must not be NULL")
        if c["schema_version"] is not None and c["schema_version"] < 1:
            raise _sqlstate("23514", "resume_admissions_schema_version_check")
        if len(c["input"]) > _MAX_ADMISSION_INPUT:
            raise _sqlstate("23514", "resume_admissions_input_check")
        admission = {
            "run_id": c["run_id"],
            "suspension_id": c["suspension_id"],
            "app": c["app"],
            "tenant": c["tenant"],
            "schema_version": c["schema_version"],
            "pinned_revision": c["revision"],
            "input": bytes(c["input"]),
            "request_digest": c["request_digest"],
            "suspension_digest": c["suspension_digest"],
            "claimed_revision": claim["revision"],
            "admitted_at": t.now,
        }
        self.tables.resume_admissions[ev_key] = admission
        out.update(outcome="admitted", admission=_copy(admission))
        return [out]

    def _start_resume(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_start_resume_v1`` (migration 0015)."""
        key = (c["app"], c["tenant"], c["run_id"])
        ev_key = (*key, c["suspension_id"])
        run = _into(self.tables.runs.get(key), RUN_COLUMNS)
        admission = self.tables.resume_admissions.get(ev_key)
        start: Row | None = _into(self.tables.resume_starts.get(ev_key), START_COLUMNS)
        expiry = self.tables.resume_expiries.get(ev_key)
        expired_at = expiry["expired_at"] if expiry is not None else None
        found = self.tables.suspensions.get(c["suspension_id"])
        pause: Row | None = _into(
            found if found is not None and (found["app"], found["tenant"], found["run_id"]) == key else None,
            SUSPENSION_COLUMNS,
        )
        assert start is not None
        assert pause is not None
        if admission is None:
            outcome = "no_admission"
        elif admission["request_digest"] != c["digest"]:
            outcome = "digest_conflict"
        elif start["run_id"] is not None:
            outcome = "started_before"
        elif expired_at is not None:
            outcome = "expired"
        elif run["id"] is None or run["state"] != "running" or run["revision"] != admission["claimed_revision"]:
            outcome = "run_conflict"
        elif pause["id"] is None:
            outcome = "pause_gone"
        else:
            outcome = "started"
        if outcome != "started" or admission is None:
            if outcome != "started_before":
                start = None
            return [{"outcome": outcome, "start": start, "expired_at": expired_at, "run": run, "pause": None}]
        if c["lease_owner"] is not None:
            current = self.tables.runs[key]
            run = _copy(
                self._put_run(
                    {
                        **current,
                        "lease_owner": c["lease_owner"],
                        "lease_expires_at": _plus(t.now, c["lease_ttl"]),
                        "updated_at": t.now,
                    }
                )
            )
            if c["first_continuation"] is not None:
                self._write_progress(
                    t, key, c["lease_owner"], c["first_continuation"], None, c["first_done"], None, None
                )
        written = {
            "run_id": c["run_id"],
            "suspension_id": c["suspension_id"],
            "app": c["app"],
            "tenant": c["tenant"],
            "schema_version": c["schema_version"],
            "pinned_revision": admission["pinned_revision"],
            "request_digest": admission["request_digest"],
            "started_at": t.now,
        }
        self.tables.resume_starts[ev_key] = written
        return [{"outcome": "started", "start": _copy(written), "expired_at": expired_at, "run": run, "pause": pause}]

    def _expire_admission(self, t: _Txn, p: Row) -> list[Row]:
        """``intermission_expire_admission_v1`` (migration 0016)."""
        key = (p["app"], p["tenant"], p["run_id"])
        ev_key = (*key, p["suspension_id"])
        run = self.tables.runs.get(key)
        admission = self.tables.resume_admissions.get(ev_key)
        if admission is None:
            return [{"outcome": "no_admission", "expiry": None}]
        if admission["request_digest"] != p["digest"]:
            return [{"outcome": "digest_conflict", "expiry": None}]
        before = self.tables.resume_expiries.get(ev_key)
        if before is not None:
            return [{"outcome": "expired_before", "expiry": _copy(before)}]
        if ev_key in self.tables.resume_starts:
            return [{"outcome": "started", "expiry": None}]
        if run is None:
            return [{"outcome": "no_run", "expiry": None}]
        if p["event_id"] is None:
            raise _sqlstate("23502", "resume_expiries.event_id must not be NULL")
        expiry = _record_evidence(
            self.tables.resume_expiries,
            "resume_expiries",
            ev_key,
            p,
            pinned_revision=admission["pinned_revision"],
            request_digest=admission["request_digest"],
            event_id=p["event_id"],
            run_revision=run["revision"],
            expired_at=t.now,
        )
        data = {"suspension_id": p["suspension_id"], "request_digest": admission["request_digest"]}
        self._add_run_event(t, p["event_id"], key, "resume_expired", run["revision"], render_jsonb(data))
        return [{"outcome": "expired", "expiry": _copy(expiry)}]

    def _close(self, t: _Txn, p: Row) -> list[Row]:
        """``intermission_close_resume_v1`` (migration 0016)."""
        key = (p["app"], p["tenant"], p["run_id"])
        ev_key = (*key, p["suspension_id"])
        run = self.tables.runs.get(key)
        before = self.tables.resume_closures.get(ev_key)

        def refused(outcome: str, revision: int | None = None) -> list[Row]:
            return [{"outcome": outcome, "closure": None, "revision": revision}]

        if before is not None:
            same = before["request_digest"] == p["request_digest"]
            return [
                {"outcome": "closed_before" if same else "closure_conflict", "closure": _copy(before), "revision": None}
            ]
        if run is None:
            return refused("no_run")
        if p["proof_expires_at"] is not None and p["proof_expires_at"] <= t.now:
            return refused("proof_expired")
        of_run = [row for k, row in self.tables.resume_admissions.items() if k[:3] == key]
        if not of_run:
            return refused("no_admission")
        latest = max(of_run, key=lambda row: row["suspension_id"])
        if latest["suspension_id"] != p["suspension_id"]:
            return refused("not_latest", latest["suspension_id"])
        if _true(
            _or(
                _ne(latest["pinned_revision"], p["pinned_revision"]),
                _ne(latest["request_digest"], p["admission_digest"]),
            )
        ):
            return refused("admission_conflict")
        start = self.tables.resume_starts.get(ev_key)
        if start is None:
            return refused("no_start")
        if start["started_at"] != p["start_started_at"]:
            return refused("start_moved")
        if p["start_matches"] is False:
            return refused("start_conflict")
        if _true(_ne(run["revision"], p["run_revision"])):
            return refused("stale", run["revision"])
        if run["state"] != "running":
            return refused("not_running")
        ended = self._end_run(
            t,
            {
                "run_id": p["run_id"],
                "app": p["app"],
                "tenant": p["tenant"],
                "owner": None,
                "revision": p["run_revision"],
                "state": "failed",
                "output": None,
                "error": p["error"],
                "messages": None,
                "checkpoint_reason": p["error"],
                "run_event_id": p["run_event_id"],
                "run_event_kind": "resume_closed",
                "run_event_data": p["run_event_data"],
                "step_count": None,
                "tokens_used": None,
                "event_message_id": p["event_message_id"],
                "event_routing_key": p["event_routing_key"],
                "event_body": p["event_body"],
                "event_correlation_id": p["event_correlation_id"],
                "event_headers": p["event_headers"],
            },
        )
        if ended["outcome"] != "ended":
            raise _invalid_state(f"run {p['run_id']} could not be closed: {ended['outcome']}")
        if p["request"] is None or p["request_digest"] is None:
            raise _sqlstate("23502", "resume_closures.request and request_digest must not be NULL")
        closure = _record_evidence(
            self.tables.resume_closures,
            "resume_closures",
            ev_key,
            p,
            request=p["request"],
            request_digest=p["request_digest"],
            event_id=p["run_event_id"],
            run_revision=ended["revision"],
            closed_at=t.now,
        )
        return [{"outcome": "closed", "closure": _copy(closure), "revision": ended["revision"]}]

    # --- operators' and the original package's transitions -------------------------------------------

    def _deadline(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_move_deadline_v1`` (migration 0012)."""
        extend_by = c["extend_by"]
        if extend_by is not None and not (extend_by > 0 and extend_by < float("inf")):
            raise _sqlstate("22023", "p_extend_by must be a positive, finite number of seconds")
        key = (c["app"], c["tenant"], c["run_id"])
        run = self.tables.runs.get(key)
        paused = run is not None and run["state"] == "paused"
        pause = self.tables.suspensions.get(c["suspension_id"]) if c["suspension_id"] is not None else None
        if paused and run is not None and pause is not None and (pause["app"], pause["tenant"], pause["run_id"]) == key:
            old: datetime | None = pause["expires_at"]
            base = old if old is not None else t.now
            # Expired: now, unless it passed already; extended: that much later than it stood, or than now.
            new = min(base, t.now) if extend_by is None else max(base, t.now) + timedelta(seconds=extend_by)
            self.tables.suspensions[pause["id"]] = {**pause, "expires_at": new}
            data = {
                "suspension_id": pause["id"],
                "previous": old,
                "expires_at": new,
                "moved_by": c["moved_by"],
                "how": "expire" if extend_by is None else "extend",
                "extend_by_seconds": extend_by,
            }
            self._add_run_event(t, uuid.uuid4(), key, "deadline_moved", run["revision"], render_jsonb(data))
            return [
                {
                    "outcome": "moved",
                    "suspension_id": pause["id"],
                    "run_revision": run["revision"],
                    "previous": old,
                    "expires_at": new,
                }
            ]
        live = self.tables.pause_of(key) if paused else None
        return [
            {
                "outcome": "not_paused" if live is None else "pause_changed",
                "suspension_id": live["id"] if live is not None else None,
                "run_revision": run["revision"] if paused and run is not None else None,
                "previous": None,
                "expires_at": None,
            }
        ]

    def _take_over(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_take_over_v1`` (migration 0015): a row per run taken."""
        lapsed = [
            run
            for run in self.tables.runs.values()
            if run["state"] == "running" and run["lease_expires_at"] is not None and run["lease_expires_at"] <= t.now
        ]
        if c["run_id"] is not None:
            key = (c["app"], c["tenant"], c["run_id"])
            taken = [run for run in lapsed if (run["app"], run["tenant"], run["id"]) == key]
        else:
            if c["lapsed_limit"] is not None and c["lapsed_limit"] < 0:
                raise _sqlstate("2201W", "LIMIT must not be negative")
            taken = sorted(lapsed, key=lambda run: (run["lease_expires_at"], run["app"], run["tenant"], run["id"]))
            taken = taken if c["lapsed_limit"] is None else taken[: c["lapsed_limit"]]
        keys = [(run["app"], run["tenant"], run["id"]) for run in taken]
        for run in taken:
            self._put_run(
                {
                    **run,
                    "lease_owner": c["owner"],
                    "lease_expires_at": _plus(t.now, c["lease_ttl"]),
                    "updated_at": t.now,
                }
            )
        if not keys:
            return []
        if c["first_continuation"] is not None:
            self._write_progress(
                t,
                (c["app"], c["tenant"], c["run_id"]),
                c["owner"],
                c["first_continuation"],
                c["first_started"],
                c["first_done"],
                c["first_ending"],
                c["first_approved"],
            )
        found: list[Row] = []
        for key in keys:
            snapshot = self.tables.progress.get(key)
            if c["first_continuation"] is None and snapshot is not None:
                # The snapshot belongs to whoever holds the run: it goes over with the lease.
                if c["owner"] is None or c["owner"] == "":
                    raise _sqlstate("23514", "progress_owner_check")
                snapshot = self.tables.progress[key] = {**snapshot, "owner": c["owner"], "updated_at": t.now}
            found.append({"run": _copy(self.tables.runs[key]), "progress": _maybe(snapshot)})
        return found

    def _create_pause(self, t: _Txn, c: Row) -> list[Row]:
        """``intermission_create_pause_v1`` (migration 0005) in its own subtransaction: a second live pause
        of one run is 'exists', and that row writes nothing."""
        key = (c["app"], c["tenant"], c["run_id"])
        if key not in self.tables.runs:
            return [{"outcome": "no_run", "pause": _nulls(SUSPENSION_COLUMNS)}]
        try:
            pause = self._insert_pause(
                {
                    "id": self.sequences.next("suspension_ids"),
                    "run_id": c["run_id"],
                    "app": c["app"],
                    "tenant": c["tenant"],
                    "reason": c["reason"],
                    "pending": c["pending"],
                    "continuation": c["continuation"],
                    "checkpoint_id": c["checkpoint_id"],
                    "approvers": c["approvers"],
                    "expires_at": c["expires_at"] if c["ttl"] is None else _plus(t.now, c["ttl"]),
                    "created_at": t.now,
                }
            )
        except _UniqueViolation:
            return [{"outcome": "exists", "pause": None}]
        return [{"outcome": "created", "pause": _copy(pause)}]

    def _delete_pause(self, t: _Txn, c: Row) -> list[Row]:
        return [{"found": self._drop_pause((c["app"], c["tenant"], c["run_id"]))}]

    def _delete_progress(self, t: _Txn, c: Row) -> list[Row]:
        return [{"found": self.tables.progress.pop((c["app"], c["tenant"], c["run_id"]), None) is not None}]

    def _release(self, t: _Txn, c: Row) -> list[Row]:
        key = (c["app"], c["tenant"], c["run_id"])
        run = self._held(t, key, c["owner"])
        if run is None:
            return [{"found": False}]
        self._put_run({**run, "lease_expires_at": t.now})
        return [{"found": True}]

    def _retry_outbox(self, t: _Txn, c: Row) -> list[Row]:
        retried: list[Row] = []
        for outbox_id, row in sorted(self.tables.outbox.items()):
            if (
                row["quarantined_at"] is not None
                and row["sent_at"] is None
                and (c["id"] is None or outbox_id == c["id"])
            ):
                # Their message_id, body and last_error stay: a re-publication is the same event.
                self.tables.outbox[outbox_id] = {**row, "quarantined_at": None, "attempts": 0, "next_attempt_at": None}
                retried.append({"id": outbox_id})
        return retried


class _UniqueViolation(StoreError):
    """unique_violation (23505): a StoreError to everyone but intermission_create_pauses_v2, which catches
    it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"database error 23505 ({what}, in memory)")


def _claim_out(
    outcome: str,
    *,
    revision: int | None = None,
    lease_owner: str | None = None,
    lease_expires_at: datetime | None = None,
    updated_at: datetime | None = None,
    suspension_id: int | None = None,
    expires_at: datetime | None = None,
    first_updated_at: datetime | None = None,
    run: Row | None = None,
    pause: Row | None = None,
) -> Row:
    return {
        "outcome": outcome,
        "revision": revision,
        "lease_owner": lease_owner,
        "lease_expires_at": lease_expires_at,
        "updated_at": updated_at,
        "suspension_id": suspension_id,
        "expires_at": expires_at,
        "first_updated_at": first_updated_at,
        "run": run,
        "pause": pause,
    }


def _claim_refusal(t: _Txn, c: Row, run: Row, pause: Row) -> str:
    """Why a claim matched nothing, from the run and pause as it read them again (NULLs as SQL has them)."""
    if run["id"] is None or pause["id"] is None or run["state"] != "paused":
        return "not_suspended"
    if c["suspension_id"] is not None and _true(
        _or(_ne(pause["id"], c["suspension_id"]), _ne(run["revision"], c["revision"]))
    ):
        return "run_conflict"
    if c["reason"] is not None and pause["reason"] != c["reason"]:
        return "wrong_reason"
    if c["expired_by"] is None and pause["expires_at"] is not None and pause["expires_at"] <= t.now:
        return "suspension_expired"
    if c["expired_by"] is not None:
        return "not_expired"
    return "lost"


# --- SQL's three-valued logic, where a NULL can reach a comparison -----------------------------------


def _ne(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a != b


def _or(*values: bool | None) -> bool | None:
    if any(v is True for v in values):
        return True
    return None if any(v is None for v in values) else False


def _true(value: bool | None) -> bool:
    """An IF or a WHEN takes its branch only on true: NULL is not."""
    return value is True


def _coalesce(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# --- an engine over it ------------------------------------------------------------------------------


def memory_engine(committer: InMemoryCommitter | None = None, **options: Any) -> Engine:
    """An ``Engine`` over an in-memory committer (a new one unless given), with ``Engine``'s own options
    (``lease``, ``defaults``, ``observer``, ``max_size``, ...). It has no ``stores``: the original package's
    store API (``engine.at(scope)``) reads from the database, so it is not there; read ``committer_of``'s
    ``tables`` instead."""
    return Engine(committer or InMemoryCommitter(), **options)


def committer_of(engine: Engine) -> InMemoryCommitter:
    """The in-memory committer an engine (or a view of it, ``Engine.under``) commits through."""
    committer = engine.scheduler.committer
    if not isinstance(committer, InMemoryCommitter):
        raise TypeError(f"this engine commits through {type(committer).__name__}, not an in-memory committer")
    return committer


# --- what a worker uses beside its engine, over the same tables ----------------------------------------


class InMemoryLeaseLine:
    """The lease keeper's line over an in-memory committer: ``store/leases.py``'s ``LeaseLine`` with the
    committer's tables and clock in place of a connection of its own. A renewal waits one turn of the event
    loop, as a round trip would, so that the run's own writes may land beside it."""

    def __init__(self, committer: InMemoryCommitter) -> None:
        self._committer = committer
        # What the keeper has done with it, for tests: renewals asked (of at least one run), and whether the
        # line is "open" (a renewal opens it; an idle keeper's close, or the fleet's stop, closes it).
        self.renewals = 0
        self.connected = False

    async def renew(self, owner: str, ttl_seconds: float, held: Sequence[HeldRun]) -> dict[HeldRun, Renewed]:
        if not held:
            return {}  # as store/leases.py: no statement for nothing
        await asyncio.sleep(0)
        self.connected = True
        self.renewals += 1
        found = self._committer.renew_leases(owner, ttl_seconds, held)
        # Decoded as store/leases.py decodes the statement's rows: by the whole key, the ending as stored.
        asked = {(h.scope.app, h.scope.tenant, h.run_id): h for h in held}
        answered = ((asked[(r["app"], r["tenant"], r["id"])], r["ending"]) for r in found)
        return {
            h: Renewed(h.run_id, h.scope, None if ending is None else load_model(Ending, ending, "run ending"))
            for h, ending in answered
        }

    async def close(self) -> None:
        self.connected = False


class InMemoryLedger:
    """The demo ledger (``store/ledger.py``'s ``DemoLedger``) at one scope, in the committer's
    ``demo_charges``."""

    def __init__(self, committer: InMemoryCommitter, scope: Scope) -> None:
        self._committer = committer
        self.scope = require_scope(scope)

    async def charge(self, run_id: str, call_id: str, amount: Decimal) -> int:
        await asyncio.sleep(0)  # a round trip, as DemoLedger's
        return self._committer.charge(self.scope, run_id, call_id, amount)

    async def times_charged(self, run_id: str) -> dict[str, int]:
        return self._committer.times_charged(self.scope, run_id)


class InMemoryFleetStore:
    """What a fleet uses beside its engine (``fleet/runtime.py``'s ``FleetStore``), over ``committer``: give
    the fleet this and an engine over the same committer (``memory_engine(committer)``)."""

    def __init__(self, committer: InMemoryCommitter) -> None:
        self.committer = committer
        # Every line the fleet asked for, in order (a fleet asks for one): tests read its renewals.
        self.lines: list[InMemoryLeaseLine] = []

    def lease_line(self, owner: str, *, timeout: float) -> InMemoryLeaseLine:
        line = InMemoryLeaseLine(self.committer)
        self.lines.append(line)
        return line

    def ledger(self, scope: Scope) -> InMemoryLedger:
        return InMemoryLedger(self.committer, scope)

    async def count_running(self) -> int:
        return self.committer.count_running()


__all__ = [
    "Clock",
    "InMemoryCommitter",
    "InMemoryFleetStore",
    "InMemoryLeaseLine",
    "InMemoryLedger",
    "Sequences",
    "Tables",
    "committer_of",
    "json_timestamp",
    "jsonb",
    "memory_engine",
    "parse_jsonb",
    "render_jsonb",
]
