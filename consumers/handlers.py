"""From a delivery that passed the envelope checks to the engine operation it asks for.

Each command has a route: the strict model its body must parse as, and the engine operation that applies
a body of it (``engine/commands.py``). The body is parsed ONCE, here, into its model; its scope is checked
once, against the scope its routing key names (the broker's topic permissions confine which keys a host
may publish); its inbox receipt is made once, from the parsed body. Authority is re-derived from what the
broker vouches for (the message's validated ``user_id``) and, in the engine, from the stored pause, never
from the body's word. The lease a claim takes is the engine's, taken at claim time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from intermission.consumers.command_spans import transaction_span
from intermission.consumers.parsing import Delivery, check_key_scope, parse_body
from intermission.engine.commands import Cancel, Claimed, Decide, Expire, Reply, Resume, Start
from intermission.engine.core import Engine
from intermission.engine.transition import Applicable
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    ScopedCommand,
    StartCommand,
)
from intermission.schemas.errors import Forbidden
from intermission.store.inbox import Receipt
from intermission.wire import Command

C = TypeVar("C", bound=ScopedCommand)

# What a route makes of a parsed body: the operation, given the delivery (who sent it), its receipt, and
# the messaging bus's user.
Make = Callable[[C, Delivery, Receipt, str], Applicable[Claimed | None]]


@dataclass(frozen=True)
class Route(Generic[C]):
    """A command's body model and the operation that applies a body of it."""

    model: type[C]
    make: Make[C]


def _start(cmd: StartCommand, d: Delivery, receipt: Receipt, bus: str) -> Applicable[Claimed | None]:
    # Events carry the causing command's id as their correlation id.
    return Start(cmd, receipt, d.message_id)


def _resume(cmd: ResumeCommand, d: Delivery, receipt: Receipt, bus: str) -> Applicable[Claimed | None]:
    return Resume(cmd, receipt=receipt, correlation_id=d.message_id)


def _decide(cmd: DecideCommand, d: Delivery, receipt: Receipt, bus: str) -> Applicable[Claimed | None]:
    # The decider is the broker-validated sender, never the body's word.
    return Decide(cmd, d.user_id, receipt=receipt, correlation_id=d.message_id)


def _expire(cmd: ExpireCommand, d: Delivery, receipt: Receipt, bus: str) -> Applicable[Claimed | None]:
    return Expire(cmd, receipt=receipt, correlation_id=d.message_id)


def _cancel(cmd: CancelCommand, d: Delivery, receipt: Receipt, bus: str) -> Applicable[Claimed | None]:
    return Cancel(cmd, receipt, d.message_id)


def _reply(cmd: ReplyCommand, d: Delivery, receipt: Receipt, bus: str) -> Applicable[Claimed | None]:
    # RabbitMQ itself checks that a message's user_id is the user that published it, so a host cannot forge
    # the bus's identity; a message without user_id is nobody's.
    if not d.user_id or d.user_id != bus:
        raise Forbidden("only the messaging bus may answer an agent_reply pause (user_id is not the bus user)")
    return Reply(cmd, receipt, d.message_id)


ROUTES: dict[Command, Route[Any]] = {
    Command.START: Route(StartCommand, _start),
    Command.RESUME: Route(ResumeCommand, _resume),
    Command.DECIDE: Route(DecideCommand, _decide),
    Command.REPLY: Route(ReplyCommand, _reply),
    Command.EXPIRE: Route(ExpireCommand, _expire),
    Command.CANCEL: Route(CancelCommand, _cancel),
}


class CommandHandlers:
    """Deliveries to engine operations, and their application in the command's transaction span."""

    def __init__(self, engine: Engine, *, bus_user: str) -> None:
        self.engine = engine
        # The RabbitMQ user whose broker-validated user_id marks a message as the messaging bus's.
        self.bus_user = bus_user

    def operation(self, command: Command, delivery: Delivery, message_id: str) -> Applicable[Claimed | None]:
        """The delivery's body parsed as its command's strict model, checked against its key's scope, with
        its receipt (the inbox's idempotency key: the body's scope, its message_id and its digest)."""
        route: Route[Any] = ROUTES[command]
        body = parse_body(route.model, delivery.body)
        check_key_scope(command, delivery.routing_key, body.scope)
        return route.make(body, delivery, Receipt.of(message_id, command.value, body), self.bus_user)

    async def apply(self, command: Command, operation: Applicable[Claimed | None]) -> Claimed | None:
        """Apply ``operation``: the run it claimed for this worker, None when there is nothing to run, or its
        typed refusal raised."""
        started = time.perf_counter()
        try:
            with transaction_span(command):
                return await self.engine.apply(operation)
        finally:
            self.engine.observer.applied(command.value, time.perf_counter() - started)
