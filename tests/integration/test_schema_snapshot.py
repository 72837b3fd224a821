"""store/schema.sql is the migrated schema: a database loaded from it and one built by the migrations have
the same tables, columns, constraints, indexes, types, functions, triggers, sequences and migration
records, and migrating the loaded one applies nothing (procrastinate's schema-versus-migrations test)."""

from __future__ import annotations

import asyncpg

from intermission.store.migrate import migrate
from tests.support import pg
from tests.support.schema import SNAPSHOT, catalog

REGENERATE = "store/schema.sql is stale: regenerate it with `.venv/bin/python -m tests.support.schema`"


async def test_the_snapshot_is_exactly_what_the_migrations_build(pg_server: str, database_url: str) -> None:
    loaded_name = f"intermission_snapshot_{database_url.rsplit('_', 1)[-1]}"
    admin = await asyncpg.connect(pg_server)
    try:
        await admin.execute(f'CREATE DATABASE "{loaded_name}"')
    finally:
        await admin.close()
    loaded = pg.with_database(pg_server, loaded_name)
    try:
        con = await asyncpg.connect(loaded)
        try:
            await con.execute(SNAPSHOT.read_text(encoding="utf-8"))
        finally:
            await con.close()
        migrated, snapshot = await catalog(database_url), await catalog(loaded)
        for kind in migrated:
            assert snapshot[kind] == migrated[kind], f"{kind}: {REGENERATE}"
        assert await migrate(loaded) == [], REGENERATE
    finally:
        await pg.drop(pg_server, loaded_name)
