"""``intermission dead list|replay``: dead-lettered commands can be seen without being taken, and sent back
once what refused them is fixed, never lost on the way."""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Callable

import aio_pika
from click.testing import CliRunner

from intermission.fleet.worker import Worker
from intermission.ops.cli import main
from intermission.ops.dead import Kept, list_dead, replay_dead
from intermission.publishers.clients import HostClient, version_of
from intermission.schemas.commands import CancelCommand, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from intermission.wire import COMMANDS_EXCHANGE, DEAD_EXCHANGE, ERROR_HEADER, SCHEMA_VERSION_HEADER, Command
from tests.support.amqp import Broker, CaptureFactory, ConnectionFactory, Vhost
from tests.support.waiting import eventually


async def test_dead_letters_are_listed_in_place_and_replayed_once_fixed(
    worker: Worker,
    stores: Stores,
    scope: Scope,
    amqp_url: str,
    amqp_vhost: Vhost,
    rabbit: Broker,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    async with await HostClient.connect(amqp_vhost.url(rabbit.host)) as host, host.subscribe(scope) as events:
        await host.start(
            StartCommand(
                scope=scope,
                run_id=run_id,
                agent_id="demo",
                script=[ScriptTurn.model_validate({"call": [{"tool": "lookup"}]})],
            )
        )
        async with asyncio.timeout(20):
            async for received in events:
                if isinstance(received.event, Notice):
                    notice = received.event
                    break
        # A valid resume the broker dead-lettered after it kept failing (say the database was down for
        # longer than the delivery limit), and a command refused for good.
        resume = ResumeCommand(
            scope=scope, version=version_of(notice), results=[ToolAnswer(call_id=notice.pending[0].id, content="v")]
        )
        connection = await amqp_connect(amqp_url, "ops")
        channel = await connection.channel(publisher_confirms=True)
        dead = await channel.get_exchange(DEAD_EXCHANGE)
        kept_failing = str(uuid.uuid4())
        await dead.publish(
            aio_pika.Message(
                resume.model_dump_json().encode(),
                message_id=kept_failing,
                content_type="application/json",
                headers={
                    SCHEMA_VERSION_HEADER: 1,
                    "x-death": [
                        {"reason": "delivery_limit", "queue": "intermission.resume", "routing-keys": ["run.resume"]}
                    ],
                },
            ),
            routing_key=Command.RESUME.value,
        )
        refused = str(uuid.uuid4())
        await dead.publish(
            aio_pika.Message(b"{not json", message_id=refused, headers={ERROR_HEADER: "invalid_message"}),
            routing_key=Command.RESUME.value,
        )

        listed = await list_dead(connection)
        assert {(d.message_id, d.code) for d in listed} == {
            (kept_failing, "delivery_limit"),
            (refused, "invalid_message"),
        }
        assert {d.message_id for d in await list_dead(connection)} == {kept_failing, refused}  # nothing was taken

        sent = await capture(amqp_url, COMMANDS_EXCHANGE, Command.RESUME.binding)
        # Published without a user_id, it goes out as the operator's user: only with the operator's consent.
        refused_consent = await replay_dead(connection, lambda d: d.code == "delivery_limit")
        assert refused_consent.replayed == []
        assert [(d.message_id, why) for d, why in refused_consent.kept] == [(kept_failing, Kept.ANOTHER_IDENTITY)]
        done = await replay_dead(connection, lambda d: d.code == "delivery_limit", as_another=True)
        assert [d.message_id for d in done.replayed] == [kept_failing]
        # It died under the bare key of an older host; it goes back keyed by its body's scope.
        (again,) = await sent.wait_ids({kept_failing})
        assert again.routing_key == again.type == Command.RESUME.key(scope)

        async def completed() -> bool:
            return (await stores.at(scope).runs.get_run(run_id)).state is RunState.COMPLETED

        await eventually(completed, what="the replayed resume applied")
        assert [d.message_id for d in await list_dead(connection)] == [refused]


class AnswerThen(io.BytesIO):
    """A terminal's answer that, as it is read, lets something happen first: what arrives while the person
    reads the question."""

    def __init__(self, answer: bytes, meanwhile: Callable[[], None]) -> None:
        super().__init__(answer)
        self.meanwhile: Callable[[], None] | None = meanwhile

    def _first(self, n: int | None) -> None:
        if n != 0 and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()

    def read(self, n: int | None = -1) -> bytes:
        self._first(n)
        return super().read(n)

    def read1(self, n: int | None = -1) -> bytes:
        self._first(n)
        return super().read1(n)

    def readline(self, n: int | None = -1) -> bytes:
        self._first(n)
        return super().readline(n)


async def test_dead_replay_publishes_as_the_operator_only_the_letters_it_asked_about(
    amqp_url: str,
    database_url: str,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    capture: CaptureFactory,
    scope: Scope,
) -> None:
    """The operator agrees to replay, as themselves, the letters ``dead replay --all`` listed; one that was
    dead-lettered while they read the question was not among them, and is kept (``another_identity``)
    rather than published on the operator's identity unseen."""
    from tests.integration.test_operator_cli import env_of, parsed

    connection = await amqp_connect(amqp_url, "ops")
    channel = await connection.channel(publisher_confirms=True)
    dead = await channel.get_exchange(DEAD_EXCHANGE)

    async def dead_letter(message_id: str) -> None:
        body = CancelCommand(scope=scope, run_id="some-run", reason=message_id)
        letter = aio_pika.Message(
            body.model_dump_json().encode(), message_id=message_id, headers={SCHEMA_VERSION_HEADER: 1}
        )
        await dead.publish(letter, routing_key=Command.CANCEL.key(scope))

    await dead_letter("shown")
    sent = await capture(amqp_url, COMMANDS_EXCHANGE, Command.CANCEL.binding)
    loop = asyncio.get_running_loop()

    def arrives() -> None:
        asyncio.run_coroutine_threadsafe(dead_letter("arrived-later"), loop).result(timeout=30)

    done = parsed(
        await asyncio.to_thread(
            CliRunner().invoke,
            main,
            ["dead", "replay", "--all", "--json"],
            env=env_of(database_url, amqp_url),
            input=AnswerThen(b"y\n", arrives),
        )
    )
    assert [d["message_id"] for d in done["replayed"]] == ["shown"]
    assert [(k["letter"]["message_id"], k["why"]) for k in done["kept"]] == [("arrived-later", "another_identity")]
    await sent.wait_ids({"shown"})
    assert [d.message_id for d in await list_dead(connection)] == ["arrived-later"]
    assert [m.message_id for m in sent.messages] == ["shown"]
