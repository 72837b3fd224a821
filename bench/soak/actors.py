"""The simulated outside world, each part a RabbitMQ user of its own (``env.py``): one host per scope,
confined to it by the broker, that starts that scope's runs and answers their notices; two approvers,
confined to the scopes they approve in, who decide approvals; a bus that answers agent asks (the
configured bus user, trusted with every scope); and "mallory", a host confined to a scope of its own, who
is neither bus nor approver and reaches for the other tenants' pauses.

Everything travels through the product's own clients (``publishers/clients.py``) over RabbitMQ, keyed
``run.<command>.<app>.<tenant>`` for the body's scope; only the malformed and hostile commands and
mallory's mismatched ones are hand-built, keyed for the publisher's own scope (a confined user may publish
nothing else). Every command is recorded in the ledger with what it must lead to (see ``ledger.Expect``)
BEFORE it is published, and published with retries under the SAME message id until the broker confirms
it, or refuses it (ACCESS_REFUSED), which only mallory's commands keyed for another scope expect.

Mallory's reach for another tenant takes three forms: a command keyed for the victim's scope (the broker
refuses the publish), one keyed for its own scope with the victim's body (the worker refuses it
``forbidden`` and tells mallory's scope, never the victim's), and the victim's run named in mallory's own
scope (``not_suspended``: scope is exact in every query).

Command faults that need a live pause (a forged reply, a decision by a non-approver, an answer at a
foreign scope...) are "wishes": the fault injector posts them and the next suitable notice takes one. The
bad command goes first; the legit answer is held back until its refusal is seen (or 20 s passed, after
which the refusal may also name the state the legit answer left), so every refusal's code is known.

A tenant's flood (``tenant_flood``) is the flooder's: confined to a scope of its own with a quota of live
runs, it publishes a burst of starts at once, each expected either applied (a run that pauses and is left
paused, so the scope stays at its quota) or refused ``quota_exceeded``; right behind the burst, the host of
another scope starts a probe run, whose wait for its first Notice the checker holds to a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractRobustConnection

from bench.soak.env import APPROVER_ROLES, FLOODER, MALLORY, SoakEnv
from bench.soak.ledger import Expect, Fate, FloodRecord, Ledger, RunPlan, SentCommand, seeded
from bench.soak.observe import Observer
from bench.soak.scripts import Chosen, flooded, probe
from intermission.publishers.amqp import RETRYABLE, ConfirmingPublisher, PublishFailed, connect
from intermission.publishers.clients import BusClient, HostClient, HostEvent, Subscription, version_of
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    Decision,
    ReplyCommand,
    ResumeCommand,
    ScopedCommand,
    StartCommand,
    ToolAnswer,
)
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import MAX_RESUME_INPUT_BYTES, ClaimVersion, Notice, SuspendReason
from intermission.wire import (
    COMMANDS_EXCHANGE,
    DETAIL_HEADER,
    ERROR_HEADER,
    ORIGINAL_KEY_HEADER,
    SCHEMA_VERSION,
    SCHEMA_VERSION_HEADER,
    Command,
    HeaderValue,
    message,
)
from tests.support.hostile import RawText, allow_raw_fields, nested, nested_table, padded_id

log = logging.getLogger("soak.actors")

FOREIGN_APP = "soak-foreign"
# Marks every forged or foreign payload: if one ever reaches a run, the checker finds it.
FORGED = "FORGED"
REFUSAL_WAIT = 20.0
EFFECT_WAIT = 20.0
# The over-17-MiB body the consumer refuses before parsing it (consumers.parsing.MAX_BODY_BYTES + 1).
OVERSIZED_BODY_BYTES = 17 * 1024 * 1024 + 1
STATE_CODES = frozenset({"not_suspended", "run_conflict"})
# What a flood's start may be refused for: its scope is at its quota of live runs.
QUOTA_CODES = frozenset({"quota_exceeded"})

# Fault kinds the actors carry out at a notice (PRE: before the legit answer; POST: after it), at the end
# of a run (END), or at once (DIRECT).
PRE_KINDS = frozenset(
    {
        "foreign_scope_command",
        "cross_tenant_key",
        "cross_tenant_body",
        "forged_dead_letter",
        "non_bus_reply",
        "non_approver_decision",
        "wrong_authority",
        "results_mismatch",
        "oversized_command",
        "reordered_commands",
    }
)
POST_KINDS = frozenset({"duplicate_command", "message_id_conflict"})
# Mallory's reach for another tenant's pause (see the module's docstring).
CROSS_TENANT_KINDS = frozenset({"foreign_scope_command", "cross_tenant_key", "cross_tenant_body", "forged_dead_letter"})
END_KINDS = frozenset({"run_exists", "cancel_ended"})
MALFORMED_VARIANTS = (
    "not_json",
    "wrong_shape",
    "unknown_field",
    "bad_scope",
    "no_schema_version",
    "wrong_schema_version",
    "json_array",
    "scope_mismatch",
)
# What a foreign or broken client can send that once left a delivery unsettled, or let a command fail in
# the database instead of being refused: each must come back refused with its code.
HOSTILE_VARIANTS = (
    "nested_deep",
    "long_message_id",
    "header_not_utf8",
    "revision_past_64_bits",
    "nan_in_arguments",
)
# Headers that once took a worker's whole connection down, each a fault kind of its own: a table nested
# 500 deep (the client's decoder recursed past Python's limit), and one filling nearly a frame (the refusal's
# dead copy, its headers plus the refusal's, went past the frame and the broker closed the connection).
HEADER_VARIANTS = ("nested_header", "near_frame_header")
# The header near_frame_header fills: the broker takes it (a frame is 128 KiB), the worker refuses it.
NEAR_FRAME_HEADER_BYTES = 130_000
# The raw senders put hand-built header tables on the wire (nested_header).
allow_raw_fields()

Client = HostClient | BusClient
# What the harness's sender retries: the broker or the connection away (aio-pika's "Connection was not
# opened" is a RuntimeError).
SENDER_RETRIES: tuple[type[BaseException], ...] = (*RETRYABLE, RuntimeError)


@dataclass(frozen=True)
class Answer:
    client: Client
    command: Command
    body: ScopedCommand
    sender: str


class Actors:
    """The outside world's connections and clients, each as its own RabbitMQ user."""

    def __init__(self, env: SoakEnv) -> None:
        self.env = env
        self.connections: list[AbstractRobustConnection] = []
        # The host of each scope, confined to it, and its publisher of hand-built commands (keyed for it).
        self.hosts: dict[Scope, HostClient] = {}
        self.raw: dict[Scope, ConfirmingPublisher] = {}
        self.raw_users: dict[Scope, str] = {}
        self.approvers: dict[str, HostClient] = {}
        self.mallory: HostClient
        self.mallory_user = env.user(MALLORY)
        self.mallory_scope = env.mallory_scope
        self.mallory_connection: AbstractRobustConnection
        # Mallory's hand-built commands: keyed for its own scope, with another tenant's body.
        self.mallory_raw: ConfirmingPublisher
        self.bus: BusClient
        # The flooding tenant (``tenant_flood``), confined to its own scope.
        self.flooder: HostClient
        self.flood_scope = env.flood_scope
        # Replies published by users who are NOT the bus, though the broker lets them publish for the run's
        # scope (its host, an approver): the worker must refuse them.
        self.host_as_bus: dict[Scope, BusClient] = {}
        self.approver_as_bus: dict[str, BusClient] = {}

    async def _connect(self, role: str) -> AbstractRobustConnection:
        connection = await connect(self.env.amqp_url(role), f"soak {role}", reconnect_interval=0.5)
        self.connections.append(connection)
        return connection

    @classmethod
    async def open(cls, env: SoakEnv) -> Actors:
        self = cls(env)
        for scope, role in env.host_roles():
            connection = await self._connect(role)
            self.hosts[scope] = HostClient(connection, user_id=env.user(role))
            self.host_as_bus[scope] = BusClient(connection, user_id=env.user(role))
            self.raw[scope] = ConfirmingPublisher(connection, COMMANDS_EXCHANGE, mandatory=True, timeout=10.0)
            self.raw_users[scope] = env.user(role)
        for role in APPROVER_ROLES:
            name = env.user(role)
            connection = await self._connect(role)
            self.approvers[name] = HostClient(connection, user_id=name)
            self.approver_as_bus[name] = BusClient(connection, user_id=name)
        self.mallory_connection = await self._connect(MALLORY)
        self.mallory = HostClient(self.mallory_connection, user_id=self.mallory_user)
        self.mallory_raw = ConfirmingPublisher(self.mallory_connection, COMMANDS_EXCHANGE, mandatory=True, timeout=10.0)
        self.bus = BusClient(await self._connect("bus"), user_id=env.user("bus"))
        self.flooder = HostClient(await self._connect(FLOODER), user_id=env.user(FLOODER))
        return self

    def mallory_alone(self) -> HostClient:
        """A client of mallory's on a channel of its own: the broker closes the channel of a publish it
        refuses, which would fail whatever else was in flight on it."""
        return HostClient(self.mallory_connection, user_id=self.mallory_user)

    async def close(self) -> None:
        clients: list[Client] = [
            *self.hosts.values(),
            *self.approvers.values(),
            self.mallory,
            self.bus,
            self.flooder,
            *self.host_as_bus.values(),
            *self.approver_as_bus.values(),
        ]
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        for publisher in (*self.raw.values(), self.mallory_raw):
            with contextlib.suppress(Exception):
                await publisher.close()
        for connection in self.connections:
            with contextlib.suppress(Exception):
                await connection.close()


