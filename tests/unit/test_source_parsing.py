"""The tests that read the product's source parse it with no finalizer in the middle (tests/support/source.py):
on CPython 3.11 a finalizer that parses, as formatting a traceback does, breaks the parse it interrupts."""

from __future__ import annotations

import ast
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.source import parse_file

SOURCE = Path(__file__).resolve().parents[2] / "engine" / "memory.py"


class ParsesWhenCollected:
    """Cyclic garbage whose finalizer parses, as a "Future exception was never retrieved" report does."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        ast.parse("x = (1 + (2 * f(a[b])))")


@pytest.fixture
def collections_often() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(100, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.collect()


def test_a_file_parses_whole_while_garbage_that_parses_when_collected_is_about(collections_often: None) -> None:
    failures: list[str] = []
    for _ in range(20):
        garbage = [ParsesWhenCollected() for _ in range(300)]
        del garbage
        try:
            assert isinstance(parse_file(SOURCE), ast.Module)
        except SystemError as broken:
            failures.append(str(broken))
    # The garbage goes now, before a failure is reported (pytest's report parses source too).
    gc.collect()
    assert gc.isenabled()
    assert failures == []
