"""Intermission's Postgres store: every store capability of the seed, at the caller's exact scope."""

from __future__ import annotations

from dataclasses import dataclass

from intermission.store.commands import CommandStore
from intermission.store.db import Database
from intermission.store.operations import OperationsStore
from intermission.store.progress import ProgressStore
from intermission.store.resume import ResumeStore
from intermission.store.runs import RunStore
from intermission.store.sessions import SessionStore
from intermission.store.suspensions import SuspensionStore


@dataclass(frozen=True)
class Stores:
    """The capabilities over one pool."""

    db: Database
    suspensions: SuspensionStore
    progress: ProgressStore
    runs: RunStore
    commands: CommandStore
    sessions: SessionStore
    operations: OperationsStore
    resume: ResumeStore

    @classmethod
    def over(cls, db: Database) -> Stores:
        return cls(
            db=db,
            suspensions=SuspensionStore(db),
            progress=ProgressStore(db),
            runs=RunStore(db),
            commands=CommandStore(db),
            sessions=SessionStore(db),
            operations=OperationsStore(db),
            resume=ResumeStore(db),
        )

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 10, relayed: bool = False) -> Stores:
        return cls.over(await Database.connect(dsn, min_size=min_size, max_size=max_size, relayed=relayed))

    async def close(self) -> None:
        await self.db.close()
