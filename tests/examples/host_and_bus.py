"""How a host and the messaging bus talk to Intermission (the README points here; a test runs it).

A subscription reads, by default, a durable queue named after the connection's user and the scope
(``<user>.<app>.<tenant>``), so a pause published while the host is down or restarting waits there for it.
Each event is acknowledged when the loop asks for the next one (or the ``async with`` block is left
without an error): a handler that raises, or a process that dies, gets the same event again. Handlers are
therefore written to be safe to run twice for one ``message_id``: a resume with a ``message_id`` derived
from the event, as below, is a duplicate the second time, not a second effect. A throwaway listener asks
for ``exclusive=True``.
"""

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
                # Run each pending call (here: pretend) and answer them all in one resume. Its message_id is
                # the notice's own: if this handler runs again for the same notice (it raised, or the
                # process died before asking for the next event), the second resume is a duplicate.
                answers = [ToolAnswer(call_id=call.id, content="sunny") for call in event.pending]
                await host.resume(
                    ResumeCommand(scope=scope, version=version_of(event), results=answers),
                    message_id=f"resume:{received.message_id}",
                )
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


async def watch_a_run(amqp_url: str, scope: Scope, run_id: str, listening: asyncio.Event | None = None) -> list[str]:
    """A throwaway listener (a dashboard, a tail of the events): an exclusive queue of its own, gone with the
    subscription, which misses whatever is published while it is not there. The routing keys of
    ``run_id``'s events until it ends. ``listening`` is set once the subscription is bound."""
    keys: list[str] = []
    async with (
        await HostClient.connect(amqp_url, name="example watcher") as host,
        host.subscribe(scope, exclusive=True) as events,
    ):
        if listening is not None:
            listening.set()
        async for received in events:
            event = received.event
            if event.run_id != run_id:
                continue
            keys.append(received.routing_key)
            if isinstance(event, RunEvent) and event.kind is not RunEventKind.RESUMED:
                return keys
    raise RuntimeError("the subscription ended")
