"""``intermission demo``: the whole product on the local servers, told as it happens.

It creates what is missing (the database, its tables, the RabbitMQ topology), starts a worker in this
process, and plays three runs of the demo agent that pause for each reason: a host answers the
``external_tool`` pause, an approver decides the ``approval`` pause, and a bus peer answers the
``agent_reply`` pause. Everything travels as real commands and events through RabbitMQ.

Who acts, when RabbitMQ's management API answers (``INTERMISSION_MANAGEMENT_URL``, with the AMQP URL's
credentials unless ``INTERMISSION_MANAGEMENT_USER``/``_PASSWORD`` say otherwise): the demo creates or
updates two users of its own in the AMQP URL's vhost, each with a fresh random password every run (never
shown, never stored):

- ``intermission-demo-host``, confined by the broker to the demo's scope ``demo/local`` and nothing else,
  with exactly the permissions ``intermission grant`` gives a host (``ops.grants``): it plays the host and
  the approver the invoice run names;
- ``intermission-demo-bus``, trusted with every scope (``intermission users add --trusted``): it plays the
  bus peer, and the worker the demo starts takes agent replies from it alone (its ``bus_user``).

Both users are deleted when the demo ends, however it ends: a demo leaves no user behind, least of all
one trusted with every scope. The worker itself connects as the AMQP URL's user. When the management API
does not answer (its plugin is off on a fresh broker) or refuses, the demo says so in one line and acts as
the AMQP URL's own user for all three (on a fresh broker that is ``guest``), trusting it as the bus. A
production fleet gives every process a user of its own (README, "Threat model").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.ops.grants import BrokerGrants, ManagementError
from intermission.publishers.amqp import amqp_nodes, safe_url, with_credentials
from intermission.publishers.clients import BusClient, HostClient, version_of
from intermission.schemas.commands import DecideCommand, Decision, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store.migrate import ensure_database, migrate

SCOPE = Scope(app="demo", tenant="local")
TIMEOUT_SECONDS = 60.0
# The management API is asked once, before anything else: a port nobody listens on answers at once, this
# bounds one that does not answer at all.
MANAGEMENT_TIMEOUT_SECONDS = 5.0
ENABLE_MANAGEMENT = "rabbitmq-plugins enable rabbitmq_management"

Say = Callable[[str], None]


@dataclass(frozen=True)
class DemoUsers:
    """The names of the demo's own RabbitMQ users."""

    host: str = "intermission-demo-host"
    bus: str = "intermission-demo-bus"


@dataclass(frozen=True)
class Cast:
    """Who the demo acts as: the host (who also approves) and the bus peer, each by URL and user name;
    ``confined`` when the host is a user the broker confines to the demo's scope."""

    host_url: str = field(repr=False)
    host_user: str
    bus_url: str = field(repr=False)
    bus_user: str
    confined: bool


def _as(url: str, user: str, password: str) -> str:
    return with_credentials(url, user, password)


async def cast(settings: Settings, say: Say, users: DemoUsers = DemoUsers()) -> Cast:
    """Create or update the demo's users through the management API, each with a fresh password: the host
    confined to ``SCOPE`` alone, the bus trusted with every scope. Without the API, the AMQP URL's own user
    plays every part (and the story says so)."""
    own = amqp_nodes(settings.amqp_url)[0].user or "guest"
    alone = Cast(settings.amqp_url, own, settings.amqp_url, own, confined=False)
    access = settings.management()
    grants = BrokerGrants.connect(
        access.url, access.user, access.password, access.vhost, timeout=MANAGEMENT_TIMEOUT_SECONDS
    )
    host_password, bus_password = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    try:
        await grants.add_user(users.host, host_password)
        # Exactly the demo's scope, whatever the user was granted before: grant's own code, made whole.
        await grants.set_scopes(users.host, [SCOPE])
        await grants.add_user(users.bus, bus_password)
        await grants.trust(users.bus)
    except httpx.HTTPError as exc:
        await _remove_quietly(grants, users)
        say(
            f"RabbitMQ's management API does not answer at {safe_url(access.url)} ({type(exc).__name__}), so the "
            f"host, the approver and the bus all act as {own}, the AMQP URL's own user; `{ENABLE_MANAGEMENT}` lets the "
            "demo confine its host to its scope."
        )
        return alone
    except ManagementError as exc:
        await _remove_quietly(grants, users)
        say(
            f"RabbitMQ's management API at {safe_url(access.url)} would not create the demo's users "
            f"({exc.detail}), so the host, the approver and the bus all act as {own}, the AMQP URL's own user."
        )
        return alone
    finally:
        await grants.close()
    return Cast(
        _as(settings.amqp_url, users.host, host_password),
        users.host,
        _as(settings.amqp_url, users.bus, bus_password),
        users.bus,
        confined=True,
    )


async def _remove_quietly(grants: BrokerGrants, users: DemoUsers) -> None:
    """Delete the demo's users as far as the management API lets it (a half-made cast included)."""
    for user in (users.host, users.bus):
        with contextlib.suppress(httpx.HTTPError, ManagementError):
            await grants.remove_user(user)


async def dismiss(settings: Settings, users: DemoUsers = DemoUsers()) -> None:
    """Delete the demo's users: the end of every demo that made them."""
    access = settings.management()
    grants = BrokerGrants.connect(
        access.url, access.user, access.password, access.vhost, timeout=MANAGEMENT_TIMEOUT_SECONDS
    )
    try:
        await _remove_quietly(grants, users)
    finally:
        await grants.close()


def _turns(*turns: dict[str, object]) -> list[ScriptTurn]:
    return [ScriptTurn.model_validate(t) for t in turns]


