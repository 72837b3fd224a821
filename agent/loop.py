"""The agent loop: the default executor.

Each step asks the model for the next assistant turn and dispatches its tool calls. Progress is saved at
step boundaries, not per call, so a step of a thousand local calls costs a few writes, not a thousand
growing snapshots; and a worker that takes the run over still repeats nothing it must not:

- the assistant turn is saved before the first of its calls is handed to a handler, so a takeover never
  asks the model for that step again (a turn whose calls all pause is saved by the pause itself);
- a call that is NOT retry-safe is written to ``started`` BEFORE it is handed to its handler, and that save
  carries everything the step has done so far; a takeover never dispatches a ``started`` call again (the
  model is told its outcome is unknown) and reuses every result in ``done``;
- the results of retry-safe calls live in memory until the step's boundary is saved: a crash loses them,
  and the worker that takes over simply runs those calls again (that is what retry-safe means);
- a turn whose calls need outside answers pauses the run (one transaction: suspension, checkpoint, paused,
  progress removed, Notice in the outbox).

So a step writes at most: its turn (merged into the first ``started`` save when its first local call is
not retry-safe), one save per further non-retry-safe call, and its boundary.

Limits hold from the first step: ``max_steps``, the token budget, ``max_tokens`` per turn, and the
tool-call budget (``budget.max_tool_calls``, per run: a turn that would take the run past it fails the run
before any of its calls runs). A turn holding a term the publication policy blocks fails the run before
anything of it leaves. The model is shown the conversation through the run's context policy
(``RunConfig.window``). A run asked to end while it runs (a cancel) ends at its next boundary or before its
next call (``RunContext``).

A suspension has ONE reason, because the reason decides who may answer. When one turn asks for answers of
different kinds, the loop pauses for the first call's kind (all calls of that kind pending together); the
others stay open and are dispatched when the run resumes, which pauses it again for them. An agent-reply
pause holds ONE question, since each reply resumes the run. An approval pause holds the calls that share a
decider (``_approval_group``): who may decide is named by the host in the run's config, and a call's own
list only narrows it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from intermission import points
from intermission.agent.executor import ENDINGS, RunContext
from intermission.agent.model import ModelClient, ModelRequest, ScriptedModel, ToolSpec
from intermission.agent.tools import Tool, ToolFailed, ToolKind, ToolRegistry, demo_tools
from intermission.schemas.answers import approval_group, call_approvers
from intermission.schemas.config import ExecutionProvenance, RunConfig
from intermission.schemas.errors import (
    BudgetExhausted,
    InvalidContinuation,
    MaxStepsReached,
    MaxTokensExceeded,
    MaxToolCallsReached,
    PublicationBlocked,
)
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome
from intermission.schemas.suspension import (
    Continuation,
    Ending,
    PendingCall,
    Progress,
    ProgressResult,
    SuspendReason,
)
from intermission.store.runs import Pause
from intermission.tracing import failed, open_span, tool_span

SYSTEM_PROMPT = "You are the Intermission demo agent. Use the tools you are given; answer briefly."

OUTCOME_UNKNOWN = (
    "outcome unknown: this call was handed to its handler, and the worker running it stopped before its "
    "result was saved; it was not run again"
)

_PAUSE_REASONS = {
    ToolKind.EXTERNAL: SuspendReason.EXTERNAL_TOOL,
    ToolKind.APPROVAL: SuspendReason.APPROVAL,
    ToolKind.AGENT: SuspendReason.AGENT_REPLY,
}


@dataclass
class _Step:
    """The run's working state between two saves."""

    cont: Continuation
    started: list[PendingCall] = field(default_factory=list)
    done: list[ProgressResult] = field(default_factory=list)
    approved: list[str] = field(default_factory=list)
    # Whether the last assistant turn is in the saved snapshot (a resume's or a takeover's is; a turn the
    # model just made is not until the step's first save).
    turn_saved: bool = True

    def snapshot(self, owner: str, run_id: str) -> Progress:
        return Progress(
            run_id=run_id,
            owner=owner,
            continuation=self.cont,
            started=list(self.started),
            done=list(self.done),
            approved=list(self.approved),
        )


class _Stop(Exception):
    """The run left this worker (paused or ended); the loop returns."""


def _arguments(call: ToolCall) -> dict[str, Any]:
    try:
        parsed = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolFailed("arguments are not valid JSON") from exc
    if not isinstance(parsed, dict):
        raise ToolFailed("arguments are not a JSON object")
    return parsed


