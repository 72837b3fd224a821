"""A pydantic-ai agent as an Intermission executor: its deferred tool calls become durable pauses.

    from intermission.integrations.pydantic_ai import PydanticAIExecutor

    def executor() -> PydanticAIExecutor:          # INTERMISSION_EXECUTOR=mymodule:executor
        return PydanticAIExecutor(agent)

What maps to what (docs/integrations.md):

- a tool with ``requires_approval=True``, or one that raises ``ApprovalRequired``, pauses ``approval``;
- a tool of an ``ExternalToolset``, or one that raises ``CallDeferred``, pauses ``external_tool``;
- a tool that raises ``ask_agent(name)`` (a ``CallDeferred`` carrying ``AGENT_REPLY`` in its metadata)
  pauses ``agent_reply`` with a fresh ``reply_with``.

The agent runs with ``output_type=[agent.output_type, DeferredToolRequests]``, so a turn that defers calls
ends the pydantic-ai run with ``DeferredToolRequests`` instead of needing any change to the user's agent.
A resume starts a NEW pydantic-ai run over the stored native history, handing it every answer of the turn
at once (``DeferredToolResults``): pydantic-ai refuses results for only some of a turn's deferred calls, so
a turn that needs answers of several kinds pauses once per kind (one reason per pause, as the demo agent
does), collecting answers in the stored envelope, and only the last resume hands them over.

The executor is a translator: every durability rule is the run's ``DurableRun``'s (agent/durable.py), the
same as for the demo agent. What it translates:

- each node boundary of ``agent.iter`` is a durable boundary: a model turn (``CallToolsNode``) is saved
  before the first of its calls runs; the next model request (``ModelRequestNode``) closes the turn, its
  results saved in the envelope's history;
- each tool's execution goes through ``DurableRun.run_call``: a tool declared not retry-safe
  (``NOT_RETRY_SAFE`` in the tool's metadata, or its name in ``not_retry_safe=``) is written to
  ``started`` before it runs and never runs again after a takeover (pydantic-ai gets
  ``ToolFailed(OUTCOME_UNKNOWN)``); pydantic-ai keeps the results of retry-safe calls itself;
- the stored ``RunConfig``'s tool allowlist holds on every request of every segment (``prepare_tools``);
  ``max_steps`` and the budgets are handed to pydantic-ai (``UsageLimits``, counted across pauses from its
  usage), which enforces them inside its own loop, and its refusal fails the run with the limit's error.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_ai import (
    Agent,
    AgentRunError,
    CallDeferred,
    CallToolsNode,
    DeferredToolRequests,
    DeferredToolResults,
    ModelRequestNode,
    ToolDenied,
    UsageLimitExceeded,
    UsageLimits,
)
from pydantic_ai import RunContext as PydanticRunContext
from pydantic_ai import ToolFailed as PydanticToolFailed
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.run import AgentRun
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tool_manager import ToolManager
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.usage import RunUsage

from intermission.agent.durable import OUTCOME_UNKNOWN as OUTCOME_UNKNOWN
from intermission.agent.durable import CallFailed, DurableRun, Limit, ModelTurn, Ran, Waiting
from intermission.agent.executor import RunContext
from intermission.agent.tools import ToolEnv
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import InvalidContinuation
from intermission.schemas.llm import Message, Role, ToolCall, ToolOutcome, Usage
from intermission.schemas.suspension import Continuation, SuspendReason

# The metadata key of ``CallDeferred(metadata=...)`` that marks a deferred call as a question to another
# agent, and its value. Chosen here (pydantic-ai has no such kind): ``ask_agent`` builds it.
MARKER = "intermission"
AGENT_REPLY = "agent_reply"
# Put in a tool's ``metadata`` (``@agent.tool(metadata=NOT_RETRY_SAFE)``): the tool must never run twice.
RETRY_SAFE_KEY = "intermission_retry_safe"
NOT_RETRY_SAFE: dict[str, Any] = {RETRY_SAFE_KEY: False}

ENVELOPE_FORMAT: Final = "intermission.pydantic_ai"
ENVELOPE_VERSION = 1
EXECUTOR_NAME = "pydantic_ai"

# What the run fails with when its config asks for a context window (docs/invariants.md, 20).
UNSUPPORTED_WINDOW = (
    "context.max_messages is not applied by the pydantic-ai executor; give the agent a history processor instead"
)

OnDenial = Literal["fail", "continue"]
_Kind = Literal["approval", "external_tool", "agent_reply"]

_tool_env: ContextVar[ToolEnv | None] = ContextVar("intermission_pydantic_ai_tool_env", default=None)


def tool_env() -> ToolEnv:
    """What the tool call running now may use (its run and call id, the demo ledger): call it from a tool
    function. Outside a call run by ``PydanticAIExecutor`` it raises LookupError."""
    env = _tool_env.get()
    if env is None:
        raise LookupError("tool_env() is only available inside a tool call run by PydanticAIExecutor")
    return env


def ask_agent(agent: str, **metadata: Any) -> CallDeferred:
    """The exception a tool raises to ask another agent: ``raise ask_agent("pricer")``. The run pauses
    ``agent_reply``; only the messaging bus answers it, and the reply is the call's result."""
    return CallDeferred(metadata={MARKER: AGENT_REPLY, "agent": agent, **metadata})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeferredCall(_Strict):
    """One call of the open batch: a call of the turn pydantic-ai deferred."""

    id: str
    name: str
    arguments: str = "{}"
    kind: _Kind
    metadata: dict[str, Any] = {}


