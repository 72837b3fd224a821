"""Continuations and progress snapshots round-trip through the store unchanged (hypothesis).

Arbitrary values (every field, arbitrary ``prepared`` bytes, unicode text, nested messages and tool calls,
configs with ``tools_restricted`` both ways) go in through the store's real write paths and must come
back equal, bytes byte for byte. One database serves the whole property (hypothesis runs every example
under the test's one set of fixtures).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intermission.schemas.config import Budget, ContextPolicy, ExecutionProvenance, PublicationPolicy, RunConfig
from intermission.schemas.errors import InvalidArgument
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome, ToolResult, Usage
from intermission.schemas.run import NewRun
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import (
    Continuation,
    Ending,
    EndingKind,
    PendingCall,
    Progress,
    ProgressResult,
    SuspendReason,
    Suspension,
)
from intermission.store import Stores
from tests.support.factories import continuation, running_run, writes
from tests.support.inspect import inspector

# PostgreSQL text (and so jsonb) cannot hold U+0000; the store refuses it (tested below), so the
# round-trip property draws text without it. Surrogates are not text in any encoding and never drawn.
text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=24)
small = st.integers(min_value=0, max_value=2**31 - 1)
anyint = st.integers(min_value=-(2**63), max_value=2**63 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False)
nonnegative = st.integers(min_value=0, max_value=2**63 - 1)
# The temperatures a config accepts (schemas/config.py, MAX_TEMPERATURE).
temperatures = st.floats(min_value=0.0, max_value=2.0)

tool_calls = st.builds(ToolCall, id=text, name=text, arguments=text)
messages = st.builds(
    Message,
    role=st.sampled_from(Role),
    content=text,
    tool_calls=st.lists(tool_calls, max_size=3),
    tool_call_id=text,
    name=text,
)
tool_results = st.builds(
    ToolResult, call_id=text, name=text, content=text, error=text, outcome=st.sampled_from(ToolOutcome)
)
configs = st.builds(
    RunConfig,
    context=st.none() | st.builds(ContextPolicy, max_messages=small, strategy=text),
    publication=st.builds(
        PublicationPolicy,
        redact_arguments=st.booleans(),
        blocked_terms=st.lists(text.filter(bool), max_size=3),  # an empty term is refused
    ),
    budget=st.builds(Budget, max_total_tokens=small, max_tool_calls=small),
    all_tools_restricted=st.booleans(),
    model=text,
    temperature=st.none() | temperatures,
    max_steps=nonnegative,
    max_tokens=nonnegative,
    reasoning_loop=text,
    tools=st.lists(text, max_size=4),
    persona_ref=text,
    tools_restricted=st.booleans(),
)
continuations = st.builds(
    Continuation,
    tool_results=st.lists(tool_results, max_size=3),
    schema_version=anyint,
    prepared=st.binary(max_size=512),
    provenance=st.builds(ExecutionProvenance, agent_id=text, executor=text, model=text, worker=text),
    usage=st.builds(Usage, input_tokens=anyint, output_tokens=anyint, total_tokens=anyint, tool_calls=anyint),
    messages=st.lists(messages, max_size=4),
    system_prompt=text,
    step_index=small,  # the run row's step count (an integer column) bounds it
    tokens_used=anyint,
    new_messages_from=anyint,
    session_id=text,
    config=configs,
)
pending_calls = st.builds(PendingCall, reply_with=text, id=text, name=text, arguments=text, note=text)
progress_results = st.builds(
    ProgressResult, call_id=text, content=text, error=text, outcome=st.sampled_from(ToolOutcome)
)
endings = st.none() | st.builds(Ending, kind=st.sampled_from(EndingKind), reason=text)
deadlines = st.none() | st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)
)
approver_names = st.lists(st.from_regex(r"[a-z0-9@._-]{1,16}", fullmatch=True), max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cont=continuations,
    started=st.lists(pending_calls, max_size=3),
    done=st.lists(progress_results, max_size=3),
    ending=endings,
    approved=st.lists(text, max_size=3),
    pending=st.lists(pending_calls, max_size=3),
    reason=st.sampled_from(SuspendReason),
    expires_at=deadlines,
    approvers=approver_names,
)
async def test_continuation_and_progress_round_trip_through_the_store_unchanged(
    stores: Stores,
    scope: Scope,
    cont: Continuation,
    started: list[PendingCall],
    done: list[ProgressResult],
    ending: Ending | None,
    approved: list[str],
    pending: list[PendingCall],
    reason: SuspendReason,
    expires_at: datetime | None,
    approvers: list[str],
) -> None:
    # Fresh runs per example, in the property's one database: one held under a lease for the snapshot,
    # one created (never started) to carry the pause.
    run, held = await running_run(stores, scope)
    paused_id = (await writes(stores, scope).runs.create_run(NewRun(run_id=f"{run.id}-p", agent_id="demo"))).run.id

    p = Progress(
        run_id=run.id,
        owner=held.owner,
        continuation=cont,
        started=started,
        done=done,
        ending=ending,
        approved=approved,
    )
    saved = await writes(stores, scope).progress.save_progress(p)
    got = await stores.at(scope).progress.get_progress(run.id)
    assert got == saved
    assert got.model_copy(update={"scope": None, "updated_at": None}) == p
    assert got.continuation.prepared == cont.prepared

    s = Suspension(
        run_id=paused_id,
        scope=scope,
        reason=reason,
        pending=pending,
        continuation=cont,
        expires_at=expires_at,
        approvers=approvers,
    )
    created = await writes(stores, scope).suspensions.create_suspension(s)
    read = await stores.at(scope).suspensions.get_suspension(paused_id)
    assert read == created
    assert read.model_copy(update={"id": 0, "created_at": None}) == s
    assert read.continuation.prepared == cont.prepared


async def test_text_with_nul_is_refused_with_a_typed_error_and_nothing_is_written(
    stores: Stores, database_url: str, scope: Scope
) -> None:
    """U+0000 cannot be stored in jsonb; the store says so with InvalidArgument instead of a driver error.
    Text that merely LOOKS like the escape (a backslash, then "u0000") is ordinary text and round-trips."""
    run, held = await running_run(stores, scope)
    async with inspector(database_url) as db:
        before = await db.snapshot()
        for bad in (continuation(system_prompt="a\x00b"), continuation(session_id="\x00")):
            with pytest.raises(InvalidArgument):
                await writes(stores, scope).progress.save_progress(
                    Progress(run_id=run.id, owner=held.owner, continuation=bad)
                )
            with pytest.raises(InvalidArgument):
                await writes(stores, scope).suspensions.create_suspension(
                    Suspension(run_id=run.id, scope=scope, reason=SuspendReason.APPROVAL, continuation=bad)
                )
        with pytest.raises(InvalidArgument):
            await writes(stores, scope).progress.save_progress(
                Progress(run_id=run.id, owner=held.owner, done=[ProgressResult(call_id="c", content="\x00")])
            )
        assert await db.snapshot() == before

    lookalike = continuation(system_prompt="\\u0000 and \\\\u0000 and \\", session_id="\\")
    await writes(stores, scope).progress.save_progress(
        Progress(run_id=run.id, owner=held.owner, continuation=lookalike)
    )
    assert (await stores.at(scope).progress.get_progress(run.id)).continuation == lookalike
