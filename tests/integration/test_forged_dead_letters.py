"""Refusals that always fit the wire, and dead letters that cannot be forged (docs/operations.md, "The
dead-letter queue").

- A refused command whose headers nearly fill a frame: its dead copy (its headers plus the refusal's) used to
  exceed ``frame_max`` and the broker closed the worker's whole connection. The copy now leaves the
  sender's headers out when they would not fit, and says so.
- A confined host (mallory, tenant B) puts refusal-looking headers on its own command naming tenant A's
  key and code. The dead-letter tools used to believe them: ``dead list`` showed the letter as A's, and an
  operator's ``dead replay`` republished its body, which acts in A's scope, under A's key on the operator's
  trusted connection: B cancelled A's run. Now a letter's key is the broker's, a refusal is believed only on
  a worker's copy, and a replay goes out only under a key naming the body's scope, as its sender unless
  the operator agreed.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pamqp.frame
import pamqp.header
import pytest
from click.testing import CliRunner, Result

from intermission.fleet.worker import Worker
from intermission.ops.cli import main
from intermission.ops.dead import Kept, Source, list_dead, replay_dead
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import CancelCommand, ResumeCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DETAIL_HEADER,
    ERROR_HEADER,
    EVENTS_EXCHANGE,
    HEADERS_DROPPED_HEADER,
    ORIGINAL_KEY_HEADER,
    SCHEMA_VERSION_HEADER,
    Command,
)
from tests.integration.test_hostile_headers import closes_of
from tests.integration.test_hostile_messages import refusals_break_for
from tests.integration.test_messaging import LOOKUP, next_event, notice_for, one_run_served, start
from tests.support.amqp import AmqpUser, CaptureFactory, ConnectionFactory, Vhost
from tests.support.confined import Confiner

__all__ = ["refusals_break_for"]  # a fixture, used by name

WAIT = 30.0


async def publish_as(
    user: AmqpUser, vhost: Vhost, amqp_connect: ConnectionFactory, message: aio_pika.Message, routing_key: str
) -> None:
    connection = await amqp_connect(vhost.url(user), f"publisher {user.name}")
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(COMMANDS_EXCHANGE)
    await exchange.publish(message, routing_key=routing_key)


# The broker's frame_max (RabbitMQ's default, which the test broker keeps): a message's properties travel
# in one frame.
FRAME_MAX = 131_072


def header_frame_bytes(message: aio_pika.Message) -> int:
    """The size on the wire of ``message``'s content header frame, which must fit ``frame_max``."""
    return len(pamqp.frame.marshal(pamqp.header.ContentHeader(0, len(message.body), message.properties), 1))


def padded_to(size: int, command: CancelCommand, message_id: str) -> aio_pika.Message:
    """``command`` with an ``x-pad`` header that makes its header frame exactly ``size`` bytes."""

    def with_pad(pad: int) -> aio_pika.Message:
        return aio_pika.Message(
            command.model_dump_json().encode(),
            message_id=message_id,
            content_type="application/json",
            headers={SCHEMA_VERSION_HEADER: 1, "x-pad": "p" * pad},
        )

    # A long string's length counts once, byte for byte: the frame grows by exactly what the pad does.
    return with_pad(100_000 + size - header_frame_bytes(with_pad(100_000)))


async def paused_run(host: HostClient, scope: Scope) -> tuple[str, ResumeCommand]:
    """A run of ``scope`` paused on an external tool, and the resume that would complete it."""
    cmd = start(scope, LOOKUP, {"say": "done"})
    async with host.subscribe(scope) as subscription:
        await host.start(cmd)
        notice = (await next_event(subscription, notice_for(cmd.run_id), within=WAIT)).event
    answer = ToolAnswer(call_id=notice.pending[0].id, content="42")
    return cmd.run_id, ResumeCommand(scope=scope, version=version_of(notice), results=[answer])


async def test_a_refusal_of_a_command_with_near_frame_headers_keeps_the_connection_and_the_copy(
    worker: Worker,
    scope: Scope,
    other_scope: Scope,
    host: HostClient,
    confiner: Confiner,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
) -> None:
    closes = closes_of(worker.connection)
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, f"command.rejected.{scope.routing_suffix()}")
    sender = await confiner.confined(scope, prefix="padder")
    message_id = f"padded-{uuid.uuid4()}"
    # A frame is 128 KiB here: these headers fill all of it but a few bytes, so the broker takes them, and
    # a copy with the refusal's headers added to them would not fit.
    padded = padded_to(FRAME_MAX - 32, CancelCommand(scope=scope, run_id="no-such-run"), message_id)
    assert header_frame_bytes(padded) == FRAME_MAX - 32
    await publish_as(sender, amqp_vhost, amqp_connect, padded, Command.CANCEL.key(scope))

    # Another tenant, served by the same worker on the same connection meanwhile.
    await one_run_served(host, other_scope, within=WAIT)

    [event] = await refused.wait_count(1, within=WAIT)
    assert (event.json()["message_id"], event.json()["code"]) == (message_id, "invalid_message")
    [letter] = await dead.wait_for(lambda got: len(got) >= 1, within=WAIT, what="the dead copy")
    assert letter.message_id == message_id
    assert letter.headers[ERROR_HEADER] == "invalid_message"
    assert "x-pad" not in letter.headers
    assert "left out" in str(letter.headers[HEADERS_DROPPED_HEADER])
    assert letter.headers[SCHEMA_VERSION_HEADER] == 1
    assert closes == []


