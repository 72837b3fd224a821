"""The test harness must never break the shared broker: a vhost deleted right after a RabbitMQ restart
used to kill the node's dead-letter supervisor (bench/rabbitctl.py), after which no test could declare
the topology until somebody restarted RabbitMQ by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.amqp import Broker, Vhost, declare_topology
from tests.support.rabbitctl import delete_expression, rabbitmqctl

SUPERVISOR_ALIVE = "is_pid(whereis(rabbit_fifo_dlx_sup))."


@pytest.fixture
async def healed(rabbit: Broker) -> AsyncIterator[None]:
    """If the test broke the node after all, mend it, so that the rest of the session can go on."""
    yield
    if (await rabbitmqctl(rabbit.ctl, "eval", SUPERVISOR_ALIVE)).strip() != "true":
        async with rabbit.admin:
            await rabbitmqctl(rabbit.ctl, "stop_app")
            await rabbitmqctl(rabbit.ctl, "start_app")


async def test_vhosts_deleted_the_instant_the_broker_is_back_leave_the_node_able_to_declare_the_topology(
    rabbit: Broker, amqp_vhost: Vhost, healed: None
) -> None:
    # Several vhosts, so that many queues recover at once and their dead-letter workers' first calls are in
    # flight when the deletion comes.
    doomed = [await rabbit.take_vhost() for _ in range(4)]
    for name in doomed:
        await declare_topology(Vhost(name, rabbit.base_url).url())

    async with rabbit.stopped():
        # The app started and the vhosts deleted in ONE evaluation inside the node: no gap at all between
        # the two, the worst case of a teardown that deletes as soon as the broker is back. Without the
        # wait for the dead-letter workers this kills rabbit_fifo_dlx_sup nearly every time.
        output = await rabbitmqctl(
            rabbit.ctl, "eval", f"ok = rabbit:start(), {delete_expression(doomed, [], 'intermission-tests')}"
        )

    assert output.strip() == "[]"
    assert (await rabbitmqctl(rabbit.ctl, "eval", SUPERVISOR_ALIVE)).strip() == "true"
    await declare_topology(amqp_vhost.url())
