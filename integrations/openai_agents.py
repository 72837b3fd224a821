"""Run an OpenAI Agents SDK agent as an Intermission executor, its approvals made durable pauses.

``OpenAIAgentsExecutor(agent, ...)`` continues one claimed run with the SDK's own ``Runner``. What maps to
what (docs/integrations.md has the whole table):

- the run's ``input`` is the user input, after the run's session history (converted to SDK items);
- a tool with ``needs_approval`` interrupts the SDK's run (``result.interruptions``): the run pauses
  ``approval`` with the interrupted calls pending (arguments verbatim), deciders per the host's
  ``RunConfig.approvers`` narrowed by the call's own list, as the demo agent decides them; the SDK's state
  (``result.to_state().to_string()``) travels in ``Continuation.prepared`` inside a versioned envelope;
- a decision restores that state (``RunState.from_string``), approves or rejects exactly the pause's calls
  and continues with ``Runner.run(agent, state)``; a denial fails the run unless ``on_denial="continue"``
  hands the model the rejection instead;
- the final output completes the run (text, or the JSON of a structured output).

The SDK runs the model and the tools itself, so durability between pauses is added around it:

- every model turn goes through a wrapper model that saves the turn (into the envelope) BEFORE the SDK
  runs any of its calls; a worker that takes the run over replays the saved turns instead of asking the
  model again, so the SDK reaches the same calls with the same call ids;
- every tool is wrapped: a tool declared NOT retry-safe (``not_retry_safe``) is written to
  ``Progress.started`` before it runs, and its result is kept in ``Progress.done``; on a takeover a
  ``started`` call is never run again (the model is told its outcome is unknown) and a ``done`` result is
  returned without running the tool. Retry-safe tools simply run again during a replay.

External tools (``tool_use_behavior`` stopping at a tool) are left out: see ``UnsupportedAgent``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import Any, Final, Literal

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    Model,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    Runner,
    RunResult,
    RunState,
    ToolApprovalItem,
)
from agents import RunConfig as SdkRunConfig
from agents import Usage as SdkUsage
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
from agents.tool import Tool as SdkTool
from agents.tool_context import ToolContext
from agents.version import __version__ as SDK_VERSION
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_prompt_param import ResponsePromptParam
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from intermission import points
from intermission.agent.executor import ENDINGS, RunContext
from intermission.agent.tools import ToolEnv
from intermission.schemas.answers import approval_group, call_approvers
from intermission.schemas.config import ExecutionProvenance, RunConfig
from intermission.schemas.errors import (
    BudgetExhausted,
    InvalidContinuation,
    MaxStepsReached,
    MaxTokensExceeded,
    MaxToolCallsReached,
    PublicationBlocked,
    UnsupportedConfig,
)
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome, Usage
from intermission.schemas.suspension import Continuation, PendingCall, Progress, ProgressResult, SuspendReason
from intermission.store.runs import Pause
from intermission.tracing import tool_span

EXECUTOR_NAME = "openai_agents"
# The envelope ``Continuation.prepared`` holds. Its version changes whenever its shape does; a stored
# envelope of an older version is decoded by the code of that version or refused (invalid_continuation),
# never guessed at (tests/fixtures/openai_agents/ keeps one of each version this module still reads).
ENVELOPE_FORMAT: Final = "intermission.openai_agents"
ENVELOPE_VERSION: Final = 1

OUTCOME_UNKNOWN = (
    "outcome unknown: this call was handed to its tool, and the worker running it stopped before its "
    "result was saved; it was not run again"
)

# Why a call needs approval, for the person deciding: (tool name, parsed arguments) -> the pending call's note.
CallNote = Callable[[str, dict[str, Any]], str]

_OUTPUT_ITEMS: TypeAdapter[list[TResponseOutputItem]] = TypeAdapter(list[TResponseOutputItem])


class UnsupportedAgent(ValueError):
    """The agent uses something this integration cannot make durable; raised when the executor is built
    (so a worker with such an agent never starts).

    - ``tool_use_behavior`` other than ``"run_llm_again"`` (``stop_at_tool_names``, ``stop_on_first_tool``,
      a function): the SDK's way of handing a call to the caller (an external tool). It ends the SDK run
      with the tool's output as the final output and its state holds no pending call: the result a host
      would send could only be fed back by starting a new SDK run from ``to_input_list()``, which loses
      the saved state's turn count (``max_turns`` across pauses), its approvals and its guardrail results.
      Left out rather than shipped half-durable.
    - handoffs and MCP servers: their turns and calls would run outside the wrappers that make a takeover
      safe.
    - tools that are not function tools (hosted tools run at the provider, out of our sight).
    """


class _Turn(BaseModel):
    """One saved model response, replayed on a takeover instead of asking the model again."""

    model_config = ConfigDict(extra="forbid", strict=True)

    output: list[dict[str, Any]]
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    requests: int = 1
    response_id: str | None = None


class Prepared(BaseModel):
    """The versioned envelope in ``Continuation.prepared``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["intermission.openai_agents"] = ENVELOPE_FORMAT
    version: Literal[1] = ENVELOPE_VERSION
    # The SDK version that wrote it: for diagnosis; RunState.from_string checks its own schema version.
    sdk: str = SDK_VERSION
    # The SDK's RunState (``to_string()``) at the last pause; None: the run begins from its input.
    state: str | None = None
    # Model turns taken since ``state`` (or since the input), in order.
    turns: list[_Turn] = Field(default_factory=list)
    # How many of the continuation's messages are session history put before the input (the SDK's input
    # items begin with them; the run's own items follow).
    history: int = 0

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, raw: bytes) -> Prepared:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidContinuation(f"not an {ENVELOPE_FORMAT} v{ENVELOPE_VERSION} envelope: {exc}") from exc


