"""The soak's isolated environment: a fresh PostgreSQL database and a fresh RabbitMQ vhost with real users
of its own, created at the start and removed at the end:

- trusted identities (every right in the vhost, no topic permission), one per part of the fleet: the
  workers, the sweepers and the bus (the workers' ``INTERMISSION_BUS_USER``);
- one host per scope the soak's runs live in, confined to it by the broker (exactly the permissions
  ``intermission grant`` gives: ``ops.grants.host_permissions``);
- two approvers, confined to the scopes they approve in (all of the runs' scopes);
- "mallory", a host confined to a scope of its own where no run lives, who is neither bus nor approver;
- "flooder", a host confined to a scope of its own with a quota of live runs, which floods starts
  (``tenant_flood``): a greedy tenant, not a forger, so apart from mallory, whose scope must stay empty.

Everything is made by ONE ``rabbitmqctl import_definitions`` (users, the vhost, permissions and topic
permissions): each ``rabbitmqctl`` call boots an Erlang VM, about a second.

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
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from intermission.ops.grants import NOTHING, host_permissions
from intermission.publishers.amqp import amqp_nodes, with_credentials, with_vhost
from intermission.schemas.scope import Scope
from intermission.store.db import Database
from intermission.store.migrate import migrate
from intermission.store.quotas import set_quota

if TYPE_CHECKING:
    from bench.soak.site import Endpoints
from intermission.wire import COMMANDS_EXCHANGE, EVENTS_EXCHANGE
from tests.support.rabbitctl import delete_vhosts, full_rights, rabbitmqctl, user_definition, write_definitions

log = logging.getLogger("soak.env")

# The fleet's own identities, each trusted with every scope.
TRUSTED_ROLES = ("worker", "sweeper", "bus")
APPROVER_ROLES = ("approver-1", "approver-2")
MALLORY = "mallory"
FLOODER = "flooder"


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
    # The scopes the broker confines it to; None for a trusted identity (every scope).
    scopes: tuple[Scope, ...] | None = None


def host_role(index: int) -> str:
    """The role of the host of the soak's ``index``-th scope."""
    return f"host-{index}"


def permission_definitions(user: AmqpUser, vhost: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """``user``'s permissions and topic permissions as import definitions: every right for a trusted
    identity; for a confined one, exactly what ``intermission grant`` gives it for its scopes."""
    if user.scopes is None:
        return full_rights(user.name, vhost), []
    p = host_permissions(user.name, list(user.scopes))
    who = {"user": user.name, "vhost": vhost}
    return (
        {**who, "configure": p.configure, "write": p.write, "read": p.read},
        [
            {**who, "exchange": COMMANDS_EXCHANGE, "write": p.commands_write, "read": NOTHING},
            {**who, "exchange": EVENTS_EXCHANGE, "write": NOTHING, "read": p.events_read},
        ],
    )


@dataclass
class SoakEnv:
    tag: str
    server_dsn: str
    admin_url: str
    ctl: list[str]
    users: dict[str, AmqpUser]
    # The scopes the runs live in, each with its own host (``host_role(i)`` for ``scopes[i]``), mallory's
    # own scope, where no run lives, and the flooder's, where only its floods' runs live.
    scopes: list[Scope]
    mallory_scope: Scope
    flood_scope: Scope
    created_database: bool = False
    created_vhost: bool = False

    @classmethod
    def new(
        cls, tag: str, scopes: list[Scope], mallory_scope: Scope, flood_scope: Scope, endpoints: Endpoints
    ) -> SoakEnv:
        confined: dict[str, tuple[Scope, ...] | None] = dict.fromkeys(TRUSTED_ROLES)
        confined.update({host_role(i): (scope,) for i, scope in enumerate(scopes)})
        confined.update({role: tuple(scopes) for role in APPROVER_ROLES})
        confined[MALLORY] = (mallory_scope,)
        confined[FLOODER] = (flood_scope,)
        users = {
            role: AmqpUser(f"soak-{tag}-{role}", secrets.token_urlsafe(18), scopes=where)
            for role, where in confined.items()
        }
        return cls(
            tag=tag,
            server_dsn=endpoints.server_dsn,
            admin_url=endpoints.admin_url,
            ctl=list(endpoints.ctl),
            users=users,
            scopes=list(scopes),
            mallory_scope=mallory_scope,
            flood_scope=flood_scope,
        )

    def host_roles(self) -> list[tuple[Scope, str]]:
        """Each scope of the runs with the role of its host."""
        return [(scope, host_role(i)) for i, scope in enumerate(self.scopes)]

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
        """The vhost's URL (one node or the list of a cluster's) as ``role``'s user (the administrator's
        when None)."""
        url = with_vhost(self.admin_url, self.vhost)
        if role is not None:
            user = self.users[role]
            url = with_credentials(url, user.name, user.password)
        return url

    def user(self, role: str) -> str:
        return self.users[role].name

    async def create(self) -> None:
        await self._create_database()
        await self._create_vhost()

    async def give_quota(self, scope: Scope, live_runs: int) -> None:
        """Give ``scope`` a quota of live runs of its own, as ``intermission quotas set`` does."""
        db = await Database.connect(self.database_url, max_size=1)
        try:
            await set_quota(db, scope, live_runs=live_runs, starts_per_second=None)
        finally:
            await db.close()

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
        admin = amqp_nodes(self.admin_url)[0].user or "guest"
        # The administrator (the topology, the harness's observer) and the fleet's identities may do
        # anything in the vhost; hosts, approvers and mallory only what the broker lets a confined host do.
        permissions = [full_rights(admin, self.vhost)]
        topic_permissions: list[dict[str, str]] = []
        for user in self.users.values():
            rights, topics = permission_definitions(user, self.vhost)
            permissions.append(rights)
            topic_permissions.extend(topics)
        definitions: dict[str, Any] = {
            "users": [user_definition(u.name, u.password) for u in self.users.values()],
            "vhosts": [{"name": self.vhost}],
            "permissions": permissions,
            "topic_permissions": topic_permissions,
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
            try:
                problems.extend(await self._delete_vhost_and_users())
            except RuntimeError as exc:
                problems.append(f"vhost {self.vhost} not deleted: {exc}")
        return problems

    async def _delete_vhost_and_users(self) -> list[str]:
        users = [u.name for u in self.users.values()]
        return await delete_vhosts(self.ctl, [self.vhost], users=users, who="intermission-soak")
