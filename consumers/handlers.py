"""What each command does, given a delivery that passed the envelope checks.

Each command has a route: the strict model its body must parse as, and the handler that applies it. Every
handler runs ONE transition through the store (inbox record, claim, lease, first progress, outbox event)
and returns the run it claimed for this worker, or None when there is nothing to run. Authority is
re-derived here from what the broker vouches for (the message's validated ``user_id``, the scope its
routing key names, which the broker's topic permissions confine) and from the stored pause, never from the
body's word.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from intermission.consumers.command_spans import transaction_span
from intermission.consumers.parsing import Delivery, check_key_scope, parse_body
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    ScopedCommand,
    StartCommand,
)
from intermission.schemas.errors import Forbidden, NotSuspended, RunConflict
from intermission.schemas.run import Lease
from intermission.store import Stores
from intermission.store.commands import AnswerRequest, Claimed, RunDefaults
from intermission.store.inbox import Receipt
from intermission.wire import Command

C = TypeVar("C", bound=ScopedCommand)


@dataclass(frozen=True)
class WorkerHooks:
    """What the fleet supplies to the consumers: its lease, its defaults, and where claimed runs go."""

    lease: Callable[[], Lease]
    defaults: RunDefaults
    # The RabbitMQ user whose broker-validated user_id marks a message as the messaging bus's.
    bus_user: str


class StaleExpiry(Exception):
    """An expiry that lost to a resume (or to another sweeper): acknowledge it, nothing to do."""


@dataclass(frozen=True)
class Applying:
    """One delivery on its way through its handler."""

    delivery: Delivery
    message_id: str
    receipt: Receipt
    lease: Lease


@dataclass(frozen=True)
class Route(Generic[C]):
    """A command's body model and the handler that applies a body of it."""

    model: type[C]
    handle: Callable[[CommandHandlers, C, Applying], Awaitable[Claimed | None]]

    def parse(
        self, handlers: CommandHandlers, command: Command, delivery: Delivery, message_id: str
    ) -> tuple[C, Applying]:
        """The body as its strict model, checked against the key's scope, with its receipt and lease."""
        body = parse_body(self.model, delivery.body)
        check_key_scope(command, delivery.routing_key, body.scope)
        return body, Applying(delivery, message_id, Receipt.of(message_id, command.value, body), handlers.hooks.lease())

    async def apply(
        self, handlers: CommandHandlers, command: Command, delivery: Delivery, message_id: str
    ) -> Claimed | None:
        body, applying = self.parse(handlers, command, delivery, message_id)
        return await self.handle(handlers, body, applying)


# The commands that answer a pause through one read and one claim (``CommandStore.answer``): those that
# arrive together go through one read and one claim for all (``answer_batch``; group commit).
BATCHED: frozenset[Command] = frozenset({Command.RESUME, Command.DECIDE, Command.EXPIRE})


class CommandHandlers:
    def __init__(self, stores: Stores, hooks: WorkerHooks) -> None:
        self.stores = stores
        self.hooks = hooks

    async def apply(self, command: Command, delivery: Delivery, message_id: str) -> Claimed | None:
        route: Route[Any] = ROUTES[command]
        with transaction_span(command):
            return await route.apply(self, command, delivery, message_id)

    def prepare(self, command: Command, delivery: Delivery, message_id: str) -> AnswerRequest:
        """A BATCHED command, parsed and checked as ``apply`` would, as the request for ``answer_batch``."""
        route: Route[Any] = ROUTES[command]
        body, a = route.parse(self, command, delivery, message_id)
        commands = self.stores.commands
        if command is Command.RESUME:
            return commands.resume_request(body, a.lease, receipt=a.receipt, correlation_id=message_id)
        if command is Command.DECIDE:
            return commands.decide_request(
                body, a.lease, principal=delivery.user_id, receipt=a.receipt, correlation_id=message_id
            )
        if command is Command.EXPIRE:
            return commands.expire_request(body, a.lease, receipt=a.receipt, correlation_id=message_id)
        raise ValueError(f"{command.value} is not applied in batches")

    async def answer_batch(self, batch: list[tuple[Command, AnswerRequest]]) -> list[Claimed | Exception]:
        """Apply prepared commands together (``CommandStore.answer_all``); each outcome is the command's own,
        as ``apply`` would have returned or raised it."""
        outcomes = await self.stores.commands.answer_all([request for _, request in batch])
        return [
            _stale(outcome) if command is Command.EXPIRE else outcome
            for (command, _), outcome in zip(batch, outcomes, strict=True)
        ]

    # Events carry the causing command's id as their correlation id.

    async def start(self, cmd: StartCommand, a: Applying) -> Claimed | None:
        return await self.stores.commands.start(
            cmd, self.hooks.defaults, a.lease, receipt=a.receipt, correlation_id=a.message_id
        )

    async def resume(self, cmd: ResumeCommand, a: Applying) -> Claimed | None:
        return await self.stores.commands.resume(cmd, a.lease, receipt=a.receipt, correlation_id=a.message_id)

    async def decide(self, cmd: DecideCommand, a: Applying) -> Claimed | None:
        return await self.stores.commands.decide(
            cmd, a.lease, principal=a.delivery.user_id, receipt=a.receipt, correlation_id=a.message_id
        )

    async def cancel(self, cmd: CancelCommand, a: Applying) -> Claimed | None:
        return await self.stores.commands.cancel(cmd, a.lease, receipt=a.receipt, correlation_id=a.message_id)

    async def expire(self, cmd: ExpireCommand, a: Applying) -> Claimed | None:
        try:
            return await self.stores.commands.expire(cmd, a.lease, receipt=a.receipt, correlation_id=a.message_id)
        except (NotSuspended, RunConflict) as exc:
            raise StaleExpiry(exc.detail) from exc

    async def reply(self, cmd: ReplyCommand, a: Applying) -> Claimed | None:
        # RabbitMQ itself checks that a message's user_id is the user that published it, so a host cannot
        # forge the bus's identity; a message without user_id is nobody's.
        if not a.delivery.user_id or a.delivery.user_id != self.hooks.bus_user:
            raise Forbidden("only the messaging bus may answer an agent_reply pause (user_id is not the bus user)")
        return await self.stores.commands.reply(cmd, a.lease, receipt=a.receipt, correlation_id=a.delivery.message_id)


def _stale(outcome: Claimed | Exception) -> Claimed | Exception:
    """An expiry refused because the pause was answered, cancelled or expired already: the sweeper lost a
    race it is expected to lose sometimes. Not a refusal of anybody's request."""
    if isinstance(outcome, NotSuspended | RunConflict):
        stale = StaleExpiry(outcome.detail)
        stale.__cause__ = outcome
        return stale
    return outcome


ROUTES: dict[Command, Route[Any]] = {
    Command.START: Route(StartCommand, CommandHandlers.start),
    Command.RESUME: Route(ResumeCommand, CommandHandlers.resume),
    Command.DECIDE: Route(DecideCommand, CommandHandlers.decide),
    Command.REPLY: Route(ReplyCommand, CommandHandlers.reply),
    Command.EXPIRE: Route(ExpireCommand, CommandHandlers.expire),
    Command.CANCEL: Route(CancelCommand, CommandHandlers.cancel),
}
