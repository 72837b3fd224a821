"""A bus reply delivered again after its run moved on (paused again, or ended) is a duplicate: acknowledged
with no second effect and NO refusal (docs/contracts.md). Found by the soak (bench/soak): the reply's
idempotency record is its admission, but the live pause was looked up first, so a redelivery that came
after the run had left that pause was refused as run_conflict or not_suspended."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from intermission.agent.loop import default_executor
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker, running_worker
from intermission.publishers.clients import BusClient, HostClient, Subscription, version_of
from intermission.schemas.commands import ReplyCommand
from intermission.schemas.errors import NotSuspended, RunConflict
from intermission.schemas.events import RunEvent, RunEventKind
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, Notice
from intermission.store import Stores
from intermission.store.inbox import AlreadyApplied
from intermission.wire import DEAD_EXCHANGE, EVENTS_EXCHANGE
from tests.support.amqp import DELIVERY_LIMIT, Broker, Capture, CaptureFactory, Vhost
from tests.support.fleet import Worker as LocalWorker
from tests.support.fleet import fast_settings, outbox_keys, start_command, worker

WAIT = 20.0
TWO_ASKS: list[dict[str, Any]] = [
    {"call": [{"tool": "ask_agent", "arguments": {"agent": "pricer", "question": "first?"}}]},
    {"call": [{"tool": "ask_agent", "arguments": {"agent": "pricer", "question": "second?"}}]},
    {"say": "both answered"},
]


def answer(content: str) -> str:
    return json.dumps({"performative": "inform", "sender": "pricer", "content": content})


async def reply_to(stores: Stores, scope: Scope, run_id: str, content: str) -> ReplyCommand:
    s = await stores.at(scope).suspensions.get_suspension(run_id)
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.PAUSED
    version = ClaimVersion(run_id=run_id, suspension_id=s.id, run_revision=run.revision)
    return ReplyCommand(scope=scope, version=version, reply_with=s.pending[0].reply_with, input=answer(content))


@pytest.fixture
async def local(stores: Stores, database_url: str) -> AsyncIterator[LocalWorker]:
    one = worker(stores, fast_settings(database_url))
    yield one
    await one.fleet.stop(grace=5)


async def test_the_same_reply_again_after_the_run_moved_on_is_a_duplicate_not_a_refusal(
    stores: Stores, scope: Scope, local: LocalWorker
) -> None:
    cmd = start_command(scope, TWO_ASKS)
    await local.control.start(cmd)
    await local.drain()
    first = await reply_to(stores, scope, cmd.run_id, "one")
    assert await local.control.reply(first, correlation_id="bus-1") is not None
    await local.drain()
    # The run paused again, on its second ask: the first reply, delivered again, changes nothing and is
    # not refused.
    second = await reply_to(stores, scope, cmd.run_id, "two")
    assert second.version.suspension_id != first.version.suspension_id
    with pytest.raises(AlreadyApplied):
        await local.control.reply(first, correlation_id="bus-1")
    # A DIFFERENT reply to the pause the run left is still refused.
    with pytest.raises(RunConflict):
        await local.control.reply(first.model_copy(update={"input": answer("another")}), correlation_id="bus-x")
    assert await local.control.reply(second, correlation_id="bus-2") is not None
    await local.drain()
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).state is RunState.COMPLETED
    # The run ended: both replies, delivered again, are duplicates; a different one is refused.
    for again in (first, second):
        with pytest.raises(AlreadyApplied):
            await local.control.reply(again)
    with pytest.raises(NotSuspended):
        await local.control.reply(second.model_copy(update={"input": answer("late")}))
    # A reply at another scope finds nothing, even where the identical reply was admitted in its own.
    with pytest.raises(NotSuspended):
        await local.control.reply(second.model_copy(update={"scope": Scope(app=scope.app, tenant="elsewhere")}))
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 2


@pytest.fixture
def settings(database_url: str, amqp_url: str, rabbit: Broker) -> Settings:
    # Prefetch 1: the worker takes the reply queue's messages one at a time, in the order they were sent.
    return fast_settings(
        database_url, amqp_url=amqp_url, bus_user=rabbit.bus.name, delivery_limit=DELIVERY_LIMIT, prefetch=1
    )


@pytest.fixture
async def running(settings: Settings, stores: Stores) -> AsyncIterator[Worker]:
    async with running_worker(settings, executor=default_executor(), stores=stores) as w:
        yield w


async def all_handled(bus: BusClient, scope: Scope, refusals: Capture) -> None:
    """Send a sentinel reply (refused: its run does not exist) after the others; once its refusal is heard,
    every reply sent before it was handled (one at a time, in order)."""
    sentinel = f"sentinel-{uuid.uuid4().hex}"
    ghost = ClaimVersion(run_id=f"ghost-{uuid.uuid4().hex[:12]}", suspension_id=1, run_revision=1)
    await bus.reply(scope, ghost, "rw-ghost", answer("nobody asked"), message_id=sentinel)
    await refusals.wait_ids({f"rejected:{sentinel}"}, within=WAIT)


async def next_notice(asks: Subscription[Notice], run_id: str) -> Notice:
    async for received in asks:
        if received.event.run_id == run_id:
            return received.event
    raise AssertionError("the subscription ended")


async def completed(events: Subscription[Any], run_id: str) -> None:
    async for received in events:
        event = received.event
        if isinstance(event, RunEvent) and event.run_id == run_id and event.kind is RunEventKind.COMPLETED:
            return
    raise AssertionError("the subscription ended")


async def test_a_reply_redelivered_through_the_broker_after_the_run_moved_on_is_acknowledged_quietly(
    stores: Stores,
    scope: Scope,
    running: Worker,
    rabbit: Broker,
    amqp_vhost: Vhost,
    amqp_url: str,
    capture: CaptureFactory,
) -> None:
    refusals = await capture(amqp_url, EVENTS_EXCHANGE, "command.rejected.#")
    dead = await capture(amqp_url, DEAD_EXCHANGE, "")
    cmd = start_command(scope, TWO_ASKS)
    async with (
        await HostClient.connect(amqp_vhost.url(rabbit.host), name="test host") as host,
        await BusClient.connect(amqp_vhost.url(rabbit.bus), name="test bus") as bus,
        host.subscribe(scope) as events,
        bus.subscribe() as asks,
    ):
        await host.start(cmd)
        ask = await next_notice(asks, cmd.run_id)
        first_id = f"reply-{uuid.uuid4().hex}"
        await bus.reply(scope, version_of(ask), ask.pending[0].reply_with, answer("one"), message_id=first_id)
        again = await next_notice(asks, cmd.run_id)
        assert again.suspension_id != ask.suspension_id
        # The first reply again, under its own message id, while the run waits on its second ask.
        await bus.reply(scope, version_of(ask), ask.pending[0].reply_with, answer("one"), message_id=first_id)
        await all_handled(bus, scope, refusals)
        second_id = f"reply-{uuid.uuid4().hex}"
        await bus.reply(scope, version_of(again), again.pending[0].reply_with, answer("two"), message_id=second_id)
        await completed(events, cmd.run_id)
        # Both again, after the run ended.
        await bus.reply(scope, version_of(ask), ask.pending[0].reply_with, answer("one"), message_id=first_id)
        await bus.reply(scope, version_of(again), again.pending[0].reply_with, answer("two"), message_id=second_id)
        await all_handled(bus, scope, refusals)
        await running.drain()
    refused = {m.json()["message_id"] for m in refusals.messages}
    assert not refused & {first_id, second_id}, refused
    # Only the two sentinels were refused, so only they were dead-lettered.
    await dead.wait_count(2, within=WAIT)
    assert {m.message_id for m in dead.messages} == {m.json()["message_id"] for m in refusals.messages}
    keys = await outbox_keys(stores, scope, cmd.run_id)
    assert keys.count(f"run.resumed.{scope.app}.{scope.tenant}") == 2
    assert (await stores.at(scope).runs.get_run(cmd.run_id)).output == "both answered"
