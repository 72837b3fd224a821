"""No message wedges a command queue. Forty of each hostile message go to the queue a worker consumes;
every one is settled (refused with its code and dead-lettered, or, when even refusing fails, dead-lettered
by the broker), nothing stays unacknowledged, and a normal run then pauses and resumes through the same
worker.

Before the refusal path was made total, three of these left their deliveries unsettled for good (JSON
nested 5,000 deep, a 250-byte message_id, a header that is not UTF-8): with prefetch-many of them held,
the queue stopped on that worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest

from intermission import points
from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient
from intermission.schemas.scope import Scope
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_QUEUE,
    ERROR_HEADER,
    EVENTS_EXCHANGE,
    MAX_SHORT_STRING_BYTES,
    SCHEMA_VERSION_HEADER,
    Command,
    derived_id,
)
from tests.integration.test_messaging import one_run_served
from tests.support.amqp import AmqpUser, Broker, CaptureFactory, ConnectionFactory, Vhost
from tests.support.hostile import RawText, nested, padded_id
from tests.support.waiting import eventually

COPIES = 40
WAIT = 60.0


GOOD_VERSION = {"run_id": "r-1", "suspension_id": 1, "run_revision": 1}


def resume_body(scope: Scope, **version: Any) -> bytes:
    return json.dumps({"scope": scope.model_dump(), "version": GOOD_VERSION | version, "results": []}).encode()


def start_body(scope: Scope, **changes: Any) -> str:
    body: dict[str, Any] = {"scope": scope.model_dump(), "run_id": f"r-{uuid.uuid4().hex[:8]}", "agent_id": "demo"}
    body.update(changes)
    return json.dumps(body)


@dataclass(frozen=True)
class Hostile:
    command: Command
    body: Callable[[Scope], bytes]
    # The code of the refusal, or None when the refusal itself fails and the broker dead-letters it.
    code: str | None
    headers: dict[str, Any] = field(default_factory=lambda: {SCHEMA_VERSION_HEADER: 1})
    message_id: Callable[[int], str] = lambda i: f"hostile-{uuid.uuid4()}"


HOSTILE = {
    "json_nested_5000_deep": Hostile(Command.RESUME, lambda s: nested(5000), "invalid_message"),
    "message_id_of_250_bytes": Hostile(
        Command.RESUME, lambda s: b"{not json", "invalid_message", message_id=lambda i: padded_id(f"{i:03d}")
    ),
    "header_not_utf8": Hostile(
        Command.RESUME,
        lambda s: b"{not json",
        "invalid_message",
        headers={
            SCHEMA_VERSION_HEADER: 1,
            "x-note": RawText(b"\xff\xfe not utf-8"),
            "x-nested": {"v": RawText(b"\xc3")},
        },
    ),
    "schema_version_not_utf8": Hostile(
        Command.RESUME,
        lambda s: resume_body(s),
        "unsupported_schema_version",
        headers={SCHEMA_VERSION_HEADER: RawText(b"\xff")},
    ),
    "message_id_with_nul": Hostile(
        Command.RESUME, lambda s: resume_body(s), "invalid_message", message_id=lambda i: f"bad\x00id-{uuid.uuid4()}"
    ),
    "body_over_the_limit": Hostile(
        Command.RESUME,
        lambda s: resume_body(s)[:-1] + b', "pad": "' + b"x" * (1024 * 1024) + b'"}',
        "invalid_message",
    ),
    "revision_past_64_bits": Hostile(Command.RESUME, lambda s: resume_body(s, run_revision=2**63), "invalid_message"),
    "suspension_id_past_64_bits": Hostile(
        Command.RESUME, lambda s: resume_body(s, suspension_id=2**64 + 1), "invalid_message"
    ),
    "ttl_past_the_database": Hostile(
        Command.START, lambda s: start_body(s, pause_ttl_seconds=2**31).encode(), "invalid_message"
    ),
    "nan_in_script_arguments": Hostile(
        Command.START,
        lambda s: (
            start_body(s, script=[{"call": [{"tool": "charge", "arguments": {"amount": 0}}]}])
            .replace('"amount": 0', '"amount": NaN')
            .encode()
        ),
        "invalid_message",
    ),
    "huge_integer_in_script_arguments": Hostile(
        Command.START,
        lambda s: start_body(s, script=[{"call": [{"tool": "charge", "arguments": {"amount": 10**30}}]}]).encode(),
        "invalid_message",
    ),
    "refusal_that_cannot_be_built": Hostile(Command.RESUME, lambda s: b"{not json", None),
}


@pytest.fixture
def refusals_break_for() -> Iterator[set[str]]:
    """While this set holds the ids of messages in flight, every refusal fails while it is being built: the
    observer of the ``refusing`` point raises (the worker runs in this process)."""
    broken: set[str] = set()

    def observer(point: str) -> None:
        if point == points.REFUSING and broken:
            raise RuntimeError("the refusal could not be built")

    points.observe(observer)
    yield broken
    points.observe(None)


async def unacknowledged(rabbit: Broker, vhost: Vhost) -> dict[str, int]:
    out = await rabbit.run(
        "list_queues", "-p", vhost.name, "name", "messages_unacknowledged", "messages", "--no-table-headers"
    )
    found: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            found[parts[0]] = int(parts[1]) + int(parts[2])
    return found


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_hostile_messages_are_all_settled_and_the_queue_keeps_serving(
    kind: str,
    worker: Worker,
    scope: Scope,
    host: HostClient,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    refusals_break_for: set[str],
) -> None:
    hostile = HOSTILE[kind]
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, "command.rejected.#")
    connection = await amqp_connect(amqp_vhost.url(AmqpUser(rabbit.host.name, rabbit.host.password)), "hostile")
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
    ids = [hostile.message_id(i) for i in range(COPIES)]
    if hostile.code is None:
        refusals_break_for.update(ids)
    await asyncio.gather(
        *(
            exchange.publish(
                aio_pika.Message(
                    hostile.body(scope),
                    message_id=message_id,
                    headers=hostile.headers,
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=hostile.command.value,
            )
            for message_id in ids
        )
    )

    letters = await dead.wait_for(lambda got: len(got) >= COPIES, within=WAIT, what=f"{COPIES} dead letters")
    assert sorted(str(m.message_id) for m in letters) == sorted(ids)  # each kept, none twice
    if hostile.code is None:
        # Refusing failed: the broker dead-lettered each delivery the worker rejected without requeue.
        assert {m.headers["x-death"][0]["reason"] for m in letters} == {"rejected"}
        assert refused.messages == []
    else:
        assert {m.headers[ERROR_HEADER] for m in letters} == {hostile.code}
        events = await refused.wait_count(COPIES, within=WAIT)
        assert sorted(m.json()["message_id"] for m in events) == sorted(ids)
        assert {m.json()["code"] for m in events} == {hostile.code}
        for event in events:
            assert event.message_id == derived_id("rejected", event.json()["message_id"])
            assert event.message_id is not None
            assert len(event.message_id.encode()) <= MAX_SHORT_STRING_BYTES
    refusals_break_for.clear()

    # The same worker still serves the queue: a normal run pauses and resumes.
    await one_run_served(host, scope, within=WAIT)

    held = await unacknowledged(rabbit, amqp_vhost)
    assert {c.queue: held.get(c.queue) for c in Command} == {c.queue: 0 for c in Command}


async def test_a_refusal_the_broker_will_not_take_is_retried_until_it_does(
    worker: Worker,
    scope: Scope,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``intermission.dead`` at a length limit with reject-publish nacks every dead copy (as a quorum queue
    without a quorum does): the refusal is retried, not given up to the broker's dead-lettering without its
    code; once the queue takes messages again the command is refused with its code, once, and settled."""
    caplog.set_level(logging.INFO)
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, "command.rejected.#")
    await rabbit.run(
        "set_policy",
        "-p",
        amqp_vhost.name,
        "dead-full",
        "^intermission\\.dead$",
        '{"max-length": 1, "overflow": "reject-publish"}',
        "--apply-to",
        "queues",
    )

    async def policy_applied() -> bool:
        out = await rabbit.run("list_queues", "-p", amqp_vhost.name, "name", "policy", "--no-table-headers")
        return any(line.split() == [DEAD_QUEUE, "dead-full"] for line in out.splitlines())

    await eventually(policy_applied, within=WAIT, what="the length limit applied to intermission.dead")
    admin = await amqp_connect(amqp_vhost.url(), "filler")
    admin_channel = await admin.channel(publisher_confirms=True)
    dead_exchange = await admin_channel.get_exchange(DEAD_EXCHANGE)
    # A quorum queue refuses a publish only once it is past its limit: two messages fill one of length 1.
    for _ in range(2):
        await dead_exchange.publish(aio_pika.Message(b"what filled it", message_id="filler"), routing_key="")
    connection = await amqp_connect(amqp_vhost.url(AmqpUser(rabbit.host.name, rabbit.host.password)), "bad")
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
    bad_id = f"bad-{uuid.uuid4()}"
    await exchange.publish(
        aio_pika.Message(b"{not json", message_id=bad_id, headers={SCHEMA_VERSION_HEADER: 1}),
        routing_key=Command.RESUME.value,
    )

    async def retried() -> bool:
        return any(getattr(r, "action", None) == "refusal_retry" for r in caplog.records)

    await eventually(retried, within=WAIT, what="the refusal retried")
    # Make room (a quorum queue keeps refusing past its limit even once the policy is cleared, so the
    # fillers are taken out instead).
    dead = await admin_channel.declare_queue(DEAD_QUEUE, passive=True)
    for _ in range(2):
        filler = await dead.get(timeout=WAIT)
        assert filler is not None
        assert filler.message_id == "filler"
        await filler.ack()

    events = await refused.wait_for(
        lambda got: any(m.json()["message_id"] == bad_id for m in got), within=WAIT, what="the refusal"
    )
    assert [m.json()["code"] for m in events] == ["invalid_message"]
    letter = await dead.get(timeout=WAIT)
    assert letter is not None
    assert (letter.message_id, letter.headers[ERROR_HEADER]) == (bad_id, "invalid_message")
    assert "x-death" not in letter.headers  # the worker's refusal, not the broker's dead-lettering

    async def settled() -> bool:
        return (await unacknowledged(rabbit, amqp_vhost)).get(Command.RESUME.queue) == 0

    await eventually(settled, within=WAIT, what="the command settled")
