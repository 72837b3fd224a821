"""What each command does, given a delivery that passed the envelope checks.

Every handler runs ONE transaction through the store (inbox record, claim, lease, first progress, outbox
event) and returns the run it claimed for this worker, or None when there is nothing to run. Authority is
re-derived here from what the broker vouches for (the message's validated ``user_id``) and from the stored
pause, never from the body's word.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from intermission.consumers.parsing import COMMAND_MODELS, Delivery, parse_body
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    StartCommand,
)
from intermission.schemas.errors import Forbidden, NotSuspended, RunConflict
from intermission.schemas.run import Lease
from intermission.store import Stores
from intermission.store.commands import Claimed, RunDefaults
from intermission.store.inbox import Receipt
from intermission.wire import Command


@dataclass(frozen=True)
class WorkerHooks:
    """What the fleet supplies to the consumers: its lease, its defaults, and where claimed runs go."""

    lease: Callable[[], Lease]
    defaults: RunDefaults
    # The RabbitMQ user whose broker-validated user_id marks a message as the messaging bus's.
    bus_user: str


class StaleExpiry(Exception):
    """An expiry that lost to a resume (or to another sweeper): acknowledge it, nothing to do."""


class CommandHandlers:
    def __init__(self, stores: Stores, hooks: WorkerHooks) -> None:
        self.stores = stores
        self.hooks = hooks

    async def apply(self, command: Command, delivery: Delivery, message_id: str) -> Claimed | None:
        cmd = parse_body(COMMAND_MODELS[command], delivery.body)
        receipt = Receipt.of(message_id, command.value, cmd)
        commands = self.stores.commands
        lease = self.hooks.lease()
        # Events carry the causing command's id as their correlation id.
        cid = message_id
        if command is Command.START:
            return await commands.start(
                cast("StartCommand", cmd), self.hooks.defaults, lease, receipt=receipt, correlation_id=cid
            )
        if command is Command.RESUME:
            return await commands.resume(cast("ResumeCommand", cmd), lease, receipt=receipt, correlation_id=cid)
        if command is Command.DECIDE:
            return await commands.decide(
                cast("DecideCommand", cmd), lease, principal=delivery.user_id, receipt=receipt, correlation_id=cid
            )
        if command is Command.CANCEL:
            return await commands.cancel(cast("CancelCommand", cmd), lease, receipt=receipt, correlation_id=cid)
        if command is Command.EXPIRE:
            try:
                return await commands.expire(cast("ExpireCommand", cmd), lease, receipt=receipt, correlation_id=cid)
            except (NotSuspended, RunConflict) as exc:
                # The pause was answered, cancelled or expired already: the sweeper lost a race it is
                # expected to lose sometimes. Not a refusal of anybody's request.
                raise StaleExpiry(exc.detail) from exc
        return await self.reply(cast("ReplyCommand", cmd), delivery, lease)

    async def reply(self, cmd: ReplyCommand, delivery: Delivery, lease: Lease) -> Claimed | None:
        # RabbitMQ itself checks that a message's user_id is the user that published it, so a host cannot
        # forge the bus's identity; a message without user_id is nobody's.
        if not delivery.user_id or delivery.user_id != self.hooks.bus_user:
            raise Forbidden("only the messaging bus may answer an agent_reply pause (user_id is not the bus user)")
        return await self.stores.commands.reply(cmd, lease, correlation_id=delivery.message_id)