_Outcome = Literal["approved", "denied", "completed", "failed"]
_OUTCOMES: dict[ToolOutcome, _Outcome] = {
    ToolOutcome.DENIED: "denied",
    ToolOutcome.FAILED: "failed",
    ToolOutcome.COMPLETED: "completed",
}


class Answer(_Strict):
    """An answer collected for a call of the open batch."""

    call_id: str
    outcome: _Outcome
    text: str = ""


class Envelope(_Strict):
    """What ``Continuation.prepared`` holds for this executor. Versioned: a pause stored by this version
    must still resume after the integration changes (tests/fixtures/pydantic_ai_envelope_v1.json)."""

    format: Literal["intermission.pydantic_ai"] = ENVELOPE_FORMAT
    version: int = ENVELOPE_VERSION
    # pydantic-ai's native history (``all_messages_json``), the loaded session history first.
    history: Any
    # Where this run's own messages begin in ``history``: what comes before is the session's history,
    # which is never saved again (the seed's ``new_messages_from`` rule). pydantic-ai's own
    # ``new_messages()`` covers one segment only, so it cannot say this across pauses.
    own_from: int
    # The index in ``history`` of the model response whose calls ``Progress.started``/``done`` belong to.
    # Call ids are reused across turns (TestModel always says ``pyd_ai_tool_call_id__<tool>``), so the
    # ledger is per turn, and a takeover that is shown the same turn again must keep it.
    turn: int = -1
    # The deferred calls of that turn, in the model's emission order, and the answers collected so far.
    batch: list[DeferredCall] = []
    answers: list[Answer] = []

    def native(self) -> list[ModelMessage]:
        return ModelMessagesTypeAdapter.validate_json(json.dumps(self.history))


def encode(envelope: Envelope) -> bytes:
    return envelope.model_dump_json().encode()


