"""The executor protocol and the run context handed to it.

An executor continues ONE claimed run. Everything it may do to the run goes through its ``RunContext``:
save progress, pause, complete, fail (and finish an ending), load its session's history, and give a tool
what a tool may use (``tool_env``). The context holds the engine privately and applies every change at the
run's stored scope: an executor never sees the database. Each write is checked against the run's lease by the
database; once a write finds the lease gone (or the lease keeper does), the context is dead: every later
write raises RunLeaseLost without touching the database, and the run's task is cancelled. A worker that
lost a run writes nothing more for it.

A run can be asked to end while it runs (``run.cancel``: ``runs.ending``). The context hears of it from its
next progress save, or from the lease keeper's renewal (``handle.ending``), and finishes that end ITSELF at
the run's next boundary (a save, ``boundary()``, ``between_calls()``, or a pause or end the store turned
aside), then raises ``EndedOnRequest``: so every executor honours a cancel, whatever it does, without
asking the database between calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import NoReturn, Protocol

from intermission.agent.tools import Ledger, ToolEnv
from intermission.engine.core import Engine
from intermission.engine.runs import EndingRequested, EndRun, Pause, Paused, PauseRun, ReadSession, SaveProgress
from intermission.schemas.errors import RunLeaseLost
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.llm import Message
from intermission.schemas.run import Ending, EndingKind, Lease, Run
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, Progress, ProgressResult
from intermission.tracing import current_traceparent, open_span

# The most session messages a run loads unless the fleet says otherwise (Settings.session_history_messages).
DEFAULT_HISTORY_MESSAGES = 200

# How each ending ends a run, and its error when the ending names no reason.
ENDINGS: dict[EndingKind, tuple[RunEventKind, str]] = {
    EndingKind.CANCEL: (RunEventKind.CANCELLED, "cancelled"),
    EndingKind.EXPIRE: (RunEventKind.EXPIRED, "suspension_expired"),
}


class StopAtBoundary(Exception):
    """The worker is stopping: the executor reached a boundary and must return now. Its lease is released
    and another worker continues from the snapshot it just saved."""


class EndedOnRequest(Exception):
    """The run was asked to end while it ran (a cancel), and its context has just ended it so: the executor
    must return (and let this propagate: the fleet expects it)."""

    def __init__(self, ending: Ending) -> None:
        super().__init__(f"ended on request: {ending.kind.value}")
        self.ending = ending


class Executor(Protocol):
    async def execute(self, ctx: RunContext) -> None: ...


@dataclass
class RunHandle:
    """Fleet-side state of one running run, shared by its context and its lease keeper."""

    lost: bool = False
    ended: bool = False
    paused: bool = False
    # The run's own pause or end is in flight. A renewal that runs just after that transition committed no
    # longer finds the run running, and would report it lost before the transition's answer reaches the run;
    # while this is set, the transition's own answer says what happened (RunLeaseLost when it was lost).
    leaving: bool = False
    # An end asked of the run while it runs, as the lease keeper or a save heard of it.
    ending: Ending | None = None


class _NoLedger:
    """The ledger of a context given none: a tool that books a charge cannot run there."""

    async def charge(self, run_id: str, call_id: str, amount: object) -> int:
        raise RuntimeError("this run context was given no ledger to book charges in")


class RunContext:
    __slots__ = (
        "_engine",
        "_history_limit",
        "_ledger",
        "_stopping",
        "correlation_id",
        "handle",
        "lease",
        "progress",
        "run",
    )

    def __init__(
        self,
        engine: Engine,
        run: Run,
        progress: Progress,
        lease: Lease,
        *,
        correlation_id: str | None,
        stopping: asyncio.Event,
        handle: RunHandle | None = None,
        history_limit: int = DEFAULT_HISTORY_MESSAGES,
        ledger: Ledger | None = None,
    ) -> None:
        # Every change after the claim is applied at the run's STORED scope (``run.scope``), never the
        # caller's.
        self._engine = engine
        # The demo ledger books a tool's charges under the run's stored scope too (the fleet gives the one
        # bound to it).
        self._ledger: Ledger = ledger if ledger is not None else _NoLedger()
        self.run = run
        self.progress = progress
        self.lease = lease
        self.correlation_id = correlation_id
        self._stopping = stopping
        self.handle = handle or RunHandle()
        self._history_limit = history_limit

    @property
    def scope(self) -> Scope:
        return self.run.scope

    @property
    def continuation(self) -> Continuation:
        return self.progress.continuation

    @property
    def answers(self) -> list[ProgressResult]:
        """Results the claim brought for the pending calls, in pending order."""
        return self.progress.done

    @property
    def owner(self) -> str:
        return self.lease.owner

    def _alive(self) -> None:
        if self.handle.lost:
            raise RunLeaseLost(f"{self.owner} lost run {self.run.id}")
        if self.handle.ended or self.handle.paused:
            raise RunLeaseLost(f"run {self.run.id} already left this worker")

    async def save_progress(self, progress: Progress) -> Progress:
        """Save a boundary. When the run was asked to end meanwhile, the run ends so here (the snapshot is
        still saved first) and this raises EndedOnRequest."""
        self._alive()
        try:
            saved = await self._engine.apply(SaveProgress(self.scope, progress))
        except RunLeaseLost:
            self.handle.lost = True
            raise
        self.progress = saved
        if saved.ending is not None:
            await self._end_as_asked(saved.ending, progress.continuation)
        return saved

    async def boundary(self) -> None:
        """Call after each durable boundary: a run asked to end ends here; a stopping worker stops here."""
        if self.handle.ending is not None:
            await self._end_as_asked(self.handle.ending, self.progress.continuation)
        if self._stopping.is_set():
            raise StopAtBoundary

    async def between_calls(self) -> None:
        """Call before handing a call to its handler: a run whose lease keeper heard it was asked to end ends
        here rather than running one more call. Costs nothing when it was not (no database round trip)."""
        if self.handle.ending is not None:
            await self._end_as_asked(self.handle.ending, self.progress.continuation)

    async def pause(self, pause: Pause) -> Paused:
        """Pause the run. A run asked to end does not pause: it ends as asked (EndedOnRequest)."""
        self._alive()
        self.handle.leaving = True
        try:
            with open_span("run.pause", attributes={"intermission.pause.reason": pause.reason.value}):
                # The pause remembers the span it is made in: the resume that answers it links to it, and the
                # run's trace goes on from it, whichever worker that is (intermission/tracing.py).
                paused = await self._engine.apply(PauseRun(self.run, self.owner, _traced(pause), self.correlation_id))
        except RunLeaseLost:
            self.handle.lost = True
            raise
        except EndingRequested as asked:
            await self._end_as_asked(asked.ending, pause.continuation)
        finally:
            self.handle.leaving = False
        self.handle.paused = True
        return paused

    async def end(
        self,
        kind: RunEventKind,
        *,
        output: str | None = None,
        error: str | None = None,
        own_messages: list[Message] | None = None,
        continuation: Continuation | None = None,
    ) -> RunEvent:
        """End the run. ``continuation`` is where it ended: its step and token counts go on the run row (the
        last saved snapshot's when None). A run asked to end ends as asked instead (EndedOnRequest), unless
        this end is that end."""
        self._alive()
        self.handle.leaving = True
        try:
            event = await self._engine.apply(
                EndRun(
                    self.scope,
                    self.run.id,
                    self.owner,
                    self.run.revision,
                    kind,
                    output=output,
                    error=error,
                    correlation_id=self.correlation_id,
                    own_messages=own_messages,
                    counts=continuation or self.progress.continuation,
                    # The run's span is current: its end event goes out in the run's trace.
                    traceparent=current_traceparent(),
                )
            )
        except RunLeaseLost:
            self.handle.lost = True
            raise
        except EndingRequested as asked:
            cont = continuation or self.progress.continuation
            await self._end_as_asked(asked.ending, cont, own_messages)
        finally:
            self.handle.leaving = False
        self.handle.ended = True
        return event

    async def complete(
        self, output: str, own_messages: list[Message] | None = None, continuation: Continuation | None = None
    ) -> RunEvent:
        return await self.end(
            RunEventKind.COMPLETED, output=output, own_messages=own_messages, continuation=continuation
        )

    async def fail(
        self, error: str, own_messages: list[Message] | None = None, continuation: Continuation | None = None
    ) -> RunEvent:
        return await self.end(RunEventKind.FAILED, error=error, own_messages=own_messages, continuation=continuation)

    async def _end_as_asked(
        self, ending: Ending, cont: Continuation, own_messages: list[Message] | None = None
    ) -> NoReturn:
        """End the run as ``ending`` says, at ``cont`` (its own messages and counts), then stop the executor."""
        self.handle.ending = ending
        kind, default = ENDINGS[ending.kind]
        own = own_messages if own_messages is not None else cont.messages[cont.new_messages_from :]
        await self.end(kind, error=ending.reason or default, own_messages=own, continuation=cont)
        raise EndedOnRequest(ending)

    async def load_history(self, session_id: str, *, most: int | None = None) -> list[Message]:
        """The session's most recent messages, at most ``most`` of them (and never more than the fleet's
        ``INTERMISSION_SESSION_HISTORY_MESSAGES``), oldest first, never opening on a tool result whose call
        was cut off: a run's snapshot holds its history, so the history it loads is bounded."""
        limit = self._history_limit if most is None else max(1, min(most, self._history_limit))
        return await self._engine.apply(ReadSession(self.scope, session_id, limit))

    def reached(self, point: str) -> None:
        """The run passed the named crash point (``intermission/points.py``), for the engine's observer."""
        self._engine.observer.reached(point)

    def tool_env(self, call_id: str) -> ToolEnv:
        """What a tool handler of this run may use for the call ``call_id``."""
        return ToolEnv(run_id=self.run.id, call_id=call_id, scope=self.scope, ledger=self._ledger)


def _traced(pause: Pause) -> Pause:
    """``pause`` with the span context current here (the ``run.pause`` span) recorded in its continuation."""
    traceparent = current_traceparent()
    if traceparent is None or traceparent == pause.continuation.traceparent:
        return pause
    return replace(pause, continuation=pause.continuation.model_copy(update={"traceparent": traceparent}))
