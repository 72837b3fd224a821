"""Health on the metrics port: ``/metrics`` (Prometheus, as before), ``/healthz`` and ``/readyz``.

``/healthz`` answers 200 ``ok`` while the process runs: a process that cannot even answer it is to be
restarted. ``/readyz`` answers 200 when every readiness check holds and 503 when one does not, both with the
same JSON (each check and its state, and the names of those that fail), so that whoever looks sees why.

The HTTP side runs in threads (a threaded wsgiref server in a daemon thread, as prometheus_client serves its
own), while everything it reports on lives on the asyncio loop: asyncpg, aio-pika and the supervisor are
not thread-safe. So the HTTP thread never touches them: the loop side (``HealthProbe``) evaluates the checks
every ``interval`` seconds and writes plain booleans into ``Readiness``, under a lock; a request only reads
them. The time of the last refresh is read too: a loop that stopped refreshing (blocked, or the probe
itself dead) makes ``/readyz`` fail its ``event_loop`` check instead of reporting old news as current.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app

from intermission.store.db import Conn, Database

log = logging.getLogger("intermission.health")

# The checks every process has: the database answers, and the loop refreshes the others.
DATABASE = "database"
EVENT_LOOP = "event_loop"
RABBITMQ = "rabbitmq"
CONSUMERS = "consumers"
# False once the process is stopping (the only check left then).
RUNNING = "running"
TASK_PREFIX = "task:"


class Readiness:
    """Named readiness checks, each true or false, written from the asyncio loop and read by HTTP threads.

    Every check named at construction starts false: a process is not ready until the loop has said so.
    """

    def __init__(self, names: Iterable[str], *, stale_after: float) -> None:
        self.stale_after = stale_after
        self._lock = threading.Lock()
        self._checks: dict[str, bool] = dict.fromkeys(names, False)
        self._refreshed: float | None = None

    def update(self, checks: Mapping[str, bool]) -> None:
        """Replace every check with ``checks`` (a check no longer named is gone: a supervised loop that
        was cancelled on purpose, say) and note the refresh."""
        with self._lock:
            self._checks = dict(checks)
            self._refreshed = time.monotonic()

    def report(self) -> tuple[bool, dict[str, object]]:
        """Whether the process is ready, and the JSON body that says which check is or is not."""
        with self._lock:
            checks = dict(self._checks)
            refreshed = self._refreshed
        checks[EVENT_LOOP] = refreshed is not None and time.monotonic() - refreshed <= self.stale_after
        failing = sorted(name for name, ok in checks.items() if not ok)
        return not failing, {"ready": not failing, "checks": dict(sorted(checks.items())), "not_ready": failing}


def task_checks(states: Mapping[str, str], required: Iterable[str]) -> dict[str, bool]:
    """One check per supervised loop (``task:NAME``): true while it runs, false while it waits out a
    backoff after a failure, once it was given up on, or when a loop the process needs is missing."""
    checks = {f"{TASK_PREFIX}{name}": state == "running" for name, state in states.items()}
    for name in required:
        checks.setdefault(f"{TASK_PREFIX}{name}", False)
    return checks


def _app(registry: CollectorRegistry, readiness: Readiness) -> Callable[[WSGIEnvironment, StartResponse], list[bytes]]:
    metrics = make_wsgi_app(registry)

    def route(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ok\n"]
        if path == "/readyz":
            ready, body = readiness.report()
            start_response(
                "200 OK" if ready else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
            )
            return [json.dumps(body).encode() + b"\n"]
        # Every other path is Prometheus's, as it was when prometheus_client served the port alone (it
        # answers any path): a scrape configured with another path keeps working.
        scraped: list[bytes] = metrics(environ, start_response)
        return scraped

    return route


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    # Request threads are not joined at close: a scrape in flight must not hold the process's exit.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        # Scrapes and probes every few seconds would drown the process's own log lines.
        pass


class HealthServer:
    """The metrics port's HTTP server, in a daemon thread of its own."""

    def __init__(self, port: int, host: str, registry: CollectorRegistry, readiness: Readiness) -> None:
        # IPv4 or IPv6 from the host given (``::`` listens on both where the system allows it).
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

        class Server(_ThreadingServer):
            address_family = family

        self._httpd = make_server(str(address[0]), port, _app(registry, readiness), Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="intermission-health", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._httpd.server_port

    def close(self) -> None:
        """Stop serving and release the port (blocks for up to the server's half-second poll)."""
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(port: int, host: str, registry: CollectorRegistry, readiness: Readiness) -> HealthServer | None:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port``; nothing when ``port`` is 0."""
    return HealthServer(port, host, registry, readiness) if port else None


class HealthProbe:
    """The loop side of readiness: every ``interval`` seconds, ``SELECT 1`` on a connection of its own
    (bounded by ``interval``) and the process's other checks (``checks``: cheap, synchronous reads of the
    process's objects, run on the loop where reading them is safe), written into ``readiness``.

    The probe has its own connection rather than the pool's: a worker whose pool is busy with commands is
    loaded, not unready, and must not fail its probe queueing for a connection. A failed probe drops the
    connection and the next one connects again, so a database that returns is seen at the next probe.
    """

    def __init__(
        self,
        readiness: Readiness,
        db: Database,
        checks: Callable[[], dict[str, bool]],
        *,
        interval: float,
        application_name: str,
        database_ok: Callable[[], bool] = lambda: True,
    ) -> None:
        self.readiness = readiness
        self.db = db
        self.checks = checks
        self.interval = interval
        self.application_name = application_name
        # Beside the probe, what else says the database is away (the worker's availability gate).
        self.database_ok = database_ok
        self._conn: Conn | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._was_ready: bool | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="health-probe")

    async def close(self) -> None:
        """Stop probing and report not ready: the process is stopping."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drop()
        self.readiness.update({RUNNING: False})

    async def _serve(self) -> None:
        while not self._stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._stop.wait()

    async def refresh(self) -> None:
        """One round of checks, written into ``readiness``."""
        try:
            checks = self.checks()
        except Exception:
            # A bug in a check must not stop the probe: report it failing, and say why in the log.
            log.exception("a readiness check failed", extra={"action": "readiness_check_failed"})
            checks = {"checks": False}
        checks[DATABASE] = await self._database() and self.database_ok()
        self.readiness.update(checks)
        ready, body = self.readiness.report()
        if ready != self._was_ready:
            # Transitions only: a probe every few seconds must not fill the log.
            level = logging.INFO if ready or self._was_ready is None else logging.WARNING
            log.log(level, "ready" if ready else "not ready", extra={"action": "readiness", **body})
            self._was_ready = ready

    async def _database(self) -> bool:
        try:
            async with asyncio.timeout(self.interval):
                if self._conn is None:
                    self._conn = await self.db.connect_dedicated(self.application_name, command_timeout=self.interval)
                await self._conn.raw.fetchval("SELECT 1")
            return True
        except Exception as exc:
            if self._was_ready is not False:
                # The error's type and text (asyncpg's and the OS's name no password), once per outage.
                log.warning("database probe failed", extra={"action": "database_probe_failed", "error": repr(exc)})
            await self._drop()
            return False

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.raw.terminate()