def decode(prepared: bytes) -> Envelope:
    try:
        raw = json.loads(prepared)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidContinuation(f"the pydantic-ai envelope is not JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != ENVELOPE_FORMAT:
        raise InvalidContinuation("the continuation was not written by the pydantic-ai executor")
    if raw.get("version") != ENVELOPE_VERSION:
        raise InvalidContinuation(f"pydantic-ai envelope version {raw.get('version')!r} is not {ENVELOPE_VERSION}")
    try:
        return Envelope.model_validate(raw)
    except ValidationError as exc:
        raise InvalidContinuation(f"the pydantic-ai envelope does not decode: {exc}") from exc


def _history_json(messages: Sequence[ModelMessage]) -> Any:
    return json.loads(ModelMessagesTypeAdapter.dump_json(list(messages)))


@dataclass
class _State:
    """One execution's envelope, and the loaded session history the run's messages begin with."""

    env: Envelope
    history: list[Message] = field(default_factory=list)


class PydanticAIExecutor:
    """Runs a pydantic-ai ``Agent`` as an Intermission executor.

    ``not_retry_safe`` names tools that must never run twice (as ``NOT_RETRY_SAFE`` in a tool's metadata
    does). ``on_denial="fail"`` (the default) fails the run with the decider's reason, as the demo agent
    does; ``"continue"`` hands the model a ``ToolDenied`` with that reason and lets it go on.
    ``model_settings`` are passed to every request, under the run's ``temperature`` and ``max_tokens``.
    """

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        not_retry_safe: Iterable[str] = (),
        on_denial: OnDenial = "fail",
        model_settings: ModelSettings | None = None,
        deps: Any = None,
    ) -> None:
        self.agent = agent
        self.not_retry_safe = frozenset(not_retry_safe)
        self.on_denial: OnDenial = on_denial
        self.model_settings = model_settings
        self.deps = deps

    async def execute(self, ctx: RunContext) -> None:
        # pydantic-ai enforces the limits itself, inside ``agent.iter`` (``UsageLimits``); the durable run
        # hands it the stored config's and names the refusal.
        run = DurableRun(ctx, executor=EXECUTOR_NAME, framework_limits=(Limit.STEPS, Limit.TOKENS, Limit.TOOL_CALLS))
        await run.drive(self._execute)

    async def _execute(self, run: DurableRun) -> None:
        cont = run.cont
        prompt: str | None = None
        if not cont.prepared:
            # A window is not silently ignored (docs/invariants.md, 20): this executor shows the agent its
            # whole history; a window belongs in the agent (a pydantic-ai history processor).
            windowed = cont.config.context is not None and cont.config.context.max_messages
            history = await run.begin(
                model=cont.config.model or _model_name(self.agent),
                # pydantic-ai is handed the input as its prompt, and its projection adds it to the messages.
                with_input=False,
                unsupported=[UNSUPPORTED_WINDOW] if windowed else [],
            )
            native = to_native(history)
            state = _State(env=Envelope(history=_history_json(native), own_from=len(native)), history=history)
            prompt = run.run.input
        else:
            try:
                env = decode(cont.prepared)
            except InvalidContinuation as exc:
                # Not this executor's state (another executor's, or an envelope version this code does not
                # know): the run cannot continue, and says why.
                await run.fail(f"{InvalidContinuation.code}: {exc}")
            await run.resume()
            state = _State(env=env, history=run.history)
        run.prepare_with(lambda: encode(state.env))
        results: DeferredToolResults | None = None
        if state.env.batch:
            results = await self._collect(run, state)
        await self._run(run, state, prompt, results)

    async def _collect(self, run: DurableRun, state: _State) -> DeferredToolResults | None:
        """Fold the answers the claim brought into the envelope; pause again for the batch's next kind while
        some call is unanswered; once all are, the results pydantic-ai is handed (all at once)."""
        env = state.env
        answered = {a.call_id for a in env.answers}
        # A result for a call not yet answered is this claim's answer; one for an answered call stays in the
        # ledger: an approved call that ran in an earlier attempt of this segment.
        results, approvals = run.take_answers({c.id for c in env.batch} - answered)
        new = [Answer(call_id=r.call_id, outcome=_OUTCOMES[r.outcome], text=r.error or r.content) for r in results]
        new.extend(Answer(call_id=call_id, outcome="approved") for call_id in approvals)
        answered.update(a.call_id for a in new)
        state.env = env.model_copy(update={"answers": [*env.answers, *new]})
        denied = next((a for a in state.env.answers if a.outcome == "denied"), None)
        if denied is not None and self.on_denial == "fail":
            await run.denied(denied.text)
        if any(c.id not in answered for c in env.batch):
            await self._pause(run, state)
        deferred = DeferredToolResults()
        kinds = {c.id: c.kind for c in env.batch}
        for answer in state.env.answers:
            if kinds[answer.call_id] == "approval":
                deferred.approvals[answer.call_id] = (
                    True if answer.outcome == "approved" else ToolDenied(answer.text or "The tool call was denied.")
                )
            elif answer.outcome == "failed":
                deferred.calls[answer.call_id] = PydanticToolFailed(answer.text)
            else:
                deferred.calls[answer.call_id] = answer.text
        return deferred

    async def _run(
        self, run: DurableRun, state: _State, prompt: str | None, results: DeferredToolResults | None
    ) -> None:
        config, cont = run.config, run.cont
        usage = RunUsage(
            requests=cont.step_index,
            input_tokens=cont.usage.input_tokens,
            output_tokens=cont.usage.output_tokens,
            tool_calls=cont.usage.tool_calls,
        )
        # Explicit limits, always: without them pydantic-ai applies its own 50 requests per segment, which
        # is neither max_steps nor counted across pauses. ``usage`` carries the counts of earlier segments.
        limits = UsageLimits(
            request_limit=config.max_steps,
            total_tokens_limit=config.budget.max_total_tokens or None,
            tool_calls_limit=config.budget.max_tool_calls or None,
        )
        capability = _Durable(self, run)
        try:
            # One call at a time, in the model's order: a non-retry-safe call's ``started`` save then
            # carries exactly the calls that ran before it.
            with ToolManager.parallel_execution_mode("sequential"):
                iterating: AbstractAsyncContextManager[AgentRun[Any, Any]] = self.agent.iter(
                    prompt,
                    output_type=[self.agent.output_type, DeferredToolRequests],
                    message_history=state.env.native(),
                    deferred_tool_results=results,
                    # A pydantic-ai run id may not be reused: each segment and each takeover is a new run.
                    run_id=str(uuid.uuid4()),
                    deps=self.deps,
                    model_settings=self._settings(config),
                    usage_limits=limits,
                    usage=usage,
                    capabilities=[capability],
                )
                async with iterating as agent_run:
                    async for node in agent_run:
                        if isinstance(node, CallToolsNode):
                            await self._turn(run, state, agent_run.all_messages(), agent_run.usage)
                        elif isinstance(node, ModelRequestNode):
                            messages = agent_run.all_messages()
                            if not messages or messages[-1] is not node.request:
                                messages = [*messages, node.request]
                            await self._results(run, state, messages, agent_run.usage)
                    result = agent_run.result
        except UsageLimitExceeded as exc:
            await run.over_limit(_limit(str(exc)), str(exc))
        except AgentRunError as exc:
            await run.fail(f"agent_error: {exc}")
        assert result is not None  # the graph ended (iteration finished without raising)
        messages = result.all_messages()
        run.update(self._advance(run, state, messages, result.usage))
        output = result.output
        if isinstance(output, DeferredToolRequests):
            state.env = state.env.model_copy(
                update={"batch": _batch(output, messages), "answers": [], "turn": _last_response(messages)}
            )
            await self._pause(run, state)
        await run.complete(output if isinstance(output, str) else pydantic_core.to_json(output).decode())

    def _settings(self, config: RunConfig) -> ModelSettings | None:
        settings: ModelSettings = dict(self.model_settings or {})  # type: ignore[assignment]
        if config.temperature is not None:
            settings["temperature"] = config.temperature
        if config.max_tokens:
            settings["max_tokens"] = config.max_tokens
        return settings or None

    def _advance(
        self, run: DurableRun, state: _State, messages: Sequence[ModelMessage], usage: RunUsage
    ) -> Continuation:
        """The continuation at ``messages``: native history, projected messages, counts from the usage."""
        total = usage.input_tokens + usage.output_tokens
        counted = Usage(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            total_tokens=total,
            tool_calls=usage.tool_calls,
        )
        own = from_native(messages[state.env.own_from :])
        state.env = state.env.model_copy(update={"history": _history_json(messages)})
        return run.cont.model_copy(
            update={
                "messages": [*state.history, *own],
                "step_index": usage.requests,
                "usage": counted,
                "tokens_used": total,
            }
        )

    async def _turn(self, run: DurableRun, state: _State, messages: list[ModelMessage], usage: RunUsage) -> None:
        """A model turn arrived (or a takeover is shown a saved one again): a durable boundary before its
        calls run."""
        turn = _last_response(messages)
        # Counted first: a turn refused below still cost its tokens and its step.
        run.update(self._advance(run, state, messages, usage))
        if turn != state.env.turn:
            # A new turn. The SAME turn again (a takeover, a resume) is not checked again, and keeps the
            # ledger the snapshot saved for it.
            state.env = state.env.model_copy(update={"turn": turn, "batch": [], "answers": []})
            response = messages[turn]
            assert isinstance(response, ModelResponse)
            await run.counted_turn(_model_turn(response), kept=from_native(messages[state.env.own_from : turn]))
        await run.boundary()

    async def _results(self, run: DurableRun, state: _State, messages: list[ModelMessage], usage: RunUsage) -> None:
        """The next model request is ready: when it carries the last turn's results, that is the turn's
        boundary. The run's first request (the prompt) is not a boundary: nothing is saved before a run's
        first turn."""
        if not any(isinstance(m, ModelResponse) for m in messages[state.env.own_from :]):
            return
        run.update(self._advance(run, state, messages, usage))
        # The turn is closed: its results are in the history, its batch handed over.
        state.env = state.env.model_copy(update={"batch": [], "answers": []})
        await run.close_turn()

    async def _pause(self, run: DurableRun, state: _State) -> None:
        """Pause on the batch's unanswered calls, in the model's order (the durable run picks the first's kind)."""
        answered = {a.call_id for a in state.env.answers}
        await run.pause(
            [
                Waiting(
                    ToolCall(id=c.id, name=c.name, arguments=c.arguments),
                    SuspendReason(c.kind),
                    note=str(c.metadata.get("note", "")) if c.kind == "approval" else "",
                )
                for c in state.env.batch
                if c.id not in answered
            ]
        )

    def retry_safe(self, tool: ToolDefinition) -> bool:
        if tool.name in self.not_retry_safe:
            return False
        return bool((tool.metadata or {}).get(RETRY_SAFE_KEY, True))


