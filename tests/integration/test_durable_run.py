"""The durability rules every executor gets from ``DurableRun`` (agent/durable.py), driven directly against
the real PostgreSQL: no model, no framework, no fleet. The executors' own tests prove the same rules end
to end (test_fleet_runs, test_runaway, test_pydantic_ai, test_openai_agents, the crash tests); these pin
each rule to the one module that holds it.

What a handler sees is read from the database while the handler runs: "saved before it runs" means the
row says so by then."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from intermission import points
from intermission.agent.durable import OUTCOME_UNKNOWN, CallFailed, DurableRun, Limit, ModelTurn, Ran, Waiting
from intermission.agent.executor import RunContext
from intermission.engine.core import Engine
from intermission.engine.observer import CrashPoints
from intermission.schemas.config import Budget, PublicationPolicy, RunConfig
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome, Usage
from intermission.schemas.run import Ending, EndingKind, Lease, NewRun, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, PendingCall, Progress, ProgressResult, SuspendReason
from intermission.store import Stores
from tests.integration.test_runaway import counted, progress_writes
from tests.support.factories import writes
from tests.support.inspect import Inspector

__all__ = ["counted"]  # the fixture, used by name

OWNER = "durable-test-worker"


@pytest.fixture
def reached() -> Iterator[list[str]]:
    """The crash points this process passes, in order."""
    seen: list[str] = []
    points.observe(seen.append)
    try:
        yield seen
    finally:
        points.observe(None)


Open = Callable[..., Awaitable[tuple[DurableRun, RunContext]]]


@pytest.fixture
def open_run(stores: Stores, scope: Scope) -> Open:
    """A running run under a live lease, and the DurableRun over its context: from a fresh start, or from
    the snapshot ``first`` (a claim's or a takeover's). Its engine passes the crash points the run reaches
    on to the process's point observer (``reached``), as a worker's does."""
    engine = Engine.over(stores, observer=CrashPoints())

    async def make(
        config: RunConfig | None = None,
        *,
        cont: Continuation | None = None,
        started: list[PendingCall] | None = None,
        done: list[ProgressResult] | None = None,
        approved: list[str] | None = None,
        ending: Ending | None = None,
        keeps_results: bool = True,
        framework_limits: tuple[Limit, ...] = (),
    ) -> tuple[DurableRun, RunContext]:
        config = config or RunConfig(max_steps=8)
        run_id = f"run-{uuid.uuid4().hex[:12]}"
        lease = Lease(owner=OWNER, ttl_seconds=30)
        first = Progress(
            run_id=run_id,
            owner=OWNER,
            continuation=(cont or Continuation()).model_copy(update={"config": config}),
            started=started or [],
            done=done or [],
            approved=approved or [],
            ending=ending,
        )
        new = NewRun(run_id=run_id, agent_id="demo", input="hello", config=config)
        created = await writes(stores, scope, engine).runs.create_run(new, lease, first)
        ctx = RunContext(engine, created.run, first, lease, correlation_id=None, stopping=asyncio.Event())
        return DurableRun(ctx, executor="test", keeps_results=keeps_results, framework_limits=framework_limits), ctx

    return make


def call(call_id: str, name: str = "tool", arguments: str = "{}") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


def with_turn(*calls: ToolCall) -> Continuation:
    """A continuation whose last assistant turn asked for ``calls`` (a snapshot a takeover continues)."""
    return Continuation(
        messages=[Message(role=Role.USER, content="hello"), Message(role=Role.ASSISTANT, tool_calls=list(calls))],
        step_index=1,
    )


async def saved(stores: Stores, scope: Scope, run_id: str) -> Progress:
    return await stores.at(scope).progress.get_progress(run_id)


async def finished(body: Callable[[DurableRun], Awaitable[None]], run: DurableRun) -> None:
    """Drive ``run`` through ``body`` to the run's end or pause."""
    await run.drive(body)


