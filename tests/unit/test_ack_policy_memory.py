"""THE ack policy (``consumers/policy.py``) on the in-memory engine: what it does with each kind of outcome
of a command's transaction. A command applied is acknowledged (after its commit) and its run handed to the
fleet; a redelivery is acknowledged with no second effect; a refusal is published (the dead copy with its
code, then ``command.rejected``) and only then acknowledged; a transient failure holds the delivery and is
retried, and one that outlasts the window goes back to its queue; a handler's bug goes back to its queue.

The broker is faked only as far as the policy touches it: a delivery that records how it was settled, and
exchanges that record what was published to them. What the broker itself does with such outcomes (delivery
limits, dead-lettering) is ``tests/integration/test_ack_policy.py``'s. No I/O."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import aio_pika
import pytest
from aio_pika.abc import AbstractExchange, AbstractIncomingMessage

from intermission.consumers.handlers import CommandHandlers
from intermission.consumers.policy import AckPolicy
from intermission.consumers.rejection import Rejecter
from intermission.engine.commands import Claimed
from intermission.engine.committer import Batch, Outs
from intermission.engine.memory import InMemoryCommitter
from intermission.engine.observer import Quiet
from intermission.engine.starts import START
from intermission.schemas.errors import StoreUnavailable
from intermission.schemas.events import CommandRejected
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import SuspendReason
from intermission.wire import ERROR_HEADER, SCHEMA_VERSION, SCHEMA_VERSION_HEADER, Command, rejected_key
from tests.support.conformance import (
    LEASE,
    OWNER,
    SCOPE,
    MemoryWorld,
    forbid_sockets,
    inbox_of,
    pin,
    run_row,
    stored_pause,
)
from tests.support.conformance import paused as paused_run

T = TypeVar("T")


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_sockets(monkeypatch)


# --- the broker, as far as the policy touches it ------------------------------------------------------


class Channel:
    """A delivery's channel: open, and weak-referenceable (the acknowledgements key their tags by it)."""

    is_closed = False


@dataclass
class Delivered:
    """One delivery of a command, recording how the policy settled it."""

    body: bytes
    message_id: str | None
    routing_key: str
    delivery_tag: int
    channel: Channel
    headers: dict[str, Any] = field(default_factory=lambda: {SCHEMA_VERSION_HEADER: SCHEMA_VERSION})
    user_id: str | None = None
    correlation_id: str | None = None
    redelivered: bool = False
    processed: bool = False
    settled: list[str] = field(default_factory=list)
    # What the broker heard, in order, from every delivery and exchange of the worker.
    log: list[str] = field(default_factory=list)

    def _settle(self, how: str) -> None:
        self.settled.append(how)
        self.log.append(f"{how} {self.message_id}")
        self.processed = True

    async def ack(self, multiple: bool = False) -> None:
        self._settle("ack-multiple" if multiple else "ack")

    async def nack(self, requeue: bool = True) -> None:
        self._settle("requeue" if requeue else "nack")

    async def reject(self, requeue: bool = False) -> None:
        self._settle("reject-requeue" if requeue else "reject")


class Exchange:
    """An exchange that keeps what is published to it, confirmed at once."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.published: list[tuple[str, aio_pika.Message]] = []

    async def publish(self, message: aio_pika.Message, routing_key: str, **_: Any) -> None:
        self.published.append((routing_key, message))
        self.log.append(f"{self.name} {message.message_id}")


class Fleet:
    """Where claimed runs go: kept."""

    def __init__(self) -> None:
        self.runs: list[Claimed] = []

    def submit(self, claimed: Claimed) -> None:
        self.runs.append(claimed)


class Settled(Quiet):
    """The policy's observer: every settled delivery's outcome and code."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str, str]] = []

    def settled(self, command: str, outcome: str, code: str) -> None:
        self.outcomes.append((command, outcome, code))


class Flaky:
    """A committer that fails its first ``failures`` statements as a database away would."""

    def __init__(self, inner: InMemoryCommitter, failures: int) -> None:
        self.inner = inner
        self.failures = failures

    async def commit(self, batch: Batch, decode: Callable[[Outs], T]) -> T:
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("the database went away")
        return await self.inner.commit(batch, decode)


class Broken(CommandHandlers):
    """Handlers whose application has a bug: not a refusal, not an outage."""

    async def apply(self, command: Command, operation: Any) -> Claimed | None:
        raise ZeroDivisionError("a handler's bug")


