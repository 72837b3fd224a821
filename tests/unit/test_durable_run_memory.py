"""A run's life as an executor drives it (``agent/durable.py`` over ``agent/executor.py``'s ``RunContext``),
on the in-memory engine: start, a model turn saved before its calls run, a pause and the host's answer,
the end; and what a cancel, a lost lease and a limit do to it. The same rules against the real database:
``tests/integration/test_durable_run.py``. No I/O: what a handler sees "saved" is read from the in-memory
store's tables while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest

from intermission import points
from intermission.agent.durable import OUTCOME_UNKNOWN, DurableRun, ModelTurn, Ran, Waiting
from intermission.agent.executor import EndedOnRequest, RunContext
from intermission.engine.commands import Resume
from intermission.engine.holding import ReleaseLease
from intermission.engine.observer import CrashPoints
from intermission.engine.runs import ReadSession, RequestEnding
from intermission.engine.starts import StartRun
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import RunLeaseLost
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome, Usage
from intermission.schemas.run import Ending, EndingKind
from intermission.schemas.suspension import (
    ClaimVersion,
    Continuation,
    PendingCall,
    Progress,
    ProgressResult,
    SuspendReason,
)
from intermission.store import rows
from tests.support.conformance import (
    LEASE,
    OWNER,
    SCOPE,
    MemoryWorld,
    assert_events,
    forbid_sockets,
    new_run,
    outbox_of,
    run_row,
    stored_pause,
    stored_progress,
)


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_sockets(monkeypatch)


@pytest.fixture
def reached() -> Iterator[list[str]]:
    """The crash points this process passes, in order."""
    seen: list[str] = []
    points.observe(seen.append)
    try:
        yield seen
    finally:
        points.observe(None)


def call(call_id: str, name: str = "lookup") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments='{"query": "q"}')


def saved_now(world: MemoryWorld) -> Progress:
    """The run's snapshot as the store holds it this instant (read synchronously, as a handler would see it)."""
    row = world.memory.tables.progress[(SCOPE.app, SCOPE.tenant, "r1")]
    return rows.progress_from_row(row)


async def opened(
    world: MemoryWorld,
    *,
    config: RunConfig | None = None,
    cont: Continuation | None = None,
    started: list[PendingCall] | None = None,
    done: list[ProgressResult] | None = None,
    ending: Ending | None = None,
) -> tuple[DurableRun, RunContext]:
    """A run started under the worker's lease with ``first`` as its snapshot, and the DurableRun over its
    context."""
    config = config or RunConfig(max_steps=8)
    first = Progress(
        run_id="r1",
        owner=OWNER,
        continuation=(cont or Continuation()).model_copy(update={"config": config}),
        started=started or [],
        done=done or [],
        ending=ending,
    )
    created = await world.engine.apply(StartRun(SCOPE, new_run(config=config), LEASE, first))
    ctx = RunContext(world.engine, created.run, first, LEASE, correlation_id="corr-1", stopping=asyncio.Event())
    return DurableRun(ctx, executor="test", keeps_results=True), ctx


def answering(content: str, seen: list[Progress], world: MemoryWorld) -> Callable[[], Awaitable[str]]:
    async def handler() -> str:
        seen.append(saved_now(world))
        return content

    return handler


