"""The engine's facade: ``apply`` one transition or operation, ``apply_all`` several. It is all that the
consumers, the fleet, the executors, the sweeper, the command line and the console call to change a run.

An engine is a group-commit scheduler over a committer (``engine/committer.py``) and the terms a worker
applies commands under: its lease (taken at claim time) and the defaults a start resolves against. Views
with other terms share the scheduler (``under``), so the original package's store API, whose callers pass
a lease with each call, is group committed with everything else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from intermission.engine.committer import Committer, GroupCommit
from intermission.engine.observer import CRASH_POINTS, Observer
from intermission.engine.postgres import PostgresCommitter
from intermission.engine.seed import ScopedEngine
from intermission.engine.sink import EventSink
from intermission.engine.starts import RunDefaults
from intermission.engine.transition import Applicable, Transition
from intermission.schemas.errors import RunLeaseLost
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope

if TYPE_CHECKING:
    from intermission.store import Stores

R = TypeVar("R")

# What a start resolves against when an engine is given no defaults (a tool, a test): no deadline, 64 steps.
PLAIN_DEFAULTS = RunDefaults(pause_ttl_seconds=0, max_steps=64)


@dataclass(frozen=True)
class Terms:
    """What commands are applied under: the lease a claim takes, the defaults a start resolves against."""

    lease: Lease | None = None
    defaults: RunDefaults = PLAIN_DEFAULTS


class Engine:
    def __init__(
        self,
        committer: Committer,
        *,
        lease: Lease | None = None,
        defaults: RunDefaults = PLAIN_DEFAULTS,
        observer: Observer = CRASH_POINTS,
        max_size: int = 64,
        max_in_flight: int = 2,
        max_statements: int | None = None,
        stores: Stores | None = None,
    ) -> None:
        self._scheduler = GroupCommit(
            committer,
            max_size=max_size,
            max_in_flight=max_in_flight,
            max_statements=max_statements,
            observer=observer,
        )
        self._terms = Terms(lease, defaults)
        # The read models the original package's store API (``at``) reads through; None for an engine over
        # something other than the database.
        self.stores = stores

    @classmethod
    def over(cls, stores: Stores, **options: Any) -> Engine:
        """An engine over ``stores``' database."""
        return cls(PostgresCommitter(stores.db), stores=stores, **options)

    def under(self, *, lease: Lease | None = None, defaults: RunDefaults | None = None) -> Engine:
        """This engine with other terms, sharing its scheduler (and so its batches)."""
        view = object.__new__(Engine)
        view._scheduler = self._scheduler
        view._terms = Terms(lease if lease is not None else self._terms.lease, defaults or self._terms.defaults)
        view.stores = self.stores
        return view

    # --- what operations are given (``Steps``) --------------------------------------------------------

    @property
    def lease(self) -> Lease:
        if self._terms.lease is None:
            raise RunLeaseLost("this engine holds no lease: it claims nothing (give it one with under(lease=...))")
        return self._terms.lease

    @property
    def defaults(self) -> RunDefaults:
        return self._terms.defaults

    async def commit(self, transition: Transition[R]) -> R:
        return await self._scheduler.commit(transition)

    # --- the facade -----------------------------------------------------------------------------------

    async def apply(self, work: Applicable[R]) -> R:
        """Apply one transition or operation: its result, or its typed refusal raised."""
        return await work.apply_in(self)

    async def apply_all(self, works: Sequence[Applicable[Any]]) -> list[Any]:
        """Apply several at once, so that they share batches; each outcome its own (its result, or the
        exception that refused it), in ``works``' order."""
        found = await asyncio.gather(*(self.apply(w) for w in works), return_exceptions=True)
        for outcome in found:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        return list(found)

    # --- the scheduler's parts ------------------------------------------------------------------------

    @property
    def scheduler(self) -> GroupCommit:
        return self._scheduler

    @property
    def observer(self) -> Observer:
        return self._scheduler.observer

    def observe(self, observer: Observer) -> None:
        """Have ``observer`` watch every commit from now on."""
        self._scheduler.observer = observer

    def hand_events_to(self, sink: EventSink) -> Callable[[], None]:
        """Hand every committed event to ``sink`` from now on; returns the function that stops it (later
        commits' events then go through the relays alone)."""
        self._scheduler.sink = sink

        def stop() -> None:
            if self._scheduler.sink is sink:
                self._scheduler.sink = None

        return stop

    def at(self, scope: Scope) -> ScopedEngine:
        """The original package's store API at ``scope``: its reads from the store, its writes through this
        engine (``engine/seed.py``)."""
        return ScopedEngine(self, scope)
