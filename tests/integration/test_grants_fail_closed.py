"""Grants that fail closed (ops/grants.py), on the real broker's management API.

- ``grant`` used to write a user's vhost permissions before its topic permissions: in between, or for good
  when the second call failed, a new host could publish any routing key. Whichever call fails now, the user
  never holds vhost permissions without the topic permissions that confine them.
- ``revoke`` removed the revoked scope's bindings from the user's ``<user>.*`` queues only; a durable
  server-named queue (``amq.gen-*``, which hosts could declare and read) kept receiving the revoked tenant's
  events.
- User names were not checked against the patterns they are used in, ``users add`` wiped an existing
  user's tags, ``grant`` on a trusted user demoted it without closing its connections, and the placeholder
  scope of unreadable refusals could be granted.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from urllib.parse import quote

import aio_pika
import aiormq
import httpx
import pytest
from click.testing import CliRunner

from intermission.ops.cli import main
from intermission.ops.grants import BrokerGrants
from intermission.publishers.amqp import with_credentials
from intermission.schemas.errors import InvalidArgument
from intermission.schemas.scope import Scope
from intermission.wire import EVENTS_EXCHANGE, declare
from tests.support.amqp import AmqpUser, ConnectionFactory, Vhost
from tests.support.confined import Confiner, Management
from tests.support.waiting import eventually

WAIT = 20.0


class FailingOn(httpx.AsyncBaseTransport):
    """The real management API, but for the first request whose method and path match: that one fails as a
    lost connection would, before it reaches the broker."""

    def __init__(self, method: str, path: str) -> None:
        self._real = httpx.AsyncHTTPTransport()
        self._method, self._path = method, re.compile(path)
        self.failed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self.failed and request.method == self._method and self._path.search(request.url.path):
            self.failed = True
            raise httpx.ConnectError("the management API went away", request=request)
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


def through(transport: FailingOn, management: Management, vhost: Vhost) -> BrokerGrants:
    """The product's grants over the real management API, behind ``transport``."""
    client = httpx.AsyncClient(
        base_url=management.url, auth=(management.user, management.password), transport=transport, timeout=10.0
    )
    return BrokerGrants(client, vhost.name)


async def rights_of(management: Management, vhost: Vhost, user: str) -> tuple[bool, set[str]]:
    """Whether ``user`` holds vhost permissions, and the exchanges it holds topic permissions on."""
    async with management.client() as http:
        vhost_rights = await http.get(f"/api/permissions/{quote(vhost.name, safe='')}/{quote(user, safe='')}")
        topics = await http.get(f"/api/topic-permissions/{quote(vhost.name, safe='')}/{quote(user, safe='')}")
    exchanges = {str(t["exchange"]) for t in topics.json()} if topics.status_code == 200 else set()
    return vhost_rights.status_code == 200, exchanges


@pytest.mark.parametrize(
    "failing",
    [
        ("PUT", r"^/api/topic-permissions/"),  # the first write
        ("PUT", r"^/api/permissions/"),  # the last
    ],
)
async def test_a_grant_that_fails_halfway_leaves_the_user_without_access(
    failing: tuple[str, str], confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope
) -> None:
    user = await confiner.add_user("halfway")
    transport = FailingOn(*failing)
    grants = through(transport, management, amqp_vhost)
    try:
        with pytest.raises(httpx.ConnectError):
            await grants.grant(user.name, scope)
    finally:
        await grants.close()
    assert transport.failed
    has_vhost_rights, _ = await rights_of(management, amqp_vhost, user.name)
    assert not has_vhost_rights
    # And the broker itself refuses the user the vhost.
    # It closes the connection it was opening: aiormq reads that as an unexpected frame.
    with pytest.raises((aiormq.exceptions.AMQPError, ConnectionError)):
        await aio_pika.connect(amqp_vhost.url(user))


