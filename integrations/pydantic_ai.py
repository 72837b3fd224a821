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

The guarantees are the demo agent's (agent/loop.py):

- a step boundary is saved at each node boundary of ``agent.iter`` (a model turn is durable before the
  first of its calls runs; a turn's tool results are durable before the next model request);
- a call of a tool declared not retry-safe (``NOT_RETRY_SAFE`` in the tool's metadata, or its name in
  ``not_retry_safe=``) is written to ``Progress.started`` before it runs; a worker taking the run over
  never runs it again (the model is told its outcome is unknown), and reuses every result in ``done``;
- the stored ``RunConfig``'s tool allowlist holds on every request of every segment (``prepare_tools``),
  as do ``max_steps`` and the budgets, counted across pauses from pydantic-ai's usage.
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
from intermission.schemas.suspension import Continuation, Ending, PendingCall, Progress, ProgressResult, SuspendReason
from intermission.store.runs import Pause
from intermission.tracing import failed, tool_span

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

OUTCOME_UNKNOWN = (
    "outcome unknown: this call was handed to its handler, and the worker running it stopped before its "
    "result was saved; it was not run again"
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


class _Stop(Exception):
    """The run left this worker (paused or ended)."""


@dataclass
class _State:
    """One execution's working state: the continuation being built and the per-turn ledger."""

    cont: Continuation
    env: Envelope
    started: list[PendingCall] = field(default_factory=list)
    done: list[ProgressResult] = field(default_factory=list)
    # The loaded session history, in Intermission's type, as the run's messages begin with it.
    history: list[Message] = field(default_factory=list)

    def snapshot(self, ctx: RunContext) -> Progress:
        cont = self.cont.model_copy(update={"prepared": encode(self.env)})
        return Progress(
            run_id=ctx.run.id, owner=ctx.owner, continuation=cont, started=list(self.started), done=list(self.done)
        )


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
        try:
            await self._execute(ctx)
        except _Stop:
            return

    async def _execute(self, ctx: RunContext) -> None:
        progress = ctx.progress
        if progress.ending is not None:
            await self._finish_ending(ctx, progress.ending)
            return
        cont = progress.continuation
        prompt: str | None = None
        if not cont.prepared:
            state = await self._begin(ctx)
            prompt = ctx.run.input
            config = state.cont.config
            if config.max_steps <= 0:
                await self._fail(ctx, state, f"{InvalidContinuation.code}: max_steps is {config.max_steps}")
            if config.context is not None and config.context.max_messages:
                # Not silently ignored (docs/invariants.md, 20): this executor shows the agent its whole
                # history; a window belongs in the agent (a pydantic-ai history processor).
                await self._fail(
                    ctx,
                    state,
                    f"{UnsupportedConfig.code}: context.max_messages is not applied by the pydantic-ai executor; "
                    "give the agent a history processor instead",
                )
        else:
            try:
                env = decode(cont.prepared)
            except InvalidContinuation as exc:
                # Not this executor's state (another executor's, or an envelope version this code does not
                # know): the run cannot continue, and says why.
                own = cont.messages[cont.new_messages_from :]
                await ctx.fail(f"{InvalidContinuation.code}: {exc}", own, continuation=cont)
                return
            state = _State(
                cont=cont,
                env=env,
                started=list(progress.started),
                done=list(progress.done),
                history=cont.messages[: cont.new_messages_from],
            )
        results: DeferredToolResults | None = None
        if state.env.batch:
            results = await self._collect(ctx, state, progress)
        await self._run(ctx, state, prompt, results)

    async def _begin(self, ctx: RunContext) -> _State:
        """A fresh run: its session's history, in front of the agent's own. Nothing is saved until its first
        turn, as with the demo agent: a takeover before that repeats only this read."""
        base = ctx.progress.continuation
        session_id = base.session_id or ctx.run.session_id or ctx.run.id
        history = await ctx.load_history(session_id)
        native = to_native(history)
        cont = base.model_copy(
            update={
                "messages": list(history),
                "new_messages_from": len(history),
                "session_id": session_id,
                "provenance": ExecutionProvenance(
                    agent_id=ctx.run.agent_id,
                    executor=EXECUTOR_NAME,
                    model=base.config.model or _model_name(self.agent),
                    worker=ctx.owner,
                ),
            }
        )
        env = Envelope(history=_history_json(native), own_from=len(native))
        return _State(cont=cont, env=env, history=list(history))

    async def _collect(self, ctx: RunContext, state: _State, progress: Progress) -> DeferredToolResults | None:
        """Fold the answers the claim brought into the envelope; pause again for the batch's next kind while
        some call is unanswered; once all are, the results pydantic-ai is handed (all at once)."""
        env = state.env
        answered = {a.call_id for a in env.answers}
        batch_ids = {c.id for c in env.batch}
        new: list[Answer] = []
        ledger: list[ProgressResult] = []
        for result in progress.done:
            # A result for a call not yet answered is this claim's answer; one for an answered call is
            # the ledger of an approved call that ran in an earlier attempt of this segment.
            if result.call_id in batch_ids and result.call_id not in answered:
                outcome = _OUTCOMES[result.outcome]
                new.append(Answer(call_id=result.call_id, outcome=outcome, text=result.error or result.content))
                answered.add(result.call_id)
            else:
                ledger.append(result)
        for call_id in progress.approved:
            if call_id in batch_ids and call_id not in answered:
                new.append(Answer(call_id=call_id, outcome="approved"))
                answered.add(call_id)
        state.env = env.model_copy(update={"answers": [*env.answers, *new]})
        state.done = ledger
        denied = next((a for a in state.env.answers if a.outcome == "denied"), None)
        if denied is not None and self.on_denial == "fail":
            # The decider's reason is the run's error, as with the demo agent.
            await self._fail(ctx, state, denied.text or "denied")
        if any(c.id not in answered for c in env.batch):
            await self._pause(ctx, state)
        results = DeferredToolResults()
        kinds = {c.id: c.kind for c in env.batch}
        for answer in state.env.answers:
            if kinds[answer.call_id] == "approval":
                results.approvals[answer.call_id] = (
                    True if answer.outcome == "approved" else ToolDenied(answer.text or "The tool call was denied.")
                )
            elif answer.outcome == "failed":
                results.calls[answer.call_id] = PydanticToolFailed(answer.text)
            else:
                results.calls[answer.call_id] = answer.text
        return results

    async def _run(
        self, ctx: RunContext, state: _State, prompt: str | None, results: DeferredToolResults | None
    ) -> None:
        config = state.cont.config
        usage = RunUsage(
            requests=state.cont.step_index,
            input_tokens=state.cont.usage.input_tokens,
            output_tokens=state.cont.usage.output_tokens,
            tool_calls=state.cont.usage.tool_calls,
        )
        # Explicit limits, always: without them pydantic-ai applies its own 50 requests per segment, which
        # is neither max_steps nor counted across pauses. ``usage`` carries the counts of earlier segments.
        limits = UsageLimits(
            request_limit=config.max_steps,
            total_tokens_limit=config.budget.max_total_tokens or None,
            tool_calls_limit=config.budget.max_tool_calls or None,
        )
        capability = _Durable(self, ctx, state)
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
                            await self._turn(ctx, state, agent_run.all_messages(), agent_run.usage)
                        elif isinstance(node, ModelRequestNode):
                            messages = agent_run.all_messages()
                            if not messages or messages[-1] is not node.request:
                                messages = [*messages, node.request]
                            await self._results(ctx, state, messages, agent_run.usage)
                    result = agent_run.result
        except UsageLimitExceeded as exc:
            await self._fail(ctx, state, _limit_error(str(exc), config))
        except AgentRunError as exc:
            await self._fail(ctx, state, f"agent_error: {exc}")
        assert result is not None  # the graph ended (iteration finished without raising)
        messages = result.all_messages()
        self._advance(state, messages, result.usage)
        output = result.output
        if isinstance(output, DeferredToolRequests):
            state.env = state.env.model_copy(
                update={"batch": _batch(output, messages), "answers": [], "turn": _last_response(messages)}
            )
            state.started, state.done = [], []
            await self._pause(ctx, state)
        text = output if isinstance(output, str) else pydantic_core.to_json(output).decode()
        await ctx.complete(text, self._own(state), continuation=state.cont)
        raise _Stop

    def _settings(self, config: RunConfig) -> ModelSettings | None:
        settings: ModelSettings = dict(self.model_settings or {})  # type: ignore[assignment]
        if config.temperature is not None:
            settings["temperature"] = config.temperature
        if config.max_tokens:
            settings["max_tokens"] = config.max_tokens
        return settings or None

    def _advance(self, state: _State, messages: Sequence[ModelMessage], usage: RunUsage) -> None:
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
        state.cont = state.cont.model_copy(
            update={
                "messages": [*state.history, *own],
                "step_index": usage.requests,
                "usage": counted,
                "tokens_used": total,
            }
        )

    async def _turn(self, ctx: RunContext, state: _State, messages: list[ModelMessage], usage: RunUsage) -> None:
        """A model turn arrived (or a takeover is shown a saved one again): save it before its calls run."""
        turn = _last_response(messages)
        # Counted first: a turn refused below still cost its tokens and its step.
        self._advance(state, messages, usage)
        if turn != state.env.turn:
            # A new turn: its ledger starts empty. The SAME turn again (a takeover, a resume) keeps the
            # saved ledger: resetting it there would run a started non-retry-safe call a second time.
            state.started, state.done = [], []
            state.env = state.env.model_copy(update={"turn": turn, "batch": [], "answers": []})
            response = messages[turn]
            assert isinstance(response, ModelResponse)
            limit = state.cont.config.max_tokens
            if limit and response.usage.output_tokens > limit:
                # The model was told the limit; a turn past it is not used (nor kept), whatever it says.
                await self._fail(
                    ctx,
                    state,
                    f"{MaxTokensExceeded.code}: the model's turn took {response.usage.output_tokens} output tokens; "
                    f"a turn may take {limit}",
                    messages=messages[:turn],
                )
            if state.cont.config.publication.blocks(_published_text(response)):
                # Nothing of the turn goes out: no call runs, no Notice, nothing into the session.
                await self._fail(
                    ctx,
                    state,
                    f"{PublicationBlocked.code}: the model's turn holds a term the run's publication policy blocks",
                    messages=messages[:turn],
                )
        await ctx.save_progress(state.snapshot(ctx))
        points.reach(points.BETWEEN_STEPS)
        await ctx.boundary()

    async def _results(self, ctx: RunContext, state: _State, messages: list[ModelMessage], usage: RunUsage) -> None:
        """The next model request is ready: when it carries the last turn's results, that is the turn's
        boundary. The run's first request (the prompt) is not saved, as the demo agent saves nothing
        before its first turn."""
        if not any(isinstance(m, ModelResponse) for m in messages[state.env.own_from :]):
            return
        self._advance(state, messages, usage)
        # The turn is closed: its results are in the history, its batch handed over.
        state.env = state.env.model_copy(update={"batch": [], "answers": []})
        state.started, state.done = [], []
        await ctx.save_progress(state.snapshot(ctx))
        points.reach(points.BETWEEN_STEPS)
        await ctx.boundary()

    async def _pause(self, ctx: RunContext, state: _State) -> None:
        """Pause for the first unanswered call's kind: every unanswered call of that kind (an agent question
        alone; approvals grouped by who may decide them)."""
        answered = {a.call_id for a in state.env.answers}
        waiting = [c for c in state.env.batch if c.id not in answered]
        kind = waiting[0].kind
        reason = SuspendReason(kind)
        group = [c for c in waiting if c.kind == kind]
        deciders: list[str] | None = None
        if reason is SuspendReason.AGENT_REPLY:
            group = group[:1]
        elif reason is SuspendReason.APPROVAL:
            group, deciders = _approval_group(group, state.cont.config)
        pending = [
            PendingCall(
                id=c.id,
                name=c.name,
                arguments=c.arguments,
                # A fresh token per question: a call id alone may be reused by a later model response.
                reply_with=f"rw-{uuid.uuid4().hex}" if reason is SuspendReason.AGENT_REPLY else "",
                note=str(c.metadata.get("note", "")) if reason is SuspendReason.APPROVAL else "",
            )
            for c in group
        ]
        cont = state.cont.model_copy(update={"prepared": encode(state.env)})
        await ctx.pause(Pause(reason=reason, pending=pending, continuation=cont, approvers=deciders or []))
        points.reach(points.AFTER_PAUSE)
        raise _Stop

    async def _fail(
        self, ctx: RunContext, state: _State, error: str, *, messages: Sequence[ModelMessage] | None = None
    ) -> None:
        own = self._own(state) if messages is None else from_native(list(messages)[state.env.own_from :])
        cont = state.cont.model_copy(update={"prepared": encode(state.env)})
        await ctx.fail(error, own, continuation=cont)
        raise _Stop

    async def _finish_ending(self, ctx: RunContext, ending: Ending) -> None:
        cont = ctx.progress.continuation
        kind, default = ENDINGS[ending.kind]
        own = cont.messages[cont.new_messages_from :]
        await ctx.end(kind, error=ending.reason or default, own_messages=own, continuation=cont)

    @staticmethod
    def _own(state: _State) -> list[Message]:
        """The run's own messages: never the history it loaded."""
        return state.cont.messages[state.cont.new_messages_from :]

    def retry_safe(self, tool: ToolDefinition) -> bool:
        if tool.name in self.not_retry_safe:
            return False
        return bool((tool.metadata or {}).get(RETRY_SAFE_KEY, True))


class _Durable(AbstractCapability[Any]):
    """The hooks pydantic-ai calls for every request and call: the run's tool allowlist, and the ledger
    of non-retry-safe calls around each tool's execution."""

    def __init__(self, executor: PydanticAIExecutor, ctx: RunContext, state: _State) -> None:
        self.executor = executor
        self.ctx = ctx
        self.state = state

    async def prepare_tools(
        self, ctx: PydanticRunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        # From the config stored with the run, on every request of every segment: a resume never widens it.
        config = self.state.cont.config
        return [t for t in tool_defs if config.allows_tool(t.name)]

    async def wrap_tool_execute(
        self,
        ctx: PydanticRunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: Any,
        handler: Any,
    ) -> Any:
        state, run = self.state, self.ctx
        call_id = call.tool_call_id
        known = next((r for r in state.done if r.call_id == call_id), None)
        if known is not None:
            # Ran in an earlier attempt of this turn and its result was saved: reuse it.
            if known.outcome is ToolOutcome.COMPLETED:
                return known.content
            raise PydanticToolFailed(known.error)
        if any(c.id == call_id for c in state.started):
            # Handed to its handler by a worker that stopped before saving the result: never again.
            state.started = [c for c in state.started if c.id != call_id]
            state.done = [
                *state.done,
                ProgressResult(call_id=call_id, error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED),
            ]
            raise PydanticToolFailed(OUTCOME_UNKNOWN)
        # A run asked to end ends here, before one more call.
        await run.between_calls()
        retry_safe = self.executor.retry_safe(tool_def)
        if not retry_safe:
            # Written BEFORE the handler gets it, with everything the turn has done so far.
            state.started = [
                *state.started,
                PendingCall(id=call_id, name=call.tool_name, arguments=call.args_as_json_str()),
            ]
            await run.save_progress(state.snapshot(run))
        token = _tool_env.set(run.tool_env(call_id))
        try:
            with tool_span(call.tool_name, call_id, retry_safe=retry_safe) as span:
                try:
                    outcome = await handler(args)
                except PydanticToolFailed:
                    failed(span, "tool failed")
                    raise
        except PydanticToolFailed as exc:
            if not retry_safe:
                self._finished(ProgressResult(call_id=call_id, error=exc.message, outcome=ToolOutcome.FAILED))
            raise
        finally:
            _tool_env.reset(token)
        if not retry_safe:
            self._finished(ProgressResult(call_id=call_id, content=_as_text(outcome), outcome=ToolOutcome.COMPLETED))
        return outcome

    def _finished(self, result: ProgressResult) -> None:
        points.reach(points.AFTER_STARTED)
        # In memory: it travels with the turn's next save (a later call's ``started``, or the boundary).
        state = self.state
        state.started = [c for c in state.started if c.id != result.call_id]
        state.done = [*state.done, result]


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


def _approval_group(group: list[DeferredCall], config: RunConfig) -> tuple[list[DeferredCall], list[str] | None]:
    """The approval calls one pause holds and who may decide it, as the demo agent groups them
    (``approval_group``): by the host-named deciders (``RunConfig.approvers``) alone, since a pydantic-ai
    tool has no argument convention for the model to name approvers."""
    return approval_group(group, lambda call: call_approvers(config.approvers_for(call.name), []))


def _limit_error(message: str, config: RunConfig) -> str:
    if "request_limit" in message:
        return f"{MaxStepsReached.code}: the run used all {config.max_steps} steps"
    if "tool_calls_limit" in message:
        return f"{MaxToolCallsReached.code}: {message}"
    return f"{BudgetExhausted.code}: {message}"


def _published_text(response: ModelResponse) -> str:
    texts = [p.content for p in response.parts if isinstance(p, TextPart)]
    calls = [f"{p.tool_name} {p.args_as_json_str()}" for p in response.parts if isinstance(p, ToolCallPart)]
    return "\n".join([*texts, *calls])


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
