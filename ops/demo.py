"""``intermission demo``: the whole product on the local servers, told as it happens.

It creates what is missing (the database, its tables, the RabbitMQ topology), starts a worker in this
process, and plays three runs of the demo agent that pause for each reason: a host answers the
``external_tool`` pause, an approver decides the ``approval`` pause, and a bus peer answers the
``agent_reply`` pause. Everything travels as real commands and events through RabbitMQ.

The demo's bus peer connects as the AMQP URL's own user and the worker it starts trusts that user as the
bus (on a fresh broker that is ``guest``); a production fleet names a dedicated user in
``INTERMISSION_BUS_USER``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

from yarl import URL

from intermission.fleet.settings import Settings
from intermission.fleet.worker import running_worker
from intermission.publishers.clients import BusClient, HostClient, version_of
from intermission.schemas.commands import DecideCommand, Decision, ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import CommandRejected, RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store.migrate import ensure_database, migrate

SCOPE = Scope(app="demo", tenant="local")
TIMEOUT_SECONDS = 60.0

Say = Callable[[str], None]


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


async def play(settings: Settings, say: Say) -> int:
    """Play the demo; returns how many runs completed."""
    say("Preparing the database and the broker topology...")
    if await ensure_database(settings.database_url):
        say("  created the database")
    for applied in await migrate(settings.database_url):
        say(f"  applied migration {applied.version:04d}_{applied.name}")
    user = URL(settings.amqp_url).user or "guest"
    settings = settings.model_copy(update={"bus_user": user})

    async with (
        running_worker(settings) as worker,
        await HostClient.connect(settings.amqp_url, name="intermission-demo host") as host,
        await BusClient.connect(settings.amqp_url, name="intermission-demo bus") as bus,
        # A throwaway listener: a durable queue would outlive the demo and fill up with nobody reading it.
        host.subscribe(SCOPE, exclusive=True) as events,
    ):
        say(f"Worker {worker.fleet.owner} is consuming; the host, an approver ({user}) and a bus peer are listening.")
        runs = demo_runs(approver=user)
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