async def test_revoke_removes_the_scope_from_a_server_named_queue_a_host_declared(
    confiner: Confiner,
    management: Management,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
    scope: Scope,
    other_scope: Scope,
) -> None:
    admin = await amqp_connect(amqp_vhost.url(), "admin")
    admin_channel = await admin.channel(publisher_confirms=True)
    await declare(admin_channel, delivery_limit=10)
    user = await confiner.confined(scope, other_scope, prefix="legacy")
    # Granted by a version that let hosts declare and read server-named queues.
    async with management.client() as http:
        legacy = r"amq\.gen-.*|" + re.escape(user.name) + r"\..*"
        response = await http.put(
            f"/api/permissions/{quote(amqp_vhost.name, safe='')}/{quote(user.name, safe='')}",
            json={
                "configure": f"^({legacy})$",
                "write": f"^(intermission\\.commands|{legacy})$",
                "read": f"^(intermission\\.events|{legacy})$",
            },
        )
        response.raise_for_status()
    host = await amqp_connect(amqp_vhost.url(user), "legacy host")
    channel = await (await host.channel()).get_underlay_channel()
    # Named by the broker (aio-pika would name it itself): the protocol's own queue.declare with no name.
    declared = await channel.queue_declare("", durable=True)
    name = str(declared.queue)
    assert name.startswith("amq.gen-")
    for kept_or_revoked in (scope, other_scope):
        await channel.queue_bind(name, EVENTS_EXCHANGE, routing_key=f"run.*.{kept_or_revoked.routing_suffix()}")

    grants = management.grants(amqp_vhost.name)
    try:
        assert await grants.revoke(user.name, other_scope) == [scope]
    finally:
        await grants.close()

    assert await confiner.event_bindings(name) == [f"run.*.{scope.routing_suffix()}"]
    events = await admin_channel.get_exchange(EVENTS_EXCHANGE)
    for sent in (other_scope, scope):  # the revoked scope's first, then the kept one's as a control
        await events.publish(
            aio_pika.Message(b"{}", message_id=str(sent)), routing_key=f"run.completed.{sent.routing_suffix()}"
        )
    admin_queue = await admin_channel.declare_queue(name, passive=True)
    received = await admin_queue.get(no_ack=True, fail=False, timeout=WAIT)
    assert received is not None
    assert received.message_id == str(scope)
    assert await admin_queue.get(no_ack=True, fail=False) is None
    # The host may not read server-named queues any more.
    again = await amqp_connect(amqp_vhost.url(user), "legacy host again")
    reader = await (await again.channel()).get_underlay_channel()
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
        await reader.basic_get(name)


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("intermission", "is reserved"),
        ("amq", "is reserved"),
        ("INTERMISSION", "is reserved"),
        ("a b", "cannot be confined"),
        ("", "cannot be confined"),
        ("x" * 129, "cannot be confined"),
    ],
)
async def test_user_names_the_patterns_cannot_hold_are_refused_before_anything_is_written(
    name: str, refusal: str, management: Management, amqp_vhost: Vhost, scope: Scope
) -> None:
    grants = management.grants(amqp_vhost.name)
    try:
        # The refusal of the name itself, not the ManagementError of a user that does not exist.
        with pytest.raises(InvalidArgument, match=refusal):
            await grants.grant(name, scope)
    finally:
        await grants.close()


async def test_an_existing_user_with_a_dot_in_its_name_is_never_confined(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope
) -> None:
    # `acme`'s queues, `acme\..*`, would hold those of `acme.eu`: such a user is refused, nothing written.
    acme = await confiner.confined(scope, prefix="acme")
    dotted = f"{acme.name}.eu"
    (
        await confiner.http.put(f"/api/users/{dotted}", json={"password": uuid.uuid4().hex, "tags": ""})
    ).raise_for_status()
    confiner.made.append(dotted)
    grants = management.grants(amqp_vhost.name)
    try:
        with pytest.raises(InvalidArgument, match="no dots"):
            await grants.grant(dotted, scope)
    finally:
        await grants.close()
    assert await rights_of(management, amqp_vhost, dotted) == (False, set())


