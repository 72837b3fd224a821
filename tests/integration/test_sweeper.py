"""The expiry sweeper on the real PostgreSQL and RabbitMQ: one deterministic ``run.expire`` per expired
pause of a paused run, across scopes, in bounded pages; several sweepers at once only ever duplicate a
command byte for byte."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import aio_pika
import asyncpg
import pytest

from intermission.publishers.sweeper import ExpirySweeper
from intermission.schemas.commands import ExpireCommand
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores
from intermission.store.db import Database
from intermission.wire import COMMANDS_EXCHANGE, SCHEMA_VERSION, SCHEMA_VERSION_HEADER, Command
from tests.conftest import MakeStores, race
from tests.support.factories import PausedRun, paused_run, writes
from tests.support.waiting import eventually

if TYPE_CHECKING:
    # Types only: importing tests.support.amqp here would defeat pytest's assertion rewriting of the plugin.
    from tests.support.amqp import Capture, CaptureFactory, ConnectionFactory

# The broker fixtures (a vhost per test, captures, the test users) until tests/conftest.py lists them.

TINY_TTL = 0.001  # a deadline a millisecond ahead of the database clock: passed almost at once
HOUR = 3600.0
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)
STOP_WITHIN = 10.0


async def expired_pauses(stores: Stores, database_url: str, scope: Scope, n: int) -> list[PausedRun]:
    made = [await paused_run(stores, scope, ttl_seconds=TINY_TTL) for _ in range(n)]
    ids = [p.run.id for p in made]
    con = await asyncpg.connect(database_url)
    try:

        async def all_passed() -> bool:
            # Judged by the database clock, like the sweeper's own read.
            return bool(
                await con.fetchval("SELECT bool_and(expires_at <= now()) FROM suspensions WHERE run_id = ANY($1)", ids)
            )

        await eventually(all_passed, what="the deadlines to pass by the database clock")
    finally:
        await con.close()
    return made


def expected(p: PausedRun, scope: Scope) -> tuple[str, bytes]:
    """The one message id and body every sweeper must publish for ``p``."""
    assert p.suspension.expires_at is not None
    body = ExpireCommand(
        scope=scope,
        version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
        expired_by=p.suspension.expires_at,
    ).model_dump_json()
    return f"expire:{p.run.id}:{p.suspension.id}", body.encode()


@pytest.fixture
async def sweepers() -> AsyncIterator[list[ExpirySweeper]]:
    made: list[ExpirySweeper] = []
    yield made
    for sweeper in made:
        await sweeper.close()


async def new_sweeper(
    db: Database, amqp_url: str, amqp_connect: ConnectionFactory, made: list[ExpirySweeper], **options: Any
) -> ExpirySweeper:
    sweeper = ExpirySweeper(db, await amqp_connect(amqp_url, "sweeper"), **options)
    made.append(sweeper)
    return sweeper


async def expire_capture(capture: CaptureFactory, amqp_url: str) -> Capture:
    return await capture(amqp_url, COMMANDS_EXCHANGE, Command.EXPIRE.binding)


async def test_sweeper_publishes_one_deterministic_expire_per_expired_pause_of_a_paused_run_in_every_scope(
    stores: Stores,
    database_url: str,
    scope: Scope,
    other_scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    sweepers: list[ExpirySweeper],
) -> None:
    seen = await expire_capture(capture, amqp_url)
    mine = await expired_pauses(stores, database_url, scope, 2)
    theirs = await expired_pauses(stores, database_url, other_scope, 1)
    # Not to be expired: a deadline ahead, no deadline at all, and an expired pause whose run is no longer
    # paused (claimed by the expiry path; the fleet has not removed the pause row yet).
    await paused_run(stores, scope, ttl_seconds=HOUR)
    await paused_run(stores, scope, ttl_seconds=0)
    (claimed,) = await expired_pauses(stores, database_url, scope, 1)
    await writes(stores, scope).suspensions.claim_expired_suspension(claimed.run.id, FAR_FUTURE)

    sweeper = await new_sweeper(stores.db, amqp_url, amqp_connect, sweepers, batch=10)
    assert await sweeper.sweep_once() == 3

    want = dict([expected(p, scope) for p in mine] + [expected(p, other_scope) for p in theirs])
    got = await seen.wait_ids(set(want))
    assert {m.message_id: m.body for m in got} == want
    for message in got:
        keyed = ExpireCommand.model_validate_json(message.body).scope
        assert message.routing_key == message.type == Command.EXPIRE.key(keyed)
        assert message.content_type == "application/json"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.headers[SCHEMA_VERSION_HEADER] == SCHEMA_VERSION
    # Each command names the row's own scope and its deadline as expired_by.
    commands = {m.message_id: ExpireCommand.model_validate_json(m.body) for m in got}
    (their_id,) = [expected(p, other_scope)[0] for p in theirs]
    assert commands[their_id].scope == other_scope
    assert commands[their_id].expired_by == theirs[0].suspension.expires_at

    # Remembered: the next sweep publishes nothing again.
    assert await sweeper.sweep_once() == 0
    assert sweeper.published == 3


async def test_sweeper_works_through_more_expired_pauses_than_one_batch(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    sweepers: list[ExpirySweeper],
) -> None:
    seen = await expire_capture(capture, amqp_url)
    pauses = await expired_pauses(stores, database_url, scope, 11)
    # republish_after_seconds=0: nothing is remembered, so every sweep publishes every pause again.
    sweeper = await new_sweeper(stores.db, amqp_url, amqp_connect, sweepers, batch=4, republish_after_seconds=0)

    assert await sweeper.sweep_once() == 11
    want = dict(expected(p, scope) for p in pauses)
    await seen.wait_ids(set(want))
    assert Counter(seen.ids()) == Counter(list(want))

    # A second sweep re-publishes the same commands, byte for byte.
    assert await sweeper.sweep_once() == 11
    got = await seen.wait_count(22)
    assert all(want[m.message_id] == m.body for m in got if m.message_id is not None)


async def test_two_sweepers_at_once_publish_only_identical_duplicates(
    stores: Stores,
    make_stores: MakeStores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    sweepers: list[ExpirySweeper],
) -> None:
    seen = await expire_capture(capture, amqp_url)
    pauses = await expired_pauses(stores, database_url, scope, 6)
    a_stores, b_stores = await make_stores(2)
    a = await new_sweeper(a_stores.db, amqp_url, amqp_connect, sweepers, batch=4)
    b = await new_sweeper(b_stores.db, amqp_url, amqp_connect, sweepers, batch=4)

    assert await race(2, lambda i: (a, b)[i].sweep_once()) == [6, 6]

    got = await seen.wait_count(12)
    copies: dict[str | None, list[tuple[Any, ...]]] = defaultdict(list)
    for m in got:
        copies[m.message_id].append((m.body, m.type, m.content_type, m.delivery_mode, m.headers, m.correlation_id))
    assert set(copies) == {expected(p, scope)[0] for p in pauses}
    for message_id, versions in copies.items():
        assert len(versions) == 2
        assert versions[0] == versions[1], message_id


async def test_sweeper_serves_until_stopped(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    sweepers: list[ExpirySweeper],
) -> None:
    seen = await expire_capture(capture, amqp_url)
    pauses = await expired_pauses(stores, database_url, scope, 2)
    # An hour between sweeps: the first sweep runs at once, and the stop must cut the wait short.
    sweeper = await new_sweeper(stores.db, amqp_url, amqp_connect, sweepers, interval_seconds=HOUR)
    stop = asyncio.Event()
    serving = asyncio.create_task(sweeper.serve(stop))
    try:
        await seen.wait_ids({expected(p, scope)[0] for p in pauses})
    finally:
        stop.set()
        async with asyncio.timeout(STOP_WITHIN):
            await serving
    assert sweeper.sweeps == 1
    assert sweeper.failures == 0


async def test_a_rate_limited_sweeper_spaces_its_pages_and_still_publishes_every_pause(
    stores: Stores,
    database_url: str,
    scope: Scope,
    amqp_url: str,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    sweepers: list[ExpirySweeper],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = await expire_capture(capture, amqp_url)
    pauses = await expired_pauses(stores, database_url, scope, 7)
    waits: list[float] = []

    async def recorded(_stop: asyncio.Event, seconds: float) -> None:
        waits.append(seconds)  # recorded, not slept: the test asserts what was asked, never a time

    monkeypatch.setattr("intermission.publishers.sweeper.wait_or_stop", recorded)
    # 3 commands a second, a second's worth in one burst: each full page of 3 must take a second, far longer
    # than it does.
    sweeper = await new_sweeper(stores.db, amqp_url, amqp_connect, sweepers, batch=3, max_rate=3.0)

    assert await sweeper.sweep_once(asyncio.Event()) == 7
    # Bursts of 3, 3 and 1: a wait after each full second's worth, none after the last.
    assert len(waits) == 2
    assert all(0 < w <= 1.0 for w in waits)
    await seen.wait_ids({expected(p, scope)[0] for p in pauses})
    with pytest.raises(ValueError, match="max_rate"):
        ExpirySweeper(stores.db, await amqp_connect(amqp_url, "bad"), max_rate=0)
