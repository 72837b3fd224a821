"""What watches the engine work: one interface for metrics, spans and crash points.

The committer, the ack policy and the durable run report to an ``Observer`` and know nothing of what it
does: the worker's metrics (``fleet/metrics.py``) time each commit and count each delivery's outcome, the
spans below link a shared commit to each command in it, and the crash tests kill the process at a named
point (``intermission/points.py``). Nothing is threaded through a constructor as a lambda, and no layer
subclasses another to time it.

Every method is called on the hot path: an observer must not block, and one that has nothing to do for a
call returns at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Protocol

from opentelemetry.trace import Span

from intermission import points
from intermission.engine.transition import Family
from intermission.tracing import LINK_BATCH, LINK_COMMAND, current_span, failed, recording, started_span


class Observer(Protocol):
    def caller(self) -> object:
        """Whatever this observer needs of the context a transition is submitted from (its span), taken
        when it is submitted; handed back to ``committing``."""
        ...

    def committing(self, family: Family, callers: Sequence[object]) -> AbstractContextManager[None]:
        """Around one statement of ``family`` carrying the transitions submitted from ``callers``: an
        exception leaving it is the statement's (the whole batch failed)."""
        ...

    def reached(self, point: str) -> None:
        """The work passed the named crash point (``intermission/points.py``)."""
        ...

    def applied(self, command: str, seconds: float) -> None:
        """One attempt at a command's transaction (its reads, its transitions, their commits) took
        ``seconds``, whatever its outcome."""
        ...

    def settled(self, command: str, outcome: str, code: str) -> None:
        """A delivery of ``command`` was settled: applied, duplicate, stale, rejected (with its error code),
        requeued, dead-lettered."""
        ...


class Observers:
    """Several observers as one, each called in turn."""

    def __init__(self, *observers: Observer) -> None:
        self._observers = observers

    def caller(self) -> object:
        return tuple(o.caller() for o in self._observers)

    @contextlib.contextmanager
    def committing(self, family: Family, callers: Sequence[object]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for i, observer in enumerate(self._observers):
                mine = [c[i] if isinstance(c, tuple) and len(c) > i else None for c in callers]
                stack.enter_context(observer.committing(family, mine))
            yield

    def reached(self, point: str) -> None:
        for observer in self._observers:
            observer.reached(point)

    def applied(self, command: str, seconds: float) -> None:
        for observer in self._observers:
            observer.applied(command, seconds)

    def settled(self, command: str, outcome: str, code: str) -> None:
        for observer in self._observers:
            observer.settled(command, outcome, code)


class Quiet:
    """Observes nothing: the default, and the base of observers that watch only part of the work."""

    def caller(self) -> object:
        return None

    def committing(self, family: Family, callers: Sequence[object]) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reached(self, point: str) -> None:
        return None

    def applied(self, command: str, seconds: float) -> None:
        return None

    def settled(self, command: str, outcome: str, code: str) -> None:
        return None


class CrashPoints(Quiet):
    """Passes every crash point on to the process's point observer (``points.observe``), which the crash
    tests and the soak install in a worker they mean to kill."""

    def reached(self, point: str) -> None:
        points.reach(point)


# Outcomes (``settled``) that say the worker could not handle the command, not that the command was
# refused: the command's span is marked failed.
_FAILURES = frozenset({"requeued", "dead_lettered"})


# The span whose work the transitions submitted here are, where that is not the current span: a command
# submits its transitions within its transaction span, but what a shared statement links to and is linked
# from is the command's own span (``consumers/command_spans.py``).
_ON_BEHALF_OF: ContextVar[Span | None] = ContextVar("intermission_on_behalf_of", default=None)


@contextlib.contextmanager
def on_behalf_of(span: Span) -> Iterator[None]:
    """Within the block, the transitions submitted are ``span``'s work (``Spans.caller``)."""
    token = _ON_BEHALF_OF.set(span)
    try:
        yield
    finally:
        _ON_BEHALF_OF.reset(token)


class Spans(Quiet):
    """Spans of the work: a statement that carries several commands' transitions at once gets a span of its
    own (``commands transaction``), a root linked to each command's span and linked from each (it cannot be
    the child of all of them, and making it one's child would put the others' work in a stranger's trace);
    a settled delivery's outcome goes on its command's span, which is current where it is reported."""

    def caller(self) -> object:
        return (_ON_BEHALF_OF.get() or current_span()) if recording() else None

    @contextlib.contextmanager
    def committing(self, family: Family, callers: Sequence[object]) -> Iterator[None]:
        spans = [c for c in callers if isinstance(c, Span) and c.is_recording()]
        if family.reads or len(callers) < 2 or not spans:
            yield
            return
        shared = started_span(
            "commands transaction",
            attributes={"intermission.batch.size": len(callers), "intermission.transition": family.name},
            links=[(span.get_span_context(), LINK_COMMAND) for span in spans],
        )
        for span in spans:
            span.add_link(shared.get_span_context(), {"intermission.link": LINK_BATCH})
        try:
            yield
        except BaseException as exc:
            shared.record_exception(exc)
            failed(shared, type(exc).__name__)
            raise
        finally:
            shared.end()

    def settled(self, command: str, outcome: str, code: str) -> None:
        span = current_span()
        if not span.is_recording():
            return
        span.set_attribute("intermission.outcome", outcome)
        if code:
            span.set_attribute("error.type", code)
        if outcome in _FAILURES:
            failed(span, code or outcome)


QUIET = Quiet()
# What an engine or an ack policy observes when given nothing else: the crash points, which cost a call where
# no test installed a point observer, and which a crash test must find passed by whatever engine the process
# it kills built (``tests/acceptance``).
CRASH_POINTS = CrashPoints()
