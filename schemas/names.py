"""Every exchange, queue and routing key of the RabbitMQ contract (DESIGN.md section 5), in one place."""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from intermission.schemas.scope import Scope
from intermission.schemas.suspension import SuspendReason

SCHEMA_VERSION: Final = 1
SCHEMA_VERSION_HEADER: Final = "x-schema-version"
ERROR_HEADER: Final = "x-intermission-error"

COMMANDS_EXCHANGE: Final = "intermission.commands"
EVENTS_EXCHANGE: Final = "intermission.events"
DEAD_EXCHANGE: Final = "intermission.dead"
DEAD_QUEUE: Final = "intermission.dead"


class Command(StrEnum):
    """Command routing keys."""

    START = "run.start"
    RESUME = "run.resume"
    DECIDE = "run.decide"
    REPLY = "run.reply"
    EXPIRE = "run.expire"
    CANCEL = "run.cancel"

    @property
    def queue(self) -> str:
        return COMMAND_QUEUES[self]


COMMAND_QUEUES: Final[dict[Command, str]] = {
    Command.START: "intermission.start",
    Command.RESUME: "intermission.resume",
    Command.DECIDE: "intermission.decide",
    Command.REPLY: "intermission.reply",
    Command.EXPIRE: "intermission.expire",
    Command.CANCEL: "intermission.cancel",
}


class RunEventKind(StrEnum):
    """The ``run.<kind>`` events a run's changes publish."""

    RESUMED = "resumed"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


def notice_key(reason: SuspendReason, scope: Scope) -> str:
    return f"notice.{reason.value}.{scope.routing_suffix()}"


def notice_binding(reason: SuspendReason) -> str:
    """Every scope's notices of one reason, as a topic binding (scope parts hold no dots)."""
    return f"notice.{reason.value}.*.*"


def run_event_key(kind: RunEventKind, scope: Scope) -> str:
    return f"run.{kind.value}.{scope.routing_suffix()}"


def rejected_key(scope: Scope | None) -> str:
    # A command whose scope could not be read is rejected under a placeholder scope, so a subscriber
    # of command.rejected.# still hears it.
    suffix = scope.routing_suffix() if scope is not None else "_._"
    return f"command.rejected.{suffix}"
