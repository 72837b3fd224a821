"""The web console for tests: served by uvicorn on a free port of this machine, in the test's own event loop,
over the test's database, vhost and the broker's management API; and a logged-in HTTP client of it.

The console is the product's (``build_app``), started exactly as ``intermission console`` starts it but on
a socket the test binds first, so that the port is known and free.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from pydantic import SecretStr

from intermission.fleet.settings import Settings
from intermission.ops.console.app import build_app
from intermission.publishers.clients import HostClient
from intermission.schemas.config import RunConfig
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.amqp import AmqpUser
from tests.support.confined import Management
from tests.support.fleet import start_command
from tests.support.waiting import eventually

START_SECONDS = 15.0
PAUSE_SECONDS = 20.0
EMAIL = {"to": "cfo@example.com", "subject": "Q3 numbers", "body": "attached"}
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def console_settings(settings: Settings, management: Management) -> Settings:
    """``settings`` (the worker's: the test's database and vhost as guest) with the management API."""
    return settings.model_copy(
        update={
            "management_url": management.url,
            "management_user": management.user,
            "management_password": SecretStr(management.password),
        }
    )


@dataclass(frozen=True)
class Served:
    url: str
    server: uvicorn.Server


@asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[Served]:
    """The console over ``settings``, listening on 127.0.0.1 at a free port, until the block ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(
        build_app(settings), log_config=None, lifespan="on", timeout_graceful_shutdown=1, server_header=False
    )
    server = uvicorn.Server(config)

    async def serve() -> None:
        try:
            await server.serve(sockets=[listener])
        except SystemExit as exc:
            # uvicorn exits the process when the app fails to start; here that is a failed test, not an exit.
            raise RuntimeError(f"the console did not start (uvicorn's exit status {exc.code}); see the log") from None

    task = asyncio.create_task(serve(), name="console-server")
    try:
        async with asyncio.timeout(START_SECONDS):
            # uvicorn offers no event for "listening": its flag is polled, within the timeout.
            while not server.started:
                if task.done():
                    task.result()
                    raise AssertionError("the console stopped while starting")
                await asyncio.sleep(0.02)
        yield Served(url=f"http://127.0.0.1:{port}", server=server)
    finally:
        server.should_exit = True
        await task
        listener.close()


async def approval_pause(
    host: HostClient,
    stores: Stores,
    scope: Scope,
    approvers: list[str] | None = None,
    *,
    run_id: str | None = None,
    arguments: dict[str, Any] | None = None,
    pause_ttl_seconds: int | None = None,
    **config: Any,
) -> str:
    """Start a run that pauses for an approval of send_email (decided by ``approvers`` when given); returns
    its id once it is paused."""
    run_config = RunConfig(approvers={"send_email": approvers} if approvers else {}, **config)
    turns: list[dict[str, Any]] = [{"call": [{"tool": "send_email", "arguments": arguments or EMAIL}]}, {"say": "sent"}]
    cmd = start_command(
        scope,
        turns,
        config=run_config,
        pause_ttl_seconds=pause_ttl_seconds,
        **({"run_id": run_id} if run_id else {}),
    )
    await host.start(cmd)

    async def paused() -> bool:
        async with stores.db.connection() as con:
            state = await con.raw.fetchval("SELECT state::text FROM runs WHERE id = $1", cmd.run_id)
        return bool(state == RunState.PAUSED.value)

    await eventually(paused, within=PAUSE_SECONDS, what=f"run {cmd.run_id} paused")
    return cmd.run_id


def csrf_of(html: str) -> str:
    found = _CSRF.search(html)
    assert found is not None, "the page has no form with a CSRF token"
    return found.group(1)


async def log_in(client: httpx.AsyncClient, user: AmqpUser, password: str | None = None) -> httpx.Response:
    """Log ``user`` in through the login form (with ``password`` instead of theirs, to be refused)."""
    form = await client.get("/login")
    return await client.post(
        "/login",
        data={
            "csrf": csrf_of(form.text),
            "user": user.name,
            "password": user.password if password is None else password,
            "next": "/inbox",
        },
    )


@asynccontextmanager
async def browsing(url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the console with a cookie jar of its own."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        yield client
