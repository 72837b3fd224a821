"""Tracing across messages, on the real servers with the SDK's in-memory exporter: a run's trace begins
with its start, goes on through its claim transaction, steps, tool calls and pause, is carried by every
event it causes, and is continued by the resume that answers the pause (the host's own trace, or none,
linked to the pause); a log line of the run names it."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanKind

from intermission.engine.claims import CLAIM
from intermission.engine.commands import Start
from intermission.engine.core import Engine
from intermission.engine.starts import RunDefaults
from intermission.fleet.logs import json_handler
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient, Received, Subscription
from intermission.schemas.commands import StartCommand
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice
from intermission.store import Stores
from intermission.tracing import LINK_BATCH, LINK_COMMAND, LINK_KIND, LINK_PAUSE, LINK_TAKEN_OVER, parsed, trace_id_of
from intermission.wire import TRACEPARENT_HEADER
from tests.support import fleet
from tests.support.batches import answer, held_back, one_batch_at_a_time
from tests.support.tracing import recorded
from tests.support.waiting import eventually

WAIT = 20.0
START_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
START_PARENT = "00f067aa0ba902b7"
RESUME_TRACE = "0af7651916cd43dd8448eb211c80319c"
RESUME_PARENT = "b7ad6b7169203331"
# A local call (a tool span), an external one (the pause), then the answer.
SCRIPT = [
    {"call": [{"tool": "echo", "arguments": {"text": "hello"}}]},
    {"call": [{"tool": "lookup", "arguments": {"query": "q"}}]},
    {"say": "done"},
]


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded() as exporter:
        yield exporter


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """What the worker logs, as its JSON handler writes it (DEBUG and up)."""
    stream = io.StringIO()
    handler = json_handler(stream)
    logger = logging.getLogger("intermission")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def start(scope: Scope) -> StartCommand:
    return StartCommand(
        scope=scope,
        run_id=f"run-{uuid.uuid4().hex[:12]}",
        agent_id="demo",
        input="hi",
        script=[ScriptTurn.model_validate(t) for t in SCRIPT],
    )


async def next_event(events: Subscription[Any], wanted: Callable[[Received[Any]], bool]) -> Received[Any]:
    async with asyncio.timeout(WAIT):
        async for received in events:
            if wanted(received):
                return received
    raise AssertionError("the subscription ended")


def notice_for(run_id: str) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, Notice) and r.event.run_id == run_id


def run_event(run_id: str, kind: RunEventKind) -> Callable[[Received[Any]], bool]:
    return lambda r: isinstance(r.event, RunEvent) and r.event.run_id == run_id and r.event.kind is kind


def trace_of(received: Received[Any]) -> tuple[str, str]:
    """(trace id, span id) of an event's traceparent header."""
    found = parsed(received.headers.get(TRACEPARENT_HEADER))
    assert found is not None, f"{received.routing_key} carries no traceparent: {dict(received.headers)}"
    return f"{found.trace_id:032x}", f"{found.span_id:016x}"


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def parent_of(span: ReadableSpan) -> str | None:
    return f"{span.parent.span_id:016x}" if span.parent is not None else None


def links_of(span: ReadableSpan) -> dict[str, str]:
    """What each link means -> the span id it points to."""
    return {str((link.attributes or {}).get(LINK_KIND)): f"{link.context.span_id:016x}" for link in span.links or []}


class Spans:
    def __init__(self, finished: Sequence[ReadableSpan]) -> None:
        self.all = list(finished)

    def named(self, name: str, run_id: str | None = None) -> list[ReadableSpan]:
        return [
            s
            for s in self.all
            if s.name == name and (run_id is None or (s.attributes or {}).get("intermission.run_id") == run_id)
        ]

    def one(self, name: str, **where: Any) -> ReadableSpan:
        found = [
            s for s in self.all if s.name == name and all((s.attributes or {}).get(k) == v for k, v in where.items())
        ]
        assert len(found) == 1, f"{len(found)} spans {name} {where}: {[s.name for s in self.all]}"
        return found[0]

    def children(self, parent: ReadableSpan, name: str | None = None) -> list[ReadableSpan]:
        _, span_id = hex_ids(parent)
        return [s for s in self.all if parent_of(s) == span_id and (name is None or s.name == name)]


async def spans_of_run(spans: InMemorySpanExporter, run_id: str, continuations: int) -> Spans:
    """The finished spans, once the run's ``continuations`` run.continue spans have ended."""

    async def ended() -> bool:
        return len(Spans(spans.get_finished_spans()).named("run.continue", run_id)) >= continuations

    await eventually(ended, within=WAIT, what=f"{continuations} run.continue span(s) of {run_id}")
    return Spans(spans.get_finished_spans())