@pytest.mark.parametrize("dead_lettered_by", [Source.WORKER, Source.BROKER])
async def test_a_forged_dead_letter_is_shown_as_its_sender_s_and_never_replayed_into_another_tenant(
    dead_lettered_by: Source,
    worker: Worker,
    stores: Stores,
    scope: Scope,
    other_scope: Scope,
    host: HostClient,
    confiner: Confiner,
    amqp_url: str,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    refusals_break_for: set[str],
) -> None:
    victim = scope
    victim_run, _ = await paused_run(host, victim)
    before = await stores.at(victim).runs.get_run(victim_run)
    mallory = await confiner.confined(other_scope, prefix="mallory")
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    message_id = f"forged-{uuid.uuid4()}"
    if dead_lettered_by is Source.BROKER:
        # Refusing it fails: the worker rejects it and the broker dead-letters it with every header it had.
        refusals_break_for.add(message_id)
    forged = aio_pika.Message(
        CancelCommand(scope=victim, run_id=victim_run, reason="forged").model_dump_json().encode(),
        message_id=message_id,
        content_type="application/json",
        headers={
            SCHEMA_VERSION_HEADER: 1,
            ORIGINAL_KEY_HEADER: Command.CANCEL.key(victim),
            ERROR_HEADER: "store_unavailable",
            DETAIL_HEADER: "the database was down; replay me",
        },
    )
    # Mallory may publish only its own scope's key; the body acts in the victim's scope.
    await publish_as(mallory, amqp_vhost, amqp_connect, forged, Command.CANCEL.key(other_scope))
    await dead.wait_for(lambda got: len(got) >= 1, within=WAIT, what="the dead letter")
    refusals_break_for.clear()

    operator = await amqp_connect(amqp_url, "operator")
    [letter] = await list_dead(operator)
    assert letter.message_id == message_id
    assert letter.routing_key == Command.CANCEL.key(other_scope)
    assert letter.scope == other_scope
    assert letter.source is dead_lettered_by
    assert letter.verified  # the worker's refusal, or the broker's reason: never mallory's headers
    if dead_lettered_by is Source.WORKER:
        assert (letter.code, letter.detail.startswith("the routing key names")) == ("forbidden", True)
    else:
        assert letter.code == "broker_rejected"
    assert "replay me" not in letter.detail

    # The operator replays everything, and even agrees to publish as itself: the body's scope is not the
    # one the key named, so nothing goes out.
    victim_queue = await capture(amqp_url, COMMANDS_EXCHANGE, f"run.*.{victim.routing_suffix()}")
    done = await replay_dead(operator, lambda d: True, as_another=True)
    assert done.replayed == []
    assert [(d.message_id, why) for d, why in done.kept] == [(message_id, Kept.SCOPE_MISMATCH)]
    assert [d.message_id for d in await list_dead(operator)] == [message_id]  # kept in place

    # A positive control behind it: a command of the victim's own reaches the victim's queue, and the
    # forged cancel never did; the victim's run is still paused.
    control = CancelCommand(scope=victim, run_id="control-run", reason="control")
    await host.cancel(control)
    await victim_queue.wait_for(lambda got: len(got) >= 1, within=WAIT, what="the control command")
    assert [m.json().get("reason") for m in victim_queue.messages] == ["control"]
    after = await stores.at(victim).runs.get_run(victim_run)
    assert after.state is RunState.PAUSED
    assert after == before  # the victim's run row, version and all, untouched


async def test_dead_replay_asks_before_publishing_a_sender_s_command_as_the_operator(
    amqp_url: str, database_url: str, amqp_vhost: Vhost, amqp_connect: ConnectionFactory, scope: Scope
) -> None:
    """A dead letter without its sender's user_id would go out as the operator: ``dead replay`` says so
    and asks; unanswered (as in a script), it stops with exit 1 and replays nothing; ``--yes`` replays it."""
    from tests.integration.test_operator_cli import env_of, parsed

    connection = await amqp_connect(amqp_url, "ops")
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(DEAD_EXCHANGE)
    letter = CancelCommand(scope=scope, run_id="some-run")
    await exchange.publish(
        aio_pika.Message(
            letter.model_dump_json().encode(),
            message_id="sent-by-a-host",
            headers={SCHEMA_VERSION_HEADER: 1, ERROR_HEADER: "store_unavailable"},
        ),
        routing_key=Command.CANCEL.key(scope),
    )
    env = env_of(database_url, amqp_url)

    def replay(*args: str) -> Result:
        return CliRunner().invoke(main, ["dead", "replay", "--all", *args], env=env, input="")

    refused = await asyncio.to_thread(replay)
    assert refused.exit_code == 1, refused.output
    assert "1 command(s) would go out as" in refused.stderr
    assert "replayed" not in refused.stdout
    assert [d.message_id for d in await list_dead(connection)] == ["sent-by-a-host"]

    agreed = parsed(await asyncio.to_thread(replay, "--yes", "--json"))
    assert [d["message_id"] for d in agreed["replayed"]] == ["sent-by-a-host"]
    assert await list_dead(connection) == []


