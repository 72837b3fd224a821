"""Prometheus metrics of a worker (served on ``INTERMISSION_METRICS_PORT`` when it is not 0).

Counters only where a rate is what an operator watches (commands by outcome, runs by how they left the
worker, takeovers), gauges for what is in flight. Labels are bounded sets (command names, outcomes, error
codes), never run ids or scopes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from intermission.wire import Command


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.commands = Counter(
            "intermission_commands_total",
            "Commands handled, by command, outcome (applied, duplicate, stale, rejected, requeued, dead_lettered)"
            " and code.",
            ["command", "outcome", "code"],
            registry=self.registry,
        )
        self.runs_left = Counter(
            "intermission_runs_left_total",
            "Runs that left this worker, by how (paused, ended, released, lease_lost, interrupted, failed).",
            ["how"],
            registry=self.registry,
        )
        self.reclaimed = Counter(
            "intermission_runs_reclaimed_total",
            "Runs this worker took over after their lease lapsed.",
            registry=self.registry,
        )
        self.quarantined = Counter(
            "intermission_runs_quarantined_total",
            "Runs taken over that could not be continued (a row that does not decode) and were ended failed.",
            registry=self.registry,
        )
        self.task_restarts = Counter(
            "intermission_task_restarts_total",
            "Background tasks (relay, reclaim sweep, lease keeper, sweeper) restarted after an unexpected error.",
            ["task"],
            registry=self.registry,
        )
        self.running = Gauge("intermission_runs_running", "Runs executing in this worker now.", registry=self.registry)

    def command(self, command: Command, outcome: str, code: str) -> None:
        self.commands.labels(command.value, outcome, code).inc()

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, registry=self.registry)
