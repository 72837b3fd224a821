"""Prometheus metrics of a worker and of a sweeper (served with the health endpoints by ``ops/health.py`` on
``INTERMISSION_METRICS_PORT`` when it is not 0).

Counters only where a rate is what an operator watches (commands by outcome, runs by how they left the
worker, takeovers, outbox refusals and quarantines), gauges for what is in flight or waiting. Labels are
bounded sets (command names, outcomes, error codes), never run ids or scopes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from intermission.wire import Command

if TYPE_CHECKING:
    from intermission.publishers.relay import OutboxRelay


class _RelayCollector:
    """The relay's own counts, read at each scrape: the relay keeps plain numbers (it knows nothing of
    Prometheus), and reading them when scraped cannot drift from them."""

    def __init__(self, relay: OutboxRelay) -> None:
        self._relay = relay

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "intermission_outbox_refused",
            "Broker refusals of outbox rows this worker's relay counted (nack, return, channel closed over it).",
            value=self._relay.refused,
        )
        yield CounterMetricFamily(
            "intermission_outbox_quarantined",
            "Outbox rows this worker's relay quarantined after INTERMISSION_OUTBOX_MAX_ATTEMPTS refusals.",
            value=self._relay.quarantined,
        )
        rows = self._relay.quarantined_rows
        if rows is not None:
            # Before the relay's first count there is no figure, rather than a made-up 0.
            yield GaugeMetricFamily(
                "intermission_outbox_quarantined_rows",
                "Quarantined outbox rows in the database, fleet-wide (every worker reports the same figure).",
                value=rows,
            )


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

    def watch_relay(self, relay: OutboxRelay) -> None:
        """Expose ``relay``'s refusals, quarantines and the quarantined rows' count."""
        self.registry.register(_RelayCollector(relay))

    def command(self, command: Command, outcome: str, code: str) -> None:
        self.commands.labels(command.value, outcome, code).inc()


class SweeperMetrics:
    """What a sweeper process reports: its pruning, the storage it keeps bounded, and the dead letters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.pruned = Counter(
            "intermission_rows_pruned_total",
            "Rows removed by retention pruning in this process, by table.",
            ["table"],
            registry=self.registry,
        )
        self.table_bytes = Gauge(
            "intermission_table_bytes",
            "Size on disk of each of Intermission's tables with its indexes and TOAST.",
            ["table"],
            registry=self.registry,
        )
        self.table_rows = Gauge(
            "intermission_table_rows",
            "Live rows of each table (PostgreSQL's statistics' estimate).",
            ["table"],
            registry=self.registry,
        )
        self.oldest_ended_run = Gauge(
            "intermission_oldest_ended_run_seconds",
            "How long ago the oldest ended run still kept ended: above INTERMISSION_RETENTION_SECONDS (plus"
            " a prune interval), pruning is falling behind.",
            registry=self.registry,
        )
        self.idempotency_window = Gauge(
            "intermission_idempotency_window_seconds",
            "The idempotency window (INTERMISSION_INBOX_RETENTION_SECONDS): a command re-sent after it is a new"
            " command.",
            registry=self.registry,
        )
        self.oldest_inbox = Gauge(
            "intermission_inbox_oldest_seconds",
            "Age of the oldest inbox record: the idempotency window as it is kept.",
            registry=self.registry,
        )
        self.dead_letters = Gauge(
            "intermission_dead_letters",
            "Messages in intermission.dead.",
            registry=self.registry,
        )
        self.dead_letter_age = Gauge(
            "intermission_dead_letter_oldest_seconds",
            "Age of the oldest message in intermission.dead (0 when it is empty).",
            registry=self.registry,
        )
        self.task_restarts = Counter(
            "intermission_task_restarts_total",
            "Background tasks (sweeper, pruner) restarted after an unexpected error.",
            ["task"],
            registry=self.registry,
        )
