"""The soak's isolated environment: a fresh PostgreSQL database and a fresh RabbitMQ vhost with real users
of its own (the workers, the bus, a host, two approvers, and "mallory", who is neither bus nor approver),
created at the start and removed at the end.

The servers come from ``INTERMISSION_SOAK_DATABASE_URL`` (a server-level DSN; else the test suite's
``INTERMISSION_TEST_DATABASE_URL``, else the ``PG*`` variables, default
``postgresql://postgres@127.0.0.1:5432/postgres``) and ``INTERMISSION_SOAK_AMQP_URL`` (an administrator's
URL; else ``INTERMISSION_TEST_AMQP_URL``, default ``amqp://guest:guest@127.0.0.1:5672/``), administered
with ``INTERMISSION_SOAK_RABBITMQCTL`` (else ``INTERMISSION_TEST_RABBITMQCTL``, default ``rabbitmqctl``).
Passwords are generated here, never printed: URLs are shown through ``publishers.amqp.safe_url`` only.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from yarl import URL

from intermission.store.migrate import migrate
from tests.support.rabbitctl import delete_vhosts, full_rights, rabbitmqctl, user_definition, write_definitions

log = logging.getLogger("soak.env")

ROLES = ("worker", "bus", "host", "approver-1", "approver-2", "mallory")


def server_dsn() -> str:
    explicit = os.environ.get("INTERMISSION_SOAK_DATABASE_URL") or os.environ.get("INTERMISSION_TEST_DATABASE_URL")
    if explicit:
        return explicit
    host = os.environ.get("PGHOST", "127.0.0.1")
    port = os.environ.get("PGPORT", "5432")
    user = os.environ.get("PGUSER", "postgres")
    password = os.environ.get("PGPASSWORD")
    auth = f"{user}:{password}" if password else user
    return f"postgresql://{auth}@{host}:{port}/postgres"


def amqp_admin_url() -> str:
    return (
        os.environ.get("INTERMISSION_SOAK_AMQP_URL")
        or os.environ.get("INTERMISSION_TEST_AMQP_URL")
        or "amqp://guest:guest@127.0.0.1:5672/"
    )


def rabbitmqctl_argv() -> list[str]:
    return shlex.split(
        os.environ.get("INTERMISSION_SOAK_RABBITMQCTL")
        or os.environ.get("INTERMISSION_TEST_RABBITMQCTL")
        or "rabbitmqctl"
    )


def with_database(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


@dataclass(frozen=True)
class AmqpUser:
    name: str
    password: str = field(repr=False)


@dataclass
class SoakEnv:
    tag: str
    server_dsn: str
    admin_url: str
    ctl: list[str]
    users: dict[str, AmqpUser]
    created_database: bool = False
    created_vhost: bool = False

    @classmethod
    def new(cls, tag: str) -> SoakEnv:
        users = {role: AmqpUser(f"soak-{tag}-{role}", secrets.token_urlsafe(18)) for role in ROLES}
        return cls(tag=tag, server_dsn=server_dsn(), admin_url=amqp_admin_url(), ctl=rabbitmqctl_argv(), users=users)

    @property
    def database(self) -> str:
        return f"intermission_soak_{self.tag}"

    @property
    def database_url(self) -> str:
        return with_database(self.server_dsn, self.database)

    @property
    def vhost(self) -> str:
        return f"intermission-soak-{self.tag}"

    def amqp_url(self, role: str | None = None) -> str:
        """The vhost's URL as ``role``'s user (the administrator's when None)."""
        url = URL(self.admin_url).with_path("/" + self.vhost)
        if role is not None:
            user = self.users[role]
            url = url.with_user(user.name).with_password(user.password)
        return str(url)

    def user(self, role: str) -> str:
        return self.users[role].name

    async def create(self) -> None:
        await self._create_database()
        await self._create_vhost()

    async def _create_database(self) -> None:
        con = await asyncpg.connect(self.server_dsn)
        try:
            await con.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            await con.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            await con.close()
        self.created_database = True
        await migrate(self.database_url)

    async def _create_vhost(self) -> None:
        admin = URL(self.admin_url).user or "guest"
        definitions: dict[str, Any] = {
            "users": [user_definition(u.name, u.password) for u in self.users.values()],
            "vhosts": [{"name": self.vhost}],
            # Everybody may publish and consume in the vhost: authority is the fleet's to enforce, from the
            # broker-validated user_id, not the broker's permissions.
            "permissions": [full_rights(who, self.vhost) for who in (admin, *(u.name for u in self.users.values()))],
        }
        with tempfile.TemporaryDirectory() as folder:
            path = write_definitions(Path(folder), definitions)
            await rabbitmqctl(self.ctl, "import_definitions", str(path))
        self.created_vhost = True

    async def destroy(self) -> list[str]:
        """Remove the database, the vhost and the users; returns what could not be removed."""
        problems: list[str] = []
        if self.created_database:
            try:
                con = await asyncpg.connect(self.server_dsn, timeout=10)
                try:
                    await con.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
                finally:
                    await con.close()
            except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
                problems.append(f"database {self.database} not dropped: {exc}")
        if self.created_vhost:
            problems.extend(await self._delete_vhost_and_users())
        return problems

    async def _delete_vhost_and_users(self) -> list[str]:
        users = [u.name for u in self.users.values()]
        return await delete_vhosts(self.ctl, [self.vhost], users=users, who="intermission-soak")
