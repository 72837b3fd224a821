"""Granting a RabbitMQ user the scopes it may act for: tenants confined by the broker itself.

A host user holds exactly these permissions on the vhost (docs/contracts.md, "Who may publish and read
what"), for the scopes it was granted:

- configure, write and read on its own queues only (``<user>.*``; not the server-named ``amq.gen-*``,
  which belong to nobody the broker can tell, so a revocation could not find them);
- write on ``intermission.commands``, and there only routing keys ``run.<command>.<app>.<tenant>`` of its
  scopes (a topic write permission), so the bare key and every other scope's key are refused by the broker;
- read on ``intermission.events``, and there only bindings of its scopes' keys (a topic read permission:
  ``<kind>.<detail>.<app>.<tenant>``), so a binding of ``#`` or of another scope's keys is refused;
- nothing else: in particular no write on ``intermission.events``, so a host cannot forge an event.

RabbitMQ holds ONE set of permissions per user and vhost and one topic permission per exchange, so a user's
scopes live in the topic patterns, as an alternation of escaped ``app\\.tenant`` pairs; granting or revoking
rewrites them whole. Every pattern is built here from validated scope names (``[A-Za-z0-9_-]{1,64}``),
escaped, never from text a caller typed.

Every change fails closed. A user's topic permissions are written before its vhost permissions (without
them RabbitMQ lets a user publish any routing key), so a failure halfway leaves a user that can do less,
never more; any narrowing closes the user's connections (RabbitMQ caches permission checks per connection)
and removes the revoked scopes' bindings from every queue it may read. A user name is checked against the
patterns it is used in: no dots (``acme``'s queues, ``acme.*``, would hold ``acme.eu``'s), and none of the
names whose ``<name>.*`` is the broker's or the product's own (``amq``, ``intermission``).

The management HTTP API applies the grants (``INTERMISSION_MANAGEMENT_URL``, with the credentials of
``INTERMISSION_MANAGEMENT_USER``/``_PASSWORD``); ``rabbitmqctl_lines`` gives the same grants as commands
for operators without the API.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import quote, unquote, urlsplit

import httpx

from intermission.schemas.errors import InvalidArgument
from intermission.schemas.scope import Reach, Scope
from intermission.wire import COMMANDS_EXCHANGE, EVENTS_EXCHANGE, UNREADABLE_SCOPE

if TYPE_CHECKING:
    from intermission.fleet.settings import Settings

# A user name the patterns can hold: what a scope part may be, so that ``<user>\.`` is never a prefix of
# another user's namespace.
USER_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Names whose ``<name>.*`` namespace is the broker's (``amq.gen-*``, ``amq.topic``) or the product's
# (``intermission.commands``, the command queues, ``intermission.dead``).
RESERVED_USER_NAMES: Final = frozenset({"amq", "intermission"})

_ALTERNATION = re.compile(r"^\(\?:(?P<scopes>.*)\)\$$")
_COMMAND_KEYS_PREFIX = r"^run\.[a-z]+\."
_EVENT_KEYS_PREFIX = r"^[^.]+\.[^.]+\."
# What a user confined to no scope may match: nothing (RabbitMQ reads an empty pattern as "nothing").
NOTHING = "^$"


class ManagementError(InvalidArgument):
    """The management API refused a request, or a user's permissions are not ones ``grant`` made."""

    code = "management_error"


@dataclass(frozen=True)
class Granted:
    """What a grant did: the user's scopes now, and whether it was trusted with every scope before (it is
    then confined, and its connections were closed)."""

    scopes: list[Scope]
    was_trusted: bool
    connections_closed: int


@dataclass(frozen=True)
class Permissions:
    """Everything a host user is granted on the vhost, for its scopes."""

    configure: str
    write: str
    read: str
    commands_write: str
    events_read: str


def _scope_alternation(scopes: list[Scope]) -> str:
    pairs = sorted({f"{re.escape(s.app)}\\.{re.escape(s.tenant)}" for s in scopes})
    return "(?:" + "|".join(pairs) + ")$"


