"""A console that bounds everything (ops/console/limits.py, throttle.py, sessions.py), served by uvicorn
over the real broker and database:

- bodies are refused past a small limit, and multipart outright, before any form parser or handler runs
  (``/login`` used to read any form whole, or spool it to disk, before checking anything);
- a name that keeps failing from one address backs off there, never at the person's own address;
- a person's sessions are capped (each is an AMQP connection), the oldest ending first;
- the password is not kept once the person's connection is open;
- the dead-letter page reads a bounded page and shows only the person's scopes, without the fleet's
  figures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
import httpx
import pytest
from starlette.applications import Starlette

from intermission.fleet.settings import Settings
from intermission.ops.console.app import Console
from intermission.publishers.amqp import NodesConnection
from intermission.schemas.scope import Scope
from intermission.wire import DEAD_EXCHANGE, ERROR_HEADER, Command
from tests.support.amqp import ConnectionFactory, Vhost
from tests.support.confined import Confiner, Management
from tests.support.console import Served, browsing, console_settings, csrf_of, log_in, serving
from tests.support.waiting import eventually

WAIT = 20.0


@pytest.fixture
async def console(settings: Settings, management: Management, confiner: Confiner) -> AsyncIterator[Served]:
    capped = console_settings(settings, management).model_copy(update={"console_sessions_per_user": 2})
    async with serving(capped) as served:
        yield served


def console_of(served: Served) -> Console:
    app = served.server.config.app
    assert isinstance(app, Starlette)
    console = app.state.console
    assert isinstance(console, Console)
    return console


@asynccontextmanager
async def browsing_from(url: str, address: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose connections come from ``address`` (any of 127.0.0.0/8 is this machine)."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(base_url=url, timeout=30.0, transport=transport) as client:
        yield client


async def test_large_and_multipart_bodies_are_refused_before_any_handler(
    console: Served, confiner: Confiner, scope: Scope
) -> None:
    user = await confiner.confined(scope, prefix="bodies")
    async with browsing(console.url) as client:
        token = csrf_of((await client.get("/login")).text)
        big = {"csrf": token, "user": user.name, "password": user.password, "pad": "x" * 100_000}
        assert (await client.post("/login", data=big)).status_code == 413

        async def chunks() -> AsyncIterator[bytes]:
            yield f"csrf={token}&user={user.name}&password=".encode()
            for _ in range(64):
                yield b"y" * 1024

        # No Content-Length: the body is counted as it is read.
        streamed = await client.post(
            "/login", content=chunks(), headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert streamed.status_code == 413
        files = {"upload": ("big.bin", b"z" * 10, "application/octet-stream")}
        multipart = await client.post("/login", data={"csrf": token, "user": user.name}, files=files)
        assert multipart.status_code == 415
        # None of them reached the login: no password check, no connection, no throttle entry.
        assert await confiner.connections_of(user.name) == []
        assert len(console_of(console).throttle) == 0
        # The same form at its normal size logs in.
        assert (await log_in(client, user)).status_code == 303


async def test_a_name_failing_from_one_address_backs_off_there_and_never_at_the_person_s_own(
    console: Served, confiner: Confiner, scope: Scope
) -> None:
    alice = await confiner.confined(scope, prefix="alice")
    statuses = []
    async with browsing_from(console.url, "127.0.0.2") as attacker:
        # Backoff doubles past the free failures, so a refusal to check comes within these tries however
        # slow the machine.
        for _ in range(10):
            status = (await log_in(attacker, alice, password=f"not-{alice.password}")).status_code
            statuses.append(status)
            if status == 429:
                break
    assert statuses[-1] == 429
    assert set(statuses[:-1]) == {401}
    async with browsing_from(console.url, "127.0.0.3") as own:
        assert (await log_in(own, alice)).status_code == 303
        assert (await own.get("/inbox")).status_code == 200


async def test_a_person_s_sessions_are_capped_the_oldest_ending_and_none_keeps_the_password(
    console: Served, confiner: Confiner, scope: Scope
) -> None:
    user = await confiner.confined(scope, prefix="many")
    async with browsing(console.url) as first, browsing(console.url) as second, browsing(console.url) as third:
        for client in (first, second, third):
            assert (await log_in(client, user)).status_code == 303
        # The cap is two: the first session ended (its connection closed), the others go on.
        assert (await first.get("/inbox")).status_code == 303
        assert (await second.get("/inbox")).status_code == 200
        assert (await third.get("/inbox")).status_code == 200

        async def two_connections() -> bool:
            return len(await confiner.connections_of(user.name)) == 2

        await eventually(two_connections, within=WAIT, what="the first session's connection closed")
        sessions = console_of(console).sessions
        assert len(sessions) == 2
        for session in sessions._by_id.values():
            connection = session.client.connection
            assert isinstance(connection, NodesConnection)
            assert connection.transport is not None
            kept = [str(connection.url), *map(str, connection.factory.nodes), str(connection.factory.current)]
            kept.append(str(connection.transport.connection.url))
            assert all(user.password not in text for text in kept), kept


async def test_the_dead_letter_page_shows_a_page_of_the_person_s_scopes_and_no_fleet_figures(
    console: Served,
    confiner: Confiner,
    scope: Scope,
    other_scope: Scope,
    amqp_vhost: Vhost,
    amqp_connect: ConnectionFactory,
) -> None:
    admin = await amqp_connect(amqp_vhost.url(), "admin")
    channel = await admin.channel(publisher_confirms=True)
    dead = await channel.get_exchange(DEAD_EXCHANGE)
    for owner in (scope, other_scope, scope):
        letter = aio_pika.Message(b"{}", message_id=f"letter-of-{owner}", headers={ERROR_HEADER: "run_not_found"})
        await dead.publish(letter, routing_key=Command.CANCEL.key(owner))
    user = await confiner.confined(scope, prefix="deadpage")
    async with browsing(console.url) as client:
        assert (await log_in(client, user)).status_code == 303
        page = (await client.get("/dead")).text
    assert page.count(f"letter-of-{scope}") == 2
    assert f"letter-of-{other_scope}" not in page
    assert str(other_scope) not in page
    assert "in the queue" not in page  # the queue's depth is the fleet's, not this person's
    assert "Page 1: 2 in your scopes." in page