def demo_runs(approver: str) -> dict[str, StartCommand]:
    suffix = uuid.uuid4().hex[:6]

    def run(name: str, text: str, script: list[ScriptTurn]) -> tuple[str, StartCommand]:
        run_id = f"{name}-{suffix}"
        return run_id, StartCommand(
            scope=SCOPE, run_id=run_id, agent_id="demo", input=text, script=script, pause_ttl_seconds=600
        )

    return dict(
        [
            run(
                "weather",
                "What's the weather in Lyon?",
                _turns(
                    {"call": [{"tool": "lookup", "arguments": {"query": "weather in Lyon"}}]},
                    {"say": "It is sunny in Lyon."},
                ),
            ),
            run(
                "invoice",
                "Send the Q3 invoice and charge the card.",
                _turns(
                    {"call": [{"tool": "charge", "arguments": {"amount": 120}}]},
                    {
                        "call": [
                            {
                                "tool": "send_email",
                                "arguments": {
                                    "to": "billing@example.com",
                                    "subject": "Q3 invoice",
                                    "body": "Attached.",
                                    "approvers": [approver],
                                },
                            }
                        ]
                    },
                    {"say": "Invoice sent and card charged."},
                ),
            ),
            run(
                "quote",
                "Ask the pricing agent for a quote.",
                _turns(
                    {
                        "call": [
                            {"tool": "ask_agent", "arguments": {"agent": "pricer", "question": "Quote for 3 seats?"}}
                        ]
                    },
                ),
            ),
        ]
    )


def _describe(notice: Notice) -> str:
    calls = ", ".join(f"{p.name}({p.arguments})" for p in notice.pending)
    deadline = f", deadline {notice.expires_at:%H:%M:%S}" if notice.expires_at else ""
    return f"{notice.run_id} paused ({notice.reason.value}) for {calls}{deadline}"


async def play(settings: Settings, say: Say, users: DemoUsers = DemoUsers()) -> int:
    """Play the demo; returns how many runs completed."""
    say("Preparing the database and the broker topology...")
    if await ensure_database(settings.database_url):
        say("  created the database")
    for applied in await migrate(settings.database_url):
        say(f"  applied migration {applied.version:04d}_{applied.name}")
    actors = await cast(settings, say, users)
    try:
        return await _perform(settings.model_copy(update={"bus_user": actors.bus_user}), say, actors)
    finally:
        if actors.confined:
            await dismiss(settings, users)


async def _perform(settings: Settings, say: Say, actors: Cast) -> int:
    """The three runs, played by ``actors``; returns how many completed."""

    async with (
        running_worker(settings) as worker,
        await HostClient.connect(actors.host_url, name="intermission-demo host") as host,
        await BusClient.connect(actors.bus_url, name="intermission-demo bus") as bus,
        # A throwaway listener: a durable queue would outlive the demo and fill up with nobody reading it.
        host.subscribe(SCOPE, exclusive=True) as events,
    ):
        say(f"Worker {worker.fleet.owner} is consuming; the host, an approver and a bus peer are listening.")
        if actors.confined:
            say(
                f"  The host {actors.host_user}, who is also the approver, is confined to {SCOPE} by the broker: it "
                f"may publish and hear nothing of any other scope. The bus peer is {actors.bus_user}, trusted with "
                "every scope, and the only user whose replies the worker takes."
            )
        else:
            say(f"  The host, the approver and the bus peer are all {actors.host_user}, trusted with every scope.")
        runs = demo_runs(approver=actors.host_user)
        for run_id, command in runs.items():
            await host.start(command)
            say(f"▶ host started {run_id}: {command.input!r}")
        done: dict[str, RunEvent] = {}
        async with asyncio.timeout(TIMEOUT_SECONDS):
            async for received in events:
                event = received.event
                if isinstance(event, Notice) and event.run_id in runs:
                    say(f"⏸ {_describe(event)}")
                    await _answer(event, host, bus, say)
                elif isinstance(event, RunEvent) and event.run_id in runs:
                    if event.kind is RunEventKind.RESUMED:
                        say(f"↻ {event.run_id} resumed (revision {event.revision})")
                    else:
                        detail = event.output if event.output is not None else event.error
                        say(f"■ {event.run_id} {event.kind.value}: {detail}")
                        done[event.run_id] = event
                        if len(done) == len(runs):
                            break
                elif isinstance(event, CommandRejected):
                    say(f"✗ command {event.message_id} refused: {event.code} ({event.detail})")
        completed = sum(e.kind is RunEventKind.COMPLETED for e in done.values())
        say(f"Done: {completed} of {len(runs)} runs completed. Every pause was durable; every resume exactly once.")
        return completed


async def _answer(notice: Notice, host: HostClient, bus: BusClient, say: Say) -> None:
    version = version_of(notice)
    if notice.reason is SuspendReason.EXTERNAL_TOOL:
        answers = [ToolAnswer(call_id=p.id, content="sunny, 24°C") for p in notice.pending]
        await host.resume(ResumeCommand(scope=notice.scope, version=version, results=answers))
        say("  → the host ran the lookup and sent the result")
    elif notice.reason is SuspendReason.APPROVAL:
        assert notice.checkpoint_id is not None
        await host.decide(
            DecideCommand(
                scope=notice.scope,
                version=version,
                checkpoint_id=notice.checkpoint_id,
                decision=Decision.APPROVE,
                reason="looks right",
            )
        )
        say(f"  → approver {host.user_id} approved checkpoint {notice.checkpoint_id}")
    else:
        call = notice.pending[0]
        reply = json.dumps({"performative": "inform", "sender": "pricer", "content": "3 seats: 270 EUR/month"})
        await bus.reply(notice.scope, version, call.reply_with, reply)
        say(f"  → the bus delivered the pricer's reply to {call.reply_with}")
