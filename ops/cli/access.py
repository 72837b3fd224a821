"""Who may do what on the broker: ``users add``, ``grant``, ``revoke`` and ``grants``, over RabbitMQ's
management HTTP API (``ops/grants.py``)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click

from intermission.fleet.settings import Settings
from intermission.ops.cli.app import emit_json, json_option, load_settings, main, run_or_exit, scope_of
from intermission.ops.grants import (
    BrokerGrants,
    check_grantable,
    check_not_fleet,
    check_user_name,
    fleet_identities,
    rabbitmqctl_lines,
)
from intermission.schemas.errors import InvalidArgument
from intermission.schemas.scope import Scope

T = TypeVar("T")


async def _with_grants(settings: Settings, use: Callable[[BrokerGrants], Awaitable[T]]) -> T:
    access = settings.management()
    grants = BrokerGrants.connect(access.url, access.user, access.password, access.vhost)
    try:
        return await use(grants)
    finally:
        await grants.close()


def _required_scope(app: str, tenant: str) -> Scope:
    scope = scope_of(app, tenant)
    assert scope is not None  # both options are required
    return scope


def _print_scopes(user: str, scopes: list[Scope]) -> None:
    click.echo(f"{user}: {', '.join(str(s) for s in scopes) if scopes else 'no scope'}")


@main.group("users")
def users_group() -> None:
    """RabbitMQ users for hosts and for the fleet's own identities."""


@users_group.command("add")
@click.argument("user")
@click.option("--password-stdin", is_flag=True, help="read the password from standard input (its first line)")
@click.option(
    "--password-file",
    type=click.Path(exists=True, dir_okay=False),
    help="read the password from this file (its first line), such as a mounted secret",
)
@click.option(
    "--password",
    help="the password itself; it then shows in the shell's history and the process list: prefer the others",
)
@click.option("--trusted", is_flag=True, help="every scope: for workers, sweepers and the bus, never a host")
def users_add_command(
    user: str, password_stdin: bool, password_file: str | None, password: str | None, trusted: bool
) -> None:
    """Create the RabbitMQ user USER with no rights (a host, to be granted scopes with `grant`), or with
    every right (--trusted). An existing user gets the new password and keeps its rights and tags, unless
    --trusted. Without a password option, the password is asked for."""
    if not trusted:
        try:
            check_user_name(user)
        except InvalidArgument as exc:
            raise click.BadParameter(exc.detail, param_hint="USER") from exc
    secret = _password(password_stdin, password_file, password)
    settings = load_settings()

    async def run(grants: BrokerGrants) -> None:
        created = await grants.add_user(user, secret)
        if trusted:
            await grants.trust(user)
        rights = "every scope" if trusted else "no scope yet (intermission grant)"
        click.echo(f"{'created' if created else 'updated'} {user}: {rights}")

    run_or_exit("users add", _with_grants(settings, run), settings)


def _password(from_stdin: bool, path: str | None, given: str | None) -> str:
    """The one password the options name, from standard input, a file, the command line, or a prompt."""
    if sum((from_stdin, path is not None, given is not None)) > 1:
        raise click.UsageError("give the password one way: --password-stdin, --password-file or --password")
    found: str
    if from_stdin:
        found = sys.stdin.readline().rstrip("\r\n")
    elif path is not None:
        with open(path, encoding="utf-8") as file:
            found = file.readline().rstrip("\r\n")
    elif given is not None:
        found = given
    else:
        found = str(click.prompt("Password", hide_input=True, confirmation_prompt=True))
    if not found:
        raise click.UsageError("the password is empty")
    return found


@main.command("grant")
@click.argument("user")
@click.option("--app", required=True)
@click.option("--tenant", required=True)
@click.option("--print", "print_only", is_flag=True, help="print the rabbitmqctl commands instead of applying them")
def grant_command(user: str, app: str, tenant: str, print_only: bool) -> None:
    """Let the RabbitMQ user USER act as a host for one more scope, and for nothing else. A user trusted with
    every scope until now is confined to this one, and its connections are closed."""
    scope = _required_scope(app, tenant)
    settings = load_settings()
    try:
        check_user_name(user)
        check_not_fleet(user, fleet_identities(settings))
        check_grantable(scope)
    except InvalidArgument as exc:
        raise click.BadParameter(exc.detail, param_hint="USER or --app/--tenant") from exc
    if print_only:
        for line in rabbitmqctl_lines(user, [scope], settings.management().vhost):
            click.echo(line)
        return

    async def run() -> None:
        granted = await _with_grants(settings, lambda g: g.grant_scope(user, scope))
        if granted.was_trusted:
            click.echo(
                f"{user} was trusted with every scope: it is confined now, and its {granted.connections_closed} "
                "open connection(s) were closed"
            )
        _print_scopes(user, granted.scopes)

    run_or_exit("grant", run(), settings)


@main.command("revoke")
@click.argument("user")
@click.option("--app", required=True)
@click.option("--tenant", required=True)
def revoke_command(user: str, app: str, tenant: str) -> None:
    """Take one scope away from the RabbitMQ user USER; with none left it may do nothing at all."""
    scope = _required_scope(app, tenant)
    settings = load_settings()
    try:
        # A trusted user has no scope list to take one from: revoking would take everything, and the
        # fleet's own identities would stop the fleet.
        check_not_fleet(user, fleet_identities(settings))
    except InvalidArgument as exc:
        raise click.BadParameter(exc.detail, param_hint="USER") from exc

    async def run() -> None:
        _print_scopes(user, await _with_grants(settings, lambda g: g.revoke(user, scope)))

    run_or_exit("revoke", run(), settings)


@main.command("grants")
@click.argument("user", required=False)
@json_option
def grants_command(user: str | None, as_json: bool) -> None:
    """The scopes each confined host user (or USER) may act for."""
    settings = load_settings()

    async def run() -> dict[str, list[Scope]]:
        if user is not None:
            return {user: await _with_grants(settings, lambda g: g.scopes(user))}
        return await _with_grants(settings, lambda g: g.all_grants())

    everyone = run_or_exit("grants", run(), settings)
    if as_json:
        emit_json({"grants": {name: [str(s) for s in scopes] for name, scopes in everyone.items()}})
        return
    for name in sorted(everyone):
        _print_scopes(name, everyone[name])
    if not everyone:
        click.echo("no confined users")
