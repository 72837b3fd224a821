"""Versioned SQL migrations, applied in order under an advisory lock and recorded in a table.

Migrations are plain ``store/migrations/NNNN_description.sql`` files, runnable by hand in psql. The
migrator takes a session advisory lock, so two processes migrating at once serialise and the second finds
nothing left to do; each file runs in its own transaction together with the row that records it, so a
failed migration leaves no trace. An applied file whose text changed is refused: a migration is history,
and a new change is a new file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from intermission.schemas.errors import IntermissionError
from intermission.store.db import Conn, translated

# Any fixed 64-bit key; it names the migrator among advisory locks.
MIGRATION_LOCK_KEY = 0x1A7E_5510_0000_0001

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_DATABASE_NAME = re.compile(r"^[A-Za-z0-9_]{1,63}$")


class MigrationError(IntermissionError):
    """The database's migration history does not match this release's migrations."""

    code = "migration_error"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations() -> list[Migration]:
    found: list[Migration] = []
    folder = resources.files("intermission.store").joinpath("migrations")
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError("two migration files share a version")
    return found


async def migrate(dsn: str) -> list[Migration]:
    """Apply every migration not yet applied; returns the ones this call applied."""
    with translated():
        raw = await asyncpg.connect(dsn)
    try:
        return await _migrate(Conn(raw))
    finally:
        await raw.close()


async def _migrate(con: Conn) -> list[Migration]:
    with translated():
        await con.fetchval("migrations_lock", MIGRATION_LOCK_KEY)
        try:
            await con.execute("migrations_table")
            applied = {row["version"]: row for row in await con.fetch("migrations_applied")}
            done: list[Migration] = []
            for migration in migrations():
                row = applied.get(migration.version)
                if row is not None:
                    if row["checksum"] != migration.checksum:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} changed after it was applied"
                        )
                    continue
                try:
                    async with con.raw.transaction():
                        await con.raw.execute(migration.sql)
                        await con.execute("migrations_record", migration.version, migration.name, migration.checksum)
                except asyncpg.RaiseError as exc:
                    # A migration that checks the data before it changes keys (0015) refuses with what to mend;
                    # its words are the operator's, not a bare SQLSTATE.
                    hint = f" ({exc.hint})" if exc.hint else ""
                    raise MigrationError(
                        f"migration {migration.version:04d}_{migration.name} refused: {exc.message}{hint}"
                    ) from exc
                done.append(migration)
            return done
        finally:
            await con.fetchval("migrations_unlock", MIGRATION_LOCK_KEY)


def split_database(dsn: str) -> tuple[str, str]:
    """The DSN of the server's maintenance database, and the name of the database ``dsn`` names."""
    parts = urlsplit(dsn)
    name = parts.path.lstrip("/") or "postgres"
    return urlunsplit(parts._replace(path="/postgres")), name


async def ensure_database(dsn: str) -> bool:
    """Create the database ``dsn`` names when it is missing. Returns whether it was created."""
    admin_dsn, name = split_database(dsn)
    if _DATABASE_NAME.fullmatch(name) is None:
        raise MigrationError(f"database name {name!r} must match {_DATABASE_NAME.pattern}")
    with translated():
        raw = await asyncpg.connect(admin_dsn)
        try:
            if await Conn(raw).fetchval("database_exists", name):
                return False
            try:
                # DDL takes no parameters; the name was checked against a strict pattern above and is
                # quoted as an identifier.
                await raw.execute(f'CREATE DATABASE "{name}"')
            except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
                # Another process created it first. Two CREATE DATABASE racing for one name can also end
                # in a unique violation on pg_database's name index rather than duplicate_database.
                return False
            return True
        finally:
            await raw.close()