class _Durable(AbstractCapability[Any]):
    """The hooks pydantic-ai calls for every request and call: the run's tool allowlist, and each tool's
    execution through the durable run."""

    def __init__(self, executor: PydanticAIExecutor, run: DurableRun) -> None:
        self.executor = executor
        self.run = run

    async def prepare_tools(
        self, ctx: PydanticRunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        # From the config stored with the run, on every request of every segment: a resume never widens it.
        return [t for t in tool_defs if self.run.allows_tool(t.name)]

    async def wrap_tool_execute(
        self,
        ctx: PydanticRunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: Any,
        handler: Any,
    ) -> Any:
        call_id = call.tool_call_id
        failure: list[PydanticToolFailed] = []

        async def execute() -> Any:
            token = _tool_env.set(self.run.tool_env(call_id))
            try:
                return await handler(args)
            except PydanticToolFailed as exc:
                failure.append(exc)
                raise CallFailed(exc.message) from exc
            finally:
                _tool_env.reset(token)

        outcome = await self.run.run_call(
            ToolCall(id=call_id, name=call.tool_name, arguments=call.args_as_json_str()),
            execute,
            retry_safe=self.executor.retry_safe(tool_def),
            text=_as_text,
        )
        if isinstance(outcome, Ran):
            return outcome.value
        if failure:
            raise failure[0]
        if outcome.outcome is ToolOutcome.COMPLETED:
            # Ran in an earlier attempt of this turn and its result was saved: reused.
            return outcome.content
        # Failed before, or handed to its handler by a worker that stopped before saving its result.
        raise PydanticToolFailed(outcome.error)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else pydantic_core.to_json(value).decode()


def _model_name(agent: Agent[Any, Any]) -> str:
    model = agent.model
    if model is None:
        return ""
    return model if isinstance(model, str) else model.model_name


def _last_response(messages: Sequence[ModelMessage]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if isinstance(messages[index], ModelResponse):
            return index
    return -1


def _batch(requests: DeferredToolRequests, messages: Sequence[ModelMessage]) -> list[DeferredCall]:
    """The deferred calls in the model's emission order: ``DeferredToolRequests`` lists approvals and calls
    apart, so the order is recovered from the last model response."""
    kinds: dict[str, tuple[_Kind, ToolCallPart]] = {}
    for part in requests.approvals:
        kinds[part.tool_call_id] = ("approval", part)
    for part in requests.calls:
        meta = requests.metadata.get(part.tool_call_id, {})
        kinds[part.tool_call_id] = ("agent_reply" if meta.get(MARKER) == AGENT_REPLY else "external_tool", part)
    response = messages[_last_response(messages)]
    order = [p.tool_call_id for p in response.parts if isinstance(p, ToolCallPart)]
    ordered = [i for i in order if i in kinds] + [i for i in kinds if i not in order]
    return [
        DeferredCall(
            id=i,
            name=kinds[i][1].tool_name,
            arguments=kinds[i][1].args_as_json_str(),
            kind=kinds[i][0],
            metadata=requests.metadata.get(i, {}),
        )
        for i in ordered
    ]


def _limit(message: str) -> Limit:
    """The limit a pydantic-ai ``UsageLimitExceeded`` names."""
    if "request_limit" in message:
        return Limit.STEPS
    if "tool_calls_limit" in message:
        return Limit.TOOL_CALLS
    return Limit.TOKENS


def _model_turn(response: ModelResponse) -> ModelTurn:
    """A pydantic-ai response in the durable run's terms (its text parts one per line)."""
    return ModelTurn(
        text="\n".join(p.content for p in response.parts if isinstance(p, TextPart)),
        calls=[
            ToolCall(id=p.tool_call_id, name=p.tool_name, arguments=p.args_as_json_str())
            for p in response.parts
            if isinstance(p, ToolCallPart)
        ],
        usage=Usage(output_tokens=response.usage.output_tokens),
    )


def to_native(messages: Sequence[Message]) -> list[ModelMessage]:
    """A session's history (Intermission's messages) as pydantic-ai messages, so the agent sees it."""
    native: list[ModelMessage] = []
    for m in messages:
        if m.role is Role.ASSISTANT:
            parts: list[Any] = [TextPart(m.content)] if m.content else []
            parts.extend(ToolCallPart(c.name, c.arguments, tool_call_id=c.id) for c in m.tool_calls)
            native.append(ModelResponse(parts=parts))
        elif m.role is Role.TOOL:
            native.append(ModelRequest(parts=[ToolReturnPart(m.name, m.content, tool_call_id=m.tool_call_id)]))
        elif m.role is Role.SYSTEM:
            native.append(ModelRequest(parts=[SystemPromptPart(m.content)]))
        else:
            native.append(ModelRequest(parts=[UserPromptPart(m.content)]))
    return native


def from_native(messages: Sequence[ModelMessage]) -> list[Message]:
    """pydantic-ai messages projected into Intermission's message type (what the session keeps)."""
    out: list[Message] = []
    for message in messages:
        if isinstance(message, ModelResponse):
            text = "".join(p.content for p in message.parts if isinstance(p, TextPart))
            calls = [
                ToolCall(id=p.tool_call_id, name=p.tool_name, arguments=p.args_as_json_str())
                for p in message.parts
                if isinstance(p, ToolCallPart)
            ]
            out.append(Message(role=Role.ASSISTANT, content=text, tool_calls=calls))
            continue
        out.extend(_request_messages(message.parts))
    return out


def _request_messages(parts: Iterable[Any]) -> Iterator[Message]:
    for part in parts:
        if isinstance(part, UserPromptPart):
            content = part.content if isinstance(part.content, str) else pydantic_core.to_json(part.content).decode()
            yield Message(role=Role.USER, content=content)
        elif isinstance(part, ToolReturnPart):
            yield Message(
                role=Role.TOOL, content=part.model_response_str(), tool_call_id=part.tool_call_id, name=part.tool_name
            )
        elif isinstance(part, RetryPromptPart):
            if part.tool_name:
                yield Message(
                    role=Role.TOOL,
                    content=f"error: {part.model_response()}",
                    tool_call_id=part.tool_call_id,
                    name=part.tool_name,
                )
            else:
                yield Message(role=Role.USER, content=part.model_response())
        # System prompt parts are the agent's, assembled again by pydantic-ai on each request: not kept.
