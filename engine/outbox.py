"""Operators' retry of quarantined outbox rows (``intermission outbox retry``): each goes back in line for
the relays with a clean count, under its own message_id and body, so a re-publication is the same event.
Every relay is woken at the commit (a row made sendable by an update fires no insert trigger)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from intermission.engine.transition import Family, Transition
from intermission.store.rows import Out


class RetryRow(NamedTuple):
    """``intermission_outbox_retry_v1``: one quarantined row by its id, or None for every one."""

    id: int | None


RETRY_OUTBOX = Family("retry_outbox", "retry_outbox_v1", RetryRow)


@dataclass(frozen=True)
class RetryQuarantined(Transition[list[int]]):
    """Put the quarantined rows ``ids`` back in line (None: every quarantined row); the ids put back."""

    family: ClassVar[Family] = RETRY_OUTBOX

    id: int | None = None

    def row(self) -> RetryRow:
        return RetryRow(self.id)

    def result(self, outs: Sequence[Out]) -> list[int]:
        return sorted(out["id"] for out in outs)
