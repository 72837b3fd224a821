"""The agent loop: the default executor, over a ``ModelClient`` and a ``ToolRegistry``.

Each step asks the model for the next assistant turn and hands its tool calls to their handlers. The loop
is a translator: it turns the model's turns and the registry's tools into the operations of the run's
``DurableRun`` (agent/durable.py), which holds every rule that makes a takeover safe: the turn saved before
its first call runs, a non-retry-safe call written to ``started`` before it runs and never run again after
a takeover, the limits, the publication policy, the pauses' grouping, the crash points. What is the
loop's own is the conversation's shape in Intermission's messages:

- a fresh run's messages are its session's history (no more than the run's context window shows the model)
  and its input; the model is shown them through the window (``RunConfig.window``);
- the open turn is the last assistant message whose calls have no tool message yet; each call's result
  becomes a tool message (``error: ...`` for a failed call) once every call of the turn has one;
- results already known when the turn pauses travel in the pause as tool messages, so the resume needs only
  the answers for the pending calls;
- a call of a tool the run does not have (or may not use) fails without running; a local call runs; an
  approval call an approval decision granted runs; any other call waits for an answer from outside (an
  external tool, an approval, another agent's reply), and a denial fails the run with the decider's reason.

The session keeps the results of the open turn (retry-safe ones too) until the turn closes, so a step
writes at most: its turn (merged into the first ``started`` save when its first call is not retry-safe),
one save per further non-retry-safe call, and its boundary.
"""

from __future__ import annotations

import json
from typing import Any

from intermission.agent.durable import OUTCOME_UNKNOWN as OUTCOME_UNKNOWN
from intermission.agent.durable import CallFailed, DurableRun, ModelTurn, Waiting
from intermission.agent.executor import RunContext
from intermission.agent.model import ModelClient, ModelRequest, ScriptedModel, ToolSpec
from intermission.agent.tools import Tool, ToolFailed, ToolKind, ToolRegistry, demo_tools
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome
from intermission.schemas.suspension import ProgressResult, SuspendReason
from intermission.tracing import open_span

SYSTEM_PROMPT = "You are the Intermission demo agent. Use the tools you are given; answer briefly."
EXECUTOR_NAME = "agent_loop"

_PAUSE_REASONS = {
    ToolKind.EXTERNAL: SuspendReason.EXTERNAL_TOOL,
    ToolKind.APPROVAL: SuspendReason.APPROVAL,
    ToolKind.AGENT: SuspendReason.AGENT_REPLY,
}


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
        await DurableRun(ctx, executor=EXECUTOR_NAME, keeps_results=True).drive(self._execute)

    async def _execute(self, run: DurableRun) -> None:
        if not run.cont.messages:
            config = run.config
            # The model is never shown more than its window, so more history than that is never loaded.
            window = config.context.max_messages if config.context is not None else 0
            await run.begin(model=config.model, system_prompt=self.system_prompt, most=window or None)
        else:
            await run.resume()
        await self._complete_open_turn(run)
        while True:
            with open_span("run.step", attributes={"intermission.run.step": run.cont.step_index + 1}):
                await self._take_step(run)

    async def _take_step(self, run: DurableRun) -> None:
        await run.before_turn()
        cont, config = run.cont, run.config
        turn = await self.model.next_turn(
            ModelRequest(
                run=run.run,
                system_prompt=cont.system_prompt,
                messages=config.window(cont.messages),
                tools=[ToolSpec(t.name, t.description) for t in self.tools.all() if config.allows_tool(t.name)],
                config=config,
                step_index=cont.step_index,
                model=config.model,
                temperature=config.temperature,
                max_tokens=config.max_tokens or None,
            )
        )
        await run.model_turn(ModelTurn(text=turn.content, calls=turn.tool_calls, usage=turn.usage))
        if not turn.tool_calls:
            await run.complete(turn.content)
        await self._complete_open_turn(run)

    async def _complete_open_turn(self, run: DurableRun) -> None:
        """Hand every open call of the last assistant turn to its handler, reusing what is known; then pause
        for the calls that need outside answers, or close the turn."""
        opened = _open_turn(run.cont.messages)
        if opened is None:
            return
        _, open_calls = opened
        denial = run.denial()
        if denial is not None:
            await run.denied(denial.error)
        waiting: list[tuple[ToolCall, Tool]] = []
        for call in open_calls:
            if run.settled(call.id) is not None:
                continue
            tool = self.tools.get(call.name)
            if tool is None or not run.allows_tool(call.name):
                error = f"tool {call.name!r} is not available to this run"
                run.record(ProgressResult(call_id=call.id, error=error, outcome=ToolOutcome.FAILED))
                continue
            if tool.kind is ToolKind.LOCAL or (tool.kind is ToolKind.APPROVAL and call.id in run.approved):
                await self._dispatch(run, call, tool)
                continue
            waiting.append((call, tool))
        if waiting:
            await self._pause(run, open_calls, waiting)
        await run.close_turn(run.cont.model_copy(update={"messages": self._answered(run, open_calls)}))

    async def _dispatch(self, run: DurableRun, call: ToolCall, tool: Tool) -> None:
        env = run.tool_env(call.id)

        async def handler() -> str:
            try:
                return await tool.run(_arguments(call), env)
            except ToolFailed as exc:
                raise CallFailed(str(exc)) from exc

        await run.run_call(call, handler, retry_safe=tool.retry_safe, text=str)

    async def _pause(self, run: DurableRun, open_calls: list[ToolCall], waiting: list[tuple[ToolCall, Tool]]) -> None:
        asks = []
        for call, tool in waiting:
            args = _arguments_or_empty(call)
            asks.append(
                Waiting(call, _PAUSE_REASONS[tool.kind], note=tool.note(args), named_approvers=tool.approvers(args))
            )
        await run.pause(asks, continuation=run.cont.model_copy(update={"messages": self._answered(run, open_calls)}))

    @staticmethod
    def _answered(run: DurableRun, open_calls: list[ToolCall]) -> list[Message]:
        """The conversation with a tool message for each open call that has a result, in call order."""
        results = {r.call_id: r for r in run.results}
        answered = [_tool_message(call, results[call.id]) for call in open_calls if call.id in results]
        return [*run.cont.messages, *answered]


def _tool_message(call: ToolCall, result: ProgressResult) -> Message:
    content = result.content if not result.error else f"error: {result.error}"
    return Message(role=Role.TOOL, content=content, tool_call_id=call.id, name=call.name)


def default_executor() -> AgentLoop:
    """The demo agent: the agent loop over the scripted model and the demo tools."""
    return AgentLoop(ScriptedModel(), demo_tools())
