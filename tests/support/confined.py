"""Confined RabbitMQ users for the tenant-isolation tests: real users, made through the management HTTP API
and granted scopes by the product's own ``BrokerGrants`` (or by ``rabbitmqctl``, to show the contract is
the permissions, not the tool), deleted when the test ends.

The management API is ``INTERMISSION_TEST_MANAGEMENT_URL`` (default ``http://127.0.0.1:15672``) with the
test broker's credentials. ``.ci/run`` enables the plugin; a machine without it fails these tests with the
command that enables it, rather than skipping what they prove.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
import pytest
from yarl import URL

from intermission.ops.grants import BrokerGrants
from intermission.schemas.scope import Scope
from intermission.wire import EVENTS_EXCHANGE
from tests.support.amqp import AmqpUser, Broker, Vhost

DEFAULT_MANAGEMENT_URL = "http://127.0.0.1:15672"


@dataclass(frozen=True)
class Management:
    url: str
    user: str
    password: str

    def grants(self, vhost: str) -> BrokerGrants:
        return BrokerGrants.connect(self.url, self.user, self.password, vhost)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, auth=(self.user, self.password), timeout=10.0)


@dataclass
class Confiner:
    """Makes users in one test vhost and grants them scopes; forgets nothing it made."""

    management: Management
    vhost: Vhost
    http: httpx.AsyncClient
    made: list[str] = field(default_factory=list)

    async def add_user(self, prefix: str = "confined") -> AmqpUser:
        """A user with a password and no permissions at all."""
        user = AmqpUser(f"intermission-test-{prefix}-{uuid.uuid4().hex[:10]}", secrets.token_urlsafe(16))
        response = await self.http.put(
            f"/api/users/{quote(user.name, safe='')}", json={"password": user.password, "tags": ""}
        )
        response.raise_for_status()
        self.made.append(user.name)
        return user

    async def confined(self, *scopes: Scope, prefix: str = "confined") -> AmqpUser:
        """A new user granted exactly ``scopes``, by ``intermission grant``'s own code."""
        user = await self.add_user(prefix)
        grants = self.management.grants(self.vhost.name)
        try:
            for scope in scopes:
                await grants.grant(user.name, scope)
        finally:
            await grants.close()
        return user

    async def connections_of(self, user: str) -> list[str]:
        """The names of ``user``'s connections the management API lists (its statistics lag by a few
        seconds: a fresh connection appears only later)."""
        response = await self.http.get(f"/api/vhosts/{quote(self.vhost.name, safe='')}/connections")
        response.raise_for_status()
        return [str(c["name"]) for c in response.json() if c.get("user") == user]

    async def event_bindings(self, queue: str) -> list[str]:
        """The routing keys binding ``queue`` to intermission.events."""
        response = await self.http.get(
            f"/api/queues/{quote(self.vhost.name, safe='')}/{quote(queue, safe='')}/bindings"
        )
        response.raise_for_status()
        return sorted(str(b["routing_key"]) for b in response.json() if b.get("source") == EVENTS_EXCHANGE)

    async def exchange_type(self, name: str) -> str | None:
        response = await self.http.get(f"/api/exchanges/{quote(self.vhost.name, safe='')}/{quote(name, safe='')}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return str(response.json()["type"])

    async def close(self) -> None:
        for name in self.made:
            await self.http.delete(f"/api/users/{quote(name, safe='')}")
        await self.http.aclose()


@pytest.fixture(scope="session")
async def management(rabbit: Broker) -> Management:
    url = os.environ.get("INTERMISSION_TEST_MANAGEMENT_URL", DEFAULT_MANAGEMENT_URL)
    base = URL(rabbit.base_url)
    found = Management(url=url, user=base.user or "guest", password=base.password or "guest")
    try:
        async with found.client() as http:
            (await http.get("/api/overview")).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(
            f"RabbitMQ's management API does not answer at {url} ({exc}); enable it with "
            "`rabbitmq-plugins enable rabbitmq_management` (.ci/run does)"
        )
    return found


@pytest.fixture
async def confiner(management: Management, amqp_vhost: Vhost) -> AsyncIterator[Confiner]:
    made = Confiner(management=management, vhost=amqp_vhost, http=management.client())
    yield made
    await made.close()