async def test_a_run_keeps_its_trace_across_a_pause_answered_in_the_hosts_own_trace(
    scope: Scope, worker: Worker, host: HostClient, spans: InMemorySpanExporter, log_lines: io.StringIO
) -> None:
    cmd = start(scope)
    async with host.subscribe(scope) as events:
        await host.start(cmd, traceparent=traceparent(START_TRACE, START_PARENT))
        notice = await next_event(events, notice_for(cmd.run_id))
        assert isinstance(notice.event, Notice)
        resume_id = await host.resume(answer(notice.event), traceparent=traceparent(RESUME_TRACE, RESUME_PARENT))
        resumed = await next_event(events, run_event(cmd.run_id, RunEventKind.RESUMED))
        completed = await next_event(events, run_event(cmd.run_id, RunEventKind.COMPLETED))
    await worker.drain()

    # Every event of the run is in the run's trace, the start's, though the resume came in another.
    for event in (notice, resumed, completed):
        assert trace_of(event)[0] == START_TRACE, event.routing_key
    found = await spans_of_run(spans, cmd.run_id, 2)

    # The start: a CONSUMER span, the child of the host's span, its transaction a child of it.
    start_span = found.one("run.start process", **{"messaging.message.id": notice.correlation_id})
    assert start_span.kind is SpanKind.CONSUMER
    assert hex_ids(start_span)[0] == START_TRACE
    assert parent_of(start_span) == START_PARENT
    assert (start_span.attributes or {})["intermission.outcome"] == "applied"
    assert (start_span.attributes or {})["intermission.run_id"] == cmd.run_id
    assert len(found.children(start_span, "run.start transaction")) == 1

    # The run continues as the start's child, step by step; the local call and the pause within steps.
    first, second = sorted(found.named("run.continue", cmd.run_id), key=lambda s: s.start_time or 0)
    assert parent_of(first) == hex_ids(start_span)[1]
    steps = found.children(first, "run.step")
    assert len(steps) == 2
    (tool,) = [s for step in steps for s in found.children(step, "execute_tool echo")]
    assert (tool.attributes or {})["gen_ai.tool.name"] == "echo"
    (pause,) = [s for step in steps for s in found.children(step, "run.pause")]
    assert hex_ids(pause)[0] == START_TRACE
    # The Notice carries the pause's own span context: the one its resume links to.
    assert trace_of(notice) == hex_ids(pause)

    # The resume: in the host's trace, linked to the pause it answered.
    resume_span = found.one("run.resume process", **{"messaging.message.id": resume_id})
    assert hex_ids(resume_span)[0] == RESUME_TRACE
    assert parent_of(resume_span) == RESUME_PARENT
    assert links_of(resume_span)[LINK_PAUSE] == hex_ids(pause)[1]
    assert len(found.children(resume_span, "run.resume transaction")) == 1
    # The run goes on in its own trace, from the pause, linked to the command that claimed it.
    assert hex_ids(second)[0] == START_TRACE
    assert parent_of(second) == hex_ids(pause)[1]
    assert links_of(second)[LINK_COMMAND] == hex_ids(resume_span)[1]
    assert found.children(second, "run.step")
    # run.completed was written within the second continuation.
    in_second = {hex_ids(s)[1] for s in [second, *found.children(second)]}
    assert trace_of(completed)[1] in in_second

    # A log line of the run names its trace.
    lines = [json.loads(line) for line in log_lines.getvalue().splitlines()]
    of_run = [line for line in lines if line.get("run_id") == cmd.run_id]
    assert START_TRACE in {line.get("trace_id") for line in of_run}, of_run
    assert {line["trace_id"] for line in of_run if "trace_id" in line} == {START_TRACE}


async def test_a_resume_without_a_traceparent_continues_the_pauses_trace(
    scope: Scope, worker: Worker, host: HostClient, spans: InMemorySpanExporter
) -> None:
    cmd = start(scope)
    async with host.subscribe(scope) as events:
        # No traceparent on the start either: the worker begins the run's trace.
        await host.start(cmd)
        notice = await next_event(events, notice_for(cmd.run_id))
        assert isinstance(notice.event, Notice)
        resume_id = await host.resume(answer(notice.event))
        resumed = await next_event(events, run_event(cmd.run_id, RunEventKind.RESUMED))
        completed = await next_event(events, run_event(cmd.run_id, RunEventKind.COMPLETED))
    await worker.drain()
    found = await spans_of_run(spans, cmd.run_id, 2)

    start_span = found.one("run.start process", **{"messaging.message.id": notice.correlation_id})
    assert start_span.parent is None  # a trace of its own
    run_trace = hex_ids(start_span)[0]
    for event in (notice, resumed, completed):
        assert trace_of(event)[0] == run_trace, event.routing_key
    (pause,) = found.named("run.pause")
    assert trace_of(notice) == hex_ids(pause)

    resume_span = found.one("run.resume process", **{"messaging.message.id": resume_id})
    assert links_of(resume_span)[LINK_PAUSE] == hex_ids(pause)[1]
    second = max(found.named("run.continue", cmd.run_id), key=lambda s: s.start_time or 0)
    assert hex_ids(second)[0] == run_trace
    assert parent_of(second) == hex_ids(pause)[1]
    assert links_of(second)[LINK_COMMAND] == hex_ids(resume_span)[1]


