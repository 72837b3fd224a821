"""The conformance suite (``tests/support/conformance.py``) against the in-memory committer: the same cases
``tests/integration/test_conformance_postgres.py`` runs against PostgreSQL. No I/O: the world is dictionaries
and a clock that moves when told."""

from __future__ import annotations

import pkgutil
from collections.abc import Sequence
from importlib import import_module
from typing import NamedTuple

import pytest

import intermission.engine
from intermission.engine.memory import InMemoryCommitter, memory_engine
from intermission.engine.transition import Family, Transition
from intermission.store.rows import Out
from tests.support.conformance import CASES, Case, MemoryWorld, case_id, forbid_sockets


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_sockets(monkeypatch)


@pytest.mark.parametrize("case", CASES, ids=case_id)
async def test_the_in_memory_committer_conforms(case: Case) -> None:
    await case(MemoryWorld())


def engine_families() -> dict[str, Family]:
    """Every family the engine's modules define."""
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(intermission.engine.__path__):
        for value in vars(import_module(f"intermission.engine.{module.name}")).values():
            if isinstance(value, Family):
                found[value.name] = value
    return found


def test_the_in_memory_committer_runs_every_family_of_the_engine() -> None:
    # A family added to the engine fails here until the fake renders its function too.
    assert set(engine_families()) == InMemoryCommitter().families


class _Row(NamedTuple):
    id: int


UNKNOWN = Family("unheard_of", "unheard_of_v1", _Row)


class _Unknown(Transition[None]):
    family = UNKNOWN

    def row(self) -> _Row:
        return _Row(1)

    def result(self, outs: Sequence[Out]) -> None:
        return None


async def test_a_family_the_in_memory_committer_does_not_run_is_named_in_its_refusal() -> None:
    with pytest.raises(NotImplementedError, match="unheard_of"):
        await memory_engine().apply(_Unknown())
