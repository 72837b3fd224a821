"""docs/architecture.md's table of what each subpackage may import, checked against the code.

The table is the map a newcomer reads; this test makes it the code's: every ``import`` of the product (at run
time or under ``TYPE_CHECKING``) must be one its row allows, and no two subpackages may import each other
through any chain. A row's "may import" cell names subpackages in backticks (``store``), or one module of a
subpackage (``store.runs``: that module only), or says "all of the above" or "nothing of ours".
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]
TABLE_HEADER = "| subpackage | folder | holds | may import |"


@dataclass(frozen=True)
class Row:
    unit: str  # "schemas", "wire", "points", ... or "" for the package's own __init__
    folder: str
    allowed: frozenset[str]  # subpackages ("store") and single modules ("store.runs")


def read_table() -> list[Row]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    lines = text[text.index(TABLE_HEADER) :].splitlines()[2:]
    rows: list[Row] = []
    for line in lines:
        if not line.startswith("|"):
            break
        subpackage, folder, _holds, may = (cell.strip() for cell in line.strip("|").split("|"))
        unit = subpackage.strip("`").removeprefix("intermission").removeprefix(".")
        if "all of the above" in may:
            allowed = frozenset(row.unit for row in rows)
        elif "nothing of ours" in may:
            allowed = frozenset()
        else:
            allowed = frozenset(re.findall(r"`([a-z_.]+)`", may))
        rows.append(Row(unit=unit, folder=folder.strip("`"), allowed=allowed))
    return rows


ROWS = read_table()
UNITS = {row.unit for row in ROWS}


def unit_of(module: str) -> tuple[str, str] | None:
    """(subpackage, module below it) of an ``intermission.*`` module, None for anything else."""
    parts = module.split(".")
    if parts[0] != "intermission":
        return None
    if len(parts) == 1:
        return ("", "")
    if parts[1] in UNITS:
        return (parts[1], ".".join(parts[1:]))
    return None


def files_of(row: Row) -> list[Path]:
    path = ROOT / row.folder
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def imports_in(path: Path) -> Iterator[tuple[int, str]]:
    tree = parse_file(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "intermission":
                # ``from intermission import points`` imports the module intermission.points.
                for alias in node.names:
                    yield node.lineno, f"intermission.{alias.name}"
            else:
                yield node.lineno, node.module


def edges() -> Iterator[tuple[Row, Path, int, str, str]]:
    """(importing row, file, line, imported subpackage, imported module) for every import across subpackages."""
    for row in ROWS:
        for path in files_of(row):
            for line, module in imports_in(path):
                target = unit_of(module)
                if target is None or target[0] == row.unit:
                    continue
                yield row, path, line, target[0], target[1]


def allows(row: Row, unit: str, module: str) -> bool:
    if unit in row.allowed:
        return True
    return any(module == entry or module.startswith(f"{entry}.") for entry in row.allowed if "." in entry)


@pytest.mark.unit
def test_the_table_names_every_subpackage_and_its_folders_exist() -> None:
    assert {"schemas", "wire", "store", "consumers", "publishers", "agent", "fleet", "ops", ""} <= UNITS
    for row in ROWS:
        assert (ROOT / row.folder).exists(), f"{row.unit or 'intermission'}: no {row.folder}"
        for entry in row.allowed:
            assert entry.split(".")[0] in UNITS, f"{row.unit}: may import `{entry}`, which the table does not name"


@pytest.mark.unit
def test_every_import_of_the_product_is_one_the_table_allows() -> None:
    forbidden = [
        f"{path.relative_to(ROOT)}:{line} imports intermission.{module} ({row.unit or 'intermission'} may not)"
        for row, path, line, unit, module in edges()
        if not allows(row, unit, module)
    ]
    assert forbidden == [], "\n".join(forbidden)


@pytest.mark.unit
def test_no_two_subpackages_import_each_other_through_any_chain() -> None:
    graph: dict[str, set[str]] = {row.unit: set() for row in ROWS}
    for row, _path, _line, unit, _module in edges():
        graph[row.unit].add(unit)
    # Depth-first search for a back edge; the cycle is reported as the path that closes it.
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for nxt in sorted(graph[unit]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]) if nxt in path else f"{unit} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])
    assert cycles == [], "\n".join(cycles)


@pytest.mark.unit
def test_the_check_catches_a_forbidden_import() -> None:
    # The check itself can fail: schemas may import nothing of ours, so an import of the store is refused,
    # and a module allowed alone (consumers may import publishers.amqp) does not open its whole subpackage.
    [schemas] = [row for row in ROWS if row.unit == "schemas"]
    [consumers] = [row for row in ROWS if row.unit == "consumers"]
    [integrations] = [row for row in ROWS if row.unit == "integrations"]
    assert not allows(schemas, "store", "store.db")
    assert allows(consumers, "publishers", "publishers.amqp")
    assert not allows(consumers, "publishers", "publishers.relay")
    # The integrations are translators: no crash point, no store.
    assert not allows(integrations, "points", "points")
    assert not allows(integrations, "store", "store.runs")
