"""Every runtime SQL statement, loaded once from ``store/queries/*.sql``.

Each statement sits under a ``-- name --`` header followed by ``--`` description lines that list its
``$n`` parameters in order. Python code never holds SQL: the store's executor takes a query NAME and looks
the text up here, so no statement can be built from data (and ruff's S608 watches for any that try).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString

_HEADER = re.compile(r"^-- ([a-z][a-z0-9_]*) --$", re.MULTILINE)


def parse(text: str, source: str = "<sql>") -> dict[str, str]:
    """Split one SQL file into its named statements."""
    headers = list(_HEADER.finditer(text))
    if not headers and text.strip():
        raise ValueError(f"{source}: no '-- name --' header")
    found: dict[str, str] = {}
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        body_lines = [line for line in text[header.end() : end].splitlines() if not line.lstrip().startswith("--")]
        body = "\n".join(body_lines).strip().rstrip(";").strip()
        if not body:
            raise ValueError(f"{source}: query {header.group(1)!r} is empty")
        if header.group(1) in found:
            raise ValueError(f"{source}: query {header.group(1)!r} is defined twice")
        found[header.group(1)] = body
    return found


def load() -> dict[str, LiteralString]:
    queries: dict[str, LiteralString] = {}
    folder = resources.files("intermission.store").joinpath("queries")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, sql in parse(entry.read_text(encoding="utf-8"), entry.name).items():
            if name in queries:
                raise ValueError(f"{entry.name}: query {name!r} is defined twice")
            # The text comes from files shipped with the package, never from data. mypy reads
            # LiteralString as str (python/mypy#12554); the name-only executor is the real guard.
            queries[name] = sql
    return queries


QUERIES: dict[str, LiteralString] = load()

# The statements that add outbox rows: a process that runs a relay wakes it when one of them commits.
_OUTBOX_INSERT = re.compile(r"\bINSERT\s+INTO\s+outbox\b", re.IGNORECASE)
OUTBOX_WRITERS: frozenset[str] = frozenset(name for name, sql in QUERIES.items() if _OUTBOX_INSERT.search(sql))
