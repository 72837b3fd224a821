"""The inbox: each accepted command's message_id, body digest and outcome, written in the transaction of
its effect.

A command's ``message_id`` is its idempotency key. A redelivered or re-sent command whose message_id is
recorded already had its effect: it is acknowledged with no second effect and no rejection. The same
message_id with a different body is ``message_id_conflict``. Recording comes FIRST in the transaction, so
a duplicate delivered concurrently waits on the unique index until the first attempt commits (and is then
a duplicate) or rolls back (and then applies itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from intermission.schemas.digest import digest
from intermission.schemas.errors import MessageIdConflict
from intermission.schemas.scope import Scope
from intermission.store.db import Conn


class AlreadyApplied(Exception):
    """The command's effect committed before: acknowledge it and do nothing."""

    def __init__(self, message_id: str, outcome: str) -> None:
        super().__init__(f"message {message_id} was applied before ({outcome})")
        self.message_id = message_id
        self.outcome = outcome


@dataclass(frozen=True)
class Receipt:
    """A delivered command: its idempotency key and what it said."""

    message_id: str
    routing_key: str
    body_digest: str

    @classmethod
    def of(cls, message_id: str, routing_key: str, command: object) -> Receipt:
        # The digest covers the parsed command in canonical form, so a sender that re-encodes the same
        # command (other key order, other whitespace) under the same message_id is still the same command.
        return cls(message_id=message_id, routing_key=routing_key, body_digest=digest([routing_key, command]))


async def record_in(con: Conn, receipt: Receipt, scope: Scope, run_id: str | None, outcome: str = "applied") -> None:
    recorded = await con.fetchval(
        "record_inbox",
        receipt.message_id,
        receipt.routing_key,
        receipt.body_digest,
        outcome,
        scope.app,
        scope.tenant,
        run_id,
    )
    if recorded is not None:
        return
    before = await con.fetchrow("get_inbox", receipt.message_id)
    if before is None:  # pragma: no cover - the conflicting row cannot vanish inside this transaction
        raise MessageIdConflict(f"message_id {receipt.message_id} is being recorded by another command")
    if before["body_digest"] != receipt.body_digest or before["routing_key"] != receipt.routing_key:
        raise MessageIdConflict(f"message_id {receipt.message_id} was used for a different command")
    raise AlreadyApplied(receipt.message_id, before["outcome"])