async def test_the_placeholder_scope_of_unreadable_refusals_is_never_granted(
    confiner: Confiner, management: Management, amqp_vhost: Vhost
) -> None:
    user = await confiner.add_user("placeholder")
    grants = management.grants(amqp_vhost.name)
    try:
        with pytest.raises(InvalidArgument, match="reserved"):
            await grants.grant(user.name, Scope(app="_", tenant="_"))
    finally:
        await grants.close()
    assert await rights_of(management, amqp_vhost, user.name) == (False, set())


async def test_users_add_keeps_an_existing_user_s_tags(confiner: Confiner, management: Management) -> None:
    user = await confiner.add_user("tagged")
    async with management.client() as http:
        (
            await http.put(f"/api/users/{user.name}", json={"password": user.password, "tags": "monitoring"})
        ).raise_for_status()
        grants = BrokerGrants(http, "/")
        assert await grants.add_user(user.name, "a-new-password") is False
        assert (await http.get(f"/api/users/{user.name}")).json()["tags"] in (["monitoring"], "monitoring")


async def test_grant_on_a_trusted_user_closes_its_connections(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope
) -> None:
    user = await confiner.add_user("demoted")
    grants = management.grants(amqp_vhost.name)
    try:
        await grants.trust(user.name)
        connection = await aio_pika.connect(amqp_vhost.url(user))
        closed = asyncio.Event()
        connection.close_callbacks.add(lambda *_: closed.set())

        async def listed() -> bool:
            return bool(await confiner.connections_of(user.name))

        # The management API lists a connection a few seconds after it opens; the grant must find it.
        await eventually(listed, within=WAIT, what="the trusted user's connection listed")
        assert await grants.grant(user.name, scope) == [scope]
        await asyncio.wait_for(closed.wait(), WAIT)
    finally:
        await grants.close()


async def test_users_add_reads_the_password_from_stdin(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, database_url: str, amqp_url: str
) -> None:
    from tests.integration.test_operator_cli import env_of

    name = f"intermission-test-stdin-{uuid.uuid4().hex[:10]}"
    confiner.made.append(name)
    password = uuid.uuid4().hex
    result = await asyncio.to_thread(
        CliRunner().invoke,
        main,
        ["users", "add", name, "--password-stdin"],
        env=env_of(database_url, amqp_url),
        input=f"{password}\n",
    )
    assert result.exit_code == 0, result.output
    assert password not in result.output
    async with management.client() as http:
        await http.put(
            f"/api/permissions/{quote(amqp_vhost.name, safe='')}/{name}",
            json={"configure": "", "write": "", "read": ""},
        )
    connection = await aio_pika.connect(with_credentials(amqp_vhost.url(), name, password))
    await connection.close()
    refused = await asyncio.to_thread(
        CliRunner().invoke,
        main,
        ["users", "add", "acme.eu", "--password-stdin"],
        env=env_of(database_url, amqp_url),
        input="x\n",
    )
    assert refused.exit_code == 2
    assert "no dots" in refused.output


async def connection_to_close(
    confiner: Confiner, vhost: Vhost, user: AmqpUser
) -> tuple[aio_pika.abc.AbstractConnection, asyncio.Event]:
    """A connection of ``user``, listed by the management API (its statistics lag: a grant finds only the
    connections listed), and the event set when the broker closes it."""
    connection = await aio_pika.connect(vhost.url(user))
    closed = asyncio.Event()
    connection.close_callbacks.add(lambda *_: closed.set())

    async def listed() -> bool:
        return bool(await confiner.connections_of(user.name))

    await eventually(listed, within=WAIT, what=f"{user.name}'s connection listed")
    return connection, closed


