"""The executors are translators: every durability rule is ``DurableRun``'s (agent/durable.py), and none is
written again in an executor. Read from the source: an executor that saves progress itself, passes a
crash point, builds a pause or a pending call, groups approvals or names a limit's error has grown a rule
of its own, which the durable run's tests would not cover."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]
TRANSLATORS = ["agent/loop.py", "integrations/pydantic_ai.py", "integrations/openai_agents.py"]

# Names an executor has no business with: each is a rule the durable run keeps.
RULES = {
    # progress saves, started-bookkeeping, boundaries
    "save_progress",
    "between_calls",
    "Progress",
    "PendingCall",
    "started",
    # crash points
    "points",
    "reach",
    "reached",
    # pauses and their grouping
    "Pause",
    "approval_group",
    "call_approvers",
    "reply_with",
    # ends and endings
    "ENDINGS",
    "end",
    # limits and the publication policy
    "blocks",
    "MaxStepsReached",
    "MaxTokensExceeded",
    "MaxToolCallsReached",
    "BudgetExhausted",
    "PublicationBlocked",
    "UnsupportedConfig",
    # tool spans
    "tool_span",
}
# Modules an executor may not import for the same reason.
MODULES = {
    "intermission.points",
    "intermission.store",
    "intermission.store.runs",
    "intermission.engine",
    "intermission.engine.runs",
}


def names_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add((node.asname or node.name).split(".")[-1])
    return found


def modules_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", TRANSLATORS)
def test_an_executor_holds_no_durability_rule(path: str) -> None:
    tree = parse_file(ROOT / path)
    assert sorted(names_in(tree) & RULES) == []
    assert sorted(modules_in(tree) & MODULES) == []


def test_the_check_sees_a_rule() -> None:
    # The check itself can fail: the durable run holds these names, so reading it finds them.
    tree = parse_file(ROOT / "agent" / "durable.py")
    assert {"save_progress", "reached", "Pause", "approval_group", "MaxStepsReached", "blocks"} <= names_in(tree)
    assert "intermission.engine.runs" in modules_in(tree)