async def test_a_run_s_life_start_a_saved_turn_a_pause_its_answer_and_the_end(reached: list[str]) -> None:
    world = MemoryWorld(observer=CrashPoints())
    run, ctx = await opened(world)
    seen: list[Progress] = []
    turn = ModelTurn(text="", calls=[call("safe"), call("ask")], usage=Usage(total_tokens=5))

    async def first_part(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.before_turn()
        await run.model_turn(turn)
        assert await run.run_call(call("safe"), answering("found", seen, world), retry_safe=True, text=str) == Ran(
            "found"
        )
        await run.pause([Waiting(call("ask"), SuspendReason.EXTERNAL_TOOL)])

    await run.drive(first_part)
    # The turn was durable before its first call ran: one step in, its calls in the conversation.
    [before_call] = seen
    assert before_call.continuation.step_index == 1
    assert before_call.continuation.messages[-1].tool_calls == turn.calls
    pause = await stored_pause(world, SCOPE, "r1")
    assert pause is not None
    assert [c.id for c in pause.pending] == ["ask"]
    # The context knows its run left this worker: it writes nothing more for it.
    assert ctx.handle.paused
    assert reached == [points.AFTER_PAUSE]
    paused_row = await run_row(world, SCOPE, "r1")
    assert paused_row is not None
    assert (paused_row["state"], paused_row["revision"], paused_row["step_count"]) == ("paused", 1, 1)

    # The host answers; the worker's claim hands the run back with the answer in its snapshot.
    version = ClaimVersion(run_id="r1", suspension_id=pause.id, run_revision=1)
    answer = ResumeCommand(scope=SCOPE, version=version, results=[ToolAnswer(call_id="ask", content="42")])
    claimed = await world.engine.under(lease=LEASE).apply(Resume(answer, correlation_id="corr-2"))
    resumed_ctx = RunContext(
        world.engine, claimed.run, claimed.progress, LEASE, correlation_id="corr-2", stopping=asyncio.Event()
    )
    resumed = DurableRun(resumed_ctx, executor="test", keeps_results=True)
    ran: list[str] = []

    async def second_part(run: DurableRun) -> None:
        await run.resume()

        async def never() -> str:
            ran.append("ask")
            return "ran again"

        assert await run.run_call(call("ask"), never, retry_safe=False, text=str) == ProgressResult(
            call_id="ask", content="42"
        )
        await run.close_turn()
        await run.complete("the answer is 42")

    await resumed.drive(second_part)
    assert ran == []
    assert reached == [points.AFTER_PAUSE, points.BETWEEN_STEPS]
    ended = await run_row(world, SCOPE, "r1")
    assert ended is not None
    assert (ended["state"], ended["revision"], ended["output"]) == ("completed", 3, "the answer is 42")
    assert (ended["step_count"], ended["tokens_used"]) == (1, 5)
    assert await stored_progress(world, SCOPE, "r1") is None
    [notice, resumed_event, completed] = [r["body"] for r in await outbox_of(world, SCOPE, "r1")]
    assert RunEvent.model_validate_json(resumed_event).kind is RunEventKind.RESUMED
    assert (
        completed
        == RunEvent(
            kind=RunEventKind.COMPLETED, run_id="r1", revision=3, scope=SCOPE, output="the answer is 42"
        ).model_dump_json()
    )
    await assert_events(world, SCOPE, "r1", [notice, resumed_event, completed])
    # The session keeps the run's own messages: its input and the turn.
    session = await world.engine.apply(ReadSession(SCOPE, "s-r1", 100))
    assert [m.role for m in session] == [Role.USER, Role.ASSISTANT]


async def test_a_not_retry_safe_call_is_saved_started_before_it_runs_and_never_runs_again(
    reached: list[str],
) -> None:
    world = MemoryWorld(observer=CrashPoints())
    run, _ = await opened(world)
    seen: list[Progress] = []

    async def body(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.model_turn(ModelTurn(text="", calls=[call("pay")]))
        await run.run_call(call("pay"), answering("paid", seen, world), retry_safe=False, text=str)
        await run.boundary()
        await run.complete("ok")

    await run.drive(body)
    [during] = seen
    assert [c.id for c in during.started] == ["pay"]
    assert reached == [points.AFTER_STARTED, points.BETWEEN_STEPS]

    # A worker taking over a snapshot whose call was started never hands it to a handler again.
    taken_over = MemoryWorld(observer=CrashPoints())
    run, _ = await opened(
        taken_over,
        cont=Continuation(messages=[Message(role=Role.ASSISTANT, tool_calls=[call("pay")])], step_index=1),
        started=[PendingCall(id="pay", name="lookup")],
    )
    results: list[object] = []

    async def again(run: DurableRun) -> None:
        await run.resume()

        async def never() -> str:
            raise AssertionError("a started call ran again")

        results.append(await run.run_call(call("pay"), never, retry_safe=False, text=str))
        await run.complete("ok")

    await run.drive(again)
    assert results == [ProgressResult(call_id="pay", error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED)]


async def test_a_cancel_heard_in_a_save_ends_the_run_before_the_call_runs() -> None:
    world = MemoryWorld(observer=CrashPoints())
    run, ctx = await opened(world)
    ending = Ending(kind=EndingKind.CANCEL, reason="stop it")
    ran: list[str] = []

    async def body(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.model_turn(ModelTurn(text="", calls=[call("pay")]))
        assert await world.engine.apply(RequestEnding(SCOPE, "r1", ending)) == "requested"

        async def pay() -> str:
            ran.append("pay")
            return "paid"

        await run.run_call(call("pay"), pay, retry_safe=False, text=str)

    with pytest.raises(EndedOnRequest):
        await run.drive(body)
    assert ran == []
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["error"], row["ending"]) == ("cancelled", "stop it", None)
    assert ctx.handle.ended


async def test_a_run_handed_an_ending_finishes_it_and_never_runs() -> None:
    world = MemoryWorld(observer=CrashPoints())
    run, _ = await opened(world, ending=Ending(kind=EndingKind.EXPIRE, reason="too late"))
    ran: list[bool] = []

    async def body(run: DurableRun) -> None:
        ran.append(True)

    await run.drive(body)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["error"], ran) == ("failed", "too late", [])
    [ended] = await outbox_of(world, SCOPE, "r1")
    assert RunEvent.model_validate_json(ended["body"]).kind is RunEventKind.EXPIRED


async def test_a_lost_lease_kills_the_context_and_nothing_more_is_written() -> None:
    world = MemoryWorld(observer=CrashPoints())
    run, ctx = await opened(world)
    assert await world.engine.apply(ReleaseLease(SCOPE, "r1", OWNER))
    statements = dict(world.memory.statements)

    async def body(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.model_turn(ModelTurn(text="", calls=[call("pay")]))

        async def pay() -> str:
            raise AssertionError("a call ran without the lease")

        await run.run_call(call("pay"), pay, retry_safe=False, text=str)

    with pytest.raises(RunLeaseLost):
        await run.drive(body)
    assert ctx.handle.lost
    # The session read and the refused save: then nothing, the context is dead.
    assert world.memory.statements.get("save", 0) == statements.get("save", 0) + 1
    with pytest.raises(RunLeaseLost):
        await ctx.complete("too late")
    assert world.memory.statements.get("end", 0) == statements.get("end", 0)
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["state"] == "running"


async def test_a_run_out_of_steps_fails_before_asking_for_another_turn() -> None:
    world = MemoryWorld(observer=CrashPoints())
    run, _ = await opened(world, config=RunConfig(max_steps=1))
    turns: list[int] = []

    async def body(run: DurableRun) -> None:
        await run.begin(model="m")
        await run.before_turn()
        await run.model_turn(ModelTurn(text="thinking"))
        turns.append(1)
        await run.boundary()
        await run.before_turn()
        turns.append(2)

    await run.drive(body)
    assert turns == [1]
    row = await run_row(world, SCOPE, "r1")
    assert row is not None
    assert row["state"] == "failed"
    assert row["error"].startswith("max_steps")
