"""The columns several transitions' rows share, encoded once: the lease a transition takes, the first
snapshot it writes, the event it writes. Each is a run of fields of the composite rows of migration 0016.

The lease and snapshot columns are spread into a row positionally (``*grant_columns(lease, first)``), the
event's by name (``**event_fields(event)``): mypy checks one star-argument of a fixed-length tuple exactly,
but not a second one in the same call, and a row built with a field out of place must not type-check.
"""

from __future__ import annotations

import uuid
from typing import TypedDict

from intermission.engine.events import OutboxEvent
from intermission.schemas.run import Lease
from intermission.schemas.suspension import Progress
from intermission.store import rows


def lease_columns(lease: Lease | None) -> tuple[str | None, float | None]:
    """``lease_owner``, ``lease_ttl``: both NULL for a transition that takes no lease."""
    return (lease.owner, lease.ttl_seconds) if lease is not None else (None, None)


def grant_columns(
    lease: Lease | None, first: Progress | None
) -> tuple[str | None, float | None, str | None, str | None]:
    """``lease_owner``, ``lease_ttl``, ``first_continuation``, ``first_done``: the lease a grant takes and
    the first snapshot it writes, NULL for none."""
    if first is None:
        return (*lease_columns(lease), None, None)
    return (*lease_columns(lease), rows.dump(first.continuation), rows.dump_list(rows.DONE, first.done))


class EventFields(TypedDict):
    """The ``event_*`` fields of a transition that always writes its event."""

    event_message_id: uuid.UUID
    event_routing_key: str
    event_body: str
    event_correlation_id: str | None
    event_headers: str


class MaybeEventFields(TypedDict):
    """The ``event_*`` fields of a transition that may write no event (all NULL then)."""

    event_message_id: uuid.UUID | None
    event_routing_key: str | None
    event_body: str | None
    event_correlation_id: str | None
    event_headers: str | None


def event_fields(event: OutboxEvent) -> EventFields:
    """The event whole, as its row stores it and the sink publishes it."""
    message_id, routing_key, body, correlation_id, headers = event.columns()
    return EventFields(
        event_message_id=message_id,
        event_routing_key=routing_key,
        event_body=body,
        event_correlation_id=correlation_id,
        event_headers=headers,
    )


def maybe_event_fields(event: OutboxEvent | None) -> MaybeEventFields:
    if event is not None:
        return MaybeEventFields(**event_fields(event))
    return MaybeEventFields(
        event_message_id=None, event_routing_key=None, event_body=None, event_correlation_id=None, event_headers=None
    )