@dataclass
class Worker:
    world: MemoryWorld
    policy: AckPolicy
    fleet: Fleet
    events: Exchange
    dead: Exchange
    observer: Settled
    log: list[str]
    channel: Channel = field(default_factory=Channel)
    tags: int = 0

    def delivery(
        self, command: Command, body: dict[str, Any], message_id: str | None = "m-1", **changes: Any
    ) -> Delivered:
        self.tags += 1
        return Delivered(
            body=json.dumps(body).encode(),
            message_id=message_id,
            routing_key=changes.pop("routing_key", command.value),
            delivery_tag=self.tags,
            channel=self.channel,
            log=self.log,
            **changes,
        )

    async def process(self, command: Command, delivered: Delivered) -> None:
        await self.policy.process(cast("AbstractIncomingMessage", delivered), command)

    def refusals(self) -> list[CommandRejected]:
        return [CommandRejected.model_validate_json(m.body) for _, m in self.events.published]


def worker(
    *, failures: int = 0, retry_seconds: float = 5.0, handlers: type[CommandHandlers] = CommandHandlers
) -> Worker:
    memory = InMemoryCommitter()
    world = MemoryWorld(Flaky(memory, failures), memory, lease=LEASE)
    log: list[str] = []
    events, dead, fleet, observer = Exchange("events", log), Exchange("dead", log), Fleet(), Settled()
    policy = AckPolicy(
        handlers(world.engine, bus_user="bus"),
        Rejecter(cast("AbstractExchange", events), cast("AbstractExchange", dead)),
        fleet,
        retry_seconds=retry_seconds,
        max_backoff_seconds=0.01,
        observer=observer,
    )
    return Worker(world, policy, fleet, events, dead, observer, log)


def start_body(run_id: str = "r1", scope: Scope = SCOPE, **changes: Any) -> dict[str, Any]:
    return {"scope": {"app": scope.app, "tenant": scope.tenant}, "run_id": run_id, "agent_id": "demo"} | changes


# --- the cases ---------------------------------------------------------------------------------------------


async def test_a_command_applied_is_acknowledged_after_its_commit_and_its_run_handed_to_the_fleet() -> None:
    w = worker()
    delivered = w.delivery(Command.START, start_body(input="hi"))
    await w.process(Command.START, delivered)
    assert delivered.settled == ["ack"]
    [claimed] = w.fleet.runs
    assert (claimed.run.id, claimed.run.lease_owner, claimed.correlation_id) == ("r1", OWNER, "m-1")
    row = await run_row(w.world, SCOPE, "r1")
    assert row is not None
    assert (row["state"], row["input"]) == ("running", "hi")
    recorded = await inbox_of(w.world, SCOPE, "m-1")
    assert recorded is not None
    assert recorded["routing_key"] == "run.start"
    assert w.observer.outcomes == [("run.start", "applied", "")]
    assert w.events.published == w.dead.published == []


async def test_a_redelivered_command_is_acknowledged_with_no_second_effect() -> None:
    w = worker()
    await w.process(Command.START, w.delivery(Command.START, start_body()))
    again = w.delivery(Command.START, start_body(), redelivered=True)
    await w.process(Command.START, again)
    assert again.settled == ["ack"]
    assert len(w.fleet.runs) == 1
    assert w.observer.outcomes[-1] == ("run.start", "duplicate", "")
    assert w.events.published == []


async def test_a_refusal_is_published_dead_copy_first_then_acknowledged() -> None:
    w = worker()
    await paused_run(w.world)
    await w.process(Command.START, w.delivery(Command.START, start_body("r3"), message_id="m-0"))
    # Another body under a message_id already recorded: message_id_conflict.
    conflicting = w.delivery(Command.START, start_body("r2"), message_id="m-0")
    await w.process(Command.START, conflicting)
    # A resume pinned to a revision the run is not at: run_conflict, and nothing of it written.
    p = await stored_pause(w.world, SCOPE, "r1")
    assert p is not None
    stale = {
        "scope": {"app": SCOPE.app, "tenant": SCOPE.tenant},
        "version": {"run_id": "r1", "suspension_id": p.id, "run_revision": 0},
        "results": [{"call_id": "c1", "content": "42"}],
    }
    resume = w.delivery(Command.RESUME, stale, message_id="m-2")
    await w.process(Command.RESUME, resume)
    # Each refused command is kept (its dead copy) before its sender hears of it, and acknowledged last.
    assert w.log == [
        "ack m-0",
        "dead m-0",
        "events rejected:m-0",
        "ack m-0",
        "dead m-2",
        "events rejected:m-2",
        "ack m-2",
    ]
    assert [(r.code, r.message_id, r.run_id, r.scope) for r in w.refusals()] == [
        ("message_id_conflict", "m-0", "r2", SCOPE),
        ("run_conflict", "m-2", "r1", SCOPE),
    ]
    assert [key for key, _ in w.events.published] == [rejected_key(SCOPE)] * 2
    assert [(key, m.headers[ERROR_HEADER], m.body) for key, m in w.dead.published] == [
        ("run.start", "message_id_conflict", conflicting.body),
        ("run.resume", "run_conflict", resume.body),
    ]
    assert await inbox_of(w.world, SCOPE, "m-2") is None
    row = await run_row(w.world, SCOPE, "r1")
    assert row is not None
    assert row["state"] == "paused"
    assert [o for o in w.observer.outcomes if o[1] == "rejected"] == [
        ("run.start", "rejected", "message_id_conflict"),
        ("run.resume", "rejected", "run_conflict"),
    ]


