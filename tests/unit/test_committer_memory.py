"""The in-memory committer's own mechanics (``engine/memory.py``): what makes its batches behave as the
database's do (a raising row takes the batch with it, an atomic batch is decoded before it commits,
sequences never give back what they handed out), its clock, and jsonb's text. What it renders of each batch
function is the conformance suite's (``tests/support/conformance.py``), held to PostgreSQL row for row by
``tests/integration/test_conformance_postgres.py``. No I/O."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from intermission.engine.commands import Resume
from intermission.engine.committer import Batch, Outs
from intermission.engine.core import Engine
from intermission.engine.holding import TakeOverRun
from intermission.engine.memory import (
    Clock,
    InMemoryCommitter,
    committer_of,
    json_timestamp,
    jsonb,
    memory_engine,
)
from intermission.engine.observer import Quiet
from intermission.engine.pauses import DeletePause
from intermission.engine.runs import DrawPauseKeys, SaveProgress
from intermission.engine.sink import CollectedEvents
from intermission.engine.starts import START, StartRow
from intermission.engine.transition import Family
from intermission.schemas.errors import InvalidArgument, NotSuspended, RunLeaseLost, SuspensionExpired
from intermission.store.db import StoreError
from tests.support.conformance import (
    LEASE,
    RIVAL,
    SCOPE,
    MemoryWorld,
    Recording,
    answer,
    forbid_sockets,
    leased,
    outbox_of,
    paused,
    run_row,
    snapshot,
    start,
)


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_sockets(monkeypatch)


def start_row(run_id: str, **changes: Any) -> StartRow:
    row = StartRow(
        run_id,
        "acme",
        "t1",
        "demo",
        "hi",
        "{}",
        None,
        0,
        f"s-{run_id}",
        "digest",
        None,
        None,
        None,
        None,
        None,
        None,
        0,
        0.0,
    )
    return row._replace(**changes)


def outcomes(outs: Outs) -> list[str]:
    return [found[0]["outcome"] for found in outs]


# --- batches -------------------------------------------------------------------------------------------


async def test_a_row_that_raises_takes_its_whole_batch_with_it() -> None:
    committer = InMemoryCommitter()
    rows = [start_row("r1"), start_row("not a run id!")]
    with pytest.raises(StoreError, match="23514"):
        await committer.commit(Batch(START, rows), outcomes)
    assert committer.tables.runs == {}
    # Alone, each gets its own outcome (what the scheduler does with a batch that failed).
    assert await committer.commit(Batch(START, rows[:1]), outcomes) == ["created"]
    assert committer.failed == {"start": 1}


async def test_rows_of_one_batch_see_what_the_rows_before_them_wrote() -> None:
    committer = InMemoryCommitter()
    rows = [start_row("r1"), start_row("r1"), start_row("r1", start_digest="another")]
    found = await committer.commit(Batch(START, rows), outcomes)
    assert found == ["created", "exists_same", "run_exists"]


async def test_an_atomic_batch_is_decoded_before_it_commits_and_a_failed_decode_rolls_it_back() -> None:
    committer = InMemoryCommitter()

    def unreadable(outs: Outs) -> None:
        raise ValueError("cannot be decoded")

    with pytest.raises(ValueError, match="decoded"):
        await committer.commit(Batch(START, [start_row("r1")], atomic=True), unreadable)
    assert committer.tables.runs == {}
    # Not atomic, the statement committed before its rows were decoded: the decode changes nothing.
    with pytest.raises(ValueError, match="decoded"):
        await committer.commit(Batch(START, [start_row("r1")]), unreadable)
    assert list(committer.tables.runs) == [("acme", "t1", "r1")]


async def test_sequences_never_give_back_what_they_handed_out() -> None:
    engine = memory_engine()
    first = await engine.apply(DrawPauseKeys(True))
    committer = committer_of(engine)
    with pytest.raises(StoreError):
        await committer.commit(Batch(START, [start_row("bad id")]), outcomes)
    second = await engine.apply(DrawPauseKeys(True))
    assert (second.suspension_id, second.checkpoint_id) == (first.suspension_id + 1, (first.checkpoint_id or 0) + 1)


async def test_text_the_database_cannot_hold_is_refused_before_anything_is_written() -> None:
    committer = InMemoryCommitter()
    for bad in (start_row("r1", input="nul \x00 here"), start_row("r1", config='{"a": "\\u0000"}')):
        with pytest.raises(InvalidArgument):
            await committer.commit(Batch(START, [bad]), outcomes)
    with pytest.raises(StoreError, match="22P02"):
        await committer.commit(Batch(START, [start_row("r1", config="{not json")]), outcomes)
    assert committer.tables.runs == {}


async def test_an_event_of_a_family_that_hands_its_events_over_is_held_for_the_sink() -> None:
    world = MemoryWorld()
    await paused(world, "r1")
    [held] = await outbox_of(world, SCOPE, "r1")
    assert held["next_attempt_at"] - held["created_at"] == timedelta(seconds=3)
    # Without a sink nothing is handed over, and the row is due at once.
    bare = MemoryWorld()
    bare.engine.hand_events_to(CollectedEvents(hold_seconds=None))
    await paused(bare, "r1")
    [due] = await outbox_of(bare, SCOPE, "r1")
    assert due["next_attempt_at"] is None


# --- the clock -----------------------------------------------------------------------------------------


async def test_a_lease_lapses_when_its_time_has_passed_on_the_clock() -> None:
    world = MemoryWorld(memory=InMemoryCommitter(Clock(datetime(2030, 1, 1, tzinfo=UTC))))
    run = (await start(world)).run
    assert run.created_at is not None
    assert run.created_at - datetime(2030, 1, 1, tzinfo=UTC) < timedelta(milliseconds=1)
    await world.later(LEASE.ttl_seconds + 1)
    await _refused_save(world)
    taken = await world.engine.apply(TakeOverRun(SCOPE, "r1", RIVAL))
    assert taken.lease_owner == RIVAL.owner


async def _refused_save(world: MemoryWorld) -> None:
    with pytest.raises(RunLeaseLost):
        await world.engine.apply(SaveProgress(SCOPE, snapshot("r1")))


async def test_a_deadline_passes_when_its_time_has_passed_on_the_clock() -> None:
    world = MemoryWorld()
    p = await paused(world, ttl=60)
    await world.later(59)
    await world.later(1.5)
    with pytest.raises(SuspensionExpired):
        await leased(world).apply(Resume(answer(p)))
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["state"] == "paused"


def test_the_clock_moves_on_by_a_tick_each_transaction_and_never_back() -> None:
    clock = Clock(datetime(2030, 1, 1, tzinfo=UTC))
    one, two = clock.transaction(), clock.transaction()
    assert two - one == timedelta(microseconds=1)
    assert clock.advance(10) - two == timedelta(seconds=10)
    with pytest.raises(ValueError, match="back"):
        clock.advance(-1)


# --- jsonb's text --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        # What PostgreSQL 15 hands back for each (`SELECT $1::jsonb::text`).
        ('{"b": 1.50, "a": [1E2, -0, "\\u00e9\\t"], "aa": {}}', '{"a": [100, 0, "é\\t"], "b": 1.50, "aa": {}}'),
        ('{"k":1,"k":2}', '{"k": 2}'),
        ("[1e-7, -0.0, 12.3400e2]", "[0.0000001, 0.0, 1234.00]"),
        ('"\\u0001 \\/"', '"\\u0001 /"'),
        ("  true ", "true"),
    ],
)
def test_jsonb_text_is_what_postgresql_writes(given: str, stored: str) -> None:
    assert jsonb(given) == stored


def test_a_timestamp_in_jsonb_loses_its_trailing_zeros() -> None:
    assert json_timestamp(datetime(2024, 1, 1, 10, 0, 0, 120000, tzinfo=UTC)) == "2024-01-01T10:00:00.12+00:00"
    assert json_timestamp(datetime(2024, 1, 1, 10, 0, tzinfo=UTC)) == "2024-01-01T10:00:00+00:00"


def test_an_engine_over_another_committer_is_not_an_in_memory_one() -> None:
    with pytest.raises(TypeError, match="Recording"):
        committer_of(Engine(Recording(InMemoryCommitter())))


class CancelsAfterCommit(Quiet):
    """Cancels ``caller_task`` as the statement ends, ``hops`` turns of the loop later: a cancel that lands
    around the moment the committer sets the outcome and the caller wakes to take it (a lease keeper
    cancelling a run whose write was just refused, say). Which turn is the dangerous one depends on how the
    caller waits, so the test tries each."""

    def __init__(self, hops: int) -> None:
        self.hops = hops
        self.caller_task: asyncio.Task[Any] | None = None

    @contextlib.contextmanager
    def committing(self, family: Family, callers: Sequence[object]) -> Iterator[None]:
        yield
        if self.caller_task is not None:
            self._later(self.caller_task, self.hops)

    def _later(self, task: asyncio.Task[Any], hops: int) -> None:
        loop = asyncio.get_running_loop()
        if hops <= 1:
            loop.call_soon(task.cancel)
        else:
            loop.call_soon(self._later, task, hops - 1)


@pytest.mark.parametrize("hops", [1, 2, 3])
async def test_a_refusal_whose_caller_was_cancelled_is_not_reported_as_never_retrieved(hops: int) -> None:
    # A refusal nobody took, reported "never retrieved" when its future is collected, logs an error with a
    # traceback from a finalizer at any moment (on CPython 3.11 it even re-enters ast.parse from there,
    # which made a test that parses source fail with "AST constructor recursion depth mismatch").
    observer = CancelsAfterCommit(hops)
    engine = memory_engine(observer=observer)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        caller = asyncio.create_task(engine.apply(DeletePause(SCOPE, "no-such-run")))
        observer.caller_task = caller
        # Cancelled, or refused when the cancel came after it woke: either way nothing is left over.
        with pytest.raises((asyncio.CancelledError, NotSuspended)):
            await caller
        await engine.scheduler.idle()
        # The refusal was there to take: alone and not cancelled, the same transition raises it.
        observer.caller_task = None
        with pytest.raises(NotSuspended):
            await engine.apply(DeletePause(SCOPE, "no-such-run"))
        del caller
        observer.caller_task = None
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c["message"] for c in reported] == []
