"""``intermission demo`` plays its three runs to completion through the real servers: as users of its own
when RabbitMQ's management API answers (a host the broker confines to the demo's scope, who also approves,
and a trusted bus), as the AMQP URL's own user when it does not.

Each test names the demo's users for itself (``DemoUsers``) and deletes them afterwards: RabbitMQ users
belong to the whole broker, and a demo of another test run beside this one would otherwise change their
passwords under it."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aio_pika
import aiormq
import pytest
from yarl import URL

from intermission.fleet.settings import Settings
from intermission.ops.demo import ENABLE_MANAGEMENT, SCOPE, DemoUsers, cast, dismiss, play
from intermission.ops.grants import NOTHING, host_permissions
from intermission.publishers.amqp import PublishFailed
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import CancelCommand
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.wire import COMMANDS_EXCHANGE, EVENTS_EXCHANGE
from tests.support.amqp import DELIVERY_LIMIT, Vhost
from tests.support.confined import Management
from tests.support.fleet import fast_settings


@pytest.fixture
async def demo_users(management: Management) -> AsyncIterator[DemoUsers]:
    suffix = uuid.uuid4().hex[:10]
    users = DemoUsers(host=f"intermission-test-demo-host-{suffix}", bus=f"intermission-test-demo-bus-{suffix}")
    yield users
    async with management.client() as http:
        for name in (users.host, users.bus):
            await http.delete(f"/api/users/{quote(name, safe='')}")


def demo_settings(database_url: str, amqp_url: str, management: Management, **changes: Any) -> Settings:
    values: dict[str, Any] = {
        "amqp_url": amqp_url,
        "delivery_limit": DELIVERY_LIMIT,
        "management_url": management.url,
        "management_user": management.user,
        "management_password": management.password,
    }
    return fast_settings(database_url, **{**values, **changes})


async def assert_three_demo_runs_completed(stores: Stores, story: list[str]) -> None:
    text = "\n".join(story)
    for reason in ("external_tool", "approval", "agent_reply"):
        assert f"paused ({reason})" in text
    assert "Done: 3 of 3 runs completed" in text
    runs = await stores.across_scopes.list_runs(RunState.COMPLETED, 10)
    assert {r.id.split("-")[0] for r in runs} == {"weather", "invoice", "quote"}
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM demo_charges") == 1


async def permissions_of(management: Management, user: str, vhost: str) -> tuple[list[Any], list[Any]]:
    """``user``'s permissions and topic permissions in ``vhost``, as the management API reads them."""
    async with management.client() as http:
        found = []
        for kind in ("permissions", "topic-permissions"):
            response = await http.get(f"/api/users/{quote(user, safe='')}/{kind}")
            response.raise_for_status()
            found.append([{k: v for k, v in r.items() if k not in ("user", "vhost")} for r in response.json()])
            assert all(r["vhost"] == vhost for r in response.json()), response.json()
    return found[0], found[1]


async def test_the_demo_acts_as_a_host_confined_to_its_scope_and_a_bus_of_its_own(
    stores: Stores,
    database_url: str,
    amqp_url: str,
    amqp_vhost: Vhost,
    management: Management,
    demo_users: DemoUsers,
) -> None:
    story: list[str] = []
    settings = demo_settings(database_url, amqp_url, management)
    assert await play(settings, story.append, demo_users) == 3
    await assert_three_demo_runs_completed(stores, story)
    text = "\n".join(story)
    assert f"The host {demo_users.host}, who is also the approver, is confined to demo/local by the broker" in text
    assert f"The bus peer is {demo_users.bus}" in text
    assert ENABLE_MANAGEMENT not in text

    # The approval was decided by the confined host, as the broker vouched for it.
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT array_agg(decided_by) FROM checkpoints") == [demo_users.host]

    # The demo leaves no user behind, least of all its trusted bus.
    async with management.client() as http:
        for user in (demo_users.host, demo_users.bus):
            assert (await http.get(f"/api/users/{user}")).status_code == 404

    # While it plays, the host is confined: exactly what `intermission grant` gives a host of demo/local.
    await cast(settings, story.append, demo_users)
    p = host_permissions(demo_users.host, [SCOPE])
    rights, topics = await permissions_of(management, demo_users.host, amqp_vhost.name)
    assert rights == [{"configure": p.configure, "write": p.write, "read": p.read}]
    assert sorted(topics, key=lambda t: str(t["exchange"])) == [
        {"exchange": COMMANDS_EXCHANGE, "write": p.commands_write, "read": NOTHING},
        {"exchange": EVENTS_EXCHANGE, "write": NOTHING, "read": p.events_read},
    ]
    # The bus is trusted with every scope.
    rights, topics = await permissions_of(management, demo_users.bus, amqp_vhost.name)
    assert rights == [{"configure": ".*", "write": ".*", "read": ".*"}]
    assert topics == []
    await dismiss(settings, demo_users)
    async with management.client() as http:
        for user in (demo_users.host, demo_users.bus):
            assert (await http.get(f"/api/users/{user}")).status_code == 404


