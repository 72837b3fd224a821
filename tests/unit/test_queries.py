"""Only named, reviewed statements run: ``store/queries/*.sql`` parsed into unique names, and an executor
that takes a NAME and refuses anything else."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import asyncpg
import pytest

from intermission.store.db import Conn
from intermission.store.queries import OUTBOX_WRITERS, QUERIES, parse

ROOT = Path(__file__).resolve().parents[2]
SQL_FILES = sorted((ROOT / "store" / "queries").glob("*.sql"))
HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)
# A store call that names its statement: con.fetchrow("name", ...), possibly across lines.
NAMED_CALL = re.compile(r"\.(?:fetch|fetchrow|fetchval|execute)\(\s*\"([A-Za-z0-9_ ]+)\"")


def test_every_query_name_is_unique_across_all_files() -> None:
    names = [name for path in SQL_FILES for name in HEADER.findall(path.read_text(encoding="utf-8"))]
    duplicated = [name for name, n in Counter(names).items() if n > 1]
    assert duplicated == []
    assert set(names) == set(QUERIES)
    assert len(names) == len(QUERIES)


def test_every_statement_the_store_names_is_a_loaded_query() -> None:
    used = {
        name
        for path in sorted((ROOT / "store").glob("*.py"))
        for name in NAMED_CALL.findall(path.read_text(encoding="utf-8"))
    }
    assert used, "the scan found no named calls at all"
    assert sorted(used - set(QUERIES)) == []


def test_parse_splits_named_statements_and_drops_descriptions() -> None:
    text = (
        "-- first --\n-- What it does. $1 id\nSELECT 1\n  FROM t WHERE id = $1;\n\n"
        "-- second_one --\n-- No parameters.\nDELETE FROM t;\n"
    )
    assert parse(text) == {"first": "SELECT 1\n  FROM t WHERE id = $1", "second_one": "DELETE FROM t"}


def test_parse_refuses_a_file_without_headers() -> None:
    with pytest.raises(ValueError, match="no '-- name --' header"):
        parse("SELECT 1;\n", "loose.sql")
    with pytest.raises(ValueError, match="no '-- name --' header"):
        parse("-- a comment, not a header\nDROP TABLE runs;\n", "loose.sql")


def test_parse_refuses_an_empty_statement() -> None:
    with pytest.raises(ValueError, match="'hollow' is empty"):
        parse("-- hollow --\n-- only a description\n\n-- next --\nSELECT 1;\n")


def test_parse_of_an_empty_file_is_empty() -> None:
    assert parse("") == {}
    assert parse("\n  \n") == {}


@pytest.mark.integration
async def test_the_executor_runs_only_names_it_knows(database_url: str) -> None:
    raw = await asyncpg.connect(database_url)
    try:
        con = Conn(raw)
        for not_a_name in ("SELECT 1", "DROP TABLE runs", "get_run; DROP TABLE runs", "GET_RUN", ""):
            with pytest.raises(KeyError):
                await con.fetch(not_a_name)
            with pytest.raises(KeyError):
                await con.fetchrow(not_a_name)
            with pytest.raises(KeyError):
                await con.fetchval(not_a_name)
            with pytest.raises(KeyError):
                await con.execute(not_a_name)
        assert await raw.fetchval("SELECT to_regclass('runs') IS NOT NULL") is True
        # A known name does run.
        assert await con.fetchrow("get_run", "no-such-run", "acme", "t1") is None
    finally:
        await raw.close()


def test_the_outbox_writers_are_exactly_the_statements_that_insert_into_the_outbox() -> None:
    # A relayed process wakes its relay only after these (store/db.py): one missing here would leave its
    # rows to the poll.
    inserting = {name for name, sql in QUERIES.items() if "into outbox" in " ".join(sql.lower().split())}
    assert inserting == OUTBOX_WRITERS
    assert {"claim_resume", "end_run_at_once", "insert_outbox"} <= OUTBOX_WRITERS
    assert "mark_outbox_sent" not in OUTBOX_WRITERS
