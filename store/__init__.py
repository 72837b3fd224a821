"""Intermission's PostgreSQL store: the database (pool, named statements, migrations, row decoding) and the
read models. Every change of a run is a transition of the engine (``engine/``), which runs it here.

``Stores`` is one pool's worth of it. ``stores.at(scope)`` is a handle bound to one scope, checked once,
whose readers (runs, suspensions, progress, resume evidence, sessions, the demo ledger) read only there;
``stores.across_scopes`` holds every read that crosses scopes for the fleet's own processes, and
``stores.granted(reach)`` the web console's reads, restricted in SQL to the scopes the broker grants the
person logged in; nothing else crosses scopes. A run id names a run only within its scope (migration
0015): two scopes may each have run "r1".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from intermission.schemas.scope import Reach, Scope, require_scope
from intermission.store.across_scopes import AcrossScopes
from intermission.store.db import Database
from intermission.store.granted import GrantedReads
from intermission.store.ledger import DemoLedger
from intermission.store.progress import ProgressStore
from intermission.store.resume import ResumeStore
from intermission.store.runs import RunStore
from intermission.store.sessions import SessionStore
from intermission.store.suspensions import SuspensionStore

_Reader = TypeVar("_Reader")


def _reader(kind: Callable[[Database, Scope], _Reader]) -> cached_property[_Reader]:
    """A reader of ``ScopedStores``: ``kind`` over its pool at its scope, made once, on first use."""

    def make(stores: ScopedStores) -> _Reader:
        return kind(stores.db, stores.scope)

    return cached_property(make)


class ScopedStores:
    """The store at one exact scope: every reader of its aggregates reads only there."""

    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        # Checked again here, not trusted from the type: a Scope built with model_construct skips pydantic,
        # and a zero scope must fail before any statement is sent.
        self.scope = require_scope(scope)

    runs = _reader(RunStore)
    suspensions = _reader(SuspensionStore)
    progress = _reader(ProgressStore)
    resume = _reader(ResumeStore)
    sessions = _reader(SessionStore)
    ledger = _reader(DemoLedger)


@dataclass(frozen=True)
class Stores:
    """The capabilities over one pool."""

    db: Database
    across_scopes: AcrossScopes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "across_scopes", AcrossScopes(self.db))

    def at(self, scope: Scope) -> ScopedStores:
        """The store at ``scope`` (InvalidScope when it is not a valid scope)."""
        return ScopedStores(self.db, scope)

    def granted(self, reach: Reach) -> GrantedReads:
        """The web console's reads for a person whose broker grants reach ``reach``."""
        return GrantedReads(self.db, reach)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        relayed: bool = False,
        connect_timeout: float = 60.0,
        application_name: str = "intermission",
        generic_plans: bool = False,
    ) -> Stores:
        return cls(
            await Database.connect(
                dsn,
                min_size=min_size,
                max_size=max_size,
                relayed=relayed,
                connect_timeout=connect_timeout,
                generic_plans=generic_plans,
                application_name=application_name,
            )
        )

    async def close(self) -> None:
        await self.db.close()