def check_user_name(user: str) -> None:
    """InvalidArgument unless ``user`` can be a host's name in the permission patterns."""
    if not USER_NAME.fullmatch(user):
        raise InvalidArgument(
            f"the user name {user!r} cannot be confined: use letters, digits, '_' and '-' only (at most 128), "
            "no dots, so that no user's queues are inside another's"
        )
    if user.lower() in RESERVED_USER_NAMES:
        raise InvalidArgument(f"the user name {user!r} is reserved: its queues would be the broker's or the fleet's")


def fleet_identities(settings: Settings) -> frozenset[str]:
    """The users a deployment's settings name as the fleet's own: the bus, the AMQP URL's user (the
    workers' and the operators') and the management API's."""
    access = settings.management()
    return frozenset({settings.bus_user, unquote(urlsplit(settings.amqp_url).username or "guest"), access.user})


def check_not_fleet(user: str, fleet: Collection[str]) -> None:
    """InvalidArgument when ``user`` is one of the fleet's own identities: confined to a scope, the bus would
    stop answering other tenants' pauses and a worker would stop consuming."""
    if user in fleet:
        raise InvalidArgument(
            f"the user {user!r} is one of the fleet's own identities (bus, workers, management): it keeps every "
            "scope; a host needs a user of its own"
        )


def check_grantable(scope: Scope) -> None:
    """InvalidArgument for the placeholder scope of refusals whose scope could not be read: whoever held it
    would hear every such refusal, of every tenant."""
    if scope.routing_suffix() == UNREADABLE_SCOPE:
        raise InvalidArgument(f"the scope {UNREADABLE_SCOPE} is reserved for refusals of unreadable commands")


def own_queues(user: str) -> str:
    return rf"{re.escape(user)}\..*"


def host_permissions(user: str, scopes: list[Scope]) -> Permissions:
    if not scopes:
        raise InvalidArgument("a host user needs at least one scope")
    check_user_name(user)
    for scope in scopes:
        check_grantable(scope)
    alternation = _scope_alternation(scopes)
    queues = own_queues(user)
    return Permissions(
        configure=f"^({queues})$",
        write=f"^({re.escape(COMMANDS_EXCHANGE)}|{queues})$",
        read=f"^({re.escape(EVENTS_EXCHANGE)}|{queues})$",
        commands_write=_COMMAND_KEYS_PREFIX + alternation,
        events_read=_EVENT_KEYS_PREFIX + alternation,
    )


def scopes_of(commands_write: str) -> list[Scope]:
    """The scopes a topic write pattern on ``intermission.commands`` grants, if ``grant`` wrote it."""
    if commands_write in ("", NOTHING):
        return []
    if not commands_write.startswith(_COMMAND_KEYS_PREFIX):
        raise ManagementError(f"the topic permission {commands_write!r} was not made by intermission grant")
    found = _ALTERNATION.match(commands_write[len(_COMMAND_KEYS_PREFIX) :])
    if found is None:
        raise ManagementError(f"the topic permission {commands_write!r} was not made by intermission grant")
    scopes = []
    for pair in found.group("scopes").split("|"):
        app, sep, tenant = pair.partition("\\.")
        if not sep:
            raise ManagementError(f"the topic permission {commands_write!r} was not made by intermission grant")
        try:
            scopes.append(Scope(app=_unescape(app), tenant=_unescape(tenant)))
        except ValueError as exc:
            raise ManagementError(f"the topic permission {commands_write!r} names no valid scope") from exc
    return scopes


def permits(pattern: str, resource: str) -> bool:
    """Whether RabbitMQ's permission ``pattern`` lets a user at ``resource``: it searches the name with the
    regular expression (unanchored unless the pattern anchors itself), and an empty pattern matches
    nothing. A pattern Python's ``re`` cannot read matches nothing here: a person is shown too little
    rather than too much."""
    if not pattern:
        return False
    try:
        return re.search(pattern, resource) is not None
    except re.error:
        return False


def _unescape(escaped: str) -> str:
    return re.sub(r"\\(.)", r"\1", escaped)