def broker_refusal(error: BaseException) -> str | None:
    """The broker's ACCESS_REFUSED behind a failed publish (the user may not publish that key), if it is one:
    no retry cures it."""
    cause = error.__cause__ if isinstance(error, PublishFailed) else error
    if isinstance(cause, aiormq.exceptions.ChannelAccessRefused):
        return str(cause)
    return None


class Sender:
    """Publishes with confirms, retrying under the same message id until confirmed, refused by the broker
    (ACCESS_REFUSED, recorded: no retry cures it) or ``give_up_at``."""

    def __init__(self, give_up_at: Callable[[], float]) -> None:
        self.give_up_at = give_up_at
        self.retries = 0

    async def _retry(self, attempt: Callable[[], Awaitable[Any]], record: SentCommand) -> None:
        delay = 0.2
        while True:
            try:
                await attempt()
            except asyncio.CancelledError:
                raise
            except SENDER_RETRIES as exc:
                refused = broker_refusal(exc)
                if refused is not None:
                    record.refused_by_broker = refused
                    return
                self.retries += 1
                if time.monotonic() > self.give_up_at():
                    record.note = f"never confirmed: {type(exc).__name__}"
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            except Exception as exc:
                # Not something a retry cures (the message could not even be encoded): not sent.
                record.note = f"not sent: {type(exc).__name__}: {exc}"
                log.error("command not sent", exc_info=exc)
                return
            record.confirmed = True
            return

    async def send(self, client: Client, command: Command, body: ScopedCommand, record: SentCommand) -> None:
        mid = record.message_id
        assert mid is not None
        await self._retry(lambda: client.send(command, body, message_id=mid), record)

    async def raw(
        self, publisher: ConfirmingPublisher, make: Callable[[], aio_pika.Message], key: str, record: SentCommand
    ) -> None:
        await self._retry(lambda: publisher.publish(make(), key), record)

    async def alone(
        self, make: Callable[[], HostClient], command: Command, body: ScopedCommand, record: SentCommand
    ) -> None:
        """Like ``send``, each attempt on a client (a channel) of its own, closed afterwards: for what the
        broker is to refuse, since it closes the channel of a refused publish."""
        mid = record.message_id
        assert mid is not None

        async def attempt() -> None:
            client = make()
            try:
                await client.send(command, body, message_id=mid)
            finally:
                with contextlib.suppress(Exception):
                    await client.close()

        await self._retry(attempt, record)