async def test_every_demo_gives_its_users_fresh_passwords_and_its_host_no_other_scope(
    database_url: str,
    amqp_url: str,
    management: Management,
    demo_users: DemoUsers,
    other_scope: Scope,
) -> None:
    settings = demo_settings(database_url, amqp_url, management)
    story: list[str] = []
    first = await cast(settings, story.append, demo_users)
    second = await cast(settings, story.append, demo_users)
    assert story == []
    assert first.confined
    assert second.confined
    assert (first.host_user, first.bus_user) == (demo_users.host, demo_users.bus)
    assert URL(first.host_url).password != URL(second.host_url).password
    assert URL(first.bus_url).password != URL(second.bus_url).password
    for stale in (first.host_url, first.bus_url):
        with pytest.raises(aiormq.exceptions.AMQPConnectionError):
            await refused_login(stale)

    async with await HostClient.connect(second.host_url, name="demo host") as host:
        await host.cancel(CancelCommand(scope=SCOPE, run_id="run-1"))
        with pytest.raises(PublishFailed) as refused:
            await host.cancel(CancelCommand(scope=other_scope, run_id="run-1"))
    assert isinstance(refused.value.__cause__, aiormq.exceptions.ChannelAccessRefused)


async def refused_login(url: str) -> None:
    """Log in with ``url`` (the test expects the broker to refuse it)."""
    connection = await aio_pika.connect(url)
    await connection.close()


def closed_port() -> int:
    """A local port nobody listens on (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_without_the_management_api_the_demo_acts_as_the_amqp_urls_own_user_and_says_so(
    stores: Stores, database_url: str, amqp_url: str, management: Management, demo_users: DemoUsers
) -> None:
    story: list[str] = []
    settings = demo_settings(database_url, amqp_url, management, management_url=f"http://127.0.0.1:{closed_port()}")
    assert await play(settings, story.append, demo_users) == 3
    await assert_three_demo_runs_completed(stores, story)
    own = URL(amqp_url).user
    told = [line for line in story if ENABLE_MANAGEMENT in line]
    assert len(told) == 1, story
    assert f"all act as {own}, the AMQP URL's own user" in told[0]
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT array_agg(decided_by) FROM checkpoints") == [own]
    # Nothing was made.
    async with management.client() as http:
        for name in (demo_users.host, demo_users.bus):
            assert (await http.get(f"/api/users/{quote(name, safe='')}")).status_code == 404


async def test_a_demo_that_fails_leaves_no_user_behind(
    stores: Stores,
    database_url: str,
    amqp_url: str,
    management: Management,
    demo_users: DemoUsers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started_as: list[str] = []

    def no_worker(settings: Settings) -> Any:
        started_as.append(settings.bus_user)
        raise RuntimeError("the worker would not start")

    monkeypatch.setattr("intermission.ops.demo.running_worker", no_worker)
    story: list[str] = []
    with pytest.raises(RuntimeError, match="would not start"):
        await play(demo_settings(database_url, amqp_url, management), story.append, demo_users)
    # The users were made (the worker was to take replies from the demo's own bus), and are gone: above all
    # the bus, trusted with every scope.
    assert started_as == [demo_users.bus]
    async with management.client() as http:
        for user in (demo_users.host, demo_users.bus):
            assert (await http.get(f"/api/users/{quote(user, safe='')}")).status_code == 404
