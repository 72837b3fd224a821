"""Logged-in people, kept in the console's memory.

A session is one person: the AMQP connection opened with their own credentials (every decision they make
is published on it, so the broker validates its ``user_id``), the scopes the broker grants them (read
again every ``REACH_SECONDS``, so a grant or a revocation shows within seconds), the subscription that
hears their scopes' events, their last decisions and the pages waiting for live updates. The browser holds
only the session's random id, in the signed session cookie; the password is used once, to open the
connection, and then dropped from everything the connection keeps (``forget_password``), so that it can
never reconnect: a session whose connection is lost (a broker restart, a closed connection, a revocation)
ends, and the person logs in again with what is their password then.

The console holds at most ``max_sessions`` sessions (a login past that is refused), and a person at most
``per_user``: a new login ends their oldest.

A session ends on logout, after ``idle_seconds`` without a request, or ``max_seconds`` after login; its
connection is closed then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Final

import aiormq

from intermission.ops.console.listener import Change, Listener, Verdict
from intermission.publishers.amqp import TRANSIENT_AMQP_ERRORS, NodesConnection, with_credentials
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import Decision
from intermission.schemas.scope import Reach, Scope

log = logging.getLogger("intermission.console")

# How long a session's grants are trusted before they are read from the broker again.
REACH_SECONDS: Final = 5.0
# How many of a person's decisions the inbox shows.
DECISIONS_KEPT: Final = 20
# How long logging in waits for the person's subscription to be bound, so that the outcome of a decision
# made right away is heard.
LISTENER_READY_SECONDS: Final = 10.0
# What RabbitMQ answers a login it refuses: bad credentials (ACCESS_REFUSED during the handshake), or a
# vhost the user may not use (the broker closes the connection instead of opening it, which aiormq reports
# as an unexpected frame). Anything else, a node that does not answer, is not the person's fault.
REFUSED_LOGIN: Final = (
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.ProtocolSyntaxError,
    aiormq.exceptions.ConnectionClosed,
)
# Live-update streams one session may hold open (one per open page); more are refused.
STREAMS_PER_SESSION: Final = 16


class LoginRefused(Exception):
    """RabbitMQ did not accept the user and password (or the user may not use the vhost)."""


class BrokerUnavailable(Exception):
    """No RabbitMQ node could be reached to check the credentials."""


class OutcomeState(StrEnum):
    WAITING = "waiting"  # published; no worker has answered yet
    APPLIED = "applied"  # a worker applied it: the run resumed
    REFUSED = "refused"  # a worker refused it (command.rejected): code and detail say why
    UNSENT = "unsent"  # the broker did not take it (a scope the person may not publish for, an outage)


@dataclass
class Outcome:
    """One decision a person sent from the console, and what became of it."""

    message_id: str
    scope: Scope
    run_id: str
    decision: Decision
    sent_at: datetime
    state: OutcomeState = OutcomeState.WAITING
    code: str = ""
    detail: str = ""
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, state: OutcomeState, code: str = "", detail: str = "") -> None:
        if self.state is not OutcomeState.WAITING:
            return
        self.state, self.code, self.detail = state, code, detail
        self.settled.set()


ReadReach = Callable[[str], Awaitable[Reach]]


async def log_in(
    url: str,
    user: str,
    password: str,
    read_reach: ReadReach,
    *,
    connect_timeout: float,
    reconnect_interval: float,
) -> ConsoleSession:
    """Open ``user``'s own connection to the broker of ``url`` (its nodes and vhost, with these credentials):
    RabbitMQ checking the password is the login. Then read what the broker grants the user and start
    hearing its scopes' events. LoginRefused when RabbitMQ refused the credentials or the vhost;
    BrokerUnavailable when no node answered."""
    try:
        client = await HostClient.connect(
            with_credentials(url, user, password),
            name=f"intermission-console {user}",
            connect_timeout=connect_timeout,
            reconnect_interval=reconnect_interval,
        )
    except REFUSED_LOGIN as exc:
        raise LoginRefused(user) from exc
    except TRANSIENT_AMQP_ERRORS as exc:
        raise BrokerUnavailable(type(exc).__name__) from exc
    connection = client.connection
    if isinstance(connection, NodesConnection):
        connection.forget_password()
    try:
        session = ConsoleSession(user, client, await read_reach(user), read_reach)
        # Lost, it cannot reconnect without the password: the session is over.
        connection.close_callbacks.add(session.connection_lost)
        await session.start_listening()
    except BaseException:
        await client.close()
        raise
    return session


class ConsoleSession:
    """One logged-in person."""

    def __init__(self, user: str, client: HostClient, reach: Reach, read_reach: ReadReach) -> None:
        self.id = secrets.token_urlsafe(32)
        self.csrf = secrets.token_urlsafe(32)
        self.user = user
        self.client = client
        self.reach = reach
        self._read_reach = read_reach
        self._reach_read_at = time.monotonic()
        self.created_at = time.monotonic()
        self.last_seen = self.created_at
        self.decisions: deque[Outcome] = deque(maxlen=DECISIONS_KEPT)
        self._waiting: dict[str, Outcome] = {}
        self._streams: set[asyncio.Queue[Change | None]] = set()
        self._listener: Listener | None = None
        self.closed = False
        self.lost = False
        self._closing: asyncio.Task[None] | None = None

    def connection_lost(self, *_: object) -> None:
        """The person's connection closed: the session is over. Closed at once, so that the robust
        connection, which no longer has the password, stops trying to log in again."""
        if self.lost or self.closed:
            return
        self.lost = True
        self._closing = asyncio.get_running_loop().create_task(self.close())

    # --- grants and the subscription ----------------------------------------------------------------

    async def start_listening(self) -> None:
        listener = Listener(self.client.connection, self.user, self.reach, self._changed, self._verdict)
        self._listener = listener
        listener.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LISTENER_READY_SECONDS):
                await listener.ready.wait()

    async def current_reach(self) -> Reach:
        """The person's grants, read again from the broker when older than ``REACH_SECONDS``; the
        subscription follows them (and is started again when it stopped)."""
        if time.monotonic() - self._reach_read_at >= REACH_SECONDS:
            reach = await self._read_reach(self.user)
            self._reach_read_at = time.monotonic()
            listener = self._listener
            if reach != self.reach or listener is None or not listener.alive:
                self.reach = reach
                if listener is not None:
                    await listener.stop()
                await self.start_listening()
        return self.reach

    # --- decisions -----------------------------------------------------------------------------------

    def expect(self, message_id: str, scope: Scope, run_id: str, decision: Decision) -> Outcome:
        """Start following the decision about to be published as ``message_id``: registered before the
        publication, so that an answer arriving at once is not missed."""
        outcome = Outcome(message_id, scope, run_id, decision, sent_at=datetime.now(UTC))
        self._waiting[message_id] = outcome
        self.decisions.appendleft(outcome)
        return outcome

    def _verdict(self, message_id: str, verdict: Verdict) -> None:
        outcome = self._waiting.pop(message_id, None)
        if outcome is None:
            return
        if verdict.applied:
            outcome.settle(OutcomeState.APPLIED)
        else:
            outcome.settle(OutcomeState.REFUSED, verdict.code, verdict.detail)

    def forget(self, outcome: Outcome) -> None:
        self._waiting.pop(outcome.message_id, None)

    # --- live updates --------------------------------------------------------------------------------

    def open_stream(self) -> asyncio.Queue[Change | None] | None:
        """A queue of this session's changes for one page; None when the session has too many open."""
        if len(self._streams) >= STREAMS_PER_SESSION:
            return None
        queue: asyncio.Queue[Change | None] = asyncio.Queue(maxsize=256)
        self._streams.add(queue)
        return queue

    def close_stream(self, queue: asyncio.Queue[Change | None]) -> None:
        self._streams.discard(queue)

    def _changed(self, change: Change) -> None:
        for queue in self._streams:
            # A page that does not read its stream misses updates rather than growing without bound;
            # any one of them makes it read everything again.
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(change)

    # --- ending ----------------------------------------------------------------------------------------

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for queue in self._streams:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
        self._streams.clear()
        if self._listener is not None:
            await self._listener.stop()
        with contextlib.suppress(*TRANSIENT_AMQP_ERRORS):
            await self.client.close()


