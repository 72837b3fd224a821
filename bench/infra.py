"""What both benchmarks share: fresh databases and vhosts, CPU and memory readings from /proc, percentiles,
the machine's description and the results file.

Every benchmark works in a database and a RabbitMQ virtual host of its own, created for it and removed
after it, so it never touches anybody else's data (the tests' or a soak's). CPU is read from
``/proc/<pid>/stat`` (user + system time) before and after a measured phase, for the processes of each
group: the Python processes (workers or the bare pipeline), every ``postgres`` process and RabbitMQ's
``beam.smp``. The machine is shared, so every result also says whether a fault-injection soak
(``bench.soak``) was running while it was taken; such figures are for development, not for the record.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg

from intermission.store.migrate import ensure_database, migrate
from tests.support.rabbitctl import delete_vhosts, rabbitmqctl, write_definitions

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
NAME_PREFIX = "intermission_bench"


# --- numbers --------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of ``values``; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(p / 100 * len(ordered))))
    return ordered[rank - 1]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 and max of durations given in seconds, in milliseconds (3 decimals)."""
    ms = [s * 1000 for s in seconds]
    return {
        "p50": round(percentile(ms, 50), 3),
        "p90": round(percentile(ms, 90), 3),
        "p99": round(percentile(ms, 99), 3),
        "max": round(max(ms), 3) if ms else float("nan"),
        "count": len(ms),
    }