async def test_an_envelope_refused_reads_nothing() -> None:
    w = worker()
    unversioned = w.delivery(Command.START, start_body(), headers={})
    nameless = w.delivery(Command.START, start_body(), message_id=None)
    forged = w.delivery(Command.START, start_body(), routing_key=f"run.start.{SCOPE.app}.other")
    for delivered in (unversioned, nameless, forged):
        await w.process(Command.START, delivered)
        assert delivered.settled == ["ack"]
    assert [r.code for r in w.refusals()] == ["unsupported_schema_version", "invalid_message", "forbidden"]
    # Refused on the envelope alone: not one statement ran.
    assert w.world.memory.statements == {}


async def test_a_reply_from_anyone_but_the_bus_is_forbidden() -> None:
    w = worker()
    p = await paused_run(w.world, reason=SuspendReason.AGENT_REPLY)
    body = {
        "scope": {"app": SCOPE.app, "tenant": SCOPE.tenant},
        "version": pin(p).model_dump(),
        "reply_with": "ask-1",
        "input": "yes",
    }
    forged = w.delivery(Command.REPLY, body, user_id="host")
    await w.process(Command.REPLY, forged)
    assert [r.code for r in w.refusals()] == ["forbidden"]
    from_the_bus = w.delivery(Command.REPLY, body, message_id="m-2", user_id="bus")
    await w.process(Command.REPLY, from_the_bus)
    assert from_the_bus.settled == ["ack"]
    [claimed] = w.fleet.runs
    assert claimed.suspension == p.suspension


async def test_a_stale_expiry_is_acknowledged() -> None:
    w = worker()
    p = await paused_run(w.world)
    body = {
        "scope": {"app": SCOPE.app, "tenant": SCOPE.tenant},
        "version": pin(p).model_dump(),
        "expired_by": "9999-01-01T00:00:00Z",
    }
    expiry = w.delivery(Command.EXPIRE, body)
    await w.process(Command.EXPIRE, expiry)
    assert expiry.settled == ["ack"]
    assert w.observer.outcomes == [("run.expire", "stale", "")]
    assert w.events.published == []
    assert w.fleet.runs == []


async def test_a_passing_outage_holds_the_delivery_and_applies_it_once() -> None:
    w = worker(failures=3)
    delivered = w.delivery(Command.START, start_body())
    await w.process(Command.START, delivered)
    assert delivered.settled == ["ack"]
    assert len(w.fleet.runs) == 1
    assert w.observer.outcomes == [("run.start", "applied", "")]
    assert w.policy.availability.is_clear


async def test_an_outage_that_outlasts_the_window_returns_the_command_to_its_queue() -> None:
    w = worker(failures=10_000, retry_seconds=0.05)
    delivered = w.delivery(Command.START, start_body())
    await w.process(Command.START, delivered)
    assert delivered.settled == ["requeue"]
    assert w.observer.outcomes == [("run.start", "requeued", "store_unavailable")]
    assert w.fleet.runs == []
    assert w.events.published == []


async def test_a_handler_s_bug_returns_the_command_to_its_queue() -> None:
    w = worker(handlers=Broken)
    delivered = w.delivery(Command.START, start_body())
    await w.process(Command.START, delivered)
    assert delivered.settled == ["requeue"]
    assert w.observer.outcomes == [("run.start", "requeued", "handler_error")]


async def test_commands_delivered_together_commit_in_one_batch_and_are_acknowledged_in_one_frame() -> None:
    w = worker()
    delivered = [w.delivery(Command.START, start_body(f"r{i}"), message_id=f"m-{i}") for i in range(3)]
    await asyncio.gather(*(w.process(Command.START, d) for d in delivered))
    assert w.world.engine.scheduler.sizes(START) == [3]
    assert [d.settled for d in delivered] == [[], [], ["ack-multiple"]]
    assert (w.policy.acks.frames, w.policy.acks.acknowledged) == (1, 3)
    assert sorted(c.run.id for c in w.fleet.runs) == ["r0", "r1", "r2"]
