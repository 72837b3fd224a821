"""Each transition family's input row is named once: the fields of its ``NamedTuple`` (``engine/*.py``) are
the attributes of the composite type its statement takes (migration 0016), by name and in order, so that a
row asyncpg encodes positionally lands in the attribute it means. And every family's statement exists."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

from intermission import engine as engine_package
from intermission.engine.transition import Family
from intermission.store import Stores
from intermission.store.queries import load

COMPOSITE = re.compile(r"\$1::(\w+)\[\]")


def families() -> list[Family]:
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(engine_package.__path__):
        loaded = importlib.import_module(f"{engine_package.__name__}.{module.name}")
        for value in vars(loaded).values():
            if isinstance(value, Family):
                found[value.name] = value
    return sorted(found.values(), key=lambda f: f.name)


def test_every_transition_family_is_found() -> None:
    # The families a run's life needs; a module that stopped defining one would drop it from the checks below.
    assert {"claim", "start", "save", "pause", "end", "ending", "admit", "start_resume", "close"} <= {
        f.name for f in families()
    }


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
async def test_a_familys_row_has_the_attributes_of_its_composite_in_order(stores: Stores, family: Family) -> None:
    queries = load()
    assert family.statement in queries, f"{family.name}: no statement {family.statement}"
    named = COMPOSITE.findall(queries[family.statement].sql)
    assert len(set(named)) == 1, f"{family.name}: {family.statement} takes no one composite array: {named}"
    async with stores.db.connection() as con:
        attributes = await con.raw.fetch(
            "SELECT a.attname FROM pg_type t JOIN pg_attribute a ON a.attrelid = t.typrelid"
            " WHERE t.typname = $1 AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            named[0],
        )
    assert attributes, f"{family.name}: no composite type {named[0]}"
    assert list(family.row._fields) == [r["attname"] for r in attributes], family.name
