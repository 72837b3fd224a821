"""What the two peer scripts share: their database, their CPU accounting, latency figures and the JSON line.

These scripts run in the peers' own venv (``bench.peer_runs`` makes it), never the project's: they import
only the standard library at the top and psycopg where they need it, and nothing of Intermission.

The server is PEERS_DATABASE_URL (a server-level DSN such as ``postgresql://postgres@127.0.0.1:5432/postgres``;
without it PGHOST/PGPORT/PGUSER, default 127.0.0.1:5432/postgres). Each run creates the database it is
given (``--db``), dropping it first if a run before it left it, and drops it at the end. Results are
written only to the folder named by PEERS_RESULTS, when it is set; the JSON line on stdout is what
``bench.resume`` reads.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from urllib.parse import urlsplit, urlunsplit

RESULTS_DIR = os.environ.get("PEERS_RESULTS")
SERVER_URL = os.environ.get("PEERS_DATABASE_URL")
PGHOST = os.environ.get("PGHOST", "127.0.0.1")
PGPORT = int(os.environ.get("PGPORT", "5432"))
PGUSER = os.environ.get("PGUSER", "postgres")


def dsn(db: str) -> str:
    if SERVER_URL:
        return urlunsplit(urlsplit(SERVER_URL)._replace(path=f"/{db}"))
    return f"postgresql://{PGUSER}@{PGHOST}:{PGPORT}/{db}"


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def quoted(name: str) -> str:
    """A database name as an SQL identifier; only the plain names the benchmark makes are accepted."""
    if not name or not all(c.isalnum() or c == "_" for c in name):
        raise ValueError(f"not a plain database name: {name!r}")
    return f'"{name}"'


# ---------------------------------------------------------------- databases
def _admin():
    import psycopg

    return psycopg.connect(dsn("postgres"), autocommit=True)


def create_db(name: str) -> None:
    with _admin() as c:
        c.execute(f"DROP DATABASE IF EXISTS {quoted(name)} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {quoted(name)}")


def drop_db(name: str) -> None:
    with _admin() as c:
        c.execute(f"DROP DATABASE IF EXISTS {quoted(name)} WITH (FORCE)")


STAT_COLS = (
    "xact_commit",
    "xact_rollback",
    "tup_inserted",
    "tup_updated",
    "tup_deleted",
    "tup_returned",
    "tup_fetched",
    "blks_read",
    "blks_hit",
)
STAT_QUERY = (
    "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, tup_returned, tup_fetched,"
    " blks_read, blks_hit FROM pg_stat_database WHERE datname = %s"
)


def db_stats(name: str) -> dict:
    """Cumulative counters of one database from pg_stat_database.

    Backends publish their counters when they go idle (at most once a second, else after
    up to 10 s of idleness) and when they exit, so callers settle or disconnect first."""
    with _admin() as c:
        c.execute("SELECT pg_stat_clear_snapshot()")
        row = c.execute(STAT_QUERY, (name,)).fetchone()
    return dict(zip(STAT_COLS, row, strict=True)) if row else {}


def stats_delta(a: dict, b: dict, units: int) -> dict:
    d = {k: b.get(k, 0) - a.get(k, 0) for k in STAT_COLS}
    d.update({k + "_per_resume": round(v / units, 2) for k, v in list(d.items())})
    return d


# ---------------------------------------------------------------- CPU accounting
_TCK = os.sysconf("SC_CLK_TCK")
# The server's shared processes, by their titles (PostgreSQL 15; "stats collector" is gone since 15).
_PG_AUX = (
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


def _proc_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / _TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _machine():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, _steal = v
    return (user + nice + system + irq + softirq) / _TCK, (idle + iowait) / _TCK


class CpuSampler:
    """CPU seconds of: this process (all threads), extra Python processes we name (e.g. a
    sender subprocess), the Postgres backends connected to OUR database, the server's shared
    processes (the postmaster, walwriter, checkpointer, bgwriter, autovacuum: shared with
    anything else that uses the server), and the whole machine.

    Other tenants' backends (another benchmark on the same server) are NOT counted as ours:
    backends are told apart by the database name in their process title. ``bench.resume``
    counts Intermission's PostgreSQL time the same way (``bench.infra.postgres_pids``). A thread
    samples /proc every `interval` s, so a backend that lives and dies between two samples is
    missed, and one that exits loses its CPU after the last sample; pooled connections live
    through the whole window, so that is small here.
    """

    def __init__(self, dbname: str, interval: float = 0.2):
        self.dbname = dbname
        self.interval = interval
        self.extra_pids: set[int] = set()
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._kind: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _classify(self, pid: int) -> str | None:
        if pid in self.extra_pids:
            return "py_extra"
        if _comm(pid) != "postgres":
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None
        if f" {self.dbname} " in title:
            return "pg_ours"
        parent = _parent(pid)
        if any(a in title for a in _PG_AUX) or (parent is not None and _comm(parent) != "postgres"):
            return "pg_aux"  # a shared process, or the postmaster (whose parent is not a postgres)
        return None

    def _sample(self, initial: bool = False) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            if pid in self._kind:
                kind = self._kind[pid]
                if kind is None:  # known to be uninteresting
                    continue
            else:
                kind = self._classify(pid)
                self._kind[pid] = kind
                if kind is None:
                    continue
            cpu = _proc_cpu(pid)
            if cpu is None:
                continue
            with self._lock:
                if pid not in self._first:
                    # a process that appeared during the window counts from zero
                    self._first[pid] = cpu if initial else 0.0
                self._last[pid] = cpu

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> None:
        self._kind.clear()
        self._first.clear()
        self._last.clear()
        self._sample(initial=True)
        t = os.times()
        self._py0 = t.user + t.system
        self._m0 = _machine()
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cpu-sampler")
        self._thread.start()

    def add_pid(self, pid: int) -> None:
        """Count a process we started (a sender) as Python, from zero."""
        self.extra_pids.add(pid)
        self._kind.pop(pid, None)

    def stop(self, units: int) -> dict:
        self._sample()
        self._stop.set()
        if self._thread:
            self._thread.join()
        t = os.times()
        py = t.user + t.system - self._py0
        busy1, idle1 = _machine()
        busy = busy1 - self._m0[0]
        idle = idle1 - self._m0[1]
        wall = time.monotonic() - self._t0
        by = {"pg_ours": 0.0, "pg_aux": 0.0, "py_extra": 0.0}
        with self._lock:
            for pid, last in self._last.items():
                kind = self._kind.get(pid)
                if kind is not None:
                    by[kind] += last - self._first.get(pid, 0.0)
        d = {
            "wall_s": round(wall, 3),
            "py_cpu_s": round(py + by["py_extra"], 3),
            "py_main_cpu_s": round(py, 3),
            "py_extra_cpu_s": round(by["py_extra"], 3),
            "pg_ours_cpu_s": round(by["pg_ours"], 3),
            "pg_aux_cpu_s": round(by["pg_aux"], 3),
            "machine_busy_cpu_s": round(busy, 3),
            "machine_util_pct": round(100.0 * busy / (busy + idle), 1) if busy + idle else None,
        }
        d["other_cpu_s"] = round(max(0.0, busy - py - by["py_extra"] - by["pg_ours"] - by["pg_aux"]), 3)
        for k in ("py", "pg_ours", "pg_aux", "other", "machine_busy"):
            d[k + "_ms_per_resume"] = round(1000.0 * d[k + "_cpu_s"] / units, 3)
        return d


def snapshot_payload(nbytes: int) -> str:
    """A string of nbytes random base64 characters: stands in for a progress snapshot.
    Random, so that Postgres' TOAST compression cannot shrink it to nothing."""
    import base64

    return base64.b64encode(os.urandom(nbytes)).decode()[:nbytes] if nbytes else ""


