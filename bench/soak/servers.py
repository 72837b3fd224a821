"""Server faults that must never outlive the harness: a RabbitMQ ``stop_app``/``start_app``, a PostgreSQL
stop/start, and terminating the soak database's backends.

Other people use these servers too, so every outage is undone three ways:

1. in a ``finally`` (with a blocking call, so a cancellation cannot interrupt the undo);
2. by an ``atexit`` handler while an outage is in progress (the harness exiting on an exception);
3. by a marker file naming the undo command (``$INTERMISSION_SOAK_STATE_DIR``, default
   ``/tmp/intermission-soak``), for a harness killed with SIGKILL: ``restore_after_crash()`` (run at every
   harness start, and by the CI test after the harness exits) undoes what a dead harness left behind.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from tests.support.rabbitctl import rabbitmqctl, settle_dead_lettering

log = logging.getLogger("soak.servers")

UNDO_SECONDS = 120.0
READY_SECONDS = 90.0


def state_dir() -> Path:
    return Path(os.environ.get("INTERMISSION_SOAK_STATE_DIR", "/tmp/intermission-soak"))  # noqa: S108


_armed: dict[str, list[str]] = {}


def _marker(key: str, pid: int | None = None) -> Path:
    return state_dir() / f"undo-{pid or os.getpid()}-{key}.json"


def _arm(key: str, argv: list[str]) -> None:
    _armed[key] = argv
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    _marker(key).write_text(json.dumps({"pid": os.getpid(), "argv": argv}))


def _disarm(key: str) -> None:
    _armed.pop(key, None)
    with contextlib.suppress(FileNotFoundError):
        _marker(key).unlink()


def _run_undo(argv: list[str]) -> bool:
    for _ in range(3):
        try:
            done = subprocess.run(argv, check=False, timeout=UNDO_SECONDS, capture_output=True)  # noqa: S603
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("undo %s failed: %s", argv[:2], exc)
            continue
        if done.returncode == 0 or b"already running" in done.stderr + done.stdout:
            return True
        log.error("undo %s exited %s: %s", argv[:2], done.returncode, done.stderr.decode()[-500:])
    return False


@atexit.register
def _undo_everything_armed() -> None:
    for key, argv in list(_armed.items()):
        _run_undo(argv)
        _disarm(key)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def restore_after_crash() -> list[str]:
    """Undo the outages a harness that died without cleaning up left in progress; returns what was run."""
    folder = state_dir()
    undone: list[str] = []
    if not folder.is_dir():
        return undone
    for path in sorted(folder.glob("undo-*.json")):
        try:
            marker = json.loads(path.read_text())
            pid, argv = int(marker["pid"]), [str(a) for a in marker["argv"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        _run_undo(argv)
        undone.append(" ".join(argv[:4]))
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return undone


def find_pg_cluster(server_dsn: str) -> tuple[str, str] | None:
    """The local cluster serving ``server_dsn`` (``INTERMISSION_SOAK_PG_CLUSTER="15 main"`` or found with
    ``pg_lsclusters``), or None when it cannot be stopped and started from here."""
    explicit = os.environ.get("INTERMISSION_SOAK_PG_CLUSTER")
    if explicit:
        version, name = explicit.split()
        return version, name
    if shutil.which("pg_ctlcluster") is None or shutil.which("pg_lsclusters") is None:
        return None
    port = str(urlsplit(server_dsn).port or 5432)
    try:
        argv = ["pg_lsclusters", "-h"]
        listing = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout  # noqa: S603
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == port and parts[3] == "online":
            return parts[0], parts[1]
    return None


class ServerFaults:
    def __init__(self, ctl: list[str], server_dsn: str, database: str, pg_cluster: tuple[str, str] | None) -> None:
        self.ctl = ctl
        self.server_dsn = server_dsn
        self.database = database
        self.pg_cluster = pg_cluster
        # One server fault at a time, and never one while another is being undone.
        self.lock = asyncio.Lock()

    def _pg_ctl(self, action: str, *extra: str) -> list[str]:
        assert self.pg_cluster is not None
        version, name = self.pg_cluster
        return ["pg_ctlcluster", "--skip-systemctl-redirect", version, name, action, *extra]

    async def rabbit_outage(self, hold: float) -> float:
        """``stop_app``, ``hold`` seconds, ``start_app`` (always). Returns the seconds the app was down."""
        async with self.lock:
            start = [*self.ctl, "-q", "start_app"]
            _arm("rabbit", start)
            began = time.monotonic()
            try:
                await rabbitmqctl(self.ctl, "stop_app")
                await asyncio.sleep(hold)
            finally:
                ok = _run_undo(start)
                _disarm("rabbit")
                if not ok:
                    raise RuntimeError("rabbitmqctl start_app failed: RabbitMQ may be down")
            down = time.monotonic() - began
            # Over only once the recovered queues' dead-letter workers have started (bench/rabbitctl.py):
            # the soak's end deletes its vhost, and a deletion before that can break the node.
            await settle_dead_lettering(self.ctl)
            return down

    async def pg_outage(self, hold: float) -> float:
        """Stop the PostgreSQL cluster (fast mode), ``hold`` seconds, start it (always) and wait until it
        answers. Returns the seconds it was down."""
        if self.pg_cluster is None:
            raise RuntimeError("no local PostgreSQL cluster to stop and start")
        async with self.lock:
            start = self._pg_ctl("start")
            _arm("pg", start)
            began = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._pg_ctl("stop", "-m", "fast"),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                )
                _, err = await proc.communicate()
                if proc.returncode != 0:
                    log.warning("pg_ctlcluster stop exited %s: %s", proc.returncode, err.decode()[-300:])
                await asyncio.sleep(hold)
            finally:
                ok = _run_undo(start)
                _disarm("pg")
                if not ok:
                    raise RuntimeError("pg_ctlcluster start failed: PostgreSQL may be down")
            await self.wait_pg()
            return time.monotonic() - began

    async def wait_pg(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while True:
            try:
                con = await asyncpg.connect(self.server_dsn, timeout=3)
            except (OSError, asyncpg.PostgresError, TimeoutError, asyncpg.InterfaceError):
                if time.monotonic() > deadline:
                    raise RuntimeError("PostgreSQL did not answer after its restart") from None
                await asyncio.sleep(0.2)
                continue
            await con.close()
            return

    async def pg_terminate(self) -> int:
        """Terminate every backend of the soak database (from a connection to another database)."""
        async with self.lock:
            con = await asyncpg.connect(self.server_dsn, timeout=10)
            try:
                killed = await con.fetchval(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = $1 AND pid <> pg_backend_pid()",
                    self.database,
                )
            finally:
                await con.close()
            return int(killed or 0)