def _arguments_or_empty(call: ToolCall) -> dict[str, Any]:
    """A pausing call's arguments as far as they parse (a call whose arguments do not parse names nothing)."""
    try:
        return _arguments(call)
    except ToolFailed:
        return {}


def _approval_group(
    group: list[tuple[ToolCall, Tool, dict[str, Any]]], config: RunConfig
) -> tuple[list[tuple[ToolCall, Tool, dict[str, Any]]], list[str] | None]:
    """The calls one approval pause holds and who may decide it (``approval_group``): each call's deciders
    are the host's list for its tool (``RunConfig.approvers``, from the config the run carries in its
    continuation, never from the model), narrowed by the list the call's own arguments name."""
    return approval_group(group, lambda c: call_approvers(config.approvers_for(c[1].name), c[1].approvers(c[2])))


def _open_turn(messages: list[Message]) -> tuple[Message, list[ToolCall]] | None:
    """The last assistant turn and those of its calls that have no tool message yet."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role is Role.ASSISTANT:
            answered = {m.tool_call_id for m in messages[index + 1 :] if m.role is Role.TOOL}
            open_calls = [c for c in message.tool_calls if c.id not in answered]
            return (message, open_calls) if open_calls else None
    return None


class AgentLoop:
    def __init__(self, model: ModelClient, tools: ToolRegistry, *, system_prompt: str = SYSTEM_PROMPT) -> None:
        self.model = model
        self.tools = tools
        self.system_prompt = system_prompt

    async def execute(self, ctx: RunContext) -> None:
        try:
            await self._execute(ctx)
        except _Stop:
            return

    async def _execute(self, ctx: RunContext) -> None:
        progress = ctx.progress
        if progress.ending is not None:
            await self._finish_ending(ctx, progress.ending)
            return
        if not progress.continuation.messages:
            step = await self._begin(ctx)
        else:
            step = _Step(
                cont=progress.continuation,
                started=list(progress.started),
                done=list(progress.done),
                approved=list(progress.approved),
            )
            if step.cont.config.max_steps <= 0:
                await self._fail(ctx, step, f"{InvalidContinuation.code}: max_steps is {step.cont.config.max_steps}")
        await self._complete_open_turn(ctx, step)
        while True:
            with open_span("run.step", attributes={"intermission.run.step": step.cont.step_index + 1}):
                await self._take_step(ctx, step)

    async def _begin(self, ctx: RunContext) -> _Step:
        """A fresh run: load its session's history and add its input. Nothing is saved yet: a worker that
        takes the run over before its first turn is saved does exactly this again, which costs a read."""
        base = ctx.progress.continuation
        session_id = base.session_id or ctx.run.session_id or ctx.run.id
        # The model is never shown more than its window, so more history than that is never loaded.
        window = base.config.context.max_messages if base.config.context is not None else 0
        history = await ctx.load_history(session_id, most=window or None)
        cont = base.model_copy(
            update={
                "messages": [*history, Message(role=Role.USER, content=ctx.run.input)],
                # Everything before this index is history: a run saves only what comes after it.
                "new_messages_from": len(history),
                "system_prompt": self.system_prompt,
                "session_id": session_id,
                "provenance": ExecutionProvenance(
                    agent_id=ctx.run.agent_id, executor="agent_loop", model=base.config.model, worker=ctx.owner
                ),
            }
        )
        return _Step(cont=cont)

    async def _take_step(self, ctx: RunContext, step: _Step) -> None:
        config = step.cont.config
        if step.cont.step_index >= config.max_steps:
            await self._fail(ctx, step, f"{MaxStepsReached.code}: the run used all {config.max_steps} steps")
        budget = config.budget.max_total_tokens
        if budget and step.cont.usage.total_tokens >= budget:
            await self._fail(
                ctx, step, f"{BudgetExhausted.code}: {step.cont.usage.total_tokens} of {budget} tokens used"
            )
        turn = await self.model.next_turn(
            ModelRequest(
                run=ctx.run,
                system_prompt=step.cont.system_prompt,
                messages=config.window(step.cont.messages),
                tools=[ToolSpec(t.name, t.description) for t in self.tools.all() if config.allows_tool(t.name)],
                config=config,
                step_index=step.cont.step_index,
                model=config.model,
                temperature=config.temperature,
                max_tokens=config.max_tokens or None,
            )
        )
        # The loop counts the calls itself: the budget must not rest on what a model client reports.
        usage = step.cont.usage.plus(turn.usage.model_copy(update={"tool_calls": len(turn.tool_calls)}))
        asked = step.cont
        assistant = Message(role=Role.ASSISTANT, content=turn.content, tool_calls=turn.tool_calls)
        step.cont = step.cont.model_copy(
            update={
                "messages": [*step.cont.messages, assistant],
                "step_index": step.cont.step_index + 1,
                "usage": usage,
                "tokens_used": usage.total_tokens,
            }
        )
        if config.max_tokens and turn.usage.output_tokens > config.max_tokens:
            # The client was told the limit; a turn past it is not used (nor kept), whatever it says.
            await self._fail(
                ctx,
                step,
                f"{MaxTokensExceeded.code}: the model's turn took {turn.usage.output_tokens} output tokens; "
                f"a turn may take {config.max_tokens}",
                messages_of=asked,
            )
        if config.publication.blocks(_published_text(turn.content, turn.tool_calls)):
            # Nothing of the turn goes out: not its answer (run.completed), not its calls' arguments (a
            # Notice), not into the session. The error does not repeat the term: it is published too.
            await self._fail(
                ctx,
                step,
                f"{PublicationBlocked.code}: the model's turn holds a term the run's publication policy blocks",
                messages_of=asked,
            )
        limit = config.budget.max_tool_calls
        if limit and usage.tool_calls > limit:
            # Before any of the turn's calls runs: a runaway turn (or run) is stopped at once, however many
            # calls it asks for. The refused turn is not kept; the tokens it cost are counted.
            await self._fail(
                ctx,
                step,
                f"{MaxToolCallsReached.code}: the turn asks for {len(turn.tool_calls)} tool calls, which would "
                f"take the run to {usage.tool_calls} of the {limit} it may make",
                messages_of=asked,
            )
        if not turn.tool_calls:
            await ctx.complete(turn.content, self._own(step.cont), continuation=step.cont)
            raise _Stop
        step.started, step.done, step.approved = [], [], []
        step.turn_saved = False
        await self._complete_open_turn(ctx, step)

    async def _complete_open_turn(self, ctx: RunContext, step: _Step) -> None:
        """Dispatch every open call of the last assistant turn, reusing what is known; then either pause
        for the calls that need outside answers or record the step's boundary."""
        opened = _open_turn(step.cont.messages)
        if opened is None:
            return
        _, open_calls = opened
        denied = next((r for r in step.done if r.outcome is ToolOutcome.DENIED), None)
        if denied is not None:
            # The decider's reason is the run's error.
            await self._fail(ctx, step, denied.error or "denied")
        known = {r.call_id for r in step.done}
        started = {c.id for c in step.started}
        # Every open call was answered before this worker touched the turn (a resume's answers, which the
        # claim wrote in its first snapshot; or a takeover of such a snapshot). That snapshot is durable and
        # a worker continuing from it closes the turn exactly as below, so this boundary is not written a
        # second time: the save would cost a transaction and add nothing a takeover needs.
        already_durable = not step.started and all(call.id in known for call in open_calls)
        waiting: list[tuple[ToolCall, Tool]] = []
        for call in open_calls:
            if call.id in known:
                continue
            if call.id in started:
                # Handed to its handler by a worker that stopped before saving the result: never again.
                step.started = [c for c in step.started if c.id != call.id]
                self._record(step, ProgressResult(call_id=call.id, error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED))
                continue
            tool = self.tools.get(call.name)
            if tool is None or not step.cont.config.allows_tool(call.name):
                failed = ProgressResult(
                    call_id=call.id,
                    error=f"tool {call.name!r} is not available to this run",
                    outcome=ToolOutcome.FAILED,
                )
                self._record(step, failed)
                continue
            if tool.kind is ToolKind.LOCAL or (tool.kind is ToolKind.APPROVAL and call.id in step.approved):
                await self._dispatch(ctx, step, call, tool)
                continue
            waiting.append((call, tool))
        if waiting:
            await self._pause(ctx, step, open_calls, waiting)
        self._close_turn(step, open_calls)
        if not already_durable:
            await ctx.save_progress(step.snapshot(ctx.owner, ctx.run.id))
        points.reach(points.BETWEEN_STEPS)
        await ctx.boundary()

    async def _dispatch(self, ctx: RunContext, step: _Step, call: ToolCall, tool: Tool) -> None:
        # A run asked to end (the lease keeper heard of it) ends here, before one more call.
        await ctx.between_calls()
        env = ctx.tool_env(call.id)
        if not tool.retry_safe:
            # Written BEFORE the handler gets it, with everything the step has done so far: if this worker
            # dies from here on, nobody calls it again.
            step.started.append(PendingCall(id=call.id, name=call.name, arguments=call.arguments))
            await ctx.save_progress(step.snapshot(ctx.owner, ctx.run.id))
            step.turn_saved = True
        elif not step.turn_saved:
            # The turn is durable before its first call runs: a takeover never asks the model for it again.
            await ctx.save_progress(step.snapshot(ctx.owner, ctx.run.id))
            step.turn_saved = True
        with tool_span(call.name, call.id, retry_safe=tool.retry_safe) as span:
            try:
                content = await tool.run(_arguments(call), env)
                result = ProgressResult(call_id=call.id, content=content, outcome=ToolOutcome.COMPLETED)
            except ToolFailed as exc:
                result = ProgressResult(call_id=call.id, error=str(exc), outcome=ToolOutcome.FAILED)
                failed(span, "tool failed")
        if not tool.retry_safe:
            points.reach(points.AFTER_STARTED)
            step.started = [c for c in step.started if c.id != call.id]
        self._record(step, result)

    @staticmethod
    def _record(step: _Step, result: ProgressResult) -> None:
        # In memory only: it travels with the step's next save (a later call's ``started`` save, the
        # boundary, or the pause).
        step.done = [*step.done, result]

    async def _pause(
        self, ctx: RunContext, step: _Step, open_calls: list[ToolCall], waiting: list[tuple[ToolCall, Tool]]
    ) -> None:
        reason = _PAUSE_REASONS[waiting[0][1].kind]
        group = [(c, t, _arguments_or_empty(c)) for c, t in waiting if _PAUSE_REASONS[t.kind] is reason]
        if reason is SuspendReason.AGENT_REPLY:
            group = group[:1]
        deciders: list[str] | None = None
        if reason is SuspendReason.APPROVAL:
            group, deciders = _approval_group(group, step.cont.config)
        pending = [
            PendingCall(
                id=call.id,
                name=call.name,
                arguments=call.arguments,
                # A fresh token per question: a call id alone may be reused by a later model response.
                reply_with=f"rw-{uuid.uuid4().hex}" if reason is SuspendReason.AGENT_REPLY else "",
                note=tool.note(args),
            )
            for call, tool, args in group
        ]
        # Results already known for this turn travel in the pause as tool messages, so the resume needs
        # only the answers for the pending calls.
        answered = {r.call_id: r for r in step.done}
        messages = list(step.cont.messages)
        for call in open_calls:
            if call.id in answered:
                messages.append(_tool_message(call, answered[call.id]))
        cont = step.cont.model_copy(update={"messages": messages})
        await ctx.pause(Pause(reason=reason, pending=pending, continuation=cont, approvers=deciders or []))
        points.reach(points.AFTER_PAUSE)
        raise _Stop

    def _close_turn(self, step: _Step, open_calls: list[ToolCall]) -> None:
        """Every open call has a result: append them as tool messages in call order."""
        results = {r.call_id: r for r in step.done}
        messages = list(step.cont.messages)
        messages.extend(_tool_message(call, results[call.id]) for call in open_calls)
        step.cont = step.cont.model_copy(update={"messages": messages})
        step.started, step.done, step.approved = [], [], []

    async def _finish_ending(self, ctx: RunContext, ending: Ending) -> None:
        """A claim was made to end this run (or a cancel asked it to end while it ran, and its holder died
        before finishing that): finish that end; never continue it."""
        cont = ctx.progress.continuation
        kind, default = ENDINGS[ending.kind]
        await ctx.end(kind, error=ending.reason or default, own_messages=self._own(cont), continuation=cont)

    async def _fail(self, ctx: RunContext, step: _Step, error: str, *, messages_of: Continuation | None = None) -> None:
        """Fail the run at ``step``; its session keeps the messages of ``messages_of`` (the step's own when
        None: a refused turn is left out of it)."""
        await ctx.fail(error, self._own(messages_of or step.cont), continuation=step.cont)
        raise _Stop

    @staticmethod
    def _own(cont: Continuation) -> list[Message]:
        """The run's own messages: never the history it loaded."""
        return cont.messages[cont.new_messages_from :]


def _published_text(content: str, calls: list[ToolCall]) -> str:
    """Everything of a model turn that can leave the run: its text, and its calls (a Notice carries them)."""
    return "\n".join([content, *(f"{c.name} {c.arguments}" for c in calls)])


def _tool_message(call: ToolCall, result: ProgressResult) -> Message:
    content = result.content if not result.error else f"error: {result.error}"
    return Message(role=Role.TOOL, content=content, tool_call_id=call.id, name=call.name)


def default_executor() -> AgentLoop:
    """The demo agent: the agent loop over the scripted model and the demo tools."""
    return AgentLoop(ScriptedModel(), demo_tools())