async def test_a_turn_is_saved_before_its_first_call_runs_and_a_not_retry_safe_call_before_it_runs(
    open_run: Open, stores: Stores, scope: Scope, reached: list[str]
) -> None:
    run, ctx = await open_run()
    seen: dict[str, Progress] = {}

    def handler(call_id: str) -> Callable[[], Awaitable[str]]:
        async def read() -> str:
            seen[call_id] = await saved(stores, scope, ctx.run.id)
            return f"{call_id} done"

        return read

    async def body(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.before_turn()
        await run.model_turn(ModelTurn(text="", calls=[call("safe"), call("unsafe")], usage=Usage(total_tokens=5)))
        assert await run.run_call(call("safe"), handler("safe"), retry_safe=True, text=str) == Ran("safe done")
        assert await run.run_call(call("unsafe"), handler("unsafe"), retry_safe=False, text=str) == Ran("unsafe done")
        await run.complete("ok")

    await finished(body, run)
    # The retry-safe call found its turn saved (one step in), with nothing started.
    safe = seen["safe"]
    assert (safe.continuation.step_index, safe.started) == (1, [])
    assert safe.continuation.messages[-1].tool_calls == [call("safe"), call("unsafe")]
    # The non-retry-safe call found itself started, with the result of the call before it.
    unsafe = seen["unsafe"]
    assert [c.id for c in unsafe.started] == ["unsafe"]
    assert unsafe.done == [ProgressResult(call_id="safe", content="safe done")]
    assert reached == [points.AFTER_STARTED]
    assert (await stores.at(scope).runs.get_run(ctx.run.id)).state is RunState.COMPLETED


async def test_a_started_call_is_never_run_again_and_a_done_result_is_reused(
    open_run: Open, stores: Stores, scope: Scope, reached: list[str]
) -> None:
    cont = with_turn(call("unsafe"), call("known"), call("fresh"))
    run, _ = await open_run(
        cont=cont,
        started=[PendingCall(id="unsafe", name="tool")],
        done=[ProgressResult(call_id="known", content="from the dead worker")],
    )
    ran: list[str] = []

    def handler(call_id: str) -> Callable[[], Awaitable[str]]:
        async def go() -> str:
            ran.append(call_id)
            return "ran"

        return go

    results: dict[str, Ran[str] | ProgressResult] = {}

    async def body(run: DurableRun) -> None:
        await run.resume()
        for c in ("unsafe", "known", "fresh"):
            results[c] = await run.run_call(call(c), handler(c), retry_safe=c == "fresh", text=str)
        await run.close_turn()
        await run.complete("ok")

    await finished(body, run)
    assert ran == ["fresh"]
    assert results["unsafe"] == ProgressResult(call_id="unsafe", error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED)
    assert results["known"] == ProgressResult(call_id="known", content="from the dead worker")
    assert results["fresh"] == Ran("ran")
    assert reached == [points.BETWEEN_STEPS]


async def test_a_failed_call_and_an_exception_of_its_handler_are_told_apart(open_run: Open) -> None:
    run, _ = await open_run(cont=with_turn(call("fails"), call("raises")))

    async def fails() -> str:
        raise CallFailed("no such customer")

    async def raises() -> str:
        raise LookupError("the framework's own")

    async def body(run: DurableRun) -> None:
        failed = await run.run_call(call("fails"), fails, retry_safe=False, text=str)
        assert failed == ProgressResult(call_id="fails", error="no such customer", outcome=ToolOutcome.FAILED)
        with pytest.raises(LookupError):
            await run.run_call(call("raises"), raises, retry_safe=False, text=str)
        # The exception went through untouched and the call stays started: a takeover never runs it again.
        assert run.settled("raises") == ProgressResult(
            call_id="raises", error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED
        )
        await run.complete("ok")

    await finished(body, run)


async def test_a_framework_that_keeps_its_results_leaves_only_non_retry_safe_ones_in_the_ledger(
    open_run: Open, stores: Stores, scope: Scope
) -> None:
    run, ctx = await open_run(cont=with_turn(call("safe"), call("unsafe"), call("last")), keeps_results=False)
    seen: list[Progress] = []

    async def ok() -> str:
        return "ok"

    async def last() -> str:
        seen.append(await saved(stores, scope, ctx.run.id))
        return "ok"

    async def body(run: DurableRun) -> None:
        await run.run_call(call("safe"), ok, retry_safe=True, text=str)
        await run.run_call(call("unsafe"), ok, retry_safe=False, text=str)
        await run.run_call(call("last"), last, retry_safe=False, text=str)
        await run.complete("ok")

    await finished(body, run)
    # The last call's started save carries the non-retry-safe result before it, and no retry-safe one: the
    # framework hands those over again itself.
    [progress] = seen
    assert [r.call_id for r in progress.done] == ["unsafe"]
    assert [c.id for c in progress.started] == ["last"]


async def test_two_not_retry_safe_calls_at_once_never_have_the_older_snapshot_land_last(
    open_run: Open, stores: Stores, scope: Scope
) -> None:
    run, ctx = await open_run(cont=with_turn(call("a"), call("b")), keeps_results=False)
    both_started = asyncio.Event()
    went_in: list[str] = []

    def handler(call_id: str) -> Callable[[], Awaitable[str]]:
        async def go() -> str:
            went_in.append(call_id)
            if len(went_in) == 2:
                both_started.set()
            await both_started.wait()
            return call_id

        return go

    async def body(run: DurableRun) -> None:
        await asyncio.gather(*(run.run_call(call(c), handler(c), retry_safe=False, text=str) for c in "ab"))
        await run.complete("ok")

    async def check_while_running() -> None:
        await both_started.wait()
        assert sorted(c.id for c in (await saved(stores, scope, ctx.run.id)).started) == ["a", "b"]

    await asyncio.gather(finished(body, run), check_while_running())


@pytest.mark.parametrize(
    ("config", "at", "error"),
    [
        (RunConfig(max_steps=2), Continuation(step_index=2), "max_steps_reached: the run used all 2 steps"),
        (
            RunConfig(max_steps=8, budget=Budget(max_total_tokens=100)),
            Continuation(step_index=1, usage=Usage(total_tokens=100)),
            "budget_exhausted: 100 of 100 tokens used",
        ),
    ],
)
async def test_a_turn_is_not_asked_for_once_a_limit_is_reached(
    open_run: Open, stores: Stores, scope: Scope, config: RunConfig, at: Continuation, error: str
) -> None:
    run, ctx = await open_run(config, cont=at.model_copy(update={"messages": [Message(role=Role.USER)]}))
    asked: list[bool] = []

    async def body(run: DurableRun) -> None:
        await run.resume()
        await run.before_turn()
        asked.append(True)

    await finished(body, run)
    ended = await stores.at(scope).runs.get_run(ctx.run.id)
    assert (ended.state, ended.error, asked) == (RunState.FAILED, error, [])


async def test_a_limit_the_framework_enforces_is_left_to_it_and_reported_back(
    open_run: Open, stores: Stores, scope: Scope
) -> None:
    run, ctx = await open_run(RunConfig(max_steps=2), cont=Continuation(step_index=2), framework_limits=(Limit.STEPS,))

    async def body(run: DurableRun) -> None:
        await run.resume()
        await run.before_turn()  # the framework counts the steps: not refused here
        await run.over_limit(Limit.STEPS)

    await finished(body, run)
    ended = await stores.at(scope).runs.get_run(ctx.run.id)
    assert (ended.state, ended.error) == (RunState.FAILED, "max_steps_reached: the run used all 2 steps")


@pytest.mark.parametrize(
    ("config", "turn", "error"),
    [
        (
            RunConfig(max_steps=8, max_tokens=10),
            ModelTurn(text="long", usage=Usage(output_tokens=11)),
            "max_tokens_exceeded: the model's turn took 11 output tokens; a turn may take 10",
        ),
        (
            RunConfig(max_steps=8, publication=PublicationPolicy(blocked_terms=["Secret"])),
            ModelTurn(text="", calls=[call("c", "send", '{"body": "the secret"}')]),
            "publication_blocked: the model's turn holds a term the run's publication policy blocks",
        ),
        (
            RunConfig(max_steps=8, budget=Budget(max_tool_calls=2)),
            ModelTurn(text="", calls=[call("a"), call("b"), call("c")]),
            "max_tool_calls_reached: the turn asks for 3 tool calls, which would take the run to 3 of the 2 it "
            "may make",
        ),
    ],
)
async def test_a_refused_turn_fails_the_run_before_any_call_and_is_not_kept(
    open_run: Open, stores: Stores, scope: Scope, config: RunConfig, turn: ModelTurn, error: str
) -> None:
    run, ctx = await open_run(config)
    after: list[bool] = []

    async def body(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.model_turn(turn)
        after.append(True)

    await finished(body, run)
    ended = await stores.at(scope).runs.get_run(ctx.run.id)
    assert (ended.state, ended.error, after) == (RunState.FAILED, error, [])
    # Counted (one step), but the session keeps only the input: the refused turn is left out.
    assert ended.step_count == 1
    assert [m.role for m in await stores.at(scope).sessions.load(ctx.run.id)] == [Role.USER]


@pytest.mark.parametrize("fresh", [True, False])
async def test_a_run_whose_config_has_no_step_cannot_continue(
    open_run: Open, stores: Stores, scope: Scope, fresh: bool
) -> None:
    run, ctx = await open_run(RunConfig(max_steps=0), cont=None if fresh else with_turn(call("c")))

    async def body(run: DurableRun) -> None:
        if fresh:
            await run.begin(model="m")
        else:
            await run.resume()
        raise AssertionError("went on")

    await finished(body, run)
    ended = await stores.at(scope).runs.get_run(ctx.run.id)
    assert (ended.state, ended.error) == (RunState.FAILED, "invalid_continuation: max_steps is 0")


async def test_what_a_framework_cannot_honour_fails_the_run_before_anything_runs(
    open_run: Open, stores: Stores, scope: Scope
) -> None:
    run, ctx = await open_run()

    async def body(run: DurableRun) -> None:
        await run.begin(model="m", unsupported=["model: set by the agent", "context.max_messages: not applied"])
        raise AssertionError("went on")

    await finished(body, run)
    ended = await stores.at(scope).runs.get_run(ctx.run.id)
    assert ended.error == "unsupported_config: model: set by the agent; context.max_messages: not applied"


async def test_a_run_handed_an_ending_finishes_it_and_never_runs(open_run: Open, stores: Stores, scope: Scope) -> None:
    run, ctx = await open_run(
        cont=with_turn(call("c")).model_copy(update={"new_messages_from": 1}),
        ending=Ending(kind=EndingKind.CANCEL, reason="stop it"),
    )
    ran: list[bool] = []

    async def body(run: DurableRun) -> None:
        ran.append(True)

    await finished(body, run)
    ended = await stores.at(scope).runs.get_run(ctx.run.id)
    assert (ended.state, ended.error, ran) == (RunState.CANCELLED, "stop it", [])
    # Its own messages (the turn), never the history before new_messages_from.
    assert [m.role for m in await stores.at(scope).sessions.load(ctx.run.id)] == [Role.ASSISTANT]


async def test_a_pause_holds_one_reason_the_first_waiting_calls(
    open_run: Open, stores: Stores, scope: Scope, reached: list[str]
) -> None:
    run, ctx = await open_run(cont=with_turn(call("e"), call("a")))

    async def body(run: DurableRun) -> None:
        await run.pause(
            [
                Waiting(call("e1"), SuspendReason.EXTERNAL_TOOL),
                Waiting(call("a1"), SuspendReason.APPROVAL),
                Waiting(call("e2"), SuspendReason.EXTERNAL_TOOL),
            ]
        )

    await finished(body, run)
    paused = await stores.at(scope).suspensions.get_suspension(ctx.run.id)
    assert (paused.reason, [c.id for c in paused.pending]) == (SuspendReason.EXTERNAL_TOOL, ["e1", "e2"])
    assert reached == [points.AFTER_PAUSE]


async def test_an_agent_reply_pause_holds_one_question_with_a_fresh_token(
    open_run: Open, stores: Stores, scope: Scope
) -> None:
    run, ctx = await open_run(cont=with_turn(call("q1"), call("q2")))

    async def body(run: DurableRun) -> None:
        await run.pause([Waiting(call(c), SuspendReason.AGENT_REPLY) for c in ("q1", "q2")])

    await finished(body, run)
    paused = await stores.at(scope).suspensions.get_suspension(ctx.run.id)
    [question] = paused.pending
    assert question.id == "q1"
    assert question.reply_with.startswith("rw-")


async def test_an_approval_pause_holds_the_calls_that_share_a_decider(
    open_run: Open, stores: Stores, scope: Scope
) -> None:
    config = RunConfig(max_steps=8, approvers={"send": ["ann", "bob"]})
    run, ctx = await open_run(config, cont=with_turn(call("b"), call("c"), call("d")))

    async def body(run: DurableRun) -> None:
        await run.pause(
            [
                Waiting(call("b", "send"), SuspendReason.APPROVAL, note="to ann", named_approvers=["ann"]),
                Waiting(call("c", "send"), SuspendReason.APPROVAL, named_approvers=["bob"]),
                Waiting(call("d", "send"), SuspendReason.APPROVAL),
            ]
        )

    await finished(body, run)
    paused = await stores.at(scope).suspensions.get_suspension(ctx.run.id)
    # c is for bob alone, b for ann alone: they share nobody, so c waits for a pause of its own.
    assert [(c.id, c.note) for c in paused.pending] == [("b", "to ann"), ("d", "")]
    assert paused.approvers == ["ann"]


async def test_a_boundary_the_snapshot_already_holds_is_not_written_again(
    open_run: Open, counted: Inspector, reached: list[str]
) -> None:
    answered = with_turn(call("c"))
    run, ctx = await open_run(cont=answered, done=[ProgressResult(call_id="c", content="the host's answer")])

    async def body(run: DurableRun) -> None:
        await run.resume()
        assert run.settled("c") == ProgressResult(call_id="c", content="the host's answer")
        await run.close_turn()
        await run.complete("ok")

    await finished(body, run)
    # The start's first snapshot only: the turn it closed was the claim's to the last result.
    assert await progress_writes(counted, ctx.run.id) == 1
    assert reached == [points.BETWEEN_STEPS]


async def test_the_answers_a_claim_brought_are_taken_out_of_the_ledger(open_run: Open) -> None:
    run, _ = await open_run(
        cont=with_turn(call("a"), call("b"), call("x")),
        done=[
            ProgressResult(call_id="a", content="answer"),
            ProgressResult(call_id="x", content="ran before the pause"),
        ],
        approved=["b"],
    )
    taken: dict[str, Any] = {}

    async def body(run: DurableRun) -> None:
        taken["answers"] = run.take_answers({"a", "b"})
        taken["left"] = (run.results, run.approved)
        await run.complete("ok")

    await finished(body, run)
    assert taken["answers"] == ([ProgressResult(call_id="a", content="answer")], ["b"])
    assert taken["left"] == ([ProgressResult(call_id="x", content="ran before the pause")], [])
