"""Group commit: the ONE scheduler every transition goes through, over a committer that runs its batches.

A worker has many runs and commands in flight at once, and under load many of them reach the same kind of
transition within the same moment: resumes that claim, runs that save a step or end, starts, pauses. Each
alone is a round trip and a commit with its WAL flush. ``GroupCommit`` gives every caller the result of its
own transition, but runs the transitions of one family that wait together as ONE statement of the family's
batch function (one array of its composite row, ``engine/transition.py``), so they share the round trip
and the commit.

- Nothing waits for a batch to fill. A batch starts as soon as a transition is submitted and fewer than
  ``max_in_flight`` batches of its family run (and fewer than ``max_statements`` statements in all); what
  is submitted while those run waits for the next one, so
  one transition alone goes straight through and, under load, batches grow by themselves up to
  ``max_size``: the busier the database, the more each commit carries. A batch takes what waits when it
  first runs, so everything submitted in the same turn of the event loop goes together.
- Each transition's outcome is its own: its result, or its typed refusal. A batch function applies its
  rows in order, each seeing what the rows before it wrote, so two transitions of one batch behave as they
  would one after the other. Rows are sorted by run, so two batches take the rows they share in one order.
- A batch that fails as a whole (the database away; a row that raises inside the function, such as a
  decision on a checkpoint no longer pending) is nobody's in particular: each of its transitions then runs
  alone, and gets its own outcome, error included.
- The events a batch's transitions wrote go to the ``EventSink`` right after its statement commits, in
  commit order, for the sink to publish from memory (their rows wait ``hold_seconds`` for the relays).

The ``Committer`` runs one batch: ``PostgresCommitter`` (``engine/postgres.py``) over the database, and
``InMemoryCommitter`` (``engine/memory.py``) over dictionaries for the fast tier of tests; one conformance
suite holds them to each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from intermission import points
from intermission.engine.events import OutboxEvent
from intermission.engine.observer import CRASH_POINTS, Observer
from intermission.engine.sink import EventSink
from intermission.engine.transition import Family, Transition
from intermission.store.rows import Out

log = logging.getLogger("intermission.engine")

T = TypeVar("T")
R = TypeVar("R")

# What a batch's output rows are, grouped by the position of the row that produced them.
Outs = list[list[Out]]


@dataclass(frozen=True)
class Batch:
    """ONE statement's worth of one family: its rows in order, the outbox hold in seconds for a family that
    takes one, and whether it is ``atomic`` (its output decoded before it commits)."""

    family: Family
    rows: Sequence[NamedTuple]
    hold: float | None = None
    atomic: bool = False


class Committer(Protocol):
    """Runs ONE batch: the family's batch function called once with the batch's rows (and its hold), its
    output rows grouped by input row and handed to ``decode``, whose value is returned. An atomic batch runs
    ``decode`` before it commits, and an exception from it rolls the whole batch back."""

    async def commit(self, batch: Batch, decode: Callable[[Outs], T]) -> T: ...


def group_by_position(found: Sequence[Out], size: int) -> Outs:
    """Output rows (each with its input row's position ``n``, from 1) grouped by input row."""
    grouped: Outs = [[] for _ in range(size)]
    for out in found:
        grouped[out["n"] - 1].append(out)
    return grouped


@dataclass
class _Waiting:
    transition: Transition[Any]
    done: asyncio.Future[Any]
    caller: object


@dataclass
class _Lane:
    family: Family
    waiting: list[_Waiting] = field(default_factory=list)
    running: set[asyncio.Task[None]] = field(default_factory=set)
    # How many transitions each statement carried, newest last (for tests and metrics; bounded).
    sizes: list[int] = field(default_factory=list)


# How many batch sizes a lane remembers.
_SIZES_KEPT = 1024


class GroupCommit:
    """The group-commit scheduler (see the module docstring)."""

    def __init__(
        self,
        committer: Committer,
        *,
        max_size: int = 64,
        max_in_flight: int = 2,
        max_statements: int | None = None,
        observer: Observer = CRASH_POINTS,
    ) -> None:
        if max_size < 1 or max_in_flight < 1 or (max_statements is not None and max_statements < 1):
            raise ValueError("a batch holds at least one transition, and at least one batch may run")
        self.committer = committer
        self.max_size = max_size
        self.max_in_flight = max_in_flight
        # Statements of every family at once: fewer than the pool's connections, so that what does not go
        # through the committer (the relay, lease renewals, reads) always finds one.
        self._statements = asyncio.Semaphore(max_statements) if max_statements is not None else None
        self.observer = observer
        self.sink: EventSink | None = None
        self._lanes: dict[str, _Lane] = {}

    def lane(self, family: Family) -> _Lane:
        lane = self._lanes.get(family.name)
        if lane is None:
            lane = self._lanes[family.name] = _Lane(family)
        return lane

    def sizes(self, family: Family) -> list[int]:
        """How many transitions each statement of ``family`` carried, oldest first."""
        return list(self.lane(family).sizes)

    def waiting(self, family: Family) -> int:
        """Transitions of ``family`` waiting for its next batch."""
        return len(self.lane(family).waiting)

    async def commit(self, transition: Transition[R]) -> R:
        """``transition``'s result once the batch it went in has committed, or its refusal raised."""
        done: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        lane = self.lane(transition.family)
        lane.waiting.append(_Waiting(transition, done, self.observer.caller()))
        self._start(lane)
        # Shielded: a caller cancelled (a stop past its grace) must not cancel a batch others share.
        return await asyncio.shield(done)

    def _start(self, lane: _Lane) -> None:
        if lane.waiting and len(lane.running) < self.max_in_flight:
            task = asyncio.create_task(self._run(lane), name=f"commit:{lane.family.name}")
            lane.running.add(task)
            task.add_done_callback(lambda t: self._finished(lane, t))

    def _finished(self, lane: _Lane, task: asyncio.Task[None]) -> None:
        lane.running.discard(task)
        self._start(lane)

    async def _run(self, lane: _Lane) -> None:
        taken, lane.waiting = lane.waiting[: self.max_size], lane.waiting[self.max_size :]
        if not taken:
            return
        lane.sizes.append(len(taken))
        del lane.sizes[:-_SIZES_KEPT]
        try:
            if len(taken) > 1:
                try:
                    await self._batch(lane.family, taken)
                    return
                except Exception as failed:  # nobody's in particular: each transition goes alone
                    log.debug(
                        "a batch failed; its transitions go one by one",
                        extra={"action": "batch_failed", "family": lane.family.name, "error": type(failed).__name__},
                    )
            for one in taken:
                if one.done.done():
                    continue
                try:
                    await self._batch(lane.family, [one])
                except Exception as failed:
                    if not one.done.done():
                        one.done.set_exception(failed)
        except BaseException as stopped:  # cancelled: nothing of the batch is known to have committed
            for one in taken:
                if not one.done.done():
                    one.done.set_exception(stopped if isinstance(stopped, Exception) else asyncio.CancelledError())
            raise

    async def _batch(self, family: Family, taken: list[_Waiting]) -> None:
        """One statement for ``taken``; every transition's outcome is set, or the statement's error raised
        and none is."""
        # A row the store cannot take (a value PostgreSQL refuses, found while encoding) is that transition's
        # refusal, before anything is sent.
        ready: list[tuple[_Waiting, NamedTuple]] = []
        for one in taken:
            try:
                ready.append((one, one.transition.row()))
            except Exception as refused:
                one.done.set_exception(refused)
        if not ready:
            return
        ready.sort(key=lambda pair: pair[0].transition.key())
        atomic = any(one.transition.atomic for one, _ in ready)
        hold = self.sink.hold_seconds if self.sink is not None and family.held else None

        def decode(outs: Outs) -> list[tuple[bool, Any]]:
            results: list[tuple[bool, Any]] = []
            for (one, _), found in zip(ready, outs, strict=True):
                try:
                    results.append((True, one.transition.result(found)))
                except Exception as refused:
                    if atomic and one.transition.atomic and one.transition.wrote(found):
                        raise  # written but not usable: the batch rolls back
                    results.append((False, refused))
            return results

        started = time.perf_counter()
        async with self._statements if self._statements is not None else contextlib.nullcontext():
            with self.observer.committing(family, [one.caller for one, _ in ready]):
                batch = Batch(family, [row for _, row in ready], hold, atomic)
                outcome = await self.committer.commit(batch, _with_outs(decode))
        outs, results = outcome
        log.debug(
            "committed",
            extra={
                "action": "committed",
                "family": family.name,
                "size": len(ready),
                "seconds": round(time.perf_counter() - started, 6),
            },
        )
        if len(ready) > 1 and not family.reads:
            # Several transitions committed together, none of their callers told yet: a crash here is what
            # group commit adds to the crashes every single transition survives.
            self.observer.reached(points.AFTER_BATCH_COMMIT)
        if self.sink is not None:
            events: list[OutboxEvent] = [
                event
                for (one, _), found in zip(ready, outs, strict=True)
                if one.transition.wrote(found)
                for event in one.transition.events()
            ]
            if events:
                self.sink.committed(events)
        for (one, _), (ok, value) in zip(ready, results, strict=True):
            if one.done.done():
                continue
            if ok:
                one.done.set_result(value)
            else:
                one.done.set_exception(value)

    def cancel(self) -> None:
        """End the running batches (a stop past its grace): their statements are cancelled, and whoever
        waits on them gets CancelledError."""
        for lane in self._lanes.values():
            for task in list(lane.running):
                task.cancel()
            for one in lane.waiting:
                if not one.done.done():
                    one.done.cancel()
            lane.waiting.clear()

    async def idle(self) -> None:
        """Return once no batch runs (what waits is started by the ones running)."""
        while True:
            running = [t for lane in self._lanes.values() for t in lane.running]
            if not running:
                return
            with contextlib.suppress(Exception):
                await asyncio.gather(*running, return_exceptions=True)


def _with_outs(decode: Callable[[Outs], T]) -> Callable[[Outs], tuple[Outs, T]]:
    """``decode`` that also hands back the output rows it decoded (the sink needs them after the commit)."""

    def both(outs: Outs) -> tuple[Outs, T]:
        return outs, decode(outs)

    return both
