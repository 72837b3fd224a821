"""Who may answer a pause, whether the answers fit it, and the first snapshot a claim writes.

These are pure functions: a consumer runs them before it claims (a refusal there moves nothing), and the
snapshot they build is written in the claiming transaction, so it already carries every answer the claim
was made with. A worker that dies right after the claim leaves a lapsed lease and that snapshot; the
worker that takes over needs nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TypeVar

from intermission.schemas.commands import Decision, ToolAnswer
from intermission.schemas.config import REDACTED_ARGUMENTS, RunConfig
from intermission.schemas.errors import (
    Forbidden,
    InvalidState,
    NotAgentReplyResumable,
    RequiresApproval,
    ResultsMismatch,
)
from intermission.schemas.llm import ToolOutcome
from intermission.schemas.suspension import Ending, PendingCall, Progress, ProgressResult, SuspendReason, Suspension

C = TypeVar("C")


class Source(StrEnum):
    """Who is answering a pause."""

    HOST = "host"  # run.resume
    DECISION = "decision"  # run.decide
    BUS = "bus"  # run.reply, with the broker-validated bus user_id


def check_authority(source: Source, suspension: Suspension) -> None:
    """Authority comes from the STORED reason, never from the caller's claim about it.

    An approval pause is answered only by a decision; an agent-reply pause only by the bus (anyone else
    would be forging a message the peer never sent); an external-tool pause by its host.
    """
    reason = suspension.reason
    if reason is SuspendReason.APPROVAL:
        if source is not Source.DECISION:
            raise RequiresApproval(f"run {suspension.run_id} waits on an approval decision")
        return
    # Before the decision check: the original refuses EVERYONE but the bus on an agent-reply pause with
    # not_agent_reply_resumable, a decision included; a decision is invalid_state only where it has no
    # reason-specific refusal (an external-tool pause).
    if reason is SuspendReason.AGENT_REPLY and source is not Source.BUS:
        raise NotAgentReplyResumable(f"run {suspension.run_id} waits on another agent's reply")
    if source is Source.DECISION:
        raise InvalidState(f"run {suspension.run_id} is not waiting on an approval")


def check_approver(suspension: Suspension, principal: str | None) -> None:
    """A decision always names its decider: ``principal`` is the message's broker-validated user_id, which
    the checkpoint records as ``decided_by``. Where the pause names approvers, only one of them may
    decide; where it names none, anyone who may publish for the scope."""
    if not principal:
        # A decision nobody can be held to, even on a pause anyone may decide: RabbitMQ vouches only for a
        # user_id the message carries.
        raise Forbidden("a decision must carry the user_id of its decider")
    if suspension.approvers and principal not in suspension.approvers:
        raise Forbidden(f"{principal} may not decide this approval")


def call_approvers(host: list[str] | None, named: list[str]) -> list[str] | None:
    """Who may decide the approval of one call: None for anyone who may publish for the scope.

    ``host`` is the host's list for the call's tool (``RunConfig.approvers``; None when it names none),
    ``named`` the list the call's own arguments name: the model's word, which may only narrow the host's.
    With no host list the call's list stands (empty: anyone); with one, only the names on both count, and
    a call that names nobody the host named gets the host's list: naming outsiders neither widens the
    pause nor leaves it open to anyone.
    """
    named = list(dict.fromkeys(named))
    if host is None:
        return named or None
    host = list(dict.fromkeys(host))
    narrowed = [name for name in named if name in host]
    return narrowed or host


def shared_approvers(one: list[str] | None, other: list[str] | None) -> list[str] | None:
    """Who both lists accept (None accepts anyone): the deciders of one decision that answers calls of
    both. Empty when they share nobody."""
    if one is None:
        return other
    if other is None:
        return one
    return [name for name in one if name in other]


def approval_group(
    calls: Sequence[C], deciders_of: Callable[[C], list[str] | None]
) -> tuple[list[C], list[str] | None]:
    """The calls one approval pause holds, in order, and who may decide it (None: anyone who may publish
    for the scope). ``deciders_of`` gives one call's deciders (``call_approvers``: the host's list for its
    tool, narrowed by what the call itself names).

    One decision approves or denies every call of the pause, so its decider must be one that EVERY call
    accepts: the pause's list is what the calls' lists share, a call with no list restricting nothing, and
    no call's list ever widens another's. A call that shares no decider with the calls before it is left
    out of this pause: it stays open and pauses on its own once this one is answered, as calls of another
    kind do. So no pause is ever one that nobody may decide, nor one that lets one call's deciders decide
    another call they were not named for. (The first call always holds: a call's own list is never empty.)
    """
    held: list[C] = []
    deciders: list[str] | None = None
    for call in calls:
        shared = shared_approvers(deciders, deciders_of(call))
        if held and shared == []:
            continue
        held.append(call)
        deciders = shared
    return held, deciders


def validate_results(pending: list[PendingCall], results: list[ToolAnswer]) -> list[ToolAnswer]:
    """Results must map one to one onto the pending calls; returns them in PENDING order.

    An extra, a duplicate or a missing id is ResultsMismatch naming the call.
    """
    wanted = {call.id for call in pending}
    by_id: dict[str, ToolAnswer] = {}
    for answer in results:
        if answer.call_id not in wanted:
            raise ResultsMismatch(f"result for call {answer.call_id!r}, which is not pending")
        if answer.call_id in by_id:
            raise ResultsMismatch(f"two results for call {answer.call_id!r}")
        by_id[answer.call_id] = answer
    for call in pending:
        if call.id not in by_id:
            raise ResultsMismatch(f"no result for pending call {call.id!r}")
    return [by_id[call.id] for call in pending]


def results_progress(suspension: Suspension, results: list[ToolAnswer], owner: str) -> Progress:
    ordered = validate_results(suspension.pending, results)
    return Progress(
        run_id=suspension.run_id,
        owner=owner,
        continuation=suspension.continuation,
        done=[
            ProgressResult(
                call_id=a.call_id,
                content=a.content,
                error=a.error or "",
                outcome=ToolOutcome.FAILED if a.error else ToolOutcome.COMPLETED,
            )
            for a in ordered
        ],
    )


def reply_progress(suspension: Suspension, reply_with: str, content: str, owner: str) -> Progress:
    """The bus's reply answers the pending call its ``reply_with`` names. The call id alone is not
    enough: a later model response may reuse it, while ``reply_with`` is fresh per question."""
    matching = [call for call in suspension.pending if call.reply_with and call.reply_with == reply_with]
    if len(matching) != 1 or len(suspension.pending) != 1:
        raise ResultsMismatch(f"reply_with {reply_with!r} does not name this pause's question")
    return Progress(
        run_id=suspension.run_id,
        owner=owner,
        continuation=suspension.continuation,
        done=[ProgressResult(call_id=matching[0].id, content=content, outcome=ToolOutcome.COMPLETED)],
    )


def decision_progress(suspension: Suspension, decision: Decision, reason: str, owner: str) -> Progress:
    """Approve: every pending call runs through the approval path. Deny: every pending call is denied,
    and the worker fails the run with the decider's reason."""
    if decision is Decision.APPROVE:
        return Progress(
            run_id=suspension.run_id,
            owner=owner,
            continuation=suspension.continuation,
            approved=[call.id for call in suspension.pending],
        )
    why = reason or "denied"
    return Progress(
        run_id=suspension.run_id,
        owner=owner,
        continuation=suspension.continuation,
        done=[ProgressResult(call_id=call.id, error=why, outcome=ToolOutcome.DENIED) for call in suspension.pending],
    )


def ending_progress(suspension: Suspension, ending: Ending, owner: str) -> Progress:
    return Progress(run_id=suspension.run_id, owner=owner, continuation=suspension.continuation, ending=ending)


def publishable(pending: list[PendingCall], config: RunConfig) -> list[PendingCall]:
    """The pending calls as a Notice (or a page) of a run under ``config`` may carry them outside: with their
    arguments redacted when its publication policy says so. The stored pause keeps them whole, for whoever
    must execute them."""
    if not config.publication.redact_arguments:
        return pending
    return [call.model_copy(update={"arguments": REDACTED_ARGUMENTS}) for call in pending]
