"""The web console's pure parts: what a person is shown (times, arguments, dead letters of their scopes),
how far a grant reaches, redirects that stay on the console, CSRF tokens, the login throttle, and that an
installed copy ships every template and static file."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatch
from pathlib import Path

import pytest

from intermission.ops.console.listener import EVERY_SCOPE_BINDINGS, bindings_for
from intermission.ops.console.security import local_path, token_matches
from intermission.ops.console.throttle import (
    FAILURE_WINDOW_SECONDS,
    FREE_ADDRESS_FAILURES,
    FREE_FAILURES,
    MAX_BACKOFF_SECONDS,
    LoginThrottle,
)
from intermission.ops.console.views import pretty_arguments, reach_label, until, visible_letters
from intermission.ops.dead import DeadLetter
from intermission.ops.grants import permits
from intermission.schemas.scope import Reach, Scope
from intermission.wire import scope_of_command_key

ROOT = Path(__file__).resolve().parents[2]
A = Scope(app="billing", tenant="acme")
B = Scope(app="billing", tenant="globex")


def letter(routing_key: str) -> DeadLetter:
    return DeadLetter(
        message_id="m",
        routing_key=routing_key,
        code="forbidden",
        detail="",
        size=2,
        scope=scope_of_command_key(routing_key),
    )


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


def fail(throttle: LoginThrottle, user: str, address: str, now: float) -> float | None:
    """One refused login, if the throttle lets it through; what ``begin`` said."""
    wait = throttle.begin(user, address, now)
    if wait is None:
        throttle.finish(user, address, now, refused=True)
    return wait


def test_a_name_tried_from_one_address_backs_off_and_only_there() -> None:
    throttle = LoginThrottle()
    for i in range(FREE_FAILURES):
        assert fail(throttle, "alice", "10.0.0.66", float(i)) is None
    # The next failure backs off 1 s, then 2 s, 4 s ... never past the cap.
    now = float(FREE_FAILURES)
    waits = []
    for _ in range(12):
        assert fail(throttle, "alice", "10.0.0.66", now) is None
        wait = throttle.begin("alice", "10.0.0.66", now)
        assert wait is not None
        waits.append(wait)
        now += wait
    assert waits[:3] == [1.0, 2.0, 4.0]
    assert max(waits) == MAX_BACKOFF_SECONDS
    # Alice herself, from her own address, is not slowed at all: backoff, not a lock-out.
    assert throttle.begin("alice", "192.0.2.7", now) is None
    throttle.finish("alice", "192.0.2.7", now, refused=False)


def test_one_password_sprayed_across_many_names_from_one_address_backs_off() -> None:
    throttle = LoginThrottle()
    for i in range(FREE_ADDRESS_FAILURES):
        assert fail(throttle, f"user-{i}", "10.0.0.66", 0.0) is None
    assert fail(throttle, "user-x", "10.0.0.66", 0.0) is None
    wait = throttle.begin("user-y", "10.0.0.66", 0.0)
    assert wait == 1.0
    assert throttle.begin("user-y", "192.0.2.7", 0.0) is None


def test_a_parallel_burst_gets_one_password_check_at_a_time() -> None:
    throttle = LoginThrottle()
    # Every begin happens before any finish, as a burst of concurrent requests would.
    let_through = [throttle.begin("alice", "10.0.0.66", 0.0) is None for _ in range(50)]
    assert let_through.count(True) == 1
    across_names = [throttle.begin(f"n{i}", "10.0.0.67", 0.0) is None for i in range(50)]
    assert across_names.count(True) == 4


def test_an_unreachable_broker_counts_for_nothing_and_a_success_clears_the_name() -> None:
    throttle = LoginThrottle()
    for _ in range(FREE_FAILURES + 5):
        assert throttle.begin("alice", "10.0.0.1", 0.0) is None
        throttle.finish("alice", "10.0.0.1", 0.0, refused=None)
    assert throttle.begin("alice", "10.0.0.1", 0.0) is None
    throttle.finish("alice", "10.0.0.1", 0.0, refused=False)
    for i in range(FREE_FAILURES + 1):
        fail(throttle, "alice", "10.0.0.1", float(i))
    assert throttle.begin("alice", "10.0.0.1", float(FREE_FAILURES)) is not None


def test_the_throttle_s_memory_is_bounded() -> None:
    throttle = LoginThrottle(max_entries=100)
    for i in range(5000):
        fail(throttle, f"user-{i}", f"10.0.{i // 250}.{i % 250}", float(i))
    assert len(throttle) <= 100
    # Past the window, a name's failures are forgotten.
    forgetful = LoginThrottle()
    for _ in range(FREE_FAILURES + 1):
        fail(forgetful, "alice", "10.0.0.1", 0.0)
    later = FAILURE_WINDOW_SECONDS + MAX_BACKOFF_SECONDS + 1
    assert forgetful.begin("alice", "10.0.0.1", later) is None


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