async def test_a_forged_command_the_delivery_limit_dead_letters_is_listed_and_kept_as_its_sender_s(
    scope: Scope,
    other_scope: Scope,
    confiner: Confiner,
    amqp_url: str,
    database_url: str,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
) -> None:
    """The broker's own delivery limit (no worker here: a consumer hands the command back until the queue
    gives up on it) dead-letters mallory's forged cancel with every header mallory wrote. ``dead list`` (and
    its --json) shows mallory's key and the broker's reason, and ``dead replay --all --yes`` sends nothing."""
    from tests.integration.test_operator_cli import env_of, parsed

    victim = scope
    mallory = await confiner.confined(other_scope, prefix="mallory")
    dead = await capture(amqp_vhost.url(), DEAD_EXCHANGE, "")
    message_id = f"forged-{uuid.uuid4()}"
    forged = aio_pika.Message(
        CancelCommand(scope=victim, run_id="victims-run", reason="forged").model_dump_json().encode(),
        message_id=message_id,
        content_type="application/json",
        headers={
            SCHEMA_VERSION_HEADER: 1,
            ORIGINAL_KEY_HEADER: Command.CANCEL.key(victim),
            ERROR_HEADER: "store_unavailable",
            DETAIL_HEADER: "the database was down; replay me",
            # A dead-lettering history of mallory's own: the broker's latest entry is still the one read.
            "x-death": [
                {"reason": "expired", "queue": "intermission.cancel", "routing-keys": [Command.CANCEL.key(victim)]}
            ],
        },
    )
    await publish_as(mallory, amqp_vhost, amqp_connect, forged, Command.CANCEL.key(other_scope))

    operator = await amqp_connect(amqp_url, "operator")
    channel = await operator.channel()
    queue = await channel.get_queue(Command.CANCEL.queue)
    handed_back = 0
    while (delivered := await queue.get(no_ack=False, fail=False)) is not None:
        assert delivered.message_id == message_id
        await delivered.nack(requeue=True)
        handed_back += 1
    [letter] = await dead.wait_for(lambda got: len(got) >= 1, within=WAIT, what="the dead letter")
    assert letter.headers["x-death"][0]["reason"] == "delivery_limit"
    assert letter.routing_key == Command.CANCEL.key(other_scope)
    assert handed_back > 1

    env = env_of(database_url, amqp_url)
    listed = parsed(await asyncio.to_thread(CliRunner().invoke, main, ["dead", "list", "--json"], env=env))
    [shown] = listed["letters"]
    assert (shown["message_id"], shown["routing_key"]) == (message_id, Command.CANCEL.key(other_scope))
    assert (shown["source"], shown["verified"], shown["code"]) == ("broker", True, "delivery_limit")
    assert "replay me" not in shown["detail"]
    text = await asyncio.to_thread(CliRunner().invoke, main, ["dead", "list"], env=env)
    assert Command.CANCEL.key(other_scope) in text.stdout
    assert Command.CANCEL.key(victim) not in text.stdout
    assert "store_unavailable" not in text.stdout

    victim_queue = await capture(amqp_url, COMMANDS_EXCHANGE, f"run.*.{victim.routing_suffix()}")
    replayed = parsed(
        await asyncio.to_thread(CliRunner().invoke, main, ["dead", "replay", "--all", "--yes", "--json"], env=env)
    )
    assert replayed["replayed"] == []
    assert [(k["letter"]["message_id"], k["why"]) for k in replayed["kept"]] == [(message_id, "scope_mismatch")]
    # A positive control behind it: a command of the victim's own reaches the capture; the forged one never did.
    commands = await channel.get_exchange(COMMANDS_EXCHANGE)
    control = CancelCommand(scope=victim, run_id="control-run", reason="control")
    await commands.publish(
        aio_pika.Message(control.model_dump_json().encode(), message_id="control"),
        routing_key=Command.CANCEL.key(victim),
    )
    await victim_queue.wait_for(lambda got: len(got) >= 1, within=WAIT, what="the control command")
    assert [m.message_id for m in victim_queue.messages] == ["control"]
    assert [d.message_id for d in await list_dead(operator)] == [message_id]  # kept in place
