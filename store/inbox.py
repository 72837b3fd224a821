"""The inbox: each accepted command's message_id, body digest and outcome, written in the transaction of
its effect.

A command's ``message_id`` is its idempotency key WITHIN its scope: the inbox is keyed by ``(app, tenant,
message_id)`` (migration 0007). Ids are chosen by whoever publishes, so a key shared by every tenant would
let one tenant's command turn another's under the same id into a duplicate or a conflict. A redelivered or
re-sent command whose message_id is recorded at its scope already had its effect: it is acknowledged with no
second effect and no rejection. The same message_id with a different body is ``message_id_conflict``. The
record is the FIRST write of the command's transition (``intermission_claim_pause_v1``,
``intermission_start_run_v1``), so a duplicate delivered concurrently waits on the unique index until the
first attempt commits (and is then a duplicate) or is refused (its record removed, and then it applies
itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from intermission.schemas.digest import digest
from intermission.schemas.errors import InvalidArgument, MessageIdConflict
from intermission.schemas.scope import Scope, require_scope


class AlreadyApplied(Exception):
    """The command's effect committed before: acknowledge it and do nothing."""

    def __init__(self, message_id: str, outcome: str) -> None:
        super().__init__(f"message {message_id} was applied before ({outcome})")
        self.message_id = message_id
        self.outcome = outcome


@dataclass(frozen=True)
class Receipt:
    """A delivered command: its idempotency key (its scope and message_id) and what it said."""

    scope: Scope
    message_id: str
    routing_key: str
    body_digest: str

    @classmethod
    def of(cls, message_id: str, routing_key: str, command: object) -> Receipt:
        # The scope is the parsed body's own (every command names one, checked by its model), so the key is
        # the scope the command acts in and a caller cannot record it under another.
        scope = require_scope(getattr(command, "scope", None))
        # The digest covers the parsed command in canonical form, so a sender that re-encodes the same
        # command (other key order, other whitespace) under the same message_id is still the same command.
        return cls(
            scope=scope, message_id=message_id, routing_key=routing_key, body_digest=digest([routing_key, command])
        )

    def arguments(self, scope: Scope) -> dict[str, str]:
        """The receipt as a transition's named inbox arguments, for a transition at ``scope``, which records
        it under that scope: a receipt of another scope's command would be another key, so it is refused."""
        if scope != self.scope:
            raise InvalidArgument(f"message {self.message_id} was received for scope {self.scope}, not {scope}")
        return {"message_id": self.message_id, "routing_key": self.routing_key, "digest": self.body_digest}

    def check_recorded(self, routing_key: Any, body_digest: Any, outcome: Any) -> None:
        """What the inbox holds for this key (None for all three when nothing): AlreadyApplied for
        this very command, MessageIdConflict for another; nothing when it is not recorded."""
        if routing_key is None:
            return
        if body_digest != self.body_digest or routing_key != self.routing_key:
            raise MessageIdConflict(f"message_id {self.message_id} was used for a different command")
        raise AlreadyApplied(self.message_id, str(outcome))

    def refuse(self, outcome: str) -> None:
        """Raise for a transition's inbox outcome ('duplicate' or 'message_id_conflict'); return otherwise."""
        if outcome == "duplicate":
            raise AlreadyApplied(self.message_id, "applied")
        if outcome == "message_id_conflict":
            raise MessageIdConflict(f"message_id {self.message_id} was used for a different command")


# A transition's inbox arguments when no message is recorded (the store's own callers, the original's API).
NO_RECEIPT: dict[str, str | None] = {"message_id": None, "routing_key": None, "digest": None}


def inbox_arguments(receipt: Receipt | None, scope: Scope) -> dict[str, str | None]:
    """``receipt``'s named inbox arguments for a transition at ``scope``, or NO_RECEIPT without one."""
    if receipt is None:
        return dict(NO_RECEIPT)
    return dict(receipt.arguments(scope))
