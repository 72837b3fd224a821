"""Every runtime SQL statement, loaded once from ``store/queries/*.sql``.

Each statement sits under a ``-- name --`` header followed by ``--`` description lines. Python code never
holds SQL: the store's executor takes a query NAME and looks the text up here, so no statement can be built
from data (and ruff's S608 watches for any that try).

A statement that applies transitions takes ONE array of their composite row (``$1::intermission_claim_v2[]``,
migration 0016), so no caller counts arguments. A description line ``-- writes: outbox`` DECLARES that the
statement adds outbox rows, and a test checks the declarations against the functions the statements call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import LiteralString

_HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)
_WRITES = re.compile(r"^--\s*writes:\s*(.+)$")


@dataclass(frozen=True)
class Query:
    name: str
    sql: LiteralString
    # What the statement declares it writes besides its own table ("outbox", "inbox").
    writes: frozenset[str]


def parse(text: str, source: str = "<sql>") -> dict[str, Query]:
    """Split one SQL file into its named statements."""
    headers = list(_HEADER.finditer(text))
    if not headers and text.strip():
        raise ValueError(f"{source}: no '-- name --' header")
    found: dict[str, Query] = {}
    for index, header in enumerate(headers):
        name = header.group(1)
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        lines = text[header.end() : end].splitlines()
        body = "\n".join(line for line in lines if not line.lstrip().startswith("--")).strip().rstrip(";").strip()
        if not body:
            raise ValueError(f"{source}: query {name!r} is empty")
        if name in found:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        writes = frozenset(
            part.strip()
            for line in lines
            if (declared := _WRITES.match(line.strip())) is not None
            for part in declared.group(1).split(",")
        )
        # The text comes from files shipped with the package, never from data. mypy reads LiteralString as
        # str (python/mypy#12554); the name-only executor is the real guard.
        found[name] = Query(name, body, writes)
    return found


def load() -> dict[str, Query]:
    queries: dict[str, Query] = {}
    folder = resources.files("intermission.store").joinpath("queries")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, query in parse(entry.read_text(encoding="utf-8"), entry.name).items():
            if name in queries:
                raise ValueError(f"{entry.name}: query {name!r} is defined twice")
            queries[name] = query
    return queries


QUERIES: dict[str, Query] = load()

# The statements that add outbox rows, as their files declare.
OUTBOX_WRITERS: frozenset[str] = frozenset(name for name, q in QUERIES.items() if "outbox" in q.writes)