def rabbitmqctl_lines(user: str, scopes: list[Scope], vhost: str) -> list[str]:
    """The same grant as ``rabbitmqctl`` commands."""
    if not scopes:
        return [
            f"rabbitmqctl clear_permissions -p {shlex.quote(vhost)} {shlex.quote(user)}",
            f"rabbitmqctl clear_topic_permissions -p {shlex.quote(vhost)} {shlex.quote(user)}",
        ]
    p = host_permissions(user, scopes)
    q = shlex.quote
    who = f"-p {q(vhost)} {q(user)}"
    # In the order set_scopes writes them, for the same reason: an operator whose last line fails is left
    # with a user the topic permissions confine and no vhost access, never the reverse.
    return [
        f"rabbitmqctl set_topic_permissions {who} {COMMANDS_EXCHANGE} {q(p.commands_write)} {q(NOTHING)}",
        f"rabbitmqctl set_topic_permissions {who} {EVENTS_EXCHANGE} {q(NOTHING)} {q(p.events_read)}",
        f"rabbitmqctl set_permissions {who} {q(p.configure)} {q(p.write)} {q(p.read)}",
    ]


class BrokerGrants:
    """Grants over the management HTTP API, for one vhost."""

    def __init__(self, client: httpx.AsyncClient, vhost: str) -> None:
        self._client = client
        self.vhost = vhost

    @classmethod
    def connect(cls, url: str, user: str, password: str, vhost: str, *, timeout: float = 10.0) -> BrokerGrants:
        return cls(httpx.AsyncClient(base_url=url, auth=(user, password), timeout=timeout), vhost)

    async def close(self) -> None:
        await self._client.aclose()

    def _path(self, *parts: str) -> str:
        return "/api/" + "/".join(quote(p, safe="") for p in parts)

    async def _request(self, method: str, path: str, json: object | None = None) -> httpx.Response:
        response = await self._client.request(method, path, json=json)
        if response.status_code >= 400 and not (method == "DELETE" and response.status_code == 404):
            raise ManagementError(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return response

    async def scopes(self, user: str) -> list[Scope]:
        """The scopes ``user`` is granted on this vhost (none when it has no topic permission)."""
        response = await self._client.get(self._path("topic-permissions", self.vhost, user))
        if response.status_code == 404:
            return []
        if response.status_code >= 400:
            raise ManagementError(f"reading {user}'s permissions: {response.status_code} {response.text[:300]}")
        for entry in response.json():
            if entry.get("exchange") == COMMANDS_EXCHANGE:
                return scopes_of(str(entry.get("write", "")))
        return []

    async def reach(self, user: str) -> Reach:
        """What ``user`` may act for on this vhost, as the broker enforces it: exactly the scopes of its
        topic permission on ``intermission.commands`` when it has one (what ``grant`` writes; none when it
        was revoked to nothing), every scope when it may write to ``intermission.commands`` with no topic
        permission there (what ``trust`` gives), and nothing when it has no permissions on the vhost or may
        not write to the exchange. A topic permission ``grant`` did not write is a ManagementError: refused
        rather than guessed at."""
        topics = await self._client.get(self._path("topic-permissions", self.vhost, user))
        if topics.status_code >= 400 and topics.status_code != 404:
            raise ManagementError(f"reading {user}'s permissions: {topics.status_code} {topics.text[:300]}")
        for entry in topics.json() if topics.status_code == 200 else []:
            if entry.get("exchange") == COMMANDS_EXCHANGE:
                return Reach(scopes=tuple(scopes_of(str(entry.get("write", "")))))
        permissions = await self._client.get(self._path("permissions", self.vhost, user))
        if permissions.status_code == 404:
            return Reach()
        if permissions.status_code >= 400:
            raise ManagementError(f"reading {user}'s permissions: {permissions.status_code} {permissions.text[:300]}")
        return Reach(every_scope=permits(str(permissions.json().get("write", "")), COMMANDS_EXCHANGE))

    async def all_grants(self) -> dict[str, list[Scope]]:
        """Every user with a topic permission on ``intermission.commands`` in this vhost, and its scopes."""
        response = await self._request("GET", self._path("vhosts", self.vhost, "topic-permissions"))
        found: dict[str, list[Scope]] = {}
        for entry in response.json():
            if entry.get("exchange") == COMMANDS_EXCHANGE:
                try:
                    found[str(entry["user"])] = scopes_of(str(entry.get("write", "")))
                except ManagementError:
                    found[str(entry["user"])] = []
        return found

    async def set_scopes(self, user: str, scopes: list[Scope]) -> None:
        """Make ``user``'s permissions exactly the host permissions for ``scopes`` (none: no access). Fails
        closed: the vhost permissions go first when access is taken away, last when it is given, so that at
        no moment, and after no failure, does the user hold vhost permissions without the topic permissions
        that confine them."""
        if not scopes:
            await self._request("DELETE", self._path("permissions", self.vhost, user))
            await self._request("DELETE", self._path("topic-permissions", self.vhost, user))
            return
        p = host_permissions(user, scopes)
        await self._request(
            "PUT",
            self._path("topic-permissions", self.vhost, user),
            {"exchange": COMMANDS_EXCHANGE, "write": p.commands_write, "read": NOTHING},
        )
        await self._request(
            "PUT",
            self._path("topic-permissions", self.vhost, user),
            {"exchange": EVENTS_EXCHANGE, "write": NOTHING, "read": p.events_read},
        )
        await self._request(
            "PUT",
            self._path("permissions", self.vhost, user),
            {"configure": p.configure, "write": p.write, "read": p.read},
        )

    async def grant(self, user: str, scope: Scope) -> list[Scope]:
        """Add ``scope`` to what ``user`` may act for; returns its scopes now (``grant_scope`` says more)."""
        return (await self.grant_scope(user, scope)).scopes

    async def grant_scope(self, user: str, scope: Scope) -> Granted:
        """Add ``scope`` to what ``user`` may act for. A user trusted with every scope until now is narrowed
        to this one, failing closed: its trusted rights are taken first and its open connections closed
        (RabbitMQ caches permission checks per connection), then the confined rights are written, so that a
        failure on the way leaves it with no access rather than with every right it had."""
        check_user_name(user)
        check_grantable(scope)
        await self._require_user(user)
        was_trusted = (await self.reach(user)).every_scope
        closed = 0
        if was_trusted:
            await self._request("DELETE", self._path("permissions", self.vhost, user))
            closed = await self.disconnect(user, reason=f"intermission grant: confined to {scope}")
            scopes = [scope]
        else:
            scopes = await self.scopes(user)
            if scope not in scopes:
                scopes.append(scope)
        await self.set_scopes(user, scopes)
        return Granted(scopes=scopes, was_trusted=was_trusted, connections_closed=closed)

    async def revoke(self, user: str, scope: Scope) -> list[Scope]:
        """Take ``scope`` away from ``user``; returns its scopes now. The user's open connections to this
        vhost are closed: RabbitMQ caches permission checks per connection and channel, so a connection
        opened before the revocation could go on publishing for the scope it lost. Its clients reconnect
        (the robust ones do it by themselves) under what the user is still granted."""
        scopes = [s for s in await self.scopes(user) if s != scope]
        await self.set_scopes(user, scopes)
        await self.disconnect(user, reason=f"intermission revoke: {scope} was revoked")
        await self.unbind(user, scope)
        return scopes

    async def unbind(self, user: str, scope: Scope) -> int:
        """Remove the bindings of ``scope``'s events to ``user``'s queues; returns how many there were.
        RabbitMQ checks a topic read permission when a binding is made, never again: without this, a
        durable subscription queue made before a revocation would go on receiving the revoked tenant's
        events."""
        response = await self._request(
            "GET", self._path("exchanges", self.vhost, EVENTS_EXCHANGE, "bindings", "source")
        )
        suffix = f".{scope.routing_suffix()}"
        # Every queue the user may read: its own, and (granted before server-named queues were taken out of
        # a host's permissions) any durable amq.gen-* queue, whose declaring user the broker does not record.
        # Once the permissions are rewritten the user may no longer read amq.gen-* queues at all; their
        # bindings of the revoked scope are removed here too, so that such a queue never again holds that
        # scope's events for whoever reads it next. An exclusive amq.gen-* queue is left alone: it lives
        # and dies with its connection (the revoked user's were closed just before, taking theirs with
        # them), so one still there belongs to someone else, a trusted process's live subscription.
        own = re.compile(rf"^(?:{own_queues(user)})$")
        bound = [
            b
            for b in response.json()
            if b.get("destination_type") == "queue" and str(b.get("routing_key", "")).endswith(suffix)
        ]
        exclusive = (
            await self._exclusive_queues()
            if any(str(b.get("destination", "")).startswith("amq.gen-") for b in bound)
            else frozenset()
        )
        doomed = [
            b
            for b in bound
            if own.match(str(b.get("destination", "")))
            or (str(b.get("destination", "")).startswith("amq.gen-") and b.get("destination") not in exclusive)
        ]
        for b in doomed:
            path = self._path(
                "bindings", self.vhost, "e", EVENTS_EXCHANGE, "q", str(b["destination"]), str(b["properties_key"])
            )
            await self._request("DELETE", path)
        return len(doomed)

    async def _exclusive_queues(self) -> frozenset[str]:
        """The names of this vhost's queues that are exclusive to a connection, in one listing."""
        response = await self._request("GET", self._path("queues", self.vhost) + "?columns=name,exclusive")
        return frozenset(str(q["name"]) for q in response.json() if q.get("exclusive"))

    async def disconnect(self, user: str, *, reason: str) -> int:
        """Close every connection ``user`` has open to this vhost; returns how many there were. They are
        found and closed through the broker's connection tracking (``/api/connections/username/``), which
        knows a connection as soon as it is open, not through the statistics (``/api/vhosts/.../connections``
        and ``DELETE /api/connections/NAME``), which know it only seconds later: a connection opened just
        before a narrowing would otherwise keep the rights it lost. The tracking endpoint closes the user's
        connections to every vhost: they reconnect, under the same rights elsewhere."""
        tracked = self._path("connections", "username", user)
        response = await self._client.get(tracked)
        if response.status_code in (404, 405):  # a broker older than the tracking endpoint
            return await self._disconnect_listed(user, reason=reason)
        if response.status_code >= 400:
            raise ManagementError(f"listing {user}'s connections: {response.status_code} {response.text[:300]}")
        here = [c for c in response.json() if c.get("user") == user and c.get("vhost") == self.vhost]
        if here:
            closed = await self._client.delete(tracked, headers={"X-Reason": reason})
            if closed.status_code >= 400 and closed.status_code != 404:
                raise ManagementError(f"closing {user}'s connections: {closed.status_code} {closed.text[:300]}")
        return len(here)

    async def _disconnect_listed(self, user: str, *, reason: str) -> int:
        """``disconnect`` through the statistics, for brokers without connection tracking endpoints."""
        response = await self._request("GET", self._path("vhosts", self.vhost, "connections"))
        names = [str(c["name"]) for c in response.json() if c.get("user") == user and "name" in c]
        for name in names:
            # 404: the connection closed meanwhile, which is what was wanted.
            response = await self._client.delete(self._path("connections", name), headers={"X-Reason": reason})
            if response.status_code >= 400 and response.status_code != 404:
                raise ManagementError(f"closing {user}'s connection: {response.status_code} {response.text[:300]}")
        return len(names)

    async def add_user(self, user: str, password: str) -> bool:
        """Create ``user`` with ``password`` and no permissions (or set the password of an existing one,
        leaving its permissions and its tags as they are); returns whether it was created."""
        found = await self._client.get(self._path("users", user))
        if found.status_code >= 400 and found.status_code != 404:
            raise ManagementError(f"reading user {user}: {found.status_code} {found.text[:300]}")
        tags = found.json().get("tags", []) if found.status_code == 200 else []
        # The API gives tags as a list (or, in older versions, a comma-separated string) and takes a string.
        tags_text = ",".join(tags) if isinstance(tags, list) else str(tags)
        await self._request("PUT", self._path("users", user), {"password": password, "tags": tags_text})
        return found.status_code == 404

    async def remove_user(self, user: str) -> None:
        """Delete ``user`` (its permissions and connections with it); nothing when there is no such user."""
        await self._request("DELETE", self._path("users", user))

    async def trust(self, user: str) -> None:
        """Give ``user`` every right on this vhost and every scope (no topic permissions): for the fleet's
        own identities (workers, sweepers, the bus), never for a host."""
        await self._require_user(user)
        await self._request("DELETE", self._path("topic-permissions", self.vhost, user))
        await self._request(
            "PUT", self._path("permissions", self.vhost, user), {"configure": ".*", "write": ".*", "read": ".*"}
        )

    async def _require_user(self, user: str) -> None:
        response = await self._client.get(self._path("users", user))
        if response.status_code == 404:
            raise ManagementError(f"no RabbitMQ user {user!r}: create it first (rabbitmqctl add_user)")
        if response.status_code >= 400:
            raise ManagementError(f"reading user {user}: {response.status_code} {response.text[:300]}")
