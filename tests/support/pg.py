"""Where the tests' PostgreSQL is, and fresh databases on it.

The DSN comes from ``INTERMISSION_TEST_DATABASE_URL`` (a server-level DSN; its database part names the
maintenance database), else the ``PG*`` variables, else the local server. Only when nothing answers
there, and Docker is available, does a testcontainers PostgreSQL stand in.
"""

from __future__ import annotations

import os
import re
import uuid
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from intermission.store.migrate import migrate

_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


def server_dsn() -> str:
    explicit = os.environ.get("INTERMISSION_TEST_DATABASE_URL")
    if explicit:
        return explicit
    host = os.environ.get("PGHOST", "127.0.0.1")
    port = os.environ.get("PGPORT", "5432")
    user = os.environ.get("PGUSER", "postgres")
    password = os.environ.get("PGPASSWORD")
    auth = f"{user}:{password}" if password else user
    return f"postgresql://{auth}@{host}:{port}/postgres"


def with_database(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


async def reachable(dsn: str) -> bool:
    try:
        con = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await con.close()
    return True


async def _admin(dsn: str, statement: str) -> None:
    con = await asyncpg.connect(dsn)
    try:
        await con.execute(statement)
    finally:
        await con.close()


async def create_template(dsn: str) -> str:
    """A database with every migration applied, to copy for each test."""
    name = f"intermission_tmpl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    await drop(dsn, name)
    await _admin(dsn, f'CREATE DATABASE "{name}"')
    await migrate(with_database(dsn, name))
    # A template with open connections cannot be copied; migrate() closed its own.
    return name


async def create_from_template(dsn: str, template: str) -> str:
    name = f"intermission_t_{uuid.uuid4().hex[:16]}"
    assert _NAME.match(name)
    assert _NAME.match(template)
    await _admin(dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


async def drop(dsn: str, name: str) -> None:
    assert _NAME.match(name)
    await _admin(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