async def test_a_trusted_user_whose_confinement_fails_halfway_is_left_with_no_access(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope
) -> None:
    user = await confiner.add_user("demoted-halfway")
    grants = management.grants(amqp_vhost.name)
    try:
        await grants.trust(user.name)
    finally:
        await grants.close()
    _, closed = await connection_to_close(confiner, amqp_vhost, user)
    transport = FailingOn("PUT", r"^/api/permissions/")  # the confined rights, written last
    failing = through(transport, management, amqp_vhost)
    try:
        with pytest.raises(httpx.ConnectError):
            await failing.grant(user.name, scope)
    finally:
        await failing.close()
    assert transport.failed
    # Not trusted any more (the old code kept its `.*` rights when the last write failed), and its
    # connection, which held the trusted rights, is closed.
    assert await rights_of(management, amqp_vhost, user.name) == (
        False,
        {"intermission.commands", "intermission.events"},
    )
    await asyncio.wait_for(closed.wait(), WAIT)
    with pytest.raises((aiormq.exceptions.AMQPError, ConnectionError)):
        await aio_pika.connect(amqp_vhost.url(user))


async def test_the_grant_command_says_it_confined_a_trusted_user_and_closes_its_connections(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope, database_url: str
) -> None:
    from tests.integration.test_operator_cli import env_of

    user = await confiner.add_user("demoted-cli")
    grants = management.grants(amqp_vhost.name)
    try:
        await grants.trust(user.name)
    finally:
        await grants.close()
    _, closed = await connection_to_close(confiner, amqp_vhost, user)
    result = await asyncio.to_thread(
        CliRunner().invoke,
        main,
        ["grant", user.name, "--app", scope.app, "--tenant", scope.tenant],
        env=env_of(database_url, amqp_vhost.url()),
    )
    assert result.exit_code == 0, result.output
    assert f"{user.name} was trusted with every scope: it is confined now" in result.output
    assert "1 open connection(s) were closed" in result.output
    await asyncio.wait_for(closed.wait(), WAIT)
    assert await rights_of(management, amqp_vhost, user.name) == (
        True,
        {"intermission.commands", "intermission.events"},
    )


async def test_the_grant_command_refuses_the_fleet_s_own_identities(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope, database_url: str
) -> None:
    from tests.integration.test_operator_cli import env_of

    bus = await confiner.add_user("bus")
    grants = management.grants(amqp_vhost.name)
    try:
        await grants.trust(bus.name)
        env = {**env_of(database_url, amqp_vhost.url()), "INTERMISSION_BUS_USER": bus.name}
        for command in ("grant", "revoke"):
            for who in (bus.name, management.user):
                result = await asyncio.to_thread(
                    CliRunner().invoke, main, [command, who, "--app", scope.app, "--tenant", scope.tenant], env=env
                )
                assert result.exit_code == 2, result.output
                assert "the fleet's own identities" in result.output
        assert (await grants.reach(bus.name)).every_scope
    finally:
        await grants.close()


async def test_revoke_leaves_a_trusted_process_s_exclusive_server_named_queue_alone(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, amqp_connect: ConnectionFactory, scope: Scope
) -> None:
    admin = await amqp_connect(amqp_vhost.url(), "trusted subscriber")
    admin_channel = await admin.channel(publisher_confirms=True)
    await declare(admin_channel, delivery_limit=10)
    host = await confiner.confined(scope, prefix="revoked")
    # A trusted process's live subscription to the scope, on a queue the broker named (aio-pika would
    # name it itself: the protocol's own queue.declare with no name).
    raw = await admin_channel.get_underlay_channel()
    name = str((await raw.queue_declare("", exclusive=True)).queue)
    assert name.startswith("amq.gen-")
    key = f"run.completed.{scope.routing_suffix()}"
    await raw.queue_bind(name, EVENTS_EXCHANGE, routing_key=key)
    queue = await admin_channel.declare_queue(name, passive=True)

    grants = management.grants(amqp_vhost.name)
    try:
        assert await grants.revoke(host.name, scope) == []
    finally:
        await grants.close()

    assert await confiner.event_bindings(name) == [key]
    events = await admin_channel.get_exchange(EVENTS_EXCHANGE)
    await events.publish(aio_pika.Message(b"{}", message_id="kept"), routing_key=key)
    received = await queue.get(no_ack=True, fail=False, timeout=WAIT)
    assert received is not None
    assert received.message_id == "kept"


