"""Every event body is encoded once, in Python (``engine/events.py``), and SQL stores it as given: an event
published from memory by the worker that committed it (the hand-over) and the same event published again
from its outbox row by a relay (the worker died after its publish, before its mark) are byte-identical,
for every kind of event the engine writes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from intermission.engine.commands import Resume
from intermission.engine.core import Engine
from intermission.engine.runs import EndRun
from intermission.publishers.relay import OutboxRelay
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.events import RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, SuspendReason
from intermission.store import Stores
from intermission.store.inbox import Receipt
from intermission.wire import EVENTS_EXCHANGE, Command
from tests.support.factories import lease, paused_run, running_run
from tests.support.resume import admission_request, agent_reply_pause, first_for

if TYPE_CHECKING:
    from tests.support.amqp import Captured, CaptureFactory, ConnectionFactory

HOLD = 60.0


@dataclass
class Paths:
    engine: Engine
    handing: OutboxRelay  # the worker's relay: the engine's sink, publishing from memory
    relay: OutboxRelay  # another process's relay, publishing from the outbox


@pytest.fixture
async def paths(stores: Stores, amqp_url: str, amqp_connect: ConnectionFactory) -> AsyncIterator[Paths]:
    handing = OutboxRelay(stores.db, await amqp_connect(amqp_url, "handing"), hand_over_seconds=HOLD)
    relay = OutboxRelay(stores.db, await amqp_connect(amqp_url, "relay"))
    engine = Engine.over(stores)
    stop = engine.hand_events_to(handing)
    try:
        yield Paths(engine, handing, relay)
    finally:
        stop()
        await handing.close()
        await relay.close()


async def every_kind(stores: Stores, scope: Scope, engine: Engine) -> None:
    """One event of each kind the engine writes, committed through ``engine``."""
    # Notices, one per pause reason (approvals with their approvers).
    await paused_run(stores, scope, reason=SuspendReason.APPROVAL, approvers=["ana"], through=engine)
    await paused_run(stores, scope, reason=SuspendReason.EXTERNAL_TOOL, through=engine)
    replying = await agent_reply_pause(stores, scope)
    # run.resumed: by a claim, and by a reply's admission.
    p = await paused_run(stores, scope, through=engine)
    command = ResumeCommand(
        scope=scope,
        version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
        results=[ToolAnswer(call_id="c1", content='"quoted" é ✓')],
    )
    claimed = await engine.under(lease=lease()).apply(
        Resume(command, receipt=Receipt.of("m-resume", Command.RESUME.value, command), correlation_id="m-resume")
    )
    held = lease()
    await engine.at(scope).resume.admit_resume_leased(
        admission_request(replying, scope), held, first_for(replying, held), correlation_id="m-reply"
    )
    # run.<end>, one of each end, the first at the claimed run (with a text that needs escaping).
    await engine.apply(
        EndRun(
            scope,
            p.run.id,
            claimed.run.lease_owner or "",
            claimed.run.revision,
            RunEventKind.COMPLETED,
            output='done: "ok" — é\n',
            correlation_id="m-resume",
        )
    )
    for kind in (RunEventKind.FAILED, RunEventKind.CANCELLED, RunEventKind.EXPIRED):
        run, holder = await running_run(stores, scope, through=engine)
        await engine.apply(
            EndRun(scope, run.id, holder.owner, run.revision, kind, error=f"{kind.value} because", correlation_id=None)
        )


def kind_of(message: Captured) -> str:
    assert message.routing_key is not None
    return ".".join(message.routing_key.split(".")[:2])


async def test_an_event_handed_over_and_the_same_event_relayed_from_its_row_are_byte_identical(
    stores: Stores, scope: Scope, amqp_url: str, capture: CaptureFactory, paths: Paths
) -> None:
    seen = await capture(amqp_url, EVENTS_EXCHANGE, f"*.*.{scope.app}.{scope.tenant}")
    await every_kind(stores, scope, paths.engine)
    await paths.handing.handed_settled()
    async with stores.db.connection() as con:
        written = await con.raw.fetch(
            "SELECT message_id::text AS message_id, body, sent_at FROM outbox WHERE app = $1 AND tenant = $2",
            scope.app,
            scope.tenant,
        )
    ids = {r["message_id"] for r in written}
    # The agent-reply pause was written without a sink (a plain store call): its Notice went to the relays.
    handed = {r["message_id"] for r in written if r["sent_at"] is not None}
    # A copy of the list the capture keeps appending to.
    handed_first = list(await seen.wait_ids(handed))
    first = {m.message_id: m for m in handed_first}
    assert first.keys() == handed
    assert {kind_of(m) for m in first.values()} == {
        "notice.approval",
        "notice.external_tool",
        "run.resumed",
        "run.completed",
        "run.failed",
        "run.cancelled",
        "run.expired",
    }

    # The worker died after its publish and before its mark: its rows are unsent, and the hold it put on them
    # is over (what the outbox holds is what a relay publishes: the test only moves the clock of the rows).
    async with stores.db.connection() as con:
        await con.raw.execute(
            "UPDATE outbox SET sent_at = NULL, next_attempt_at = NULL WHERE message_id::text = ANY($1::text[])",
            sorted(handed),
        )
    assert await paths.relay.run_once() == len(ids)
    got = await seen.wait_for(lambda got: len(got) >= len(handed) + len(ids), what="the relayed copies")
    again = {m.message_id: m for m in got[len(handed_first) :]}
    assert again.keys() == ids
    assert "notice.agent_reply" in {kind_of(m) for m in again.values()}
    for message_id, handed_copy in first.items():
        relayed = again[message_id]
        assert relayed.body == handed_copy.body, kind_of(handed_copy)
        assert (relayed.routing_key, relayed.correlation_id, relayed.headers, relayed.type) == (
            handed_copy.routing_key,
            handed_copy.correlation_id,
            handed_copy.headers,
            handed_copy.type,
        )
    # And what either path publishes is what the outbox stored, as text, unchanged.
    stored = {r["message_id"]: r["body"] for r in written}
    for message_id, relayed in again.items():
        assert relayed.body == stored[message_id].encode()
