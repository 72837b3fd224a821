"""Who may answer which pause, and whether answers fit it (docs/scenarios.md, scenarios 9 and 20)."""

from __future__ import annotations

import pytest

from intermission.schemas.answers import (
    Source,
    approval_group,
    call_approvers,
    check_approver,
    check_authority,
    decision_progress,
    reply_progress,
    results_progress,
    shared_approvers,
    validate_results,
)
from intermission.schemas.commands import Decision, ToolAnswer
from intermission.schemas.errors import (
    Forbidden,
    IntermissionError,
    InvalidState,
    NotAgentReplyResumable,
    RequiresApproval,
    ResultsMismatch,
)
from intermission.schemas.llm import ToolOutcome
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import PendingCall, SuspendReason, Suspension

PENDING = [PendingCall(id="c1", name="lookup"), PendingCall(id="c2", name="lookup")]


def pause(reason: SuspendReason, **changes: object) -> Suspension:
    base = Suspension(id=7, run_id="r1", scope=Scope(app="a", tenant="t"), reason=reason, pending=PENDING)
    return base.model_copy(update=changes)


# The full source x reason matrix: None means allowed.
MATRIX: dict[tuple[Source, SuspendReason], type[IntermissionError] | None] = {
    (Source.HOST, SuspendReason.EXTERNAL_TOOL): None,
    (Source.HOST, SuspendReason.APPROVAL): RequiresApproval,
    (Source.HOST, SuspendReason.AGENT_REPLY): NotAgentReplyResumable,
    (Source.BUS, SuspendReason.EXTERNAL_TOOL): None,
    (Source.BUS, SuspendReason.APPROVAL): RequiresApproval,
    (Source.BUS, SuspendReason.AGENT_REPLY): None,
    (Source.DECISION, SuspendReason.EXTERNAL_TOOL): InvalidState,
    (Source.DECISION, SuspendReason.APPROVAL): None,
    (Source.DECISION, SuspendReason.AGENT_REPLY): NotAgentReplyResumable,
}


@pytest.mark.parametrize(("source", "reason"), list(MATRIX))
def test_authority_matrix(source: Source, reason: SuspendReason) -> None:
    expected = MATRIX[(source, reason)]
    if expected is None:
        check_authority(source, pause(reason))
    else:
        with pytest.raises(expected):
            check_authority(source, pause(reason))


def test_results_must_match_pending_calls_one_to_one() -> None:
    exact = [ToolAnswer(call_id="c2", content="two"), ToolAnswer(call_id="c1", content="one")]
    assert [a.call_id for a in validate_results(PENDING, exact)] == ["c1", "c2"]  # pending order
    cases = {
        "extra": [*exact, ToolAnswer(call_id="c3")],
        "duplicate": [*exact, ToolAnswer(call_id="c1")],
        "missing": exact[:1],
    }
    for name, results in cases.items():
        with pytest.raises(ResultsMismatch) as caught:
            validate_results(PENDING, results)
        assert any(c in caught.value.detail for c in ("c1", "c2", "c3")), name


def test_results_become_done_in_pending_order_with_outcomes() -> None:
    p = results_progress(
        pause(SuspendReason.EXTERNAL_TOOL),
        [ToolAnswer(call_id="c2", error="boom"), ToolAnswer(call_id="c1", content="ok")],
        owner="w",
    )
    assert [(d.call_id, d.outcome) for d in p.done] == [("c1", ToolOutcome.COMPLETED), ("c2", ToolOutcome.FAILED)]
    assert p.owner == "w"


def test_approvers_listed_on_the_pause_decide_and_nobody_else() -> None:
    named = pause(SuspendReason.APPROVAL, approvers=["alice"])
    check_approver(named, "alice")
    for who in ("bob", None, ""):
        with pytest.raises(Forbidden):
            check_approver(named, who)
    check_approver(pause(SuspendReason.APPROVAL), "anyone")  # no approvers named: any identity in scope


@pytest.mark.parametrize("who", [None, ""])
def test_a_decision_without_a_user_id_is_forbidden_even_where_anyone_may_decide(who: str | None) -> None:
    with pytest.raises(Forbidden):
        check_approver(pause(SuspendReason.APPROVAL), who)


@pytest.mark.parametrize(
    ("host", "named", "deciders"),
    [
        (None, [], None),  # nobody named anybody: anyone in scope
        (None, ["carol"], ["carol"]),  # no host list: the call's own list stands
        (["alice"], [], ["alice"]),  # the call names nobody: the host's list
        (["alice", "bob"], ["bob"], ["bob"]),  # the call narrows the host's list
        (["alice", "bob"], ["bob", "mallory"], ["bob"]),  # ... and its outsiders are dropped
        (["alice"], ["mallory"], ["alice"]),  # naming only outsiders neither widens nor opens the pause
        (["alice", "alice"], ["alice", "alice"], ["alice"]),
    ],
)
def test_a_calls_own_approvers_only_narrow_the_hosts(
    host: list[str] | None, named: list[str], deciders: list[str] | None
) -> None:
    assert call_approvers(host, named) == deciders


def test_a_decider_of_several_calls_must_be_one_every_call_accepts() -> None:
    assert shared_approvers(None, None) is None
    assert shared_approvers(None, ["alice"]) == ["alice"]
    assert shared_approvers(["alice", "bob"], None) == ["alice", "bob"]
    assert shared_approvers(["alice", "bob"], ["bob", "carol"]) == ["bob"]
    assert shared_approvers(["alice"], ["bob"]) == []


def test_decisions_become_approved_calls_or_denied_results() -> None:
    s = pause(SuspendReason.APPROVAL)
    approve = decision_progress(s, Decision.APPROVE, "", owner="w")
    assert (approve.approved, approve.done) == (["c1", "c2"], [])
    deny = decision_progress(s, Decision.DENY, "too risky", owner="w")
    assert [(d.outcome, d.error) for d in deny.done] == [(ToolOutcome.DENIED, "too risky")] * 2


def test_a_reply_must_name_the_question_of_this_pause() -> None:
    s = pause(SuspendReason.AGENT_REPLY, pending=[PendingCall(id="c1", name="ask_agent", reply_with="rw-1")])
    assert reply_progress(s, "rw-1", '{"x":1}', owner="w").done[0].content == '{"x":1}'
    with pytest.raises(ResultsMismatch):
        reply_progress(s, "rw-other", "{}", owner="w")


def test_an_approval_pause_holds_only_calls_that_share_a_decider() -> None:
    lists: dict[str, list[str] | None] = {"a": ["alice", "bob"], "b": None, "c": ["bob"], "d": ["dave"], "e": ["bob"]}
    held, deciders = approval_group(list(lists), lists.__getitem__)
    # d shares nobody with the calls before it: it waits for a pause of its own.
    assert (held, deciders) == (["a", "b", "c", "e"], ["bob"])
    assert approval_group(["d"], lists.__getitem__) == (["d"], ["dave"])
    assert approval_group(["b"], lists.__getitem__) == (["b"], None)
