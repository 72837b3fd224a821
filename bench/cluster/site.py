"""The soak on the cluster (``bench/soak/site.py``'s ``Site``): its servers, faults and own invariants.

Every process of the fleet and of the harness is given the cluster's URL lists: the three RabbitMQ nodes
(with a 5 s heartbeat, so that a node that vanishes without a word is noticed in seconds, not minutes)
and both PostgreSQL servers with ``target_session_attrs=read-write``. The workers journal their charges
outside the database (``tests/support/charge_journal.py``) and log at INFO, so that their own words say
when they moved between nodes and servers and which commands were delivered to them again.

Invariants of its own, checked after the soak's:

- ``no_double_charge_across_timelines``: no (run, call) charged twice in the journal, which outlives both
  database timelines, and every charge the database kept is in it;
- ``faults_real``: every fault did what it says (``bench/cluster/faults.py``'s proofs);
- ``cluster_healthy``: after the drain every quorum queue has a leader and all its members online.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.cluster.faults import ClusterFaults
from bench.cluster.partition import available as netns_available
from bench.cluster.servers import RABBIT_BIN, Servers
from bench.soak.checker import CheckResult
from bench.soak.servers import ServerFaults
from bench.soak.site import Endpoints, FaultAction, FaultPlan, SoakRun
from tests.support import charge_journal

HEARTBEAT_SECONDS = 5
AFTERMATH_KINDS = (
    "rabbit_leader_kill",
    "pg_failover",
    "worker_partition",
    "worker_stall",
    "worker_sigkill",
    "pg_terminate_backends",
)
# What the workers say in their logs that the report counts (fleet and publishers' "action" fields).
COUNTED_ACTIONS = ("redelivered", "duplicate", "amqp_moved", "pg_connected", "run_reclaimed", "run_lease_lost")
# What happened within this long after a fault is put down to it (faults may overlap: an upper bound).
AFTERMATH_SECONDS = 30.0
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
INVARIANTS = {
    "no_double_charge_across_timelines": "no call charged twice in the journal kept outside the database",
    "faults_real": "every fault did what it says (node led queues, standby was synchronous, ...)",
    "cluster_healthy": "after the drain every quorum queue has a leader and all members online",
}


class ClusterSite:
    name = "cluster"

    def __init__(
        self,
        servers: Servers,
        *,
        partitions: bool,
        node_down: tuple[float, float],
        stall_seconds: float,
        partition_hold: tuple[float, float] = (20.0, 40.0),
        heavy_per_deck: int = 1,
    ) -> None:
        self.heavy_per_deck = heavy_per_deck
        self.servers = servers
        self.partitions = partitions
        self.node_down = node_down
        self.stall_seconds = stall_seconds
        self.partition_hold = partition_hold
        self.journal = servers.folder / "charges.jsonl"
        self.faults: ClusterFaults | None = None
        ctl = ["env", f"HOME={servers.home}", str(RABBIT_BIN / "rabbitmqctl"), "-n", servers.rabbits[0].name]
        self._endpoints = Endpoints(
            server_dsn=servers.database_url,
            admin_url=f"{servers.amqp_url}?heartbeat={HEARTBEAT_SECONDS}",
            ctl=ctl,
        )

    @property
    def endpoints(self) -> Endpoints:
        return self._endpoints

    def fleet_env(self) -> dict[str, str]:
        return {
            charge_journal.ENV: str(self.journal),
            "INTERMISSION_LOG_LEVEL": "INFO",
            "INTERMISSION_AMQP_RECONNECT_SECONDS": "1",
            "INTERMISSION_AMQP_CONNECT_TIMEOUT_SECONDS": "3",
            # Both hosts within it: one dead server's unanswered connect must leave time for the other.
            "INTERMISSION_DATABASE_CONNECT_TIMEOUT_SECONDS": "10",
        }

    def fault_plan(self, run: SoakRun) -> FaultPlan:
        faults = ClusterFaults(self.servers, run, node_down=self.node_down, stall_seconds=self.stall_seconds)
        self.faults = faults
        heavy: tuple[str, ...] = ("rabbit_leader_kill", "pg_failover")
        actions = {
            "rabbit_leader_kill": faults.kill_leader,
            "pg_failover": faults.failover,
            "worker_stall": faults.stall,
            "pg_terminate_backends": self._terminate(run),
        }
        if self.partitions:
            why = netns_available()
            if why is None:
                heavy = (*heavy, "worker_partition")

                async def partition() -> str | None:
                    return await faults.partition(self.partition_hold)

                actions["worker_partition"] = partition
            else:
                run.ledger.notes.append(f"worker_partition skipped: {why}")
        return FaultPlan(
            light=("worker_stall", "pg_terminate_backends"),
            heavy=heavy,
            actions=actions,
            heavy_per_deck=self.heavy_per_deck,
        )

    def _terminate(self, run: SoakRun) -> FaultAction:
        # The soak's own backend termination, through the URL list: it reaches whichever server is primary.
        servers = ServerFaults(self._endpoints.ctl, self.servers.database_url, run.env.database, None)

        async def terminate() -> str:
            return f"{await servers.pg_terminate()} backends terminated"

        return terminate

    async def verify(self, run: SoakRun, result: CheckResult) -> dict[str, Any]:
        result.site_invariants.update(INVARIANTS)
        await self._charges(run, result)
        self._proofs(result)
        queues = await self._queues(run, result)
        return {
            "cluster": {
                "fault_proofs": [
                    {"kind": p.kind, **p.facts, "problems": p.problems}
                    for p in (self.faults.proofs if self.faults else [])
                ],
                "recovery_by_kind": self._recovery(run),
                "worker_log_counts": self._log_counts(run.logdir),
                "aftermath": self._aftermath(run),
                "journal_entries": len(charge_journal.read(self.journal)),
                "failovers": self.faults.failovers if self.faults else 0,
                "queues": queues,
            }
        }

    async def _charges(self, run: SoakRun, result: CheckResult) -> None:
        inv = "no_double_charge_across_timelines"
        # Each charge by its run's key (scope and id: a run id is unique only within its scope) and call.
        journal = Counter((e.app, e.tenant, e.run_id, e.call_id) for e in charge_journal.read(self.journal))
        con = await asyncpg.connect(run.env.database_url, timeout=30)
        try:
            rows = await con.fetch(
                "SELECT app, tenant, run_id, call_id, count(*) AS times FROM demo_charges GROUP BY 1, 2, 3, 4"
            )
        finally:
            await con.close()
        for (app, tenant, run_id, call_id), times in journal.items():
            result.checked[inv] += 1
            if times > 1:
                result.fail(
                    inv,
                    f"run {run_id} of {app}/{tenant} call {call_id}",
                    "charged once (the journal)",
                    f"{times} charges",
                )
        for row in rows:
            result.checked[inv] += 1
            if (row["app"], row["tenant"], row["run_id"], row["call_id"]) not in journal:
                result.fail(
                    inv,
                    f"run {row['run_id']} of {row['app']}/{row['tenant']} call {row['call_id']}",
                    "every charge in the database journalled before it was made",
                    "a database charge the journal does not have",
                )

    def _proofs(self, result: CheckResult) -> None:
        inv = "faults_real"
        proofs = self.faults.proofs if self.faults else []
        for proof in proofs:
            result.checked[inv] += 1
            for problem in proof.problems:
                result.fail(inv, f"{proof.kind} at {proof.at:.0f}", "the fault was real", problem)

    async def _queues(self, run: SoakRun, result: CheckResult) -> list[dict[str, Any]]:
        inv = "cluster_healthy"
        if self.faults is None:
            return []
        rows = await self.faults.queues(self.servers.rabbits[0])
        nodes = len(self.servers.rabbits)
        for row in rows:
            if row.get("type") != "quorum":
                continue
            result.checked[inv] += 1
            online, members = list(row.get("online") or []), list(row.get("members") or [])
            if not row.get("leader") or len(online) != nodes or len(members) != nodes:
                result.fail(
                    inv,
                    f"queue {row['name']}",
                    f"a leader and {nodes} members online",
                    f"leader {row.get('leader')!r}, members {members}, online {online}",
                )
        return [{k: row.get(k) for k in ("name", "leader", "online")} for row in rows]

    @staticmethod
    def _recovery(run: SoakRun) -> dict[str, dict[str, float | int | None]]:
        done = sorted(run.observer.completed_at)
        gaps: dict[str, list[float]] = defaultdict(list)
        for fault in run.ledger.faults:
            if fault.done:
                later = [t for t in done if t >= fault.at]
                if later:
                    gaps[fault.kind].append(later[0] - fault.at)
        return {
            kind: {"faults": len(g), "median_s": round(statistics.median(g), 2), "max_s": round(max(g), 2)}
            for kind, g in sorted(gaps.items())
        }

    @staticmethod
    def _worker_lines(logdir: Path) -> list[dict[str, Any]]:
        """Every line of the workers' JSON logs that names an action the report counts."""
        lines: list[dict[str, Any]] = []
        for path in logdir.glob("worker-*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if '"action"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("action") in COUNTED_ACTIONS:
                    lines.append(record)
        return lines

    def _log_counts(self, logdir: Path) -> dict[str, int]:
        return dict(sorted(Counter(str(r["action"]) for r in self._worker_lines(logdir)).items()))

    def _aftermath(self, run: SoakRun) -> dict[str, dict[str, int]]:
        """Per kind of server or worker fault: the runs reclaimed by another worker, the commands delivered
        again and the events heard twice within ``AFTERMATH_SECONDS`` of one (the cost of a fault to the
        runs in flight and to the subscribers)."""
        # The logs carry wall-clock times, the ledger and the observer monotonic ones.
        offset = time.time() - time.monotonic()
        reclaimed: list[tuple[float, str]] = []
        redelivered: list[float] = []
        for record in self._worker_lines(run.logdir):
            try:
                at = datetime.strptime(str(record["asctime"]), LOG_TIME).timestamp() - offset
            except (KeyError, ValueError):
                continue
            if record["action"] == "run_reclaimed":
                reclaimed.append((at, str(record.get("run_id"))))
            elif record["action"] == "redelivered":
                redelivered.append(at)
        seen: set[str] = set()
        twice: list[float] = []
        for event in run.observer.events:
            if event.message_id is None:
                continue
            if event.message_id in seen:
                twice.append(event.arrived)
            seen.add(event.message_id)
        kinds = {f.kind for f in run.ledger.faults if f.done and f.kind in AFTERMATH_KINDS}
        out: dict[str, dict[str, int]] = {}
        for kind in sorted(kinds):
            windows = [(f.at, f.at + AFTERMATH_SECONDS) for f in run.ledger.faults if f.done and f.kind == kind]

            def within(t: float, spans: list[tuple[float, float]] = windows) -> bool:
                return any(lo <= t <= hi for lo, hi in spans)

            out[kind] = {
                "faults": len(windows),
                "runs_reclaimed": len({r for t, r in reclaimed if within(t)}),
                "commands_redelivered": sum(1 for t in redelivered if within(t)),
                "events_heard_twice": sum(1 for t in twice if within(t)),
            }
        return out
