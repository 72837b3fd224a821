"""One run's durability rules, held once: every executor drives its run through a ``DurableRun``.

An executor (the agent loop, each integration) is a translator between its framework's types and the
operations an agent has: begin or resume, ask for a model turn, run a call, pause on calls, close a turn,
complete or fail. Each operation keeps every rule that makes a takeover safe; an executor holds none of
them (docs/integrations.md, "Writing an integration", gives the order of the calls):

- a run handed an ending (a claim's cancel or expiry, or a cancel its dead holder heard) finishes it before
  anything else, and never continues (``drive``);
- a run whose config has no step to take (``max_steps <= 0``) cannot continue (``begin``, ``resume``);
- limits hold from the first turn: ``max_steps`` and the token budget before a turn is asked for
  (``before_turn``); ``max_tokens``, the publication policy and the tool-call budget on the turn, before
  any of its calls runs, the refused turn left out of the session (``model_turn``);
- the model turn is durable before the first of its calls runs: saved then, merged into the first
  ``started`` save when that call is not retry-safe (``run_call``), or at once (``boundary``);
- a call that is not retry-safe is written to ``started`` before its handler gets it, in a save carrying
  everything the turn did so far; a takeover never hands a ``started`` call to a handler again (its result
  is ``OUTCOME_UNKNOWN``, a failed call the model is shown) and reuses every result in ``done``
  (``settled``, ``run_call``);
- a pause has ONE reason, the first waiting call's: every waiting call of that reason, a question to
  another agent alone (with a fresh ``reply_with``), approvals grouped by who may decide them (``pause``);
- a boundary is saved unless the snapshot this worker holds already has it (``close_turn``);
- the crash points are passed here and only here: ``after_started`` once a non-retry-safe call ran (its
  result not saved yet), ``between_steps`` once a boundary was saved, ``after_pause`` once a pause committed.

Below it, the ``RunContext`` keeps the rest: every write checked against the lease, a cancel heard while the
run runs finished at the next boundary or before the next call, a stopping worker stopped at a boundary.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, NoReturn, TypeVar

from intermission import points
from intermission.agent.executor import ENDINGS, RunContext
from intermission.agent.tools import ToolEnv
from intermission.engine.runs import Pause
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
from intermission.schemas.run import Run
from intermission.schemas.suspension import Continuation, PendingCall, Progress, ProgressResult, SuspendReason
from intermission.tracing import failed, tool_span

T = TypeVar("T")

OUTCOME_UNKNOWN = (
    "outcome unknown: this call was handed to its handler, and the worker running it stopped before its "
    "result was saved; it was not run again"
)


class Limit(StrEnum):
    """A limit of the run's config that a turn may reach, named as the config names it."""

    STEPS = "max_steps"
    TOKENS = "budget.max_total_tokens"
    TOOL_CALLS = "budget.max_tool_calls"


@dataclass(frozen=True)
class ModelTurn:
    """One model response, in Intermission's terms: its text, its calls, what it cost."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    # What the model reported for this turn alone. Its ``tool_calls`` is ignored: the session counts the
    # turn's calls itself, so the budget never rests on what a model client reports.
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True)
class Waiting:
    """A call that needs an answer from outside the run, and why."""

    call: ToolCall
    reason: SuspendReason
    # Why the call needs approval, for the person deciding.
    note: str = ""
    # Who the call itself names as its deciders: the model's word, which only narrows the host's list.
    named_approvers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Ran(Generic[T]):
    """A call that ran here, now, and completed: what its handler returned, in the framework's type."""

    value: T


