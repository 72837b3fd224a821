"""Rows to domain models, and domain models to column values.

Stored JSON is decoded with pydantic's JSON mode, so bytes come back from base64 exactly, and STRICTLY, so
a malformed row is an ``InvalidContinuation`` at the boundary, not a half-restored run several steps later:
``"step_index": "3"`` or ``"tools_restricted": "true"`` is malformed, never coerced (lax mode would continue
a run on values nobody wrote as such). A stored record without ``schema_version`` reads as legacy 0
(``schemas/base.py``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import asyncpg
from pydantic import BaseModel, TypeAdapter, ValidationError

from intermission.schemas.base import STORED
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import InvalidArgument, InvalidContinuation
from intermission.schemas.llm import Message
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import (
    Continuation,
    Ending,
    PendingCall,
    Progress,
    ProgressResult,
    SuspendReason,
    Suspension,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

M = TypeVar("M", bound=BaseModel)

# A row as the store hands it over: an asyncpg Record, or a mapping of the same columns (the engine's
# in-memory committer).
Out: TypeAlias = asyncpg.Record | Mapping[str, Any]
T = TypeVar("T")

PENDING = TypeAdapter(list[PendingCall])
STARTED = PENDING
DONE = TypeAdapter(list[ProgressResult])
CALL_IDS = TypeAdapter(list[str])
MESSAGES = TypeAdapter(list[Message])
SCRIPT = TypeAdapter(list[ScriptTurn])


# PostgreSQL text, and so jsonb, cannot hold U+0000: JSON writes it as the escape \u0000, which jsonb refuses
# with an untyped driver error. It is refused here, typed, before the statement that would carry it (so its
# transaction rolls back). The escape is a backslash after an even number of backslashes; "\\u0000" is text.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _storable(encoded: str) -> str:
    # The substring test is a C-speed scan; the regex (which tells an escape from escaped text) runs only
    # on the rare text that holds the six characters at all.
    if "\\u0000" in encoded and _NUL_ESCAPE.search(encoded) is not None:
        raise InvalidArgument("text must not contain U+0000 (NUL): PostgreSQL cannot store it")
    return encoded


def optional_limit(limit: int | None) -> int | None:
    """A listing's limit: None or 0 means no limit (the original's ``<= 0``); a negative one is refused."""
    if limit is None or limit == 0:
        return None
    if limit < 0:
        raise InvalidArgument("limit must not be negative")
    return limit


def dump(value: BaseModel) -> str:
    return _storable(value.model_dump_json())


def dump_list(adapter: TypeAdapter[list[T]], values: list[T]) -> str:
    return _storable(adapter.dump_json(values).decode())


def load_model(model: type[M], raw: str, what: str) -> M:
    try:
        return model.model_validate_json(raw, strict=True, context=STORED)
    except ValidationError as exc:
        raise InvalidContinuation(f"stored {what} is malformed: {exc.error_count()} error(s)") from exc


def _load_list(adapter: TypeAdapter[T], raw: str, what: str) -> T:
    try:
        return adapter.validate_json(raw, strict=True, context=STORED)
    except ValidationError as exc:
        raise InvalidContinuation(f"stored {what} is malformed: {exc.error_count()} error(s)") from exc


def load_pending(raw: str) -> list[PendingCall]:
    """A stored pause's pending calls (its ``pending`` column)."""
    return _load_list(PENDING, raw, "pending calls")


def run_from_row(row: Out, prefix: str = "") -> Run:
    def col(name: str) -> Any:
        return row[prefix + name]

    script_raw = col("script")
    ending_raw = col("ending")
    return Run(
        id=col("id"),
        scope=Scope(app=col("app"), tenant=col("tenant")),
        agent_id=col("agent_id"),
        state=RunState(col("state")),
        revision=col("revision"),
        lease_owner=col("lease_owner"),
        lease_expires_at=col("lease_expires_at"),
        input=col("input"),
        output=col("output"),
        error=col("error"),
        session_id=col("session_id"),
        config=load_model(RunConfig, col("config"), "run config"),
        script=None if script_raw is None else _load_list(SCRIPT, script_raw, "run script"),
        pause_ttl_seconds=col("pause_ttl_seconds"),
        step_count=col("step_count"),
        tokens_used=col("tokens_used"),
        ending=None if ending_raw is None else load_model(Ending, ending_raw, "run ending"),
        created_at=col("created_at"),
        updated_at=col("updated_at"),
    )


