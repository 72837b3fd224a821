"""Intermission: durable pauses and exactly-once resumes for AI agent runs, on PostgreSQL and RabbitMQ.

What a host or the messaging bus needs is importable from here::

    from intermission import HostClient, Scope, StartCommand

The layers, each a subpackage: ``schemas`` (domain types, command and event bodies, errors), ``wire`` (the
RabbitMQ contract) and ``tracing`` (trace context across messages), ``store`` (PostgreSQL), ``consumers``
(the command queues), ``publishers`` (outbox relay, expiry sweeper, clients), ``fleet`` (the worker
runtime), ``agent`` (executors: the agent loop, models, tools) and ``ops`` (the CLI, the demo, metrics).
``docs/architecture.md`` draws how they fit.
"""

from __future__ import annotations

from intermission.publishers.clients import BusClient, EventKind, HostClient, Received, Subscription, version_of
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    StartCommand,
    ToolAnswer,
)
from intermission.schemas.config import RunConfig
from intermission.schemas.errors import IntermissionError, PermanentError, TransientError
from intermission.schemas.events import CommandRejected, RunEvent
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Notice, PendingCall, SuspendReason

__all__ = [
    "BusClient",
    "CancelCommand",
    "ClaimVersion",
    "CommandRejected",
    "DecideCommand",
    "Decision",
    "EventKind",
    "ExpireCommand",
    "HostClient",
    "IntermissionError",
    "Notice",
    "PendingCall",
    "PermanentError",
    "Received",
    "ReplyCommand",
    "ResumeCommand",
    "RunConfig",
    "RunEvent",
    "Scope",
    "StartCommand",
    "Subscription",
    "SuspendReason",
    "ToolAnswer",
    "TransientError",
    "version_of",
]