class CallFailed(Exception):
    """Raised by a handler given to ``run_call``: the call ran and failed; the model is shown ``error``."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class _Left(Exception):
    """The run left this worker (paused or ended): ``drive`` returns."""


class DurableRun:
    """One claimed run as an executor drives it. Built over the run's ``RunContext``, which it alone writes
    through; an executor reads the continuation (``cont``) and the ledger (``results``, ``approved``)
    and changes them only through the operations below.

    ``keeps_results``: whether results of retry-safe calls are kept in the ledger until the turn closes (the
    agent loop, whose conversation the session builds from them); False when the framework keeps them
    itself and hands them over again on a takeover (the ledger then holds the non-retry-safe calls only).
    ``framework_limits``: the limits the framework enforces inside its own loop, where no operation of the
    session runs; they are handed to it from ``config``, and reported back with ``over_limit``.
    """

    def __init__(
        self,
        ctx: RunContext,
        *,
        executor: str,
        keeps_results: bool = False,
        framework_limits: Iterable[Limit] = (),
    ) -> None:
        self._ctx = ctx
        self._executor = executor
        self._keeps_results = keeps_results
        self._framework_limits = frozenset(framework_limits)
        progress = ctx.progress
        self._cont = progress.continuation
        self._started: list[PendingCall] = list(progress.started)
        self._done: list[ProgressResult] = []
        # The first result of each call id, denials left out: a denial is a decision's answer, which the
        # executor hands its framework as a refusal, never as a result of the call that ran.
        self._results: dict[str, ProgressResult] = {}
        for result in progress.done:
            self._done.append(result)
            self._keep(result)
        self._approved: list[str] = list(progress.approved)
        self._prepared: Callable[[], bytes] | None = None
        # Whether the session holds something its last durable snapshot lacks. The snapshot it was handed
        # (a claim's first snapshot, a takeover's, the start's) is durable.
        self._unsaved = False
        # Whether the last model turn is in a durable snapshot, and which turn that is (a new turn may begin
        # while a save of the one before is in flight: it is not the one that save makes durable).
        self._turn = 0
        self._turn_saved = True
        # Saves are taken one at a time, each snapshotting the state when it holds the lock: two
        # non-retry-safe calls a framework runs at once must never have the older snapshot land last.
        self._saving = asyncio.Lock()

    # -- what an executor reads -------------------------------------------------------------------------

    @property
    def run(self) -> Run:
        return self._ctx.run

    @property
    def cont(self) -> Continuation:
        """The run's continuation as this worker has it now (saved or not)."""
        return self._cont

    @property
    def config(self) -> RunConfig:
        """The config stored with the run: the only one it runs under, after every pause and takeover."""
        return self._cont.config

    @property
    def history(self) -> list[Message]:
        """The session history the run's messages begin with (never saved again)."""
        return self._cont.messages[: self._cont.new_messages_from]

    @property
    def results(self) -> list[ProgressResult]:
        """The ledger's results: the claim's answers, then those of the calls that ran since."""
        return list(self._done)

    @property
    def approved(self) -> list[str]:
        """The calls an approval decision granted: they run without asking again."""
        return list(self._approved)

    def allows_tool(self, name: str) -> bool:
        return self.config.allows_tool(name)

    def tool_env(self, call_id: str) -> ToolEnv:
        return self._ctx.tool_env(call_id)

    def prepare_with(self, encode: Callable[[], bytes]) -> None:
        """The executor's own state (``Continuation.prepared``), encoded at the moment each save or pause is
        taken: a framework's history, its saved turns."""
        self._prepared = encode

    # -- beginning --------------------------------------------------------------------------------------

    async def drive(self, body: Callable[[DurableRun], Awaitable[None]]) -> None:
        """Run ``body`` over this run until the run leaves this worker. A run handed an ending finishes it
        here, and ``body`` never runs: it is never continued past a cancel or an expiry."""
        try:
            if self._ctx.progress.ending is not None:
                await self._finish_ending()
                return
            await body(self)
        except _Left:
            return

    async def begin(
        self,
        *,
        model: str,
        system_prompt: str | None = None,
        with_input: bool = True,
        most: int | None = None,
        unsupported: Sequence[str] = (),
    ) -> list[Message]:
        """A run that never took a turn: its session's history (at most ``most`` messages), and its input as
        the user's message unless the framework is handed it apart (``with_input=False``); returns the
        history. Nothing is saved: a worker that takes the run over before its first turn is saved does
        exactly this again, which costs a read. ``unsupported``: what of the config the framework cannot
        honour; the run fails on it before anything runs (nothing a config accepts is silently ignored)."""
        base = self._cont
        run = self.run
        # Asked once and kept: a lookup after a pause could name another session than the one the history
        # came from.
        session_id = base.session_id or run.session_id or run.id
        history = await self._ctx.load_history(session_id, most=most)
        messages = [*history, Message(role=Role.USER, content=run.input)] if with_input else list(history)
        update: dict[str, object] = {
            "messages": messages,
            # Everything before this index is history: a run saves only what comes after it.
            "new_messages_from": len(history),
            "session_id": session_id,
            "provenance": ExecutionProvenance(
                agent_id=run.agent_id, executor=self._executor, model=model, worker=self._ctx.owner
            ),
        }
        if system_prompt is not None:
            update["system_prompt"] = system_prompt
        self._set(base.model_copy(update=update))
        await self._check_config(unsupported)
        return history

    async def resume(self) -> None:
        """A run that took turns before (a resume, a takeover): its continuation as stored."""
        await self._check_config(())

    async def _check_config(self, unsupported: Sequence[str]) -> None:
        config = self.config
        if config.max_steps <= 0:
            await self.fail(f"{InvalidContinuation.code}: max_steps is {config.max_steps}")
        if unsupported:
            await self.fail(f"{UnsupportedConfig.code}: {'; '.join(unsupported)}")

    # -- model turns ------------------------------------------------------------------------------------

    async def before_turn(self) -> None:
        """Call before asking the model for a new turn: a run with no step or no tokens left fails here, and
        a run asked to end ends here rather than ask the model once more."""
        config, cont = self.config, self._cont
        if Limit.STEPS not in self._framework_limits and cont.step_index >= config.max_steps:
            await self.over_limit(Limit.STEPS)
        budget = config.budget.max_total_tokens
        if Limit.TOKENS not in self._framework_limits and budget and cont.usage.total_tokens >= budget:
            await self.over_limit(Limit.TOKENS, f"{cont.usage.total_tokens} of {budget} tokens used")
        await self._ctx.between_calls()

    async def model_turn(self, turn: ModelTurn) -> None:
        """A new model turn: counted (one step, its tokens, its calls) and added to the conversation, then
        checked before any of its calls runs. A turn past ``max_tokens``, holding a blocked term or taking
        the run past its tool-call budget fails the run: it is not used, nor kept in the session (its cost
        is counted)."""
        asked = self._cont
        usage = asked.usage.plus(turn.usage.model_copy(update={"tool_calls": len(turn.calls)}))
        assistant = Message(role=Role.ASSISTANT, content=turn.text, tool_calls=turn.calls)
        self._set(
            asked.model_copy(
                update={
                    "messages": [*asked.messages, assistant],
                    "step_index": asked.step_index + 1,
                    "usage": usage,
                    "tokens_used": usage.total_tokens,
                }
            )
        )
        await self._new_turn(turn, kept=_own(asked))

    async def counted_turn(self, turn: ModelTurn, *, kept: list[Message]) -> None:
        """A new model turn that the framework counted into the continuation itself (``update`` first),
        checked as ``model_turn`` checks one; ``kept`` is what the session keeps if the turn is refused."""
        await self._new_turn(turn, kept=kept)

    async def _new_turn(self, turn: ModelTurn, *, kept: list[Message]) -> None:
        self._turn += 1
        self._turn_saved = False
        config = self.config
        if config.max_tokens and turn.usage.output_tokens > config.max_tokens:
            # The client was told the limit; a turn past it is not used (nor kept), whatever it says.
            await self.fail(
                f"{MaxTokensExceeded.code}: the model's turn took {turn.usage.output_tokens} output tokens; "
                f"a turn may take {config.max_tokens}",
                kept=kept,
            )
        if config.publication.blocks(_published(turn)):
            # Nothing of the turn goes out: not its answer (run.completed), not its calls' arguments (a
            # Notice), not into the session. The error does not repeat the term: it is published too.
            await self.fail(
                f"{PublicationBlocked.code}: the model's turn holds a term the run's publication policy blocks",
                kept=kept,
            )
        limit = config.budget.max_tool_calls
        calls = self._cont.usage.tool_calls
        if Limit.TOOL_CALLS not in self._framework_limits and limit and calls > limit:
            # Before any of the turn's calls runs: a runaway turn (or run) is stopped at once, however many
            # calls it asks for.
            await self.over_limit(
                Limit.TOOL_CALLS,
                f"the turn asks for {len(turn.calls)} tool calls, which would take the run to {calls} of the "
                f"{limit} it may make",
                kept=kept,
            )

    def update(self, cont: Continuation) -> None:
        """The continuation as the framework has moved it on (its history, its counts): the next boundary
        saves it."""
        self._set(cont)

    async def boundary(self) -> None:
        """A durable boundary: saved (unless the last snapshot has it), then a run asked to end ends here and
        a stopping worker stops here."""
        if self._unsaved:
            await self._save()
        self._ctx.reached(points.BETWEEN_STEPS)
        await self._ctx.boundary()

    async def close_turn(self, continuation: Continuation | None = None) -> None:
        """Every call of the open turn has its result in the conversation: ``continuation`` (as the executor
        writes results into it; None: the session's own, as ``update`` last set it). The ledger empties and
        the boundary is saved, unless nothing happened since the snapshot this worker holds: when a claim's
        snapshot answered every call, a worker continuing from it closes the turn exactly so, and the save
        would cost a transaction and add nothing a takeover needs."""
        if continuation is not None:
            self._cont = continuation
        self._started, self._done, self._results, self._approved = [], [], {}, []
        await self.boundary()

    # -- calls ------------------------------------------------------------------------------------------

    def settled(self, call_id: str) -> ProgressResult | None:
        """The call's result if it has one already: a result in the ledger (reused, never run again), or,
        for a call handed to its handler by a worker that stopped before saving its result, an outcome
        unknown (recorded: the call is never handed to a handler again). None: the call may run."""
        known = self._results.get(call_id)
        if known is not None:
            return known
        if any(c.id == call_id for c in self._started):
            self._started = [c for c in self._started if c.id != call_id]
            unknown = ProgressResult(call_id=call_id, error=OUTCOME_UNKNOWN, outcome=ToolOutcome.FAILED)
            self.record(unknown)
            return unknown
        return None

    def record(self, result: ProgressResult) -> None:
        """A call's result known without running it (a call of a tool the run does not have). In memory: it
        travels with the turn's next save."""
        self._done.append(result)
        self._keep(result)
        self._unsaved = True

    async def run_call(
        self,
        call: ToolCall,
        handler: Callable[[], Awaitable[T]],
        *,
        retry_safe: bool,
        text: Callable[[T], str],
    ) -> Ran[T] | ProgressResult:
        """Run one call through ``handler``, or settle it without running it (``settled``). ``Ran``: it ran
        now and completed; a ``ProgressResult``: its result otherwise (reused, unknown, or failed: the
        handler raised CallFailed). ``text`` is the completed result as the ledger keeps it. Any other
        exception of the handler goes through untouched, and the call stays ``started``."""
        known = self.settled(call.id)
        if known is not None:
            return known
        # A run asked to end (its lease keeper heard of it) ends here, before one more call.
        await self._ctx.between_calls()
        if not retry_safe:
            # Written BEFORE the handler gets it, with everything the turn has done so far: if this worker
            # dies from here on, nobody calls it again.
            self._started.append(PendingCall(id=call.id, name=call.name, arguments=call.arguments))
            self._unsaved = True
            await self._save()
        elif not self._turn_saved:
            # The turn is durable before its first call runs: a takeover never asks the model for it again.
            await self._save()
        outcome: Ran[T] | ProgressResult
        with tool_span(call.name, call.id, retry_safe=retry_safe) as span:
            try:
                outcome = Ran(await handler())
            except CallFailed as exc:
                failed(span, "tool failed")
                outcome = ProgressResult(call_id=call.id, error=exc.error, outcome=ToolOutcome.FAILED)
        if not retry_safe:
            self._ctx.reached(points.AFTER_STARTED)
            self._started = [c for c in self._started if c.id != call.id]
        if not retry_safe or self._keeps_results:
            # In memory only: it travels with the turn's next save (a later call's ``started`` save, the
            # boundary, or the pause); a crash before that loses a retry-safe result, and the worker that
            # takes over runs that call again (that is what retry-safe means).
            if isinstance(outcome, Ran):
                self.record(ProgressResult(call_id=call.id, content=text(outcome.value)))
            else:
                self.record(outcome)
        return outcome

    def take_answers(self, call_ids: set[str]) -> tuple[list[ProgressResult], list[str]]:
        """Take the answers a claim brought for ``call_ids`` out of the ledger, for an executor that hands
        them to its framework itself: each call's first result, and the approval of each call without one.
        Every approval of those calls is consumed."""
        taken: list[ProgressResult] = []
        answered: set[str] = set()
        rest: list[ProgressResult] = []
        for result in self._done:
            if result.call_id in call_ids and result.call_id not in answered:
                taken.append(result)
                answered.add(result.call_id)
            else:
                rest.append(result)
        approvals: list[str] = []
        for call_id in self._approved:
            if call_id in call_ids and call_id not in answered:
                approvals.append(call_id)
                answered.add(call_id)
        self._done, self._results = [], {}
        for result in rest:
            self._done.append(result)
            self._keep(result)
        self._approved = [c for c in self._approved if c not in call_ids]
        return taken, approvals

    def denial(self) -> ProgressResult | None:
        """The first denial a decision brought, if any."""
        return next((r for r in self._done if r.outcome is ToolOutcome.DENIED), None)

    # -- leaving ----------------------------------------------------------------------------------------

    async def pause(self, waiting: Sequence[Waiting], *, continuation: Continuation | None = None) -> NoReturn:
        """Pause the run for the first waiting call's reason; ``waiting`` in the model's order, the others
        stay open and pause again once this pause is answered. ``continuation``: what the pause stores
        (None: the session's, with the executor's prepared state)."""
        reason = waiting[0].reason
        group = [w for w in waiting if w.reason is reason]
        deciders: list[str] | None = None
        if reason is SuspendReason.AGENT_REPLY:
            # Each reply resumes the run: one question per pause.
            group = group[:1]
        elif reason is SuspendReason.APPROVAL:
            group, deciders = self._approval_group(group)
        pending = [
            PendingCall(
                id=w.call.id,
                name=w.call.name,
                arguments=w.call.arguments,
                # A fresh token per question: a call id alone may be reused by a later model response.
                reply_with=f"rw-{uuid.uuid4().hex}" if reason is SuspendReason.AGENT_REPLY else "",
                note=w.note,
            )
            for w in group
        ]
        cont = continuation if continuation is not None else self._with_prepared(self._cont)
        await self._ctx.pause(Pause(reason=reason, pending=pending, continuation=cont, approvers=deciders or []))
        self._ctx.reached(points.AFTER_PAUSE)
        raise _Left

    def _approval_group(self, group: list[Waiting]) -> tuple[list[Waiting], list[str] | None]:
        """The approval calls one pause holds and who may decide it (``approval_group``): each call's
        deciders are the host's list for its tool (``RunConfig.approvers``, from the config the run carries,
        never from the model), narrowed by the list the call itself names."""
        config = self.config
        return approval_group(group, lambda w: call_approvers(config.approvers_for(w.call.name), w.named_approvers))

    async def complete(self, output: str) -> NoReturn:
        await self._ctx.complete(output, _own(self._cont), continuation=self._cont)
        raise _Left

    async def fail(self, error: str, *, kept: list[Message] | None = None) -> NoReturn:
        """Fail the run where it stands; its session keeps ``kept`` (the run's own messages when None)."""
        await self._ctx.fail(error, _own(self._cont) if kept is None else kept, continuation=self._cont)
        raise _Left

    async def denied(self, reason: str) -> NoReturn:
        """A decider denied a call, and the executor does not hand the denial to its model: the decider's
        reason is the run's error."""
        await self.fail(reason or "denied")

    async def over_limit(self, limit: Limit, detail: str = "", *, kept: list[Message] | None = None) -> NoReturn:
        """Fail the run on ``limit`` (a framework that enforces it reports it here, ``detail`` saying how)."""
        if limit is Limit.STEPS:
            error = f"{MaxStepsReached.code}: the run used all {self.config.max_steps} steps"
        elif limit is Limit.TOKENS:
            error = f"{BudgetExhausted.code}: {detail}"
        else:
            error = f"{MaxToolCallsReached.code}: {detail}"
        await self.fail(error, kept=kept)

    async def _finish_ending(self) -> None:
        """A claim was made to end this run (or a cancel asked it to end while it ran, and its holder died
        before finishing that): finish that end; never continue it."""
        ending = self._ctx.progress.ending
        assert ending is not None
        cont = self._ctx.progress.continuation
        kind, default = ENDINGS[ending.kind]
        await self._ctx.end(kind, error=ending.reason or default, own_messages=_own(cont), continuation=cont)

    # -- saving -----------------------------------------------------------------------------------------

    def _set(self, cont: Continuation) -> None:
        self._cont = cont
        self._unsaved = True

    def _keep(self, result: ProgressResult) -> None:
        if result.outcome is not ToolOutcome.DENIED:
            self._results.setdefault(result.call_id, result)

    def _with_prepared(self, cont: Continuation) -> Continuation:
        if self._prepared is None:
            return cont
        return cont.model_copy(update={"prepared": self._prepared()})

    async def _save(self) -> None:
        async with self._saving:
            snapshot = Progress(
                run_id=self.run.id,
                owner=self._ctx.owner,
                continuation=self._with_prepared(self._cont),
                started=list(self._started),
                done=list(self._done),
                approved=list(self._approved),
            )
            turn = self._turn
            self._unsaved = False
            await self._ctx.save_progress(snapshot)
            if turn == self._turn:
                self._turn_saved = True


def _own(cont: Continuation) -> list[Message]:
    """The run's own messages: never the history it loaded."""
    return cont.messages[cont.new_messages_from :]


def _published(turn: ModelTurn) -> str:
    """Everything of a model turn that can leave the run: its text, and its calls (a Notice carries them)."""
    return "\n".join([turn.text, *(f"{c.name} {c.arguments}" for c in turn.calls)])