def suspension_from_row(row: Out, prefix: str = "") -> Suspension:
    def col(name: str) -> Any:
        return row[prefix + name]

    return Suspension(
        id=col("id"),
        run_id=col("run_id"),
        scope=Scope(app=col("app"), tenant=col("tenant")),
        reason=SuspendReason(col("reason")),
        pending=_load_list(PENDING, col("pending"), "pending calls"),
        continuation=load_model(Continuation, col("continuation"), "continuation"),
        checkpoint_id=col("checkpoint_id"),
        approvers=list(col("approvers")),
        expires_at=col("expires_at"),
        created_at=col("created_at"),
    )


def progress_from_row(row: Out) -> Progress:
    return _progress(row, "", row["run_id"], Scope(app=row["app"], tenant=row["tenant"]), row["owner"])


def taken_progress(row: Out, run: Run) -> Progress | None:
    """The snapshot a takeover adopted (``row`` is a progress row), now owned by the run's new lease owner;
    None when the run had none."""
    if row is None:
        return None
    return _progress(row, "", run.id, run.scope, run.lease_owner or row["owner"])


def _progress(row: Out, prefix: str, run_id: str, scope: Scope, owner: str) -> Progress:
    def col(name: str) -> Any:
        return row[prefix + name]

    ending_raw = col("ending")
    return Progress(
        run_id=run_id,
        scope=scope,
        owner=owner,
        continuation=load_model(Continuation, col("continuation"), "progress continuation"),
        started=_load_list(STARTED, col("started"), "progress started"),
        done=_load_list(DONE, col("done"), "progress done"),
        ending=None if ending_raw is None else load_model(Ending, ending_raw, "progress ending"),
        approved=_load_list(CALL_IDS, col("approved"), "progress approved"),
        updated_at=col("updated_at"),
    )


def progress_arguments(p: Progress, prefix: str = "", *, continuation: bool = True) -> dict[str, str | None]:
    """A snapshot as the named arguments of a transition (``continuation``, ``started``, ``done``,
    ``ending``, ``approved``, each with ``prefix``). Without ``continuation`` that one is None: the
    transition takes it from the row it claims, and it is not encoded for nothing."""
    return {
        f"{prefix}continuation": dump(p.continuation) if continuation else None,
        f"{prefix}started": dump_list(STARTED, p.started),
        f"{prefix}done": dump_list(DONE, p.done),
        f"{prefix}ending": None if p.ending is None else dump(p.ending),
        f"{prefix}approved": dump_list(CALL_IDS, p.approved),
    }


# --- records read as stored ----------------------------------------------------------------------------

D = TypeVar("D", bound="DataclassInstance")


@functools.cache
def _field_names(kind: type[DataclassInstance]) -> frozenset[str]:
    # Cached: the relay decodes every outbox row it publishes through ``stored``.
    return frozenset(f.name for f in fields(kind))


def stored(kind: type[D], row: Out, **decoded: Any) -> D:
    """A ``kind`` read as stored: each field is the row's column of the same name, except those given in
    ``decoded`` (a value decoded from its column, or read from a column of another name)."""
    names = _field_names(kind)
    if not decoded.keys() <= names:
        # A misspelt field would otherwise be read from its column without a word.
        raise TypeError(f"{kind.__name__} has no field {sorted(decoded.keys() - names)}")
    return kind(**{name: decoded[name] if name in decoded else row[name] for name in names})


def header_table(raw: str | None) -> dict[str, str | int | float | bool]:
    """An outbox row's stored headers as the AMQP header table they were written as."""
    decoded: object = json.loads(raw) if raw else {}
    if not isinstance(decoded, dict):
        return {}
    # AMQP header tables take scalars; the outbox only ever stores scalars (the schema version, a
    # traceparent), so anything else is a foreign row and is left out rather than failing the read.
    return {str(k): v for k, v in decoded.items() if isinstance(v, str | int | float | bool)}