# --- /proc ----------------------------------------------------------------------------------------------


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` in clock ticks, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def pids_named(comm: str) -> list[int]:
    """Every process whose command name (``/proc/<pid>/comm``) is ``comm``."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == comm:
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


# The server's shared processes, by their titles: what a database's share of PostgreSQL includes beside its
# own backends (bench/peers/common.py counts the peers' the same way).
PG_SHARED = (
    "checkpointer",
    "background writer",
    "walwriter",
    "autovacuum",
    "logical replication",
    "stats collector",
    "archiver",
    "walsender",
    "walreceiver",
)


def _parent_pid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[1])


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def postgres_pids(database: str | None = None) -> list[int]:
    """Every ``postgres`` process; with ``database``, only that database's backends (their title names it)
    and the server's shared processes: the postmaster, the WAL writer, the checkpointer, autovacuum and the
    like. Another tenant's backends on the same server are then not counted."""
    every = pids_named("postgres")
    if database is None:
        return every
    found: list[int] = []
    for pid in every:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        parent = _parent_pid(pid)
        postmaster = parent is not None and _comm(parent) != "postgres"
        if f" {database} " in title or postmaster or any(name in title for name in PG_SHARED):
            found.append(pid)
    return found


def status_kib(pid: int, key: str) -> int | None:
    """A ``kB`` line of ``/proc/<pid>/status`` (VmHWM: peak resident memory; VmRSS: current)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def system_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in first]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


@dataclass
class CpuReading:
    """Ticks per pid of each group, and the machine's, at one instant."""

    groups: dict[str, dict[int, int]]
    system: tuple[int, int]
    at: float


@dataclass
class CpuProbe:
    """Reads CPU time of fixed pids (``python``: workers or the bare pipeline; ``driver``: this process)
    and of the servers' processes, found anew at each reading: a backend that connects during the phase is
    counted from zero."""

    python: list[int]
    driver: list[int] = field(default_factory=lambda: [os.getpid()])
    # With a database, PostgreSQL is that database's backends and the server's shared processes only
    # (postgres_pids): what another tenant of the server does is then ``other``.
    database: str | None = None

    def read(self) -> CpuReading:
        groups: dict[str, Iterable[int]] = {
            "python": self.python,
            "postgres": postgres_pids(self.database),
            "rabbitmq": pids_named("beam.smp"),
            "driver": self.driver,
        }
        ticks: dict[str, dict[int, int]] = {}
        for name, pids in groups.items():
            ticks[name] = {}
            for pid in pids:
                value = cpu_ticks(pid)
                if value is not None:
                    ticks[name][pid] = value
        return CpuReading(ticks, system_ticks(), time.perf_counter())

    @staticmethod
    def used_ms(before: CpuReading, after: CpuReading) -> dict[str, float]:
        """CPU milliseconds each group used between two readings, plus the whole machine's busy time and
        ``other``: busy time no group accounts for (somebody else on the machine)."""
        used: dict[str, float] = {}
        for name, now in after.groups.items():
            then = before.groups.get(name, {})
            ticks = sum(value - then.get(pid, 0) for pid, value in now.items())
            used[name] = ticks * 1000 / CLK_TCK
        busy = (after.system[0] - before.system[0]) * 1000 / CLK_TCK
        used["machine_busy"] = busy
        used["other"] = max(0.0, busy - sum(v for k, v in used.items() if k != "machine_busy"))
        used["wall"] = (after.at - before.at) * 1000
        return used


def per_item(used: dict[str, float], count: int) -> dict[str, float]:
    return {k: round(v / count, 4) for k, v in used.items() if k != "wall"} if count else {}


# --- the machine ----------------------------------------------------------------------------------------


def _command_output(*argv: str) -> str:
    if shutil.which(argv[0]) is None:
        return ""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def soak_processes() -> list[str]:
    """Command lines of a fault-injection soak running on this machine (another engineer's)."""
    return [
        line
        for line in _command_output("pgrep", "-af", "bench.soak").splitlines()
        if line.strip() and str(os.getpid()) != line.split()[0]
    ]


def machine() -> dict[str, Any]:
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "lscpu": [line.strip() for line in _command_output("lscpu").splitlines()[:15]],
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": _command_output("psql", "--version").strip(),
        "rabbitmq": _command_output("rabbitmqctl", "-q", "version").strip(),
    }


async def postgres_server_version(dsn: str) -> str:
    """The server's ``server_version`` (``psql --version`` in :func:`machine` is the client's)."""
    try:
        con = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError) as exc:
        return f"unknown ({exc})"
    try:
        return str(await con.fetchval("SHOW server_version"))
    finally:
        await con.close()


def write_results(kind: str, data: dict[str, Any], out: Path | None = None) -> Path:
    """Write ``data`` as JSON to ``out`` or to bench/results/<kind>-<UTC time>.json; returns the path."""
    if out is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        out = RESULTS_DIR / f"{kind}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return out


# --- PostgreSQL -----------------------------------------------------------------------------------------


def with_database(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


def database_of(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


def fresh_name(label: str) -> str:
    return f"{NAME_PREFIX}_{label}_{uuid.uuid4().hex[:10]}"


async def fresh_database(server_dsn: str, label: str, *, migrated: bool = True) -> str:
    """A new database on the server of ``server_dsn``, migrated like ``intermission migrate`` does it
    (ensure_database, then migrate); returns its DSN."""
    dsn = with_database(server_dsn, fresh_name(label))
    await ensure_database(dsn)
    if migrated:
        await migrate(dsn)
    return dsn


async def drop_database(dsn: str) -> None:
    name = urlsplit(dsn).path.lstrip("/")
    if not name.startswith(NAME_PREFIX):
        raise ValueError(f"refusing to drop {name!r}: not a benchmark database")
    con = await asyncpg.connect(with_database(dsn, "postgres"))
    try:
        # The name was made by fresh_name (a fixed prefix and hex) and checked above.
        await con.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await con.close()


# --- RabbitMQ -------------------------------------------------------------------------------------------


def vhost_url(base_url: str, vhost: str) -> str:
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


def url_user(url: str) -> str:
    return urlsplit(url).username or "guest"


class RabbitAdmin:
    """Virtual hosts of the benchmark's own, through ``rabbitmqctl`` (each call boots an Erlang VM, so
    vhosts are made in ONE ``import_definitions`` call and removed in one ``eval`` where possible)."""

    def __init__(self, ctl: Sequence[str], user: str) -> None:
        self.ctl = list(ctl)
        self.user = user
        self.made: list[str] = []

    async def add_vhosts(self, labels: Sequence[str]) -> list[str]:
        names = [fresh_name(label).replace("_", "-") for label in labels]
        definitions = {
            "vhosts": [{"name": n} for n in names],
            "permissions": [
                {"user": self.user, "vhost": n, "configure": ".*", "write": ".*", "read": ".*"} for n in names
            ],
        }
        with tempfile.TemporaryDirectory() as folder:
            path = write_definitions(Path(folder), definitions)
            await rabbitmqctl(self.ctl, "import_definitions", str(path))
        self.made.extend(names)
        return names

    async def delete_all(self) -> None:
        names, self.made = self.made, []
        for problem in await delete_vhosts(self.ctl, names, who="intermission-bench"):
            print(f"warning: not deleted: {problem}")


# --- subprocesses ---------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


async def stop_process(proc: asyncio.subprocess.Process, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        async with asyncio.timeout(grace):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