async def test_a_host_cannot_read_the_queues_of_a_host_whose_name_starts_with_its_own(
    confiner: Confiner, amqp_vhost: Vhost, amqp_connect: ConnectionFactory, scope: Scope
) -> None:
    # `acme` and `acme.eu` were both valid names, and acme's `acme\..*` held acme.eu's queues; dots are
    # refused now (test_user_names_the_patterns_cannot_hold_are_refused_before_anything_is_written), and
    # the nearest names left, `acme` and `acme-eu`, have disjoint queues.
    admin = await amqp_connect(amqp_vhost.url(), "admin")
    await declare(await admin.channel(), delivery_limit=10)
    acme = await confiner.confined(scope, prefix="acme")
    acme_eu = AmqpUser(f"{acme.name}-eu", uuid.uuid4().hex)
    (
        await confiner.http.put(f"/api/users/{acme_eu.name}", json={"password": acme_eu.password, "tags": ""})
    ).raise_for_status()
    confiner.made.append(acme_eu.name)
    grants = confiner.management.grants(amqp_vhost.name)
    try:
        await grants.grant(acme_eu.name, scope)
    finally:
        await grants.close()
    eu_channel = await (await amqp_connect(amqp_vhost.url(acme_eu), "acme-eu")).channel()
    eu_queue = f"{acme_eu.name}.events"
    await eu_channel.declare_queue(eu_queue, durable=True)
    acme_raw = await (await (await amqp_connect(amqp_vhost.url(acme), "acme")).channel()).get_underlay_channel()
    own = await acme_raw.queue_declare(f"{acme.name}.events", durable=True)  # a positive control
    assert own.queue == f"{acme.name}.events"
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
        await acme_raw.basic_get(eu_queue)


@pytest.mark.parametrize("command", [["doctor"], ["grants"], ["grant", "someone", "--app", "acme", "--tenant", "t1"]])
async def test_a_management_url_with_credentials_is_never_printed_with_its_password(
    command: list[str], database_url: str, amqp_url: str
) -> None:
    from tests.integration.test_operator_cli import env_of
    from tests.support.metrics import free_port

    secret = uuid.uuid4().hex
    unreachable = f"http://admin:{secret}@127.0.0.1:{free_port()}"
    result = await asyncio.to_thread(CliRunner().invoke, main, command, env=env_of(database_url, amqp_url, unreachable))
    assert result.exit_code == 2, result.output
    assert "admin:***@127.0.0.1" in result.output
    assert secret not in result.output


async def test_a_narrowing_closes_a_connection_opened_an_instant_before(
    confiner: Confiner, management: Management, amqp_vhost: Vhost, scope: Scope, other_scope: Scope
) -> None:
    # The management API's statistics list a connection only seconds after it opens; a revocation that
    # looked there left a connection opened just before it with the rights it lost (cached per channel).
    host = await confiner.confined(scope, other_scope, prefix="fresh")
    trusted = await confiner.add_user("fresh-trusted")
    grants = management.grants(amqp_vhost.name)
    try:
        await grants.trust(trusted.name)
        closed = {who.name: asyncio.Event() for who in (host, trusted)}
        connections = [await aio_pika.connect(amqp_vhost.url(who)) for who in (host, trusted)]
        for who, connection in zip((host, trusted), connections, strict=True):
            connection.close_callbacks.add(lambda *_, event=closed[who.name]: event.set())
        assert await grants.revoke(host.name, other_scope) == [scope]
        assert (await grants.grant_scope(trusted.name, scope)).connections_closed == 1
    finally:
        await grants.close()
    for event in closed.values():
        await asyncio.wait_for(event.wait(), WAIT)
