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

The SDK runs the model and the tools itself; the executor translates what it sees of them into the run's
``DurableRun`` (agent/durable.py), which holds every durability rule, as for the demo agent:

- every model turn goes through a wrapper model: a new turn is checked and made durable (its response
  kept in the envelope's ``turns``) BEFORE the SDK runs any of its calls; a worker that takes the run over
  replays the saved turns instead of asking the model again, so the SDK reaches the same calls with the
  same call ids;
- every tool is wrapped and runs through ``DurableRun.run_call``: a tool declared NOT retry-safe
  (``not_retry_safe``) is written to ``started`` before it runs and its result kept in ``done``; on a
  takeover a ``started`` call is never run again (the model is told its outcome is unknown) and a ``done``
  result is returned without running the tool. Retry-safe tools simply run again during a replay;
- ``max_steps`` is the SDK's ``max_turns`` (its state counts turns across pauses); its refusal fails the run
  with the limit's error.

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

from intermission.agent.durable import OUTCOME_UNKNOWN as OUTCOME_UNKNOWN
from intermission.agent.durable import DurableRun, Limit, ModelTurn, Ran, Waiting
from intermission.agent.executor import RunContext
from intermission.agent.tools import ToolEnv
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import InvalidContinuation
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome, Usage
from intermission.schemas.suspension import SuspendReason

EXECUTOR_NAME = "openai_agents"
# The envelope ``Continuation.prepared`` holds. Its version changes whenever its shape does; a stored
# envelope of an older version is decoded by the code of that version or refused (invalid_continuation),
# never guessed at (tests/fixtures/openai_agents/ keeps one of each version this module still reads).
ENVELOPE_FORMAT: Final = "intermission.openai_agents"
ENVELOPE_VERSION: Final = 1

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
        # The SDK counts the run's turns itself (``max_turns``, kept in its state across pauses).
        await DurableRun(ctx, executor=EXECUTOR_NAME, framework_limits=(Limit.STEPS,)).drive(self._execute)

    async def _execute(self, run: DurableRun) -> None:
        cont = run.cont
        if not cont.prepared:
            instructions = self.agent.instructions
            await run.begin(
                model=_model_name(self.agent),
                system_prompt=instructions if isinstance(instructions, str) else "",
                # What the SDK agent cannot honour on top of what the core checked at start, refused before
                # the agent runs or anything of the run is saved.
                unsupported=_unsupported(cont.config),
            )
            prepared = Prepared(history=run.cont.new_messages_from)
        else:
            try:
                prepared = Prepared.decode(cont.prepared)
            except InvalidContinuation as exc:
                await run.fail(f"{InvalidContinuation.code}: {exc.detail}")
            await run.resume()
        await _Run(self, run, prepared).go()


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
    """One run's life in this worker: the SDK's run over the durable run, and the turns saved since the
    SDK's state was."""

    def __init__(self, executor: OpenAIAgentsExecutor, run: DurableRun, prepared: Prepared) -> None:
        self.executor = executor
        self.run = run
        self.prepared = prepared
        # Saved turns are replayed, in order, before the model is asked anything.
        self.replay = list(prepared.turns)
        # What our own code raised inside the SDK's run: the SDK wraps exceptions of models and tools in
        # its own, so the executor re-raises the original once Runner.run returns or raises.
        self.abort: BaseException | None = None
        run.prepare_with(self.prepared.encode)

    # -- the run --------------------------------------------------------------------------------------

    async def go(self) -> None:
        config = self.run.config
        agent = self._agent()
        start: str | list[TResponseInputItem] | RunState[Any]
        if self.prepared.state is None:
            start = _to_items(self.run.cont.messages[: self.prepared.history + 1])
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
                await self.run.over_limit(Limit.STEPS)
            raise
        if self.abort is not None:
            raise self.abort
        self.run.update(self.run.cont.model_copy(update={"messages": self._messages(result)}))
        if result.interruptions:
            await self._pause(result)
        await self.run.complete(_output(result.final_output))

    def _agent(self) -> Agent[Any]:
        """The agent as this run may use it: only the tools its stored config allows (so a narrowed list
        holds after every resume), each wrapped, and its model behind the turn-saving wrapper."""
        tools: list[SdkTool] = [
            self._wrap(tool)
            for tool in self.executor.agent.tools
            if isinstance(tool, FunctionTool) and self.run.allows_tool(tool.name)
        ]
        return self.executor.agent.clone(tools=tools, model=_DurableModel(self, _inner_model(self.executor)))

    async def _restore(self, agent: Agent[Any], saved: str) -> RunState[Any]:
        """The SDK state of the last pause, with the decision the claim brought applied to its calls."""
        try:
            state = await RunState.from_string(agent, saved)
        except Exception as exc:
            await self.run.fail(f"{InvalidContinuation.code}: the saved OpenAI Agents state does not load: {exc}")
        denied = {r.call_id: r for r in self.run.results if r.outcome is ToolOutcome.DENIED}
        approved = set(self.run.approved)
        for item in state.get_interruptions():
            call_id = item.call_id or ""
            if call_id in approved:
                state.approve(item)
            elif call_id in denied:
                if self.executor.on_denial == "fail":
                    await self.run.denied(denied[call_id].error)
                state.reject(item, rejection_message=f"denied: {denied[call_id].error or 'denied'}")
        return state

    async def _pause(self, result: RunResult) -> None:
        """Pause on the interrupted calls (the durable run groups them by who may decide): the SDK interrupts
        again, after the decision, for every call this pause left out."""
        waiting = []
        for item in result.interruptions:
            call = ToolCall(id=item.call_id or "", name=item.tool_name or "", arguments=item.arguments or "{}")
            note = self.executor.note(call.name, _arguments(call.arguments)) if self.executor.note else ""
            waiting.append(Waiting(call, SuspendReason.APPROVAL, note=note, named_approvers=self._named(item)))
        # What a pause stores is the SDK's state at the pause: the turns saved since the last one are in it.
        prepared = Prepared(state=result.to_state().to_string(), history=self.prepared.history)
        await self.run.pause(waiting, continuation=self.run.cont.model_copy(update={"prepared": prepared.encode()}))

    def _named(self, item: ToolApprovalItem) -> list[str]:
        argument = self.executor.approvers_argument
        if argument is None:
            return []
        named = _arguments(item.arguments or "{}").get(argument) or []
        if not isinstance(named, list) or not all(isinstance(a, str) for a in named):
            return []
        return [str(a) for a in named]

    def _messages(self, result: RunResult) -> list[Message]:
        history = self.run.cont.messages[: self.prepared.history]
        return [*history, *_from_items(result.to_input_list()[self.prepared.history :])]

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
        await self.run.before_turn()
        response = await ask()
        calls = [
            ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
            for item in response.output
            if isinstance(item, ResponseFunctionToolCall)
        ]
        usage = Usage(
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            total_tokens=response.usage.total_tokens,
        )
        await self.run.model_turn(ModelTurn(text=_text(response.output), calls=calls, usage=usage))
        self.prepared.turns.append(_turn(response))
        if calls:
            # The SDK runs the turn's calls before it asks this model again: the turn is durable first, and a
            # takeover replays it.
            await self.run.boundary()
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
        # The tool's own exceptions go to the SDK as they would without this wrapper; ours are re-raised
        # once the SDK's run is over (``abort``).
        raised: list[BaseException] = []

        async def execute() -> Any:
            token = _ENV.set(self.run.tool_env(call_id))
            try:
                return await invoke()
            except BaseException as exc:
                raised.append(exc)
                raise
            finally:
                _ENV.reset(token)

        try:
            outcome = await self.run.run_call(
                ToolCall(id=call_id, name=name, arguments=arguments), execute, retry_safe=retry_safe, text=str
            )
        except BaseException as exc:
            if not any(exc is mine for mine in raised):
                self.abort = exc
            raise
        if isinstance(outcome, Ran):
            return outcome.value
        # Ran before this worker (reused, not run again), or handed to its tool by a worker that stopped
        # before saving its result (never run again).
        return outcome.content if not outcome.error else f"error: {outcome.error}"


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

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        # The executor runs with Runner.run only; a stream would need its turns saved event by event. Its
        # parameters are the SDK's (``Model.stream_response``, as ``get_response`` spells them out): none is
        # used, so they are not repeated here.
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
