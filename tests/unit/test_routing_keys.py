"""Scoped routing keys: what each command is published under, what scope a key names, and whose stream
hears a refusal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intermission.consumers.parsing import check_key_scope
from intermission.consumers.rejection import _refusal_scope
from intermission.schemas.errors import Forbidden, InvalidScope
from intermission.schemas.scope import Scope
from intermission.wire import Command, KeyScopeInvalid

scope_part = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
A = Scope(app="acme", tenant="t1")
B = Scope(app="acme", tenant="t2")


@given(app=scope_part, tenant=scope_part, command=st.sampled_from(list(Command)))
def test_a_key_names_exactly_the_scope_it_was_made_for(app: str, tenant: str, command: Command) -> None:
    scope = Scope(app=app, tenant=tenant)
    key = command.key(scope)
    assert key == f"{command.value}.{app}.{tenant}"
    assert command.scope_of_key(key) == scope
    assert Command.of_key(key) is command


def test_the_bare_key_names_no_scope_and_the_binding_takes_both() -> None:
    assert Command.RESUME.scope_of_key("run.resume") is None
    assert Command.RESUME.binding == "run.resume.#"
    assert Command.of_key("run.resume") is Command.RESUME
    assert Command.of_key("run.resumed.acme.t1") is None
    assert Command.of_key("notice.approval.acme.t1") is None


@pytest.mark.parametrize(
    "key", ["run.resume.acme", "run.resume.acme.t1.extra", "run.resume.acme.", "run.resume..t1", "run.resume.a b.t1"]
)
def test_a_key_whose_scope_part_is_not_app_dot_tenant_is_invalid(key: str) -> None:
    with pytest.raises(KeyScopeInvalid):
        Command.RESUME.scope_of_key(key)
    with pytest.raises(InvalidScope):
        check_key_scope(Command.RESUME, key, A)


def test_a_body_must_act_in_the_scope_its_key_names() -> None:
    check_key_scope(Command.RESUME, Command.RESUME.key(A), A)
    check_key_scope(Command.RESUME, "run.resume", B)  # trusted: the bare key carries no scope
    with pytest.raises(Forbidden, match=r"names the scope acme\.t1 but the body acts in acme\.t2"):
        check_key_scope(Command.RESUME, Command.RESUME.key(A), B)


def test_a_refusal_goes_to_the_scope_the_key_names_never_to_the_bodys() -> None:
    body_of_b = {"scope": {"app": "acme", "tenant": "t2"}}
    assert _refusal_scope(Command.RESUME.key(A), body_of_b) == A
    assert _refusal_scope("run.resume", body_of_b) == B  # the bare key: a trusted sender's own scope
    assert _refusal_scope("run.resume.acme", body_of_b) is None  # nobody's: command.rejected._._
    assert _refusal_scope("run.resume", None) is None
