"""Where the events a commit wrote go: the one interface between the engine and whatever publishes them.

An event is written to the outbox in the transaction that caused it, so it can never be lost. Every event
is also known whole before its commit (``engine/events.py``), so the committer hands each commit's events to
the sink right after the commit, to be published from memory without waiting for a relay to read them back.
Their rows wait ``hold_seconds`` for the sink meanwhile (migration 0009): a relay publishes a held row only
if the sink did not get it confirmed and marked sent by then (a crash, an outage), so an event leaves at
least once and, in the common case, once. A sink with no hold (None) publishes nothing from memory: the rows
are due at once, and the sink only learns that they were written (the relay wakes for them).

The relay implements this (``publishers/relay.py``); tests use ``CollectedEvents``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from intermission.engine.events import OutboxEvent


class EventSink(Protocol):
    """Takes the events of each commit, in commit order, right after the commit."""

    @property
    def hold_seconds(self) -> float | None:
        """How long the rows of handed events wait for this sink before a relay may publish them (None: they
        do not wait)."""
        ...

    def committed(self, events: Sequence[OutboxEvent]) -> None:
        """The events one commit wrote; must not block (publishing happens elsewhere)."""
        ...


class CollectedEvents:
    """An ``EventSink`` that keeps what it is handed, for tests and for callers that publish nothing."""

    def __init__(self, hold_seconds: float | None = 3.0) -> None:
        self._hold_seconds = hold_seconds
        self.events: list[OutboxEvent] = []

    @property
    def hold_seconds(self) -> float | None:
        return self._hold_seconds

    def committed(self, events: Sequence[OutboxEvent]) -> None:
        self.events.extend(events)
