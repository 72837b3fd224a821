"""Only named, reviewed statements run: ``store/queries/*.sql`` parsed into unique names, and an executor
that takes a NAME and refuses anything else."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

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
    assert {name: q.sql for name, q in parse(text).items()} == {
        "first": "SELECT 1\n  FROM t WHERE id = $1",
        "second_one": "DELETE FROM t",
    }


def test_parse_reads_what_a_statement_declares_it_writes() -> None:
    text = "-- call_it --\n-- Calls f.\n-- writes: outbox, inbox\nSELECT * FROM f($1::t[]);\n"
    (query,) = parse(text).values()
    assert query.writes == {"outbox", "inbox"}
    (plain,) = parse("-- read_it --\nSELECT 1;\n").values()
    assert plain.writes == frozenset()


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


MIGRATIONS = sorted((ROOT / "store" / "migrations").glob("*.sql"))
FUNCTION = re.compile(r"CREATE (?:OR REPLACE )?FUNCTION (\w+)\((.*?)\$\$(.*?)\$\$", re.DOTALL)


def _functions() -> dict[str, str]:
    """Every function the migrations define, with its body (a later definition replaces an earlier one)."""
    found: dict[str, str] = {}
    for path in MIGRATIONS:
        for name, _signature, body in FUNCTION.findall(path.read_text(encoding="utf-8")):
            found[name] = body
    return found


def test_the_declared_outbox_writers_are_exactly_the_statements_that_add_outbox_rows() -> None:
    # The declarations say which statements' commits carry events (the engine hands those to its sink,
    # engine/committer.py); one that lied would mislead whoever reads store/queries/. A statement writes the
    # outbox when its own text inserts into it, or when it calls a function that does (directly or through
    # another function).
    functions = _functions()
    writers = {name for name, body in functions.items() if "insert into outbox" in " ".join(body.lower().split())}
    while True:
        more = {name for name, body in functions.items() if any(w + "(" in body for w in writers)} - writers
        if not more:
            break
        writers |= more
    inserting = {
        name
        for name, q in QUERIES.items()
        if "into outbox" in " ".join(q.sql.lower().split()) or any(w + "(" in q.sql for w in writers)
    }
    assert inserting == OUTBOX_WRITERS
    assert {"claim_pauses_v2", "pause_runs_v3", "end_runs_v3", "admit_resumes_v2", "close_resumes_v1"} <= OUTBOX_WRITERS
    assert "mark_outbox_sent" not in OUTBOX_WRITERS
