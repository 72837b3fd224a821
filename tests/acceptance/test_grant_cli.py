"""The grant commands as an operator types them: `users add`, `grant`, `grants`, `revoke` and
`grant --print`, against the real broker's management API, in the vhost of INTERMISSION_AMQP_URL."""

from __future__ import annotations

import os

import aio_pika
import aiormq
import pytest

from intermission.publishers.amqp import PublishFailed
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import CancelCommand
from intermission.schemas.scope import Scope
from tests.acceptance.test_messaging_faults import WAIT
from tests.support.amqp import AmqpUser, Vhost
from tests.support.confined import Confiner
from tests.support.worker_process import cli


def cli_env(vhost: Vhost, confiner: Confiner) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERMISSION_")}
    env["INTERMISSION_AMQP_URL"] = vhost.url()
    env["INTERMISSION_MANAGEMENT_URL"] = confiner.management.url
    return env


async def intermission(*args: str, env: dict[str, str]) -> str:
    ran = await cli(*args, env=env, within=WAIT)
    assert ran.code == 0, (args, ran.err[-2000:])
    return ran.out


async def refused(url: str, scope: Scope) -> bool:
    """Whether the broker refuses this user a command keyed for ``scope`` (any other failure raises)."""
    async with await HostClient.connect(url, name="probe") as host:
        try:
            await host.cancel(CancelCommand(scope=scope, run_id="run-1"))
        except PublishFailed as exc:
            if isinstance(exc.__cause__, aiormq.exceptions.ChannelAccessRefused):
                return True
            raise
    return False


async def test_an_operator_confines_a_host_with_the_cli(
    amqp_url: str, amqp_vhost: Vhost, confiner: Confiner, scope: Scope, other_scope: Scope
) -> None:
    env = cli_env(amqp_vhost, confiner)
    name = f"intermission-test-cli-host-{os.getpid()}"
    confiner.made.append(name)
    said = await intermission("users", "add", name, "--password", "s3cret-host", env=env)
    assert said.strip() == f"created {name}: no scope yet (intermission grant)"
    user = AmqpUser(name, "s3cret-host")

    for s in (scope, other_scope):
        said = await intermission("grant", name, "--app", s.app, "--tenant", s.tenant, env=env)
    assert said.strip() == f"{name}: {scope}, {other_scope}"
    assert f"{name}: {scope}, {other_scope}" in await intermission("grants", env=env)
    assert not await refused(amqp_vhost.url(user), other_scope)

    said = await intermission("revoke", name, "--app", other_scope.app, "--tenant", other_scope.tenant, env=env)
    assert said.strip() == f"{name}: {scope}"
    assert (await intermission("grants", name, env=env)).strip() == f"{name}: {scope}"
    assert await refused(amqp_vhost.url(user), other_scope)
    assert not await refused(amqp_vhost.url(user), scope)

    printed = await intermission("grant", name, "--app", scope.app, "--tenant", scope.tenant, "--print", env=env)
    lines = printed.splitlines()
    # The topic permissions first, as the API grant writes them: a failure halfway leaves no vhost access.
    assert [line.split()[:2] for line in lines] == [
        ["rabbitmqctl", "set_topic_permissions"],
        ["rabbitmqctl", "set_topic_permissions"],
        ["rabbitmqctl", "set_permissions"],
    ]
    assert all(f"-p {amqp_vhost.name} {name}" in line for line in lines)


async def test_a_trusted_user_acts_in_every_scope(
    amqp_url: str, amqp_vhost: Vhost, confiner: Confiner, scope: Scope, other_scope: Scope
) -> None:
    env = cli_env(amqp_vhost, confiner)
    name = f"intermission-test-cli-bus-{os.getpid()}"
    confiner.made.append(name)
    said = await intermission("users", "add", name, "--password", "s3cret-bus", "--trusted", env=env)
    assert said.strip() == f"created {name}: every scope"
    url = amqp_vhost.url(AmqpUser(name, "s3cret-bus"))
    assert not await refused(url, scope)
    assert not await refused(url, other_scope)
    # Adding it again only changes the password.
    said = await intermission("users", "add", name, "--password", "new-secret", "--trusted", env=env)
    assert said.strip() == f"updated {name}: every scope"
    with pytest.raises(aiormq.exceptions.ProbableAuthenticationError):
        await aio_pika.connect(url)
