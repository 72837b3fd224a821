"""The console's Starlette application: its routes, and what it holds while it runs.

Every page is rendered on the server from the database, restricted to the person's scopes
(``stores.granted(reach)``); the one script only asks for the same pages' fragments again when the
person's subscription heard that something changed (``/events``, server-sent events). Every form works
without it.

What the process holds (``Console``): a small database pool, the management API (to read each person's
grants), a connection of its own to the broker (to read the dead-letter queue, which no host may read),
and the sessions. Decisions never go over the console's own connection: each is published on the deciding
person's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import httpx
from aio_pika.abc import AbstractRobustConnection
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from intermission.fleet.settings import Settings
from intermission.ops.console import views
from intermission.ops.console.limits import RequestBounds
from intermission.ops.console.security import SecurityHeaders, local_path, new_token, token_matches
from intermission.ops.console.sessions import (
    BrokerUnavailable,
    ConsoleSession,
    LoginRefused,
    OutcomeState,
    Sessions,
    log_in,
)
from intermission.ops.console.throttle import LoginThrottle
from intermission.ops.dead import list_dead
from intermission.ops.grants import BrokerGrants, ManagementError
from intermission.publishers.amqp import PublishFailed, connect
from intermission.publishers.dead_queue import dead_stats
from intermission.schemas.commands import DecideCommand
from intermission.schemas.run import TERMINAL_STATES, RunState
from intermission.schemas.scope import Reach, Scope
from intermission.store import Stores

log = logging.getLogger("intermission.console")

HERE: Final = Path(__file__).resolve().parent
SESSION_COOKIE: Final = "intermission_console"
# How long a decision's form waits for the workers' answer before the page says it is still on its way
# (it is settled later, live, when the answer is heard).
OUTCOME_SECONDS: Final = 10.0
# A live-update stream says something at least this often, so proxies and browsers keep it open.
KEEPALIVE_SECONDS: Final = 15.0
LIVE_STATES: Final = frozenset({RunState.PAUSED, RunState.RUNNING})
# Dead letters are read whole off the queue (basic.get), a page at a time, and only so far into it.
DEAD_PAGE: Final = 20
DEAD_PAGES: Final = 5


def templates() -> Jinja2Templates:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        when=views.when,
        iso=views.iso,
        until=views.until,
        pretty=views.pretty_arguments,
    )
    return Jinja2Templates(env=env)


class Console:
    """The running console: its servers, its sessions, its pages."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sessions = Sessions(
            idle_seconds=settings.console_idle_seconds,
            max_seconds=settings.console_session_max_seconds,
            max_sessions=settings.console_max_sessions,
            per_user=settings.console_sessions_per_user,
        )
        self.pages = templates()
        self.throttle = LoginThrottle()
        self._stores: Stores | None = None
        self._grants: BrokerGrants | None = None
        self._broker: AbstractRobustConnection | None = None
        # One reader of the dead-letter queue at a time: a message one channel holds unacknowledged is not
        # delivered to another, so two readers at once would each see part of the queue.
        self._dead_lock = asyncio.Lock()

    # --- what it holds -------------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        settings = self.settings
        access = settings.management()
        self._stores = await Stores.connect(
            settings.database_url,
            min_size=1,
            max_size=4,
            connect_timeout=settings.database_connect_timeout_seconds,
            application_name="intermission-console",
        )
        self._grants = BrokerGrants.connect(access.url, access.user, access.password, access.vhost)
        try:
            self._broker = await connect(
                settings.amqp_url,
                "intermission-console",
                reconnect_interval=settings.amqp_reconnect_seconds,
                connect_timeout=settings.amqp_connect_timeout_seconds,
                offset=settings.amqp_first_node,
            )
            sweeper = asyncio.create_task(self.sessions.sweep_forever(), name="console-session-sweeper")
            try:
                yield
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
                await self.sessions.close_all()
                await self._broker.close()
        finally:
            await self._grants.close()
            await self._stores.close()

    @property
    def stores(self) -> Stores:
        assert self._stores is not None, "the console is not running"
        return self._stores

    async def read_reach(self, user: str) -> Reach:
        """What the broker grants ``user`` now; ManagementError when the management API cannot say (the
        person is then shown nothing new rather than a guess)."""
        assert self._grants is not None, "the console is not running"
        try:
            return await self._grants.reach(user)
        except httpx.HTTPError as exc:
            raise ManagementError(f"the management API did not answer: {type(exc).__name__}") from exc

    # --- helpers --------------------------------------------------------------------------------------

    def session_of(self, request: Request) -> ConsoleSession | None:
        return self.sessions.get(request.session.get("sid"))

    def render(
        self,
        request: Request,
        name: str,
        context: dict[str, Any],
        *,
        session: ConsoleSession | None = None,
        status_code: int = 200,
    ) -> HTMLResponse:
        base: dict[str, Any] = {"user": None, "csrf": "", "active": "", "scopes_label": ""}
        if session is not None:
            base.update(
                user=session.user,
                csrf=session.csrf,
                reach=session.reach,
                scopes_label=views.reach_label(session.reach),
            )
        base.update(context)
        return self.pages.TemplateResponse(request, name, base, status_code=status_code)

    def problem(
        self, request: Request, status_code: int, title: str, detail: str, session: ConsoleSession | None
    ) -> HTMLResponse:
        return self.render(
            request, "problem.html", {"title": title, "detail": detail}, session=session, status_code=status_code
        )

    @staticmethod
    def to_login(request: Request) -> RedirectResponse:
        target = local_path(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
        return RedirectResponse(f"/login?next={target}" if target != "/inbox" else "/login", status_code=303)

    async def signed_in(self, request: Request, page: Callable[[ConsoleSession], Awaitable[Response]]) -> Response:
        """``page`` for the request's person, with their grants fresh; the login page for nobody."""
        session = self.session_of(request)
        if session is None:
            return self.to_login(request)
        try:
            reach = await session.current_reach()
        except ManagementError as exc:
            log.warning("console grants unreadable", extra={"action": "console_grants_unreadable", "error": str(exc)})
            return self.problem(request, 503, "Grants unreadable", "The broker's grants could not be read.", session)
        if reach.is_empty:
            # Revoked to nothing (or deleted): such a user could not log in now, so the session ends too.
            await self.sessions.end(session.id)
            request.session.clear()
            log.info("console session revoked", extra={"action": "console_session_revoked", "user": session.user})
            return RedirectResponse("/login", status_code=303)
        return await page(session)

    # --- pages ----------------------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        return RedirectResponse("/inbox" if self.session_of(request) else "/login", status_code=303)

    async def login_form(self, request: Request) -> Response:
        if self.session_of(request) is not None:
            return RedirectResponse(local_path(request.query_params.get("next")), status_code=303)
        return self.login_page(request, error=None, user="", status_code=200)

    def login_page(self, request: Request, *, error: str | None, user: str, status_code: int) -> HTMLResponse:
        # The login form's CSRF token lives in the cookie until login (there is no session yet).
        token = request.session.get("csrf")
        if not isinstance(token, str) or not token:
            token = new_token()
            request.session["csrf"] = token
        return self.render(
            request,
            "login.html",
            {
                "login_csrf": token,
                "error": error,
                "login_user": user,
                "next": local_path(request.query_params.get("next")),
            },
            status_code=status_code,
        )

    async def login(self, request: Request) -> Response:
        form = await request.form()
        if not token_matches(request.session.get("csrf"), form.get("csrf")):
            return self.login_page(request, error="The form expired; please log in again.", user="", status_code=400)
        user, password = form.get("user"), form.get("password")
        if not isinstance(user, str) or not isinstance(password, str) or not user or not password:
            return self.login_page(request, error="Give a user and a password.", user="", status_code=400)
        user = user.strip()
        if self.sessions.full:
            return self.login_page(
                request,
                error="The console holds as many sessions as it may; try again later.",
                user=user,
                status_code=503,
            )
        address = request.client.host if request.client is not None else "unknown"
        clock = asyncio.get_running_loop().time
        wait = self.throttle.begin(user, address, clock())
        if wait is not None:
            return self.login_page(
                request,
                error=f"Too many failed logins; try again in {max(1, round(wait))} s.",
                user=user,
                status_code=429,
            )
        settings = self.settings
        refused: bool | None = None
        try:
            session = await log_in(
                settings.amqp_url,
                user,
                password,
                self.read_reach,
                connect_timeout=settings.amqp_connect_timeout_seconds,
                reconnect_interval=settings.amqp_reconnect_seconds,
            )
            refused = False
        except LoginRefused:
            refused = True
            log.info("console login refused", extra={"action": "console_login_refused", "user": user})
            return self.login_page(
                request, error="RabbitMQ refused this user and password.", user=user, status_code=401
            )
        except BrokerUnavailable as exc:
            log.warning("console login failed", extra={"action": "console_login_failed", "error": str(exc)})
            return self.login_page(request, error="RabbitMQ cannot be reached.", user=user, status_code=503)
        except ManagementError as exc:
            log.warning("console grants unreadable", extra={"action": "console_grants_unreadable", "error": str(exc)})
            return self.login_page(
                request, error="Your grants on the broker could not be read.", user=user, status_code=503
            )
        finally:
            self.throttle.finish(user, address, clock(), refused=refused)
        for evicted in self.sessions.add(session):
            await evicted.close()
        # A new cookie for the new session: nothing of the anonymous one (its CSRF token) carries over.
        request.session.clear()
        request.session["sid"] = session.id
        log.info(
            "console login",
            extra={"action": "console_login", "user": user, "scopes": views.reach_label(session.reach)},
        )
        return RedirectResponse(local_path(form.get("next")), status_code=303)

    async def logout(self, request: Request) -> Response:
        session = self.session_of(request)
        form = await request.form()
        if session is not None and token_matches(session.csrf, form.get("csrf")):
            await self.sessions.end(session.id)
            log.info("console logout", extra={"action": "console_logout", "user": session.user})
        elif session is not None:
            return self.problem(request, 400, "Form expired", "Reload the page and try again.", session)
        request.session.clear()
        return RedirectResponse("/login", status_code=303)

    async def inbox(self, request: Request) -> Response:
        async def page(session: ConsoleSession) -> Response:
            fragment = request.query_params.get("fragment")
            context: dict[str, Any] = {"active": "inbox", "decisions": list(session.decisions)}
            if fragment != "decisions":
                context["approvals"] = await self.stores.granted(session.reach).approvals()
            if fragment == "approvals":
                return self.render(request, "_approvals.html", context, session=session)
            if fragment == "decisions":
                return self.render(request, "_decisions.html", context, session=session)
            decided = request.query_params.get("decided")
            context["decided"] = next((d for d in session.decisions if d.message_id == decided), None)
            return self.render(request, "inbox.html", context, session=session)

        return await self.signed_in(request, page)

    async def decide(self, request: Request) -> Response:
        session = self.session_of(request)
        if session is None:
            return self.to_login(request)
        form = await request.form()
        if not token_matches(session.csrf, form.get("csrf")):
            return self.problem(request, 400, "Form expired", "Reload the page and decide again.", session)
        try:
            command = DecideCommand.model_validate(
                {
                    "scope": {"app": form.get("app"), "tenant": form.get("tenant")},
                    "version": {
                        "run_id": form.get("run_id"),
                        "suspension_id": form.get("suspension_id"),
                        "run_revision": form.get("run_revision"),
                    },
                    "checkpoint_id": form.get("checkpoint_id"),
                    "decision": form.get("decision"),
                    "reason": form.get("reason") or "",
                },
                strict=False,
            )
        except ValidationError:
            return self.problem(request, 400, "Not a decision", "The form did not describe a decision.", session)
        try:
            reach = await session.current_reach()
        except ManagementError:
            return self.problem(request, 503, "Grants unreadable", "The broker's grants could not be read.", session)
        if not reach.covers(command.scope):
            # The broker would refuse it too (the key is not the person's); say so without trying.
            return self.problem(request, 403, "Not your scope", f"You may not act for {command.scope}.", session)
        message_id = str(uuid.uuid4())
        outcome = session.expect(message_id, command.scope, command.version.run_id, command.decision)
        try:
            await session.client.decide(command, message_id=message_id)
        except PublishFailed as exc:
            session.forget(outcome)
            cause = exc.__cause__ or exc
            outcome.settle(OutcomeState.UNSENT, "publish_failed", str(cause)[:300])
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(OUTCOME_SECONDS):
                    await outcome.settled.wait()
            if outcome.state is OutcomeState.WAITING:
                # The answer may have been missed (the subscription was reconnecting): the inbox records
                # every applied command.
                recorded = await self.stores.granted(reach).command_outcome(command.scope, message_id)
                if recorded is not None:
                    session.forget(outcome)
                    outcome.settle(OutcomeState.APPLIED)
        log.info(
            "console decision",
            extra={
                "action": "console_decision",
                "user": session.user,
                "scope": str(command.scope),
                "run_id": command.version.run_id,
                "decision": command.decision.value,
                "message_id": message_id,
                "outcome": outcome.state.value,
                "code": outcome.code,
            },
        )
        target = local_path(form.get("next"))
        separator = "&" if "?" in target else "?"
        return RedirectResponse(f"{target}{separator}decided={message_id}#outcome", status_code=303)

    async def runs(self, request: Request) -> Response:
        async def page(session: ConsoleSession) -> Response:
            reads = self.stores.granted(session.reach)
            context: dict[str, Any] = {
                "active": "runs",
                "live_runs": await reads.runs(LIVE_STATES),
                "ended_runs": await reads.runs(TERMINAL_STATES, limit=20),
            }
            if request.query_params.get("fragment") == "runs":
                return self.render(request, "_runs.html", context, session=session)
            return self.render(request, "runs.html", context, session=session)

        return await self.signed_in(request, page)

    async def run(self, request: Request) -> Response:
        async def page(session: ConsoleSession) -> Response:
            params = request.path_params
            try:
                scope = Scope(app=params["app"], tenant=params["tenant"])
            except ValidationError:
                scope = None
            found = None
            if scope is not None:
                found = await self.stores.granted(session.reach).run(scope, str(params["run_id"]))
            if found is None:
                return self.problem(
                    request, 404, "No such run", "There is no such run in the scopes you may see.", session
                )
            decided = request.query_params.get("decided")
            context: dict[str, Any] = {
                "active": "runs",
                "view": found,
                "decided": next((d for d in session.decisions if d.message_id == decided), None),
            }
            if request.query_params.get("fragment") == "run":
                return self.render(request, "_run.html", context, session=session)
            return self.render(request, "run.html", context, session=session)

        return await self.signed_in(request, page)

    async def dead(self, request: Request) -> Response:
        async def page(session: ConsoleSession) -> Response:
            assert self._broker is not None
            broker = self._broker
            number = views.page_number(request.query_params.get("page"), DEAD_PAGES)
            async with self._dead_lock:
                # The queue's own figures are the fleet's: only a person trusted with every scope sees them.
                stats = await dead_stats(broker) if session.reach.every_scope else None
                letters = await list_dead(broker, DEAD_PAGE * number)
            looked_at = letters[DEAD_PAGE * (number - 1) :]
            context = {
                "active": "dead",
                "letters": views.visible_letters(looked_at, session.reach),
                "stats": stats,
                "page": number,
                "more": len(letters) == DEAD_PAGE * number and number < DEAD_PAGES,
            }
            return self.render(request, "dead.html", context, session=session)

        return await self.signed_in(request, page)

    async def events(self, request: Request) -> Response:
        """Server-sent events: ``changed`` whenever the person's subscription hears one of their scopes'
        events. The page then reads the database again; the event itself carries no data it could not."""
        session = self.session_of(request)
        if session is None:
            # Not 200: an EventSource gives up on it rather than reconnecting for ever.
            return Response("log in first", status_code=401, media_type="text/plain")
        queue = session.open_stream()
        if queue is None:
            return Response("too many open pages", status_code=429, media_type="text/plain")

        async def stream() -> AsyncIterator[str]:
            try:
                yield "retry: 3000\n\n"
                while True:
                    try:
                        async with asyncio.timeout(KEEPALIVE_SECONDS):
                            change = await queue.get()
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    if change is None:  # the session ended
                        yield "event: ended\ndata: {}\n\n"
                        return
                    yield f"event: changed\ndata: {change.json()}\n\n"
            finally:
                session.close_stream(queue)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"cache-control": "no-store", "x-accel-buffering": "no"}
        )


def build_app(settings: Settings) -> Starlette:
    """The console over ``settings``' database, broker and management API."""
    console = Console(settings)
    secret = settings.console_secret.get_secret_value() if settings.console_secret else secrets.token_urlsafe(48)
    routes = [
        Route("/", console.home),
        Route("/login", console.login_form, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/inbox", console.inbox),
        Route("/decide", console.decide, methods=["POST"]),
        Route("/runs", console.runs),
        Route("/runs/{app}/{tenant}/{run_id}", console.run),
        Route("/dead", console.dead),
        Route("/events", console.events),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [
        Middleware(RequestBounds, max_requests=settings.console_max_requests, max_streams=settings.console_max_streams),
        Middleware(SecurityHeaders),
        Middleware(
            SessionMiddleware,
            secret_key=secret,
            session_cookie=SESSION_COOKIE,
            max_age=int(settings.console_session_max_seconds),
            same_site="strict",
            https_only=settings.console_https_only,
        ),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=console.lifespan)
    app.state.console = console
    return app
