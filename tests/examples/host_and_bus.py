"""How a host and the messaging bus talk to Intermission (the README points here; a test runs it)."""

from __future__ import annotations

import asyncio
import json

from intermission.publishers.clients import BusClient, HostClient, version_of
from intermission.schemas.commands import ResumeCommand, StartCommand, ToolAnswer
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason


async def host_runs_a_lookup(amqp_url: str, scope: Scope, run_id: str) -> str:
    """Start a run, answer its external_tool pause, return its output."""
    async with await HostClient.connect(amqp_url, name="example host") as host, host.subscribe(scope) as events:
        await host.start(
            StartCommand(
                scope=scope,
                run_id=run_id,
                agent_id="demo",
                input="What's the weather?",
                script=[
                    ScriptTurn.model_validate({"call": [{"tool": "lookup", "arguments": {"query": "weather"}}]}),
                    ScriptTurn.model_validate({"say": "Sunny."}),
                ],
            )
        )
        async for received in events:
            event = received.event
            if isinstance(event, Notice) and event.run_id == run_id and event.reason is SuspendReason.EXTERNAL_TOOL:
                # Run each pending call (here: pretend) and answer them all in one resume.
                answers = [ToolAnswer(call_id=call.id, content="sunny") for call in event.pending]
                await host.resume(ResumeCommand(scope=scope, version=version_of(event), results=answers))
            elif isinstance(event, RunEvent) and event.run_id == run_id and event.kind is RunEventKind.COMPLETED:
                return event.output or ""
    raise RuntimeError("the subscription ended")


async def bus_answers_one_ask(bus_url: str, listening: asyncio.Event | None = None) -> str:
    """Answer the next agent_reply pause in any scope; return the run it resumed. ``bus_url`` logs in as
    the user named in INTERMISSION_BUS_USER: the broker-validated user_id is what makes it the bus.
    ``listening`` is set once the subscription is bound (nothing published before that reaches it)."""
    async with await BusClient.connect(bus_url, name="example bus") as bus, bus.subscribe() as asks:
        if listening is not None:
            listening.set()
        async for received in asks:
            notice = received.event
            ask = notice.pending[0]
            reply = json.dumps({"performative": "inform", "sender": "pricer", "content": "42"})
            await bus.reply(notice.scope, version_of(notice), ask.reply_with, reply)
            return notice.run_id
    raise RuntimeError("the subscription ended")
