"""The web console's pure parts: what a person is shown (times, arguments, dead letters of their scopes),
how far a grant reaches, redirects that stay on the console, CSRF tokens, the login throttle, and that an
installed copy ships every template and static file."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatch
from pathlib import Path

import pytest

from intermission.ops.console.app import FAILED_LOGIN_SECONDS, FAILED_LOGINS, FailedLogins
from intermission.ops.console.listener import EVERY_SCOPE_BINDINGS, bindings_for
from intermission.ops.console.security import local_path, token_matches
from intermission.ops.console.views import pretty_arguments, reach_label, until, visible_letters
from intermission.ops.dead import DeadLetter
from intermission.ops.grants import permits
from intermission.schemas.scope import Reach, Scope

ROOT = Path(__file__).resolve().parents[2]
A = Scope(app="billing", tenant="acme")
B = Scope(app="billing", tenant="globex")


def letter(routing_key: str) -> DeadLetter:
    return DeadLetter(message_id="m", routing_key=routing_key, code="forbidden", detail="", size=2)


def test_a_person_sees_the_dead_letters_of_their_scopes_and_only_a_trusted_one_those_of_no_scope() -> None:
    letters = [letter("run.decide.billing.acme"), letter("run.decide.billing.globex"), letter("run.decide")]
    assert [s for _, s in visible_letters(letters, Reach(scopes=(A,)))] == [A]
    assert [s for _, s in visible_letters(letters, Reach(every_scope=True))] == [A, B, None]
    assert visible_letters(letters, Reach()) == []
    assert visible_letters([letter("run.decide.billing.acme.extra"), letter("nonsense")], Reach(scopes=(A,))) == []


def test_a_reach_covers_exactly_its_scopes() -> None:
    assert Reach(scopes=(A,)).covers(A)
    assert not Reach(scopes=(A,)).covers(B)
    assert Reach(every_scope=True).covers(B)
    assert Reach().is_empty
    assert (reach_label(Reach()), reach_label(Reach(every_scope=True))) == ("no scope", "every scope")
    assert reach_label(Reach(scopes=(B, A))) == "billing/acme, billing/globex"


def test_a_subscription_binds_its_scopes_keys_or_every_scopes_for_a_trusted_person() -> None:
    keys = bindings_for(Reach(scopes=(A,)))
    assert "notice.approval.billing.acme" in keys
    assert "command.rejected.billing.acme" in keys
    assert all(k.endswith(".billing.acme") for k in keys)
    assert bindings_for(Reach()) == {}
    assert bindings_for(Reach(every_scope=True)) == EVERY_SCOPE_BINDINGS


@pytest.mark.parametrize(
    ("pattern", "reaches"),
    [
        (".*", True),  # what `trust` gives
        ("^(intermission\\.commands|alice\\..*)$", True),
        ("^(intermission\\.events)$", False),
        ("", False),  # RabbitMQ reads an empty pattern as nothing
        ("^$", False),
        ("(unclosed", False),  # unreadable here: shown too little, never too much
    ],
)
def test_a_write_permission_reaches_the_commands_exchange_as_rabbitmq_reads_it(pattern: str, reaches: bool) -> None:
    assert permits(pattern, "intermission.commands") is reaches


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/runs/billing/acme/run-1", "/runs/billing/acme/run-1"),
        ("/inbox?decided=x", "/inbox?decided=x"),
        ("//evil.example/", "/inbox"),
        ("https://evil.example/", "/inbox"),
        ("/\\evil.example", "/inbox"),
        ("/inbox\r\nSet-Cookie: x", "/inbox"),
        (None, "/inbox"),
        ("", "/inbox"),
    ],
)
def test_a_redirect_after_a_form_stays_on_the_console(target: object, expected: str) -> None:
    assert local_path(target) == expected


def test_a_csrf_token_must_be_the_sessions_own() -> None:
    assert token_matches("abc", "abc")
    assert not token_matches("abc", "abd")
    assert not token_matches("abc", "")
    assert not token_matches("", "")
    assert not token_matches(None, "abc")
    assert not token_matches("abc", ["abc"])


def test_too_many_failed_logins_of_one_user_pause_that_user_only() -> None:
    failed = FailedLogins()
    for i in range(FAILED_LOGINS):
        assert not failed.blocked("alice", float(i))
        failed.failed("alice", float(i))
    assert failed.blocked("alice", float(FAILED_LOGINS))
    assert not failed.blocked("bob", float(FAILED_LOGINS))
    assert not failed.blocked("alice", FAILED_LOGINS + FAILED_LOGIN_SECONDS)
    failed.failed("alice", 1000.0)
    failed.succeeded("alice")
    assert not failed.blocked("alice", 1000.0)


def test_times_and_arguments_read_as_a_person_reads_them() -> None:
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    assert until(None, now) == "no deadline"
    assert until(now - timedelta(seconds=1), now) == "passed"
    assert until(now + timedelta(seconds=30), now) == "in less than a minute"
    assert until(now + timedelta(minutes=5, seconds=10), now) == "in 5 min"
    assert until(now + timedelta(hours=23, minutes=59), now) == "in 23 h 59 min"
    assert until(now + timedelta(days=2, hours=3), now) == "in 2 d 3 h"
    assert pretty_arguments('{"b":1,"a":"é"}') == '{\n  "a": "é",\n  "b": 1\n}'
    assert pretty_arguments('"[redacted]"') == '"[redacted]"'
    assert pretty_arguments("not json") == "not json"


def test_an_installed_copy_ships_every_template_and_static_file() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "intermission.ops.console" in project["packages"]
    shipped = project["package-data"]["intermission.ops.console"]
    folder = ROOT / "ops" / "console"
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.suffix != ".py"]
    files = [f for f in files if f != "py.typed" and "__pycache__" not in f]
    assert files
    assert [f for f in files if not any(fnmatch(f, pattern) for pattern in shipped)] == []