_ENV: ContextVar[ToolEnv] = ContextVar("intermission_openai_agents_tool_env")


def tool_env() -> ToolEnv:
    """Inside a tool of an agent this executor runs: what Intermission gives the call (its run, its call
    id, the demo ledger). Outside one it raises LookupError."""
    return _ENV.get()


class _Fail(Exception):
    """The run must fail with ``error``; its session keeps the messages of ``messages_of`` (or the run's)."""

    def __init__(self, error: str, messages_of: Continuation | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.messages_of = messages_of


class OpenAIAgentsExecutor:
    """An Intermission executor over an OpenAI Agents SDK ``Agent``.

    ``not_retry_safe``: names of tools that must never run twice (written to ``started`` first).
    ``approvers_argument``: the argument of a call that names who may decide it (a list of user names);
    it only narrows the host's ``RunConfig.approvers`` list. ``note``: why a call needs approval, for the
    person deciding. ``on_denial``: ``"fail"`` (the default, as the demo agent) fails the run with the
    decider's reason; ``"continue"`` rejects the call in the SDK's state with that reason and lets the model
    go on. ``run_config``: the SDK RunConfig to start from (tracing is always turned off: a worker must not
    send a run's data anywhere Intermission does not know of).
    """

    def __init__(
        self,
        agent: Agent[Any],
        *,
        not_retry_safe: Iterable[str] = (),
        approvers_argument: str | None = None,
        note: CallNote | None = None,
        on_denial: Literal["fail", "continue"] = "fail",
        run_config: SdkRunConfig | None = None,
    ) -> None:
        _check_agent(agent)
        names = {tool.name for tool in agent.tools}
        unsafe = set(not_retry_safe)
        unknown = sorted(unsafe - names)
        if unknown:
            raise UnsupportedAgent(f"not_retry_safe names tools the agent does not have: {unknown}")
        self.agent = agent
        self.not_retry_safe = frozenset(unsafe)
        self.approvers_argument = approvers_argument
        self.note = note
        self.on_denial = on_denial
        self.run_config = dataclasses.replace(run_config or SdkRunConfig(), tracing_disabled=True)

    async def execute(self, ctx: RunContext) -> None:
        progress = ctx.progress
        if progress.ending is not None:
            cont = progress.continuation
            kind, default = ENDINGS[progress.ending.kind]
            await ctx.end(kind, error=progress.ending.reason or default, own_messages=_own(cont), continuation=cont)
            return
        cont = progress.continuation
        if not cont.prepared:
            cont = await self._fresh(ctx)
            unsupported = _unsupported(cont.config)
            if unsupported:
                # The core checked the config at start; this is what the SDK agent cannot honour on top of
                # it, refused before the agent runs or anything of the run is saved.
                error = f"{UnsupportedConfig.code}: {'; '.join(unsupported)}"
                await ctx.fail(error, _own(cont), continuation=cont)
                return
            prepared = Prepared(history=cont.new_messages_from)
        else:
            try:
                prepared = Prepared.decode(cont.prepared)
            except InvalidContinuation as exc:
                await ctx.fail(f"{InvalidContinuation.code}: {exc.detail}", _own(cont), continuation=cont)
                return
        run = _Run(self, ctx, cont, prepared, progress)
        try:
            await run.go()
        except _Fail as failed:
            await ctx.fail(failed.error, _own(failed.messages_of or run.cont), continuation=run.cont)

    async def _fresh(self, ctx: RunContext) -> Continuation:
        """A run that never saved anything: its session's history and its input. Nothing is saved yet: a
        worker that takes the run over before its first turn is saved does exactly this again."""
        base = ctx.progress.continuation
        session_id = base.session_id or ctx.run.session_id or ctx.run.id
        history = await ctx.load_history(session_id)
        instructions = self.agent.instructions
        return base.model_copy(
            update={
                "messages": [*history, Message(role=Role.USER, content=ctx.run.input)],
                "new_messages_from": len(history),
                "system_prompt": instructions if isinstance(instructions, str) else "",
                "session_id": session_id,
                "provenance": ExecutionProvenance(
                    agent_id=ctx.run.agent_id, executor=EXECUTOR_NAME, model=_model_name(self.agent), worker=ctx.owner
                ),
            }
        )


def _check_agent(agent: Agent[Any]) -> None:
    if agent.tool_use_behavior != "run_llm_again":
        raise UnsupportedAgent(
            "tool_use_behavior must be 'run_llm_again': external tools (stop_at_tool_names, stop_on_first_tool) "
            "are not supported by this integration (docs/integrations.md, 'External tools: left out, and why')"
        )
    if agent.handoffs:
        raise UnsupportedAgent("handoffs are not supported: the other agents' turns would not be durable")
    if agent.mcp_servers:
        raise UnsupportedAgent("MCP servers are not supported: their calls would not be durable")
    others = [type(tool).__name__ for tool in agent.tools if not isinstance(tool, FunctionTool)]
    if others:
        raise UnsupportedAgent(f"only function tools are supported, not {sorted(set(others))}")


def _unsupported(config: RunConfig) -> list[str]:
    """What of a RunConfig the SDK agent cannot honour (the core refuses the rest at start)."""
    found = []
    if config.model:
        found.append("model: the agent module sets the OpenAI Agents SDK agent's model, a run cannot change it")
    if config.context is not None and config.context.max_messages:
        found.append("context.max_messages: the OpenAI Agents SDK integration shows the model the whole run")
    return found


def _model_name(agent: Agent[Any]) -> str:
    model = agent.model
    if isinstance(model, str):
        return model
    return type(model).__name__ if model is not None else ""


class _Run:
    """One run's life in this worker: its continuation, its saved turns, and its calls' bookkeeping."""

    def __init__(
        self,
        executor: OpenAIAgentsExecutor,
        ctx: RunContext,
        cont: Continuation,
        prepared: Prepared,
        progress: Progress,
    ) -> None:
        self.executor = executor
        self.ctx = ctx
        self.cont = cont
        self.prepared = prepared
        # Saved turns are replayed, in order, before the model is asked anything.
        self.replay = list(prepared.turns)
        self.started = list(progress.started)
        self.done = list(progress.done)
        self.approved = list(progress.approved)
        # What our own code raised inside the SDK's run: the SDK wraps exceptions of models and tools in
        # its own, so the executor re-raises the original once Runner.run returns or raises.
        self.abort: BaseException | None = None
        # Saves are taken one at a time, each snapshotting the state at the moment it holds the lock: two
        # non-retry-safe calls the SDK runs at once must never have an older snapshot land last.
        self.saving = asyncio.Lock()

    # -- the run --------------------------------------------------------------------------------------

    async def go(self) -> None:
        config = self.cont.config
        if config.max_steps <= 0:
            raise _Fail(f"{InvalidContinuation.code}: max_steps is {config.max_steps}")
        agent = self._agent()
        start: str | list[TResponseInputItem] | RunState[Any]
        if self.prepared.state is None:
            start = _to_items(self.cont.messages[: self.prepared.history + 1])
        else:
            start = await self._restore(agent, self.prepared.state)
        sdk_config = dataclasses.replace(
            self.executor.run_config,
            model_settings=_model_settings(self.executor.run_config.model_settings, config),
        )
        try:
            result = await Runner.run(agent, start, max_turns=config.max_steps, run_config=sdk_config)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self.abort is not None:
                raise self.abort from None
            if isinstance(exc, MaxTurnsExceeded):
                raise _Fail(f"{MaxStepsReached.code}: the run used all {config.max_steps} steps") from None
            raise
        if self.abort is not None:
            raise self.abort
        self.cont = self.cont.model_copy(update={"messages": self._messages(result)})
        if result.interruptions:
            await self._pause(result)
            return
        await self.ctx.complete(_output(result.final_output), _own(self.cont), continuation=self.cont)

    def _agent(self) -> Agent[Any]:
        """The agent as this run may use it: only the tools its stored config allows (so a narrowed list
        holds after every resume), each wrapped, and its model behind the turn-saving wrapper."""
        config = self.cont.config
        tools: list[SdkTool] = [
            self._wrap(tool)
            for tool in self.executor.agent.tools
            if isinstance(tool, FunctionTool) and config.allows_tool(tool.name)
        ]
        return self.executor.agent.clone(tools=tools, model=_DurableModel(self, _inner_model(self.executor)))

    async def _restore(self, agent: Agent[Any], saved: str) -> RunState[Any]:
        """The SDK state of the last pause, with the decision the claim brought applied to its calls."""
        try:
            state = await RunState.from_string(agent, saved)
        except Exception as exc:
            raise _Fail(f"{InvalidContinuation.code}: the saved OpenAI Agents state does not load: {exc}") from None
        denied = {r.call_id: r for r in self.done if r.outcome is ToolOutcome.DENIED}
        for item in state.get_interruptions():
            call_id = item.call_id or ""
            if call_id in self.approved:
                state.approve(item)
            elif call_id in denied:
                if self.executor.on_denial == "fail":
                    # The decider's reason is the run's error, as the demo agent does.
                    raise _Fail(denied[call_id].error or "denied")
                state.reject(item, rejection_message=f"denied: {denied[call_id].error or 'denied'}")
        return state

    async def _pause(self, result: RunResult) -> None:
        held, deciders = self._approval_group(result.interruptions)
        pending = []
        for item in held:
            arguments = item.arguments or "{}"
            note = self.executor.note(item.tool_name or "", _arguments(arguments)) if self.executor.note else ""
            pending.append(
                PendingCall(id=item.call_id or "", name=item.tool_name or "", arguments=arguments, note=note)
            )
        prepared = Prepared(state=result.to_state().to_string(), history=self.prepared.history)
        cont = self.cont.model_copy(update={"prepared": prepared.encode()})
        await self.ctx.pause(
            Pause(reason=SuspendReason.APPROVAL, pending=pending, continuation=cont, approvers=deciders or [])
        )
        points.reach(points.AFTER_PAUSE)

    def _approval_group(self, items: list[ToolApprovalItem]) -> tuple[list[ToolApprovalItem], list[str] | None]:
        """The interrupted calls one pause holds and who may decide it: the demo agent's rule
        (``approval_group``). Calls that share no decider with the first pause on their own later: the SDK
        interrupts again for every call left undecided."""
        config = self.cont.config
        return approval_group(
            items, lambda item: call_approvers(config.approvers_for(item.tool_name or ""), self._named(item))
        )

    def _named(self, item: ToolApprovalItem) -> list[str]:
        argument = self.executor.approvers_argument
        if argument is None:
            return []
        named = _arguments(item.arguments or "{}").get(argument) or []
        if not isinstance(named, list) or not all(isinstance(a, str) for a in named):
            return []
        return [str(a) for a in named]

    def _messages(self, result: RunResult) -> list[Message]:
        history = self.cont.messages[: self.prepared.history]
        return [*history, *_from_items(result.to_input_list()[self.prepared.history :])]

    # -- saves ----------------------------------------------------------------------------------------

    async def save(self) -> None:
        async with self.saving:
            prepared = self.prepared.model_copy(update={"turns": list(self.prepared.turns)})
            cont = self.cont.model_copy(update={"prepared": prepared.encode()})
            await self.ctx.save_progress(
                Progress(
                    run_id=self.ctx.run.id,
                    owner=self.ctx.owner,
                    continuation=cont,
                    started=list(self.started),
                    done=list(self.done),
                    approved=list(self.approved),
                )
            )

    # -- model turns ----------------------------------------------------------------------------------

    async def turn(self, ask: Callable[[], Awaitable[ModelResponse]]) -> ModelResponse:
        if self.replay:
            # Saved by the worker that ran this turn before: the SDK gets it again, with its call ids.
            return _response(self.replay.pop(0))
        try:
            return await self._new_turn(ask)
        except BaseException as exc:
            self.abort = exc
            raise

    async def _new_turn(self, ask: Callable[[], Awaitable[ModelResponse]]) -> ModelResponse:
        config = self.cont.config
        budget = config.budget.max_total_tokens
        if budget and self.cont.usage.total_tokens >= budget:
            raise _Fail(f"{BudgetExhausted.code}: {self.cont.usage.total_tokens} of {budget} tokens used")
        await self.ctx.between_calls()
        response = await ask()
        calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
        text = _text(response.output)
        # Counted here: the budget must not rest on what a model reports.
        usage = self.cont.usage.plus(
            Usage(
                input_tokens=response.usage.input_tokens,
                output_tokens=response.usage.output_tokens,
                total_tokens=response.usage.total_tokens,
                tool_calls=len(calls),
            )
        )
        asked = self.cont
        assistant = Message(
            role=Role.ASSISTANT,
            content=text,
            tool_calls=[ToolCall(id=c.call_id, name=c.name, arguments=c.arguments) for c in calls],
        )
        self.cont = self.cont.model_copy(
            update={
                "messages": [*self.cont.messages, assistant],
                "step_index": self.cont.step_index + 1,
                "usage": usage,
                "tokens_used": usage.total_tokens,
            }
        )
        if config.max_tokens and response.usage.output_tokens > config.max_tokens:
            raise _Fail(
                f"{MaxTokensExceeded.code}: the model's turn took {response.usage.output_tokens} output tokens; "
                f"a turn may take {config.max_tokens}",
                messages_of=asked,
            )
        published = "\n".join([text, *(f"{c.name} {c.arguments}" for c in calls)])
        if config.publication.blocks(published):
            raise _Fail(
                f"{PublicationBlocked.code}: the model's turn holds a term the run's publication policy blocks",
                messages_of=asked,
            )
        limit = config.budget.max_tool_calls
        if limit and usage.tool_calls > limit:
            raise _Fail(
                f"{MaxToolCallsReached.code}: the turn asks for {len(calls)} tool calls, which would take the run "
                f"to {usage.tool_calls} of the {limit} it may make",
                messages_of=asked,
            )
        self.prepared.turns.append(_turn(response))
        if calls:
            # The turn is durable before the SDK runs any of its calls: a takeover replays it.
            await self.save()
            points.reach(points.BETWEEN_STEPS)
            await self.ctx.boundary()
        return response

    # -- tool calls -----------------------------------------------------------------------------------

    def _wrap(self, tool: FunctionTool) -> FunctionTool:
        original = tool.on_invoke_tool
        retry_safe = tool.name not in self.executor.not_retry_safe

        async def invoke(tool_ctx: ToolContext[Any], arguments: str) -> Any:
            return await self.call(
                tool.name, tool_ctx.tool_call_id, arguments, lambda: original(tool_ctx, arguments), retry_safe
            )

        return dataclasses.replace(tool, on_invoke_tool=invoke)

    async def call(
        self, name: str, call_id: str, arguments: str, invoke: Callable[[], Awaitable[Any]], retry_safe: bool
    ) -> Any:
        known = next((r for r in self.done if r.call_id == call_id and r.outcome is not ToolOutcome.DENIED), None)
        if known is not None:
            # Ran before this worker (it is not retry-safe): its result, not a second run.
            return known.content if not known.error else f"error: {known.error}"
        if any(c.id == call_id for c in self.started):
            # Handed to its tool by a worker that stopped before saving its result: never again.
            self.started = [c for c in self.started if c.id != call_id]
            self.done.append(ProgressResult(call_id=call_id, error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED))
            return f"error: {OUTCOME_UNKNOWN}"
        try:
            # A run asked to end ends here, before one more call.
            await self.ctx.between_calls()
            if not retry_safe:
                # Written BEFORE the tool gets it: if this worker dies from here on, nobody calls it again.
                self.started.append(PendingCall(id=call_id, name=name, arguments=arguments))
                await self.save()
        except BaseException as exc:
            self.abort = exc
            raise
        token = _ENV.set(self.ctx.tool_env(call_id))
        try:
            with tool_span(name, call_id, retry_safe=retry_safe):
                output = await invoke()
        finally:
            _ENV.reset(token)
        if not retry_safe:
            points.reach(points.AFTER_STARTED)
            self.started = [c for c in self.started if c.id != call_id]
            # In memory: it travels with the next save (the next turn, or another call's ``started``).
            self.done.append(ProgressResult(call_id=call_id, content=str(output), outcome=ToolOutcome.COMPLETED))
        return output


class _DurableModel(Model):
    """The agent's model behind the run's turn bookkeeping (``_Run.turn``)."""

    def __init__(self, run: _Run, inner: Model) -> None:
        self._run = run
        self._inner = inner

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[SdkTool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        def ask() -> Awaitable[ModelResponse]:
            return self._inner.get_response(
                system_instructions,
                input,
                model_settings,
                tools,
                output_schema,
                handoffs,
                tracing,
                previous_response_id=previous_response_id,
                conversation_id=conversation_id,
                prompt=prompt,
            )

        return await self._run.turn(ask)

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[SdkTool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        # The executor runs with Runner.run only; a stream would need its turns saved event by event.
        raise NotImplementedError("the Intermission executor does not stream")


def _inner_model(executor: OpenAIAgentsExecutor) -> Model:
    model = executor.agent.model
    if isinstance(model, Model):
        return model
    if executor.run_config.model is not None:
        configured = executor.run_config.model
        return configured if isinstance(configured, Model) else executor.run_config.model_provider.get_model(configured)
    return executor.run_config.model_provider.get_model(model)


def _model_settings(base: ModelSettings | None, config: RunConfig) -> ModelSettings | None:
    """The run's temperature and max_tokens, over the SDK run config's own settings."""
    if config.temperature is None and not config.max_tokens:
        return base
    settings = base or ModelSettings()
    return settings.resolve(ModelSettings(temperature=config.temperature, max_tokens=config.max_tokens or None))


# -- conversions ------------------------------------------------------------------------------------------


def _turn(response: ModelResponse) -> _Turn:
    return _Turn(
        output=[item.model_dump(mode="json", exclude_none=True) for item in response.output],
        input_tokens=response.usage.input_tokens,
        output_tokens=response.usage.output_tokens,
        total_tokens=response.usage.total_tokens,
        requests=response.usage.requests,
        response_id=response.response_id,
    )


def _response(turn: _Turn) -> ModelResponse:
    return ModelResponse(
        output=_OUTPUT_ITEMS.validate_python(turn.output),
        usage=SdkUsage(
            requests=turn.requests,
            input_tokens=turn.input_tokens,
            output_tokens=turn.output_tokens,
            total_tokens=turn.total_tokens,
        ),
        response_id=turn.response_id,
    )


def _text(output: list[TResponseOutputItem]) -> str:
    return "".join(
        part.text
        for item in output
        if isinstance(item, ResponseOutputMessage)
        for part in item.content
        if isinstance(part, ResponseOutputText)
    )


def _to_items(messages: list[Message]) -> list[TResponseInputItem]:
    """Intermission messages as the SDK's input items."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m.role is Role.TOOL:
            items.append({"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content})
            continue
        if m.content or not m.tool_calls:
            items.append({"role": m.role.value, "content": m.content})
        items.extend(
            {"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls
        )
    return items  # type: ignore[return-value]  # TResponseInputItem is a union of TypedDicts these match


def _from_items(items: list[TResponseInputItem]) -> list[Message]:
    """The SDK's items as Intermission messages (text, calls, results; reasoning items are left out)."""
    messages: list[Message] = []
    for raw in items:
        # The SDK hands input items as TypedDicts (plain dicts at run time).
        item: dict[str, Any] = dict(raw)
        kind = item.get("type")
        if kind == "function_call":
            call = ToolCall(
                id=str(item.get("call_id", "")),
                name=str(item.get("name", "")),
                arguments=str(item.get("arguments") or "{}"),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role is Role.ASSISTANT:
                messages[-1] = last.model_copy(update={"tool_calls": [*last.tool_calls, call]})
            else:
                messages.append(Message(role=Role.ASSISTANT, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else json.dumps(output)
            messages.append(Message(role=Role.TOOL, content=content, tool_call_id=str(item.get("call_id", ""))))
        elif "role" in item and kind in (None, "message"):
            role = {
                "user": Role.USER,
                "assistant": Role.ASSISTANT,
                "system": Role.SYSTEM,
                "developer": Role.SYSTEM,
            }.get(str(item["role"]), Role.USER)
            messages.append(Message(role=role, content=_content_text(item.get("content"))))
    return messages


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _output(final: Any) -> str:
    """A run's output: its text, or the JSON of a structured output."""
    if isinstance(final, str):
        return final
    if isinstance(final, BaseModel):
        return final.model_dump_json()
    if dataclasses.is_dataclass(final) and not isinstance(final, type):
        return json.dumps(dataclasses.asdict(final))
    return json.dumps(final)


def _own(cont: Continuation) -> list[Message]:
    return cont.messages[cont.new_messages_from :]