async def test_a_batch_keeps_each_command_in_its_own_trace_linked_to_their_one_transaction(
    scope: Scope, stores: Stores, settings: Settings, host: HostClient, spans: InMemorySpanExporter
) -> None:
    commands = [start(scope) for _ in range(4)]
    run_traces = [uuid.uuid4().hex for _ in commands]
    async with one_batch_at_a_time(settings, stores) as w, host.subscribe(scope) as events:
        heard: list[Received[Any]] = []

        async def until(wanted: Callable[[Received[Any]], bool], count: int) -> list[Received[Any]]:
            async with asyncio.timeout(WAIT):
                while len(found := [r for r in heard if wanted(r)]) < count:
                    heard.append(await anext(aiter(events)))
            return found

        for cmd, trace_id in zip(commands, run_traces, strict=True):
            await host.start(cmd, traceparent=traceparent(trace_id, START_PARENT))
        ids = {c.run_id for c in commands}
        notices = {
            r.event.run_id: r.event
            for r in await until(lambda r: isinstance(r.event, Notice) and r.event.run_id in ids, len(commands))
        }
        blocker, *batched = commands
        async with held_back(stores, w, host, notices[blocker.run_id]) as gathered:
            for cmd in batched:
                await host.resume(answer(notices[cmd.run_id]), traceparent=traceparent(RESUME_TRACE, RESUME_PARENT))
            await gathered(len(batched))
        completed = await until(
            lambda r: isinstance(r.event, RunEvent) and r.event.kind is RunEventKind.COMPLETED, len(commands)
        )
        await w.drain()
        assert max(w.fleet.engine.scheduler.sizes(CLAIM)) == len(batched)

    # Each run's events stay in its own trace, though its resume went through a shared transaction.
    by_run = {r.event.run_id: r for r in completed}
    for cmd, trace_id in zip(commands, run_traces, strict=True):
        assert trace_of(by_run[cmd.run_id])[0] == trace_id

    async def all_ended() -> bool:
        return len(Spans(spans.get_finished_spans()).named("commands transaction")) >= 1

    await eventually(all_ended, within=WAIT, what="the batch's transaction span")
    found = Spans(spans.get_finished_spans())
    # The resumes' claims went in one statement of the claim family (other families batch on their own).
    shared = next(
        s
        for s in found.named("commands transaction")
        if (s.attributes or {})["intermission.batch.size"] == len(batched)
        and (s.attributes or {})["intermission.transition"] == CLAIM.name
    )
    resumes = [
        s
        for s in found.named("run.resume process")
        if s.attributes and s.attributes.get("intermission.run_id") in {c.run_id for c in batched}
    ]
    assert len(resumes) == len(batched)
    linked_from_shared = {f"{link.context.span_id:016x}" for link in shared.links or []}
    for resume in resumes:
        assert hex_ids(resume)[0] == RESUME_TRACE
        assert parent_of(resume) == RESUME_PARENT
        assert hex_ids(resume)[1] in linked_from_shared
        assert links_of(resume)[LINK_BATCH] == hex_ids(shared)[1]
        assert LINK_PAUSE in links_of(resume)


async def test_a_run_taken_over_goes_on_in_its_trace_linked_to_where_it_was(
    stores: Stores, scope: Scope, settings: Settings, spans: InMemorySpanExporter
) -> None:
    # A worker started the run in the host's trace and died holding it: its first snapshot recorded the trace.
    cmd = fleet.start_command(scope, [{"say": "done"}])
    host_span = parsed(traceparent(START_TRACE, START_PARENT))
    assert host_span is not None
    dead = Lease(owner="worker-that-died", ttl_seconds=30)
    defaults = RunDefaults(pause_ttl_seconds=0, max_steps=8)
    with trace.use_span(NonRecordingSpan(host_span)):
        assert await Engine.over(stores, lease=dead, defaults=defaults).apply(Start(cmd)) is not None
    async with stores.db.connection() as con:
        await con.raw.execute("UPDATE runs SET lease_expires_at = now() WHERE id = $1", cmd.run_id)

    taker = fleet.worker(stores, settings)
    assert await taker.fleet.reclaim_once() == 1
    await taker.drain()
    found = await spans_of_run(spans, cmd.run_id, 1)

    (continued,) = found.named("run.continue", cmd.run_id)
    assert (continued.attributes or {})["intermission.taken_over"] is True
    assert hex_ids(continued)[0] == START_TRACE
    assert parent_of(continued) == START_PARENT
    assert links_of(continued)[LINK_TAKEN_OVER] == START_PARENT
    async with stores.db.connection() as con:
        headers = await con.raw.fetchval(
            "SELECT headers FROM outbox WHERE run_id = $1 AND routing_key LIKE 'run.completed.%'", cmd.run_id
        )
    assert trace_id_of(json.loads(headers)[TRACEPARENT_HEADER]) == START_TRACE