class Simulator:
    def __init__(
        self,
        *,
        seed: int,
        ledger: Ledger,
        actors: Actors,
        observer: Observer,
        sender: Sender,
        scopes: list[Scope],
        rng: random.Random,
    ) -> None:
        self.seed = seed
        self.ledger = ledger
        self.actors = actors
        self.observer = observer
        self.sender = sender
        self.scopes = scopes
        self.rng = rng
        self.approver_names = sorted(actors.approvers)
        self.wishes: list[str] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.injecting = True
        self.starts_done = 0
        self.start_bodies: dict[str, StartCommand] = {}
        self._flooding = False

    # --- bookkeeping -------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.ledger.notes.append(f"harness task {task.get_name()} failed: {type(exc).__name__}: {exc}")
            log.error("harness task failed", exc_info=exc)

    @property
    def busy(self) -> int:
        return len(self.tasks)

    def stop_injecting(self) -> None:
        self.injecting = False
        self.wishes.clear()

    def wish(self, kind: str) -> None:
        if self.injecting and len(self.wishes) < 32:
            self.wishes.append(kind)

    def _take(self, kinds: frozenset[str], fits: Callable[[str], bool]) -> str | None:
        for index, kind in enumerate(self.wishes):
            if kind in kinds and fits(kind):
                del self.wishes[index]
                return kind
        return None

    def _record(
        self,
        *,
        mid: str | None,
        key: Command,
        run_id: str | None,
        scope: Scope | None,
        sender: str,
        purpose: str,
        expect: Expect,
        codes: frozenset[str] = frozenset(),
        suspension_id: int | None = None,
        group: str | None = None,
        routed: str | None = None,
        victim: Scope | None = None,
    ) -> SentCommand:
        """Record a command before it is sent. ``routed`` is the key it goes under: by default its key for
        ``scope``, as the clients send it."""
        return self.ledger.sent(
            SentCommand(
                message_id=mid,
                key=key.value,
                run_id=run_id,
                scope=scope,
                sender=sender,
                purpose=purpose,
                expect=expect,
                codes=codes,
                suspension_id=suspension_id,
                group=group,
                routing_key=routed if routed is not None else key.key(scope) if scope is not None else None,
                victim=victim,
            )
        )

    # --- starting runs -----------------------------------------------------------------------------

    async def start_runs(self, chosen: list[Chosen], until: float, stop: asyncio.Event) -> None:
        """Start the runs evenly over the time left until ``until``."""
        for n, choice in enumerate(chosen):
            if stop.is_set() or time.monotonic() >= until:
                self.ledger.notes.append(f"{len(chosen) - n} planned runs were not started (time was up)")
                return
            self.spawn(self._start(n, choice), f"start:{n}")
            left = len(chosen) - n - 1
            if left:
                pause = max(0.0, (until - time.monotonic()) / (left + 1))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause * self.rng.uniform(0.5, 1.5))

    async def _start(self, n: int, choice: Chosen) -> None:
        scope = self.scopes[n % len(self.scopes)]
        run_id = f"soak-{self.seed}-{n:05d}"
        await self._launch(run_id, scope, choice, f"soak run {n} ({choice.template.name}, {choice.fate.value})")

    async def _launch(self, run_id: str, scope: Scope, choice: Chosen, text: str) -> None:
        """Start a run of ``scope`` from its host, as planned by ``choice``."""
        mid = f"start:{run_id}"
        plan = RunPlan(
            run_id=run_id,
            scope=scope,
            template=choice.template.name,
            fate=choice.fate,
            pause_ttl_seconds=choice.pause_ttl_seconds,
            start_message_id=mid,
            deny_reason=f"soak-deny: {run_id}",
        )
        self.ledger.runs[run_id] = plan
        command = StartCommand(
            scope=scope,
            run_id=run_id,
            agent_id="demo",
            input=text,
            script=[ScriptTurn.model_validate(t) for t in choice.script],
            pause_ttl_seconds=choice.pause_ttl_seconds,
        )
        self.start_bodies[run_id] = command
        record = self._record(
            mid=mid, key=Command.START, run_id=run_id, scope=scope, sender="host", purpose="start", expect=Expect.APPLY
        )
        await self.sender.send(self.actors.hosts[scope], Command.START, command, record)
        self.starts_done += 1

    # --- a tenant's flood --------------------------------------------------------------------------

    async def flood(self, name: str, size: int, quota: int, workers: int) -> None:
        """The flooder publishes ``size`` starts at once in its own scope, on its own scoped key; right
        behind them, another tenant's host starts a probe run. One flood at a time: a probe is judged
        against its own flood's starts only."""
        if self._flooding:
            self.ledger.fault("tenant_flood", f"{name}: the previous flood is still being published", done=False)
            return
        self._flooding = True
        try:
            await self._flood(name, size, quota, workers)
        finally:
            self._flooding = False

    async def _flood(self, name: str, size: int, quota: int, workers: int) -> None:
        scope = self.actors.flood_scope
        chosen = flooded(seeded(self.seed, name))
        script = [ScriptTurn.model_validate(t) for t in chosen.script]
        flood = FloodRecord(name=name, scope=scope, size=size, quota=quota, workers=workers)
        self.ledger.floods.append(flood)
        sends: list[Coroutine[Any, Any, None]] = []
        for i in range(size):
            run_id = f"soak-{self.seed}-{name}-{i:05d}"
            mid = f"start:{run_id}"
            self.ledger.runs[run_id] = RunPlan(
                run_id=run_id,
                scope=scope,
                template=chosen.template.name,
                fate=chosen.fate,
                pause_ttl_seconds=chosen.pause_ttl_seconds,
                start_message_id=mid,
                flood=name,
            )
            body = StartCommand(scope=scope, run_id=run_id, agent_id="demo", input=f"{name} start {i}", script=script)
            record = self._record(
                mid=mid,
                key=Command.START,
                run_id=run_id,
                scope=scope,
                sender="flooder",
                purpose="tenant_flood",
                expect=Expect.EITHER,
                codes=QUOTA_CODES,
            )
            flood.starts.append(mid)
            sends.append(self.sender.send(self.actors.flooder, Command.START, body, record))
        self.ledger.fault("tenant_flood", f"{name}: {size} starts at {scope} (quota {quota}), {workers} workers")
        await asyncio.gather(*sends)
        flood.published = time.monotonic()
        other = self.rng.choice(self.scopes)
        flood.probe_run = f"soak-{self.seed}-{name}-probe"
        await self._launch(flood.probe_run, other, probe(seeded(self.seed, flood.probe_run)), f"probe behind {name}")

    # --- hearing events ----------------------------------------------------------------------------

    async def host_loop(self, subscription: Subscription[HostEvent]) -> None:
        async for received in subscription:
            event = received.event
            if isinstance(event, Notice):
                self.on_notice(event, "host")
            elif isinstance(event, RunEvent):
                self.on_run_event(event)

    async def bus_loop(self, subscription: Subscription[Notice]) -> None:
        async for received in subscription:
            self.on_notice(received.event, "bus")

    def _responsible(self, plan: RunPlan, notice: Notice) -> str:
        first = not plan.handled
        if first and plan.fate in (Fate.CANCEL, Fate.RACE_CANCEL, Fate.EXPIRE, Fate.ABANDON):
            return "host"
        return "bus" if notice.reason is SuspendReason.AGENT_REPLY else "host"

    def on_notice(self, notice: Notice, via: str) -> None:
        plan = self.ledger.runs.get(notice.run_id)
        if plan is None:
            self.ledger.notes.append(f"{via} heard a notice for unknown run {notice.run_id}")
            return
        if plan.first_heard is None:
            plan.first_heard = time.monotonic()
        heard = plan.heard_by_host if via == "host" else plan.heard_by_bus
        if notice.suspension_id not in heard:
            heard.append(notice.suspension_id)
        if notice.suspension_id in plan.handled or self._responsible(plan, notice) != via:
            return
        first = not plan.handled
        plan.handled.add(notice.suspension_id)
        self.spawn(self._handle(plan, notice, first), f"notice:{notice.run_id}:{notice.suspension_id}")

    def on_run_event(self, event: RunEvent) -> None:
        plan = self.ledger.runs.get(event.run_id)
        if plan is None or event.kind is RunEventKind.RESUMED:
            return
        if plan.first_heard is None:
            plan.first_heard = time.monotonic()
        if plan.ended is None:
            plan.ended = event.kind.value
            kind = self._take(END_KINDS, lambda _k: True) if plan.fate is Fate.COMPLETE else None
            if kind is not None:
                self.spawn(self._after_end(kind, plan), f"end-fault:{plan.run_id}")

    # --- answering ---------------------------------------------------------------------------------

    def _rng(self, plan: RunPlan, notice: Notice) -> random.Random:
        return seeded(self.seed, plan.run_id, notice.suspension_id)

    def _legit(self, plan: RunPlan, notice: Notice, rng: random.Random, *, deny: bool = False) -> Answer:
        version = version_of(notice)
        scope = plan.scope
        if notice.reason is SuspendReason.EXTERNAL_TOOL:
            results = [ToolAnswer(call_id=p.id, content=f"soak answer to {p.id}") for p in notice.pending]
            return Answer(
                self.actors.hosts[scope],
                Command.RESUME,
                ResumeCommand(scope=scope, version=version, results=results),
                "host",
            )
        if notice.reason is SuspendReason.APPROVAL:
            assert notice.checkpoint_id is not None
            listed = [a for a in notice.approvers if a in self.actors.approvers]
            if notice.approvers:
                who = rng.choice(listed) if listed else self.approver_names[0]
                client: HostClient = self.actors.approvers[who]
                sender = who
            else:
                client, sender = self.actors.hosts[scope], "host"
            body = DecideCommand(
                scope=scope,
                version=version,
                checkpoint_id=notice.checkpoint_id,
                decision=Decision.DENY if deny else Decision.APPROVE,
                reason=plan.deny_reason if deny else "soak approves",
            )
            return Answer(client, Command.DECIDE, body, sender)
        call = notice.pending[0]
        reply = json.dumps({"performative": "inform", "sender": "pricer", "content": f"soak reply to {call.id}"})
        answer = ReplyCommand(scope=scope, version=version, reply_with=call.reply_with, input=reply)
        return Answer(self.actors.bus, Command.REPLY, answer, "bus")

    async def _send_answer(
        self,
        plan: RunPlan,
        notice: Notice,
        answer: Answer,
        expect: Expect,
        codes: frozenset[str] = frozenset(),
        *,
        mid: str | None = None,
        group: str | None = None,
        purpose: str = "answer",
    ) -> SentCommand:
        mid = mid or f"answer:{plan.run_id}:{notice.suspension_id}"
        if answer.command is Command.DECIDE and "not_suspended" in codes:
            # A decision that finds its pause gone finds its checkpoint closed too (by the cancel, the expiry
            # or the decision that won): the original answers that invalid_state, before not_suspended.
            codes = codes | {"invalid_state"}
        record = self._record(
            mid=mid,
            key=answer.command,
            run_id=plan.run_id,
            scope=plan.scope,
            sender=answer.sender,
            purpose=purpose,
            expect=expect,
            codes=codes,
            suspension_id=notice.suspension_id,
            group=group,
        )
        if purpose == "answer":
            plan.answers[notice.suspension_id] = (
                mid,
                answer.command.value,
                answer.body.model_dump_json(),
                answer.sender,
            )
        await self.sender.send(answer.client, answer.command, answer.body, record)
        return record

    async def _cancel(self, plan: RunPlan, notice: Notice, expect: Expect, codes: frozenset[str]) -> None:
        record = self._record(
            mid=f"cancel:{plan.run_id}",
            key=Command.CANCEL,
            run_id=plan.run_id,
            scope=plan.scope,
            sender="host",
            purpose="cancel",
            expect=expect,
            codes=codes,
            suspension_id=notice.suspension_id,
        )
        body = CancelCommand(scope=plan.scope, run_id=plan.run_id, reason="soak cancels")
        await self.sender.send(self.actors.hosts[plan.scope], Command.CANCEL, body, record)

    async def _handle(self, plan: RunPlan, notice: Notice, first: bool) -> None:
        rng = self._rng(plan, notice)
        fate = plan.fate
        if first and fate is Fate.ABANDON:
            plan.left_paused = notice.suspension_id
            return
        if first and fate is Fate.EXPIRE:
            return
        if first and fate is Fate.CANCEL:
            await self._cancel(plan, notice, Expect.APPLY, frozenset())
            return
        if first and fate is Fate.RACE_CANCEL:
            # The cancel either claims this pause (or, if the answer won, the run's next one) or finds the
            # run running or ended; the answer either wins or finds the pause gone.
            await asyncio.gather(
                self._cancel(plan, notice, Expect.EITHER, frozenset({"not_suspended", "invalid_state"})),
                self._send_answer(
                    plan, notice, self._legit(plan, notice, rng), Expect.EITHER, frozenset({"not_suspended"})
                ),
            )
            return
        if fate is Fate.RACE_CANCEL:
            await self._send_answer(plan, notice, self._legit(plan, notice, rng), Expect.EITHER, STATE_CODES)
            return
        if fate is Fate.RACE_DEADLINE:
            if first and notice.expires_at is not None:
                left = notice.expires_at.timestamp() - time.time()
                await asyncio.sleep(max(0.0, left + rng.uniform(-0.6, 0.4)))
            codes = frozenset({"suspension_expired", *STATE_CODES})
            await self._send_answer(plan, notice, self._legit(plan, notice, rng), Expect.EITHER, codes)
            return
        if fate is Fate.DENY and notice.reason is SuspendReason.APPROVAL:
            await self._send_answer(plan, notice, self._legit(plan, notice, rng, deny=True), Expect.APPLY)
            return
        if fate is not Fate.COMPLETE:
            await self._send_answer(plan, notice, self._legit(plan, notice, rng), Expect.APPLY)
            return
        await self._answer_with_faults(plan, notice, rng)

    def _fits(self, plan: RunPlan, notice: Notice, kind: str) -> bool:
        reason = notice.reason
        if kind == "non_bus_reply" or kind == "oversized_command":
            return reason is SuspendReason.AGENT_REPLY
        if kind == "non_approver_decision":
            return reason is SuspendReason.APPROVAL and bool(notice.approvers)
        if kind == "results_mismatch":
            return reason is SuspendReason.EXTERNAL_TOOL
        if kind == "message_id_conflict":
            return reason is not SuspendReason.AGENT_REPLY  # replies have no inbox record to conflict with
        if kind == "reordered_commands":
            # A stale answer needs an earlier one; competing answers are not made for approvals.
            return bool(plan.answers) or reason is not SuspendReason.APPROVAL
        return True

    def _client_of(self, sender: str, scope: Scope) -> Client:
        if sender == "bus":
            return self.actors.bus
        if sender in self.actors.approvers:
            return self.actors.approvers[sender]
        return self.actors.hosts[scope]

    async def _answer_with_faults(self, plan: RunPlan, notice: Notice, rng: random.Random) -> None:
        kind = self._take(PRE_KINDS | POST_KINDS, lambda k: self._fits(plan, notice, k))
        legit = self._legit(plan, notice, rng)
        if kind == "reordered_commands":
            competing = notice.reason is not SuspendReason.APPROVAL
            if competing and (not plan.answers or rng.random() < 0.5):
                await self._competing_answers(plan, notice, legit)
                return
            await self._stale_answer(plan, notice)
        elif kind in CROSS_TENANT_KINDS:
            await self._cross_tenant(kind, plan, notice, rng)
        elif kind in PRE_KINDS:
            await self._bad_before_answer(kind, plan, notice, rng)
        record = await self._send_answer(plan, notice, legit, Expect.APPLY)
        if kind == "duplicate_command":
            await asyncio.sleep(rng.uniform(0.0, 3.0))
            self.ledger.fault("duplicate_command", f"{record.key} {record.message_id} re-sent")
            record.sends += 1
            await self.sender.send(legit.client, legit.command, legit.body, record)
        elif kind == "message_id_conflict":
            await self._conflicting(plan, notice, legit, record)

    async def _await_refusal(self, record: SentCommand) -> None:
        mid = record.message_id
        assert mid is not None
        if not await self.observer.wait(lambda: self.observer.was_rejected(mid), REFUSAL_WAIT):
            # The legit answer goes now and may overtake it: the refusal may then name the state it left.
            record.codes = record.codes | STATE_CODES
            record.note = "refusal not seen in time; state codes allowed"

    def _forged_mid(self, kind: str) -> str:
        return f"{kind}:{uuid.uuid4().hex[:16]}"

    def _reach(
        self, plan: RunPlan, notice: Notice, at: Scope, forged: str, rng: random.Random
    ) -> tuple[Command, ScopedCommand]:
        """A command for ``notice``'s run and pause, naming the scope ``at`` in its body: a cancel now and
        then, else the answer its pause's reason asks for, with a forged payload."""
        version = version_of(notice)
        if rng.random() < 0.25:
            return Command.CANCEL, CancelCommand(scope=at, run_id=plan.run_id, reason=forged)
        if notice.reason is SuspendReason.EXTERNAL_TOOL:
            results = [ToolAnswer(call_id=p.id, content=forged) for p in notice.pending]
            return Command.RESUME, ResumeCommand(scope=at, version=version, results=results)
        if notice.reason is SuspendReason.APPROVAL:
            assert notice.checkpoint_id is not None
            return Command.DECIDE, DecideCommand(
                scope=at, version=version, checkpoint_id=notice.checkpoint_id, decision=Decision.DENY, reason=forged
            )
        reply = ReplyCommand(scope=at, version=version, reply_with=notice.pending[0].reply_with, input=forged)
        return Command.REPLY, reply

    async def _cross_tenant(self, kind: str, plan: RunPlan, notice: Notice, rng: random.Random) -> None:
        """Mallory, confined to a scope of its own, reaches for this (another tenant's) live pause, before
        its legit answer goes:

        - ``cross_tenant_key``: the command keyed for the victim's scope, as any client keys it: the broker
          refuses the publish (ACCESS_REFUSED), so it never reaches the fleet;
        - ``cross_tenant_body``: keyed for mallory's own scope, with the victim's body: the worker refuses
          it ``forbidden``, and the refusal goes to mallory's scope, never to the victim's;
        - ``foreign_scope_command``: the victim's run and pause named in mallory's own scope (by the bus,
          trusted with every scope, for a reply): ``not_suspended``, since scope is exact in every query;
        - ``forged_dead_letter``: as ``cross_tenant_body``, with refusal headers forged to name the victim's
          key and a passing error, so that the dead-letter tools would show it as the victim's and an
          operator would replay it there: the worker's copy drops them, and the tools read the key the
          broker delivered it with (the checker holds them to it).
        """
        victim, own = plan.scope, self.actors.mallory_scope
        mid = self._forged_mid(kind)
        forged = f"{FORGED}:{mid}"
        if kind == "foreign_scope_command":
            command, body = self._reach(plan, notice, own, forged, rng)
            client: Client = self.actors.bus if command is Command.REPLY else self.actors.mallory
            sender = "bus" if command is Command.REPLY else "mallory"
            record = self._record(
                mid=mid,
                key=command,
                run_id=plan.run_id,
                scope=own,
                sender=sender,
                purpose=kind,
                expect=Expect.REJECT,
                codes=frozenset({"not_suspended"}),
                suspension_id=notice.suspension_id,
                victim=victim,
            )
            self.ledger.fault(kind, f"{command.key(own)} from {sender} for {plan.run_id} of {victim}")
            await self.sender.send(client, command, body, record)
            await self._await_refusal(record)
            return
        command, body = self._reach(plan, notice, victim, forged, rng)
        if kind == "cross_tenant_key":
            record = self._record(
                mid=mid,
                key=command,
                run_id=plan.run_id,
                scope=victim,
                sender="mallory",
                purpose=kind,
                expect=Expect.BROKER_REFUSES,
                suspension_id=notice.suspension_id,
                victim=victim,
            )
            self.ledger.fault(kind, f"{command.key(victim)} from mallory for {plan.run_id}")
            await self.sender.alone(self.actors.mallory_alone, command, body, record)
            return
        assert kind in ("cross_tenant_body", "forged_dead_letter"), kind
        key = command.key(own)
        record = self._record(
            mid=mid,
            key=command,
            run_id=plan.run_id,
            scope=victim,
            sender="mallory",
            purpose=kind,
            expect=Expect.REJECT,
            codes=frozenset({"forbidden"}),
            suspension_id=notice.suspension_id,
            routed=key,
            victim=victim,
        )
        text = body.model_dump_json()
        forged_refusal: dict[str, HeaderValue] = (
            {
                ORIGINAL_KEY_HEADER: command.key(victim),
                ERROR_HEADER: "store_unavailable",
                DETAIL_HEADER: "the database was down; replay me",
            }
            if kind == "forged_dead_letter"
            else {}
        )

        def make() -> aio_pika.Message:
            return message(
                text, message_id=mid, routing_key=key, user_id=self.actors.mallory_user, headers=forged_refusal
            )

        self.ledger.fault(kind, f"{key} from mallory with a body acting in {victim} for {plan.run_id}")
        await self.sender.raw(self.actors.mallory_raw, make, key, record)
        await self._await_refusal(record)

    async def _bad_before_answer(self, kind: str, plan: RunPlan, notice: Notice, rng: random.Random) -> None:
        """Send one bad command at this live pause, each from a user the broker lets publish for its scope,
        and wait for its refusal."""
        version = version_of(notice)
        mid = self._forged_mid(kind)
        forged = f"{FORGED}:{mid}"
        reason = notice.reason
        scope = plan.scope
        host = self.actors.hosts[scope]
        client: Client
        body: ScopedCommand
        if kind == "non_bus_reply":
            # Its host, or an approver: both may publish for the scope, neither is the bus.
            who = rng.choice(["host", *sorted(self.actors.approver_as_bus)])
            codes = frozenset({"forbidden"})
            forger = self.actors.host_as_bus[scope] if who == "host" else self.actors.approver_as_bus[who]
            command, client, sender = Command.REPLY, forger, who
            body = ReplyCommand(scope=scope, version=version, reply_with=notice.pending[0].reply_with, input=forged)
        elif kind == "non_approver_decision":
            assert notice.checkpoint_id is not None
            outsiders: list[tuple[str, HostClient]] = [("host", host)]
            outsiders += [(n, c) for n, c in self.actors.approvers.items() if n not in notice.approvers]
            sender, decider = rng.choice(outsiders)
            codes = frozenset({"forbidden"})
            command, client = Command.DECIDE, decider
            body = DecideCommand(
                scope=scope, version=version, checkpoint_id=notice.checkpoint_id, decision=Decision.DENY, reason=forged
            )
        elif kind == "wrong_authority":
            command, client, sender = Command.RESUME, host, "host"
            if reason is SuspendReason.EXTERNAL_TOOL:
                codes = frozenset({"invalid_state"})
                command = Command.DECIDE
                body = DecideCommand(
                    scope=scope, version=version, checkpoint_id=1, decision=Decision.DENY, reason=forged
                )
            else:
                codes = frozenset(
                    {"requires_approval" if reason is SuspendReason.APPROVAL else "not_agent_reply_resumable"}
                )
                body = ResumeCommand(
                    scope=scope,
                    version=version,
                    results=[ToolAnswer(call_id=p.id, content=forged) for p in notice.pending],
                )
        elif kind == "results_mismatch":
            codes = frozenset({"results_mismatch"})
            command, client, sender = Command.RESUME, host, "host"
            wrong = [ToolAnswer(call_id=f"no-such-call-{mid}", content=forged)]
            body = ResumeCommand(scope=scope, version=version, results=wrong)
        elif kind == "oversized_command":
            codes = frozenset({"input_too_large"})
            command, client, sender = Command.REPLY, self.actors.bus, "bus"
            body = ReplyCommand(
                scope=scope,
                version=version,
                reply_with=notice.pending[0].reply_with,
                input=forged + "x" * (MAX_RESUME_INPUT_BYTES + 1 - len(forged)),
            )
        else:
            raise AssertionError(f"not a pre-answer fault: {kind}")
        record = self._record(
            mid=mid,
            key=command,
            run_id=plan.run_id,
            scope=scope,
            sender=sender,
            purpose=kind,
            expect=Expect.REJECT,
            codes=codes,
            suspension_id=notice.suspension_id,
        )
        self.ledger.fault(kind, f"{command.value} from {sender} at {record.scope} for {plan.run_id}")
        await self.sender.send(client, command, body, record)
        await self._await_refusal(record)

    async def _stale_answer(self, plan: RunPlan, notice: Notice) -> None:
        """Re-send the run's previous answer (pinned to its older pause) under a new id, before this pause's
        answer: out of order, it must change nothing; a host's is refused as a conflict, the bus's reply is
        acknowledged as the duplicate of the admitted one."""
        old_sid = max(plan.answers)
        _old_mid, key, body_json, sender = plan.answers[old_sid]
        command = Command(key)
        mid = self._forged_mid("stale")
        body: ScopedCommand
        if command is Command.REPLY:
            body = ReplyCommand.model_validate_json(body_json)
        elif command is Command.DECIDE:
            body = DecideCommand.model_validate_json(body_json)
        else:
            body = ResumeCommand.model_validate_json(body_json)
        client = self._client_of(sender, plan.scope)
        # A host's answer is refused as a conflict; the bus's identical reply is the admitted reply again.
        duplicate = command is Command.REPLY
        record = self._record(
            mid=mid,
            key=command,
            run_id=plan.run_id,
            scope=plan.scope,
            sender=sender,
            purpose="reordered_commands",
            expect=Expect.DUPLICATE if duplicate else Expect.REJECT,
            codes=frozenset() if duplicate else frozenset({"run_conflict"}),
            suspension_id=old_sid,
        )
        self.ledger.fault("reordered_commands", f"stale {key} for suspension {old_sid} of {plan.run_id}")
        await self.sender.send(client, command, body, record)
        if not duplicate:
            await self._await_refusal(record)

    async def _competing_answers(self, plan: RunPlan, notice: Notice, legit: Answer) -> None:
        """Two different answers to one pause, the later one sent first: exactly one has an effect."""
        if isinstance(legit.body, ResumeCommand):
            other: ScopedCommand = legit.body.model_copy(
                update={
                    "results": [r.model_copy(update={"content": "competing " + r.content}) for r in legit.body.results]
                }
            )
        else:
            assert isinstance(legit.body, ReplyCommand)
            other = legit.body.model_copy(update={"input": json.dumps({"performative": "inform", "content": "other"})})
        group = f"race:{plan.run_id}:{notice.suspension_id}"
        codes = frozenset({*STATE_CODES, "resume_admission_conflict"})
        self.ledger.fault("reordered_commands", f"competing answers for {plan.run_id}/{notice.suspension_id}")
        second = Answer(legit.client, legit.command, other, legit.sender)
        await asyncio.gather(
            self._send_answer(
                plan,
                notice,
                second,
                Expect.EITHER,
                codes,
                mid=self._forged_mid("competing"),
                group=group,
                purpose="reordered_commands",
            ),
            self._send_answer(plan, notice, legit, Expect.EITHER, codes, group=group),
        )

    async def _conflicting(self, plan: RunPlan, notice: Notice, legit: Answer, record: SentCommand) -> None:
        """Once the answer's effect is seen, re-use its message id for a different body."""
        mid = record.message_id
        assert mid is not None
        if not await self.observer.wait(lambda: self.observer.effect_seen(mid), EFFECT_WAIT):
            self.ledger.fault("message_id_conflict", f"{mid}: effect not seen in time", done=False)
            return
        if isinstance(legit.body, ResumeCommand):
            body: ScopedCommand = legit.body.model_copy(
                update={"results": [r.model_copy(update={"content": FORGED}) for r in legit.body.results]}
            )
        else:
            assert isinstance(legit.body, DecideCommand)
            body = legit.body.model_copy(update={"decision": Decision.DENY, "reason": f"{FORGED}:{mid}"})
        record.conflicted = True
        conflict = self._record(
            mid=mid,
            key=legit.command,
            run_id=plan.run_id,
            scope=plan.scope,
            sender=legit.sender,
            purpose="message_id_conflict",
            expect=Expect.REJECT,
            codes=frozenset({"message_id_conflict"}),
            suspension_id=notice.suspension_id,
        )
        self.ledger.fault("message_id_conflict", f"{mid} re-used for another {legit.command.value}")
        await self.sender.send(legit.client, legit.command, body, conflict)

    async def _after_end(self, kind: str, plan: RunPlan) -> None:
        mid = self._forged_mid(kind)
        if kind == "run_exists":
            body: ScopedCommand = StartCommand(scope=plan.scope, run_id=plan.run_id, agent_id="demo", input=FORGED)
            command, codes = Command.START, frozenset({"run_exists"})
        else:
            body = CancelCommand(scope=plan.scope, run_id=plan.run_id, reason=FORGED)
            command, codes = Command.CANCEL, frozenset({"invalid_state"})
        record = self._record(
            mid=mid,
            key=command,
            run_id=plan.run_id,
            scope=plan.scope,
            sender="host",
            purpose=kind,
            expect=Expect.REJECT,
            codes=codes,
        )
        self.ledger.fault(kind, f"{command.value} for ended run {plan.run_id}")
        await self.sender.send(self.actors.hosts[plan.scope], command, body, record)

    # --- faults that need no pause -----------------------------------------------------------------

    async def malformed(self, variant: str) -> None:
        """Hand-built bytes from the host of a scope, keyed for that scope (a confined user may publish no
        other key, the bare one included). The key is checked only once the body parsed, so a body that does
        not parse, or names no valid scope, is refused for that (invalid_message, invalid_scope); a
        well-formed body naming another scope under the publisher's key is ``forbidden``."""
        scope = self.rng.choice(self.scopes)
        # The scope the body acts in, where it has a readable one (another one's only in scope_mismatch).
        body_scope: Scope | None = scope
        victim: Scope | None = None
        ghost = f"ghost-{uuid.uuid4().hex[:16]}"
        mid = self._forged_mid("malformed")
        headers: dict[str, Any] = {SCHEMA_VERSION_HEADER: SCHEMA_VERSION}
        key = Command.RESUME
        resume: dict[str, Any] = {
            "scope": scope.model_dump(),
            "version": {"run_id": ghost, "suspension_id": 1, "run_revision": 1},
            "results": [],
        }
        codes = frozenset({"invalid_message"})
        if variant == "not_json":
            key = self.rng.choice(list(Command))
            body = b'{"scope": {"app": '
        elif variant == "wrong_shape":
            body = json.dumps({**resume, "results": 5, "version": {"run_id": ghost}}).encode()
        elif variant == "unknown_field":
            key = Command.CANCEL
            body = json.dumps({"scope": scope.model_dump(), "run_id": ghost, "sneaky": True}).encode()
        elif variant == "bad_scope":
            body = json.dumps({**resume, "scope": {"app": "no spaces allowed", "tenant": "t"}}).encode()
            codes = frozenset({"invalid_scope"})
        elif variant == "no_schema_version":
            headers = {}
            body = json.dumps(resume).encode()
            codes = frozenset({"unsupported_schema_version"})
        elif variant == "wrong_schema_version":
            headers = {SCHEMA_VERSION_HEADER: SCHEMA_VERSION + 1}
            body = json.dumps(resume).encode()
            codes = frozenset({"unsupported_schema_version"})
        elif variant == "json_array":
            # (A message without an id cannot be sent from here: aiormq gives it a random one; nor can an id
            # over 255 bytes: AMQP carries it as a short string.)
            body = json.dumps([resume]).encode()
        elif variant == "nested_deep":
            body = nested(5000)
            codes = frozenset({"invalid_message"})
        elif variant == "long_message_id":
            mid = padded_id(mid)
            body = b"{not json"
        elif variant == "header_not_utf8":
            headers = {**headers, "x-note": RawText(b"\xff\xfe not utf-8")}
            body = json.dumps(resume).encode()
            codes = frozenset({"not_suspended"})
        elif variant == "revision_past_64_bits":
            past = {"run_id": ghost, "suspension_id": 1, "run_revision": 2**63}
            body = json.dumps({**resume, "version": past}).encode()
        elif variant == "nan_in_arguments":
            key = Command.START
            start = {"scope": scope.model_dump(), "run_id": ghost, "agent_id": "demo", "input": ""}
            call = {"call": [{"tool": "lookup", "arguments": {"query": 0}}]}
            body = json.dumps({**start, "script": [call]}).replace('"query": 0', '"query": NaN').encode()
        elif variant == "nested_header":
            headers = {**headers, "x-nest": nested_table(500)}
            body = json.dumps(resume).encode()
        elif variant == "near_frame_header":
            headers = {**headers, "x-pad": "p" * NEAR_FRAME_HEADER_BYTES}
            body = json.dumps(resume).encode()
        elif variant == "oversized_body":
            key = Command.START
            head = json.dumps({"scope": scope.model_dump(), "run_id": ghost, "agent_id": "demo", "input": ""})
            body = head[:-2].encode() + b"x" * OVERSIZED_BODY_BYTES + b'"}'
        elif variant == "scope_mismatch":
            # Well formed, keyed for the publisher's scope, acting in another tenant's.
            victim = body_scope = self.rng.choice([s for s in self.scopes if s != scope])
            body = json.dumps({**resume, "scope": victim.model_dump()}).encode()
            codes = frozenset({"forbidden"})
        else:
            raise AssertionError(variant)
        if variant in ("not_json", "bad_scope", "nested_deep", "long_message_id"):
            body_scope = None
        routed = key.key(scope)
        record = self._record(
            mid=mid,
            key=key,
            run_id=ghost,
            scope=body_scope,
            routed=routed,
            victim=victim,
            sender="raw",
            purpose=(
                "oversized_command"
                if variant == "oversized_body"
                else variant
                if variant in HEADER_VARIANTS
                else "hostile_message"
                if variant in HOSTILE_VARIANTS
                else "malformed_command"
            ),
            expect=Expect.REJECT,
            codes=codes,
        )
        record.note = variant
        user = self.actors.raw_users[scope]

        def make() -> aio_pika.Message:
            return aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=mid,
                type=routed,
                headers=dict(headers),
                user_id=user,
            )

        self.ledger.fault(record.purpose, f"{variant} on {routed} ({len(body)} bytes)")
        await self.sender.raw(self.actors.raw[scope], make, routed, record)

    async def unknown_run(self) -> None:
        scope = self.rng.choice(self.scopes)
        ghost = f"ghost-{uuid.uuid4().hex[:16]}"
        mid = self._forged_mid("unknown_run")
        body = ResumeCommand(
            scope=scope, version=ClaimVersion(run_id=ghost, suspension_id=1, run_revision=1), results=[]
        )
        record = self._record(
            mid=mid,
            key=Command.RESUME,
            run_id=ghost,
            scope=scope,
            sender="host",
            purpose="unknown_run",
            expect=Expect.REJECT,
            codes=frozenset({"not_suspended"}),
        )
        self.ledger.fault("unknown_run", f"run.resume for {ghost}")
        await self.sender.send(self.actors.hosts[scope], Command.RESUME, body, record)

    async def duplicate_start(self) -> bool:
        """Re-send a start already sent, under its own message id: no second run, no refusal."""
        starts = [c for c in self.ledger.commands[-400:] if c.purpose == "start" and c.confirmed]
        if not starts:
            return False
        record = self.rng.choice(starts)
        body = self.start_bodies[record.run_id or ""]
        self.ledger.fault("duplicate_command", f"run.start {record.message_id} re-sent")
        record.sends += 1
        await self.sender.send(self.actors.hosts[body.scope], Command.START, body, record)
        return True
