"""A console session's ear on ``intermission.events``: its scopes' notices, run events and refusals, heard
on the person's OWN connection, so the broker itself decides what they may hear (a user confined to scopes
may bind only their keys).

Each event does two things: it wakes the person's open pages (server-sent events, ``Change``), which then
read what changed from the database; and it settles the outcome of a decision the person sent, matched by
``message_id``: the worker's ``run.resumed`` carries the deciding command's id as its ``correlation_id``
(applied), and a ``command.rejected`` names the refused id (refused, with the worker's code and detail).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from aio_pika.abc import AbstractRobustConnection
from pydantic import BaseModel

from intermission.publishers.amqp import TRANSIENT_AMQP_ERRORS
from intermission.publishers.clients import (
    ALL_KINDS,
    HostEvent,
    Received,
    Subscription,
    exclusive_queue_name,
    host_bindings,
)
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Reach
from intermission.schemas.suspension import Notice

log = logging.getLogger("intermission.console")

# What a subscription of a person trusted with every scope binds: every scope's notices, run events and
# refusals (scope parts hold no dots, so each "*" is one part).
EVERY_SCOPE_BINDINGS: dict[str, type[BaseModel]] = {
    "notice.*.*.*": Notice,
    "run.*.*.*": RunEvent,
    "command.rejected.*.*": CommandRejected,
}


@dataclass(frozen=True)
class Change:
    """What a page is told when something in its person's scopes changed: enough to decide whether to
    read again, nothing it could not read itself."""

    kind: str  # "notice", "run" or "rejected"
    what: str  # the reason, the run event's kind, or the refusal's code
    run_id: str | None
    scope: str | None

    def json(self) -> str:
        return json.dumps({"kind": self.kind, "what": self.what, "run_id": self.run_id, "scope": self.scope})


@dataclass(frozen=True)
class Verdict:
    """How the workers answered a command: applied, or refused with a code and detail."""

    applied: bool
    code: str = ""
    detail: str = ""


def bindings_for(reach: Reach) -> dict[str, type[BaseModel]]:
    """The routing keys a session's subscription binds, each with its body type."""
    if reach.every_scope:
        return dict(EVERY_SCOPE_BINDINGS)
    keys: dict[str, type[BaseModel]] = {}
    for scope in reach.scopes:
        keys.update(host_bindings(scope, ALL_KINDS))
    return keys


def decoder(keys: dict[str, type[BaseModel]]) -> Callable[[str, bytes], HostEvent]:
    def decode(routing_key: str, body: bytes) -> HostEvent:
        # By the key's first part: the wildcard bindings of a trusted person name no exact key.
        if routing_key.startswith("notice."):
            return Notice.model_validate_json(body)
        if routing_key.startswith("run."):
            return RunEvent.model_validate_json(body)
        if routing_key.startswith("command.rejected."):
            return CommandRejected.model_validate_json(body)
        raise KeyError(routing_key)

    return decode


class Listener:
    """The subscription of one session, run as a task until ``stop``."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        user: str,
        reach: Reach,
        on_change: Callable[[Change], None],
        on_verdict: Callable[[str, Verdict], None],
    ) -> None:
        self.reach = reach
        self._connection = connection
        self._user = user
        self._on_change = on_change
        self._on_verdict = on_verdict
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name=f"console-listener-{self._user}")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, *TRANSIENT_AMQP_ERRORS):
                await task

    async def _listen(self) -> None:
        keys = bindings_for(self.reach)
        if not keys:
            # Granted nothing: nothing to hear, and nothing it may bind.
            self.ready.set()
            return
        # An exclusive queue named after the person (a confined user may declare only queues named
        # <user>.*), gone with the connection: the console shows the database, so an event missed while
        # nobody listened costs nothing but a live update.
        subscription = Subscription(
            self._connection, keys, decoder(keys), exclusive_queue=exclusive_queue_name(self._user), prefetch=256
        )
        try:
            async with subscription as events:
                self.ready.set()
                async for received in events:
                    self._heard(received)
        except TRANSIENT_AMQP_ERRORS as exc:
            # The connection was closed under it (a revoke closes the person's connections) or the broker
            # refused a binding: the pages still work, without live updates, until the session's grants are
            # read again and a new listener starts.
            log.warning(
                "console listener stopped",
                extra={"action": "console_listener_stopped", "user": self._user, "error": type(exc).__name__},
            )
        finally:
            self.ready.set()

    def _heard(self, received: Received[HostEvent]) -> None:
        event = received.event
        if isinstance(event, Notice):
            self._on_change(Change("notice", event.reason.value, event.run_id, str(event.scope)))
        elif isinstance(event, RunEvent):
            if event.kind is RunEventKind.RESUMED and received.correlation_id:
                self._on_verdict(received.correlation_id, Verdict(applied=True))
            self._on_change(Change("run", event.kind.value, event.run_id, str(event.scope)))
        else:
            self._on_verdict(event.message_id, Verdict(applied=False, code=event.code, detail=event.detail))
            scope = str(event.scope) if event.scope is not None else None
            self._on_change(Change("rejected", event.code, event.run_id, scope))