# ---------------------------------------------------------------- statistics
def percentile(values, p: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def lat_summary(lat_s) -> dict:
    """Latencies in seconds -> milliseconds."""
    if not lat_s:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    return {
        "p50_ms": round(percentile(lat_s, 50) * 1000, 2),
        "p99_ms": round(percentile(lat_s, 99) * 1000, 2),
        "max_ms": round(max(lat_s) * 1000, 2),
        "mean_ms": round(statistics.fmean(lat_s) * 1000, 2),
    }


def versions(*dists: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    try:
        with _admin() as c:
            out["postgresql"] = c.execute("SHOW server_version").fetchone()[0]
            out["synchronous_commit"] = c.execute("SHOW synchronous_commit").fetchone()[0]
    except Exception as exc:  # a version is a fact for the record, not a reason to fail the run
        log(f"versions: the server's could not be read: {exc}")
    return out


def emit(result: dict) -> None:
    """The last stdout line of every `one` run is its JSON result (``bench.resume`` reads it); with
    PEERS_RESULTS set, the same result is also kept there as a file."""
    if RESULTS_DIR:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        path = os.path.join(RESULTS_DIR, f"{result.get('peer', 'peer')}-{time.strftime('%Y%m%dT%H%M%S')}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        log(f"[saved] {path}")
    print(json.dumps(result, sort_keys=True), flush=True)