class Sessions:
    """Every session of this console process, by id."""

    def __init__(self, *, idle_seconds: float, max_seconds: float, max_sessions: int = 1000, per_user: int = 8) -> None:
        self.idle_seconds = idle_seconds
        self.max_seconds = max_seconds
        self.max_sessions = max_sessions
        self.per_user = per_user
        self._by_id: dict[str, ConsoleSession] = {}
        # Closings started from a request, held so that they are not collected before they finish.
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def full(self) -> bool:
        """Whether a new login must be refused: every place is taken."""
        return len(self._by_id) >= self.max_sessions

    def add(self, session: ConsoleSession) -> list[ConsoleSession]:
        """Keep ``session``; returns the sessions it displaced, for the caller to close: its person's oldest
        past ``per_user``, and (a race of logins past ``full``) the oldest of all past ``max_sessions``."""
        self._by_id[session.id] = session
        displaced: list[ConsoleSession] = []
        theirs = sorted((s for s in self._by_id.values() if s.user == session.user), key=lambda s: s.created_at)
        displaced += theirs[: max(0, len(theirs) - self.per_user)]
        for old in displaced:
            self._by_id.pop(old.id, None)
        if len(self._by_id) > self.max_sessions:
            oldest = sorted(self._by_id.values(), key=lambda s: s.created_at)[: len(self._by_id) - self.max_sessions]
            for old in oldest:
                self._by_id.pop(old.id, None)
            displaced += oldest
        return displaced

    def get(self, session_id: object) -> ConsoleSession | None:
        """The live session ``session_id`` names, marked as used now; None when there is none (never was,
        ended, or expired: an expired one is closed in the background)."""
        if not isinstance(session_id, str):
            return None
        session = self._by_id.get(session_id)
        if session is None:
            return None
        now = time.monotonic()
        if self._expired(session, now):
            self._by_id.pop(session_id, None)
            closing = asyncio.create_task(session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            return None
        session.last_seen = now
        return session

    def _expired(self, session: ConsoleSession, now: float) -> bool:
        return (
            session.lost or now - session.last_seen > self.idle_seconds or now - session.created_at > self.max_seconds
        )

    async def end(self, session_id: object) -> None:
        if isinstance(session_id, str):
            session = self._by_id.pop(session_id, None)
            if session is not None:
                await session.close()

    async def sweep(self) -> int:
        """Close every expired session; returns how many."""
        now = time.monotonic()
        expired = [s for s in self._by_id.values() if self._expired(s, now)]
        for session in expired:
            self._by_id.pop(session.id, None)
            await session.close()
            log.info("console session expired", extra={"action": "console_session_expired", "user": session.user})
        return len(expired)

    async def sweep_forever(self, interval: float = 30.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.sweep()

    async def close_all(self) -> None:
        sessions, self._by_id = list(self._by_id.values()), {}
        for session in sessions:
            await session.close()

    def __len__(self) -> int:
        return len(self._by_id)
