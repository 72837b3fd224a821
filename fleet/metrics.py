"""Prometheus metrics of a worker and of a sweeper (served with the health endpoints by ``fleet/health.py`` on
``INTERMISSION_METRICS_PORT`` when it is not 0).

Counters only where a rate is what an operator watches (commands by outcome, runs by how they left the
worker, takeovers, outbox refusals and quarantines), gauges for what is in flight or waiting. Labels are
bounded sets (command names, outcomes, error codes), never run ids or scopes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from intermission.engine.observer import Quiet
from intermission.engine.transition import Family
from intermission.schemas.suspension import SuspendReason
from intermission.store.across_scopes import PAUSE_AGES, OutboxLag, PauseFigures

if TYPE_CHECKING:
    from intermission.publishers.relay import OutboxRelay

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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


class _ProcessMetrics:
    """What the metrics of every process share: the registry each metric is registered on as it is made, and
    the restarts of the process's background tasks."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry or CollectorRegistry()

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def _gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def _task_restarts(self, tasks: str) -> Counter:
        """One metric in every process, by task; ``tasks`` names the tasks this process runs."""
        return self._counter(
            "intermission_task_restarts_total",
            f"Background tasks ({tasks}) restarted after an unexpected error.",
            ["task"],
        )


class WorkerMetrics(_ProcessMetrics, Quiet):
    """What a worker reports, as an observer of its engine (``engine/observer.py``): each command's outcome
    and transaction time, each statement the committer ran, and the fleet's own figures."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.commands = self._counter(
            "intermission_commands_total",
            "Commands handled, by command, outcome (applied, duplicate, stale, rejected, requeued, dead_lettered)"
            " and code.",
            ["command", "outcome", "code"],
        )
        self.runs_left = self._counter(
            "intermission_runs_left_total",
            "Runs that left this worker, by how (paused, ended, released, lease_lost, interrupted, failed).",
            ["how"],
        )
        self.reclaimed = self._counter(
            "intermission_runs_reclaimed_total", "Runs this worker took over after their lease lapsed."
        )
        self.quarantined = self._counter(
            "intermission_runs_quarantined_total",
            "Runs taken over that could not be continued (a row that does not decode) and were ended failed.",
        )
        self.task_restarts = self._task_restarts("relay, reclaim sweep, lease keeper, sweeper")
        self.running = self._gauge("intermission_runs_running", "Runs executing in this worker now.")
        self.command_seconds = self._histogram(
            "intermission_command_transaction_seconds",
            "How long one command's transaction took in this worker (its claim, start, cancel, reply: the read,"
            " the transition and the commit, waiting for the batch it went in included), by command. Retried"
            " attempts are observed each.",
            ["command"],
            _SECONDS,
        )
        self.commit_seconds = self._histogram(
            "intermission_commit_seconds",
            "How long one statement of the engine's committer took (every transition that waited with it went"
            " in it), by transition.",
            ["transition"],
            _SECONDS,
        )
        self.commit_size = self._histogram(
            "intermission_commit_transitions",
            "How many transitions one statement of the engine's committer carried, by transition.",
            ["transition"],
            (1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.lease_takeovers = self._counter(
            "intermission_lease_takeovers_total",
            "Running runs whose lapsed lease this worker's reclaim sweep took over (continued or quarantined).",
        )
        self.lease_lost_writes = self._counter(
            "intermission_lease_lost_writes_total",
            "Writes of a run (a progress save, a pause, an end) the database refused because this worker's lease"
            " on it was lost: another worker took the run over.",
        )

    def watch_relay(self, relay: OutboxRelay) -> None:
        """Expose ``relay``'s refusals, quarantines and the quarantined rows' count."""
        self.registry.register(_RelayCollector(relay))

    # --- as the engine's observer ---------------------------------------------------------------------

    def settled(self, command: str, outcome: str, code: str) -> None:
        self.commands.labels(command, outcome, code).inc()

    def applied(self, command: str, seconds: float) -> None:
        self.command_seconds.labels(command).observe(seconds)

    @contextlib.contextmanager
    def committing(self, family: Family, callers: Sequence[object]) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.commit_seconds.labels(family.name).observe(time.perf_counter() - started)
            self.commit_size.labels(family.name).observe(len(callers))


class SweeperMetrics(_ProcessMetrics):
    """What a sweeper process reports: its pruning, the storage it keeps bounded, and the dead letters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.pruned = self._counter(
            "intermission_rows_pruned_total", "Rows removed by retention pruning in this process, by table.", ["table"]
        )
        self.table_bytes = self._gauge(
            "intermission_table_bytes",
            "Size on disk of each of Intermission's tables with its indexes and TOAST.",
            ["table"],
        )
        self.table_rows = self._gauge(
            "intermission_table_rows", "Live rows of each table (PostgreSQL's statistics' estimate).", ["table"]
        )
        self.oldest_ended_run = self._gauge(
            "intermission_oldest_ended_run_seconds",
            "How long ago the oldest ended run still kept ended: above INTERMISSION_RETENTION_SECONDS (plus"
            " a prune interval), pruning is falling behind.",
        )
        self.idempotency_window = self._gauge(
            "intermission_idempotency_window_seconds",
            "The idempotency window (INTERMISSION_INBOX_RETENTION_SECONDS): a command re-sent after it is a new"
            " command.",
        )
        self.oldest_inbox = self._gauge(
            "intermission_inbox_oldest_seconds", "Age of the oldest inbox record: the idempotency window as it is kept."
        )
        self.dead_letters = self._gauge("intermission_dead_letters", "Messages in intermission.dead.")
        self.dead_letter_age = self._gauge(
            "intermission_dead_letter_oldest_seconds",
            "Age of the oldest message in intermission.dead (0 when it is empty).",
        )
        self.task_restarts = self._task_restarts("sweeper, pruner")
        self.pauses_open = self._gauge(
            "intermission_pauses_open",
            "Live pauses of paused runs, fleet-wide, by reason and by how long they have been open (under_1m,"
            " 1m_to_1h, 1h_to_1d, 1d_to_7d, over_7d).",
            ["reason", "age"],
        )
        self.earliest_deadline = self._gauge(
            "intermission_pause_earliest_deadline_timestamp_seconds",
            "When the earliest deadline of a live pause falls (Unix time; 0 when no live pause has one).",
        )
        self.sweeper_lag = self._gauge(
            "intermission_sweeper_lag_seconds",
            "How long ago the oldest pause whose deadline passed, and whose run is still paused, should have"
            " expired: 0 when none waits; above INTERMISSION_SWEEP_INTERVAL_SECONDS (plus a claim), the sweepers"
            " or the expire consumers are behind.",
        )
        self.outbox_pending = self._gauge(
            "intermission_outbox_pending_rows",
            "Outbox rows the relays have yet to publish, fleet-wide (quarantined ones are not among them).",
        )
        self.outbox_oldest = self._gauge(
            "intermission_outbox_oldest_pending_seconds",
            "How long ago the oldest outbox row the relays have yet to publish was written (0 when none waits).",
        )

    def report_pauses(self, figures: PauseFigures) -> None:
        """Every reason and age bucket, those with no pause at 0, so that a drained bucket reads 0."""
        for reason in SuspendReason:
            for age in PAUSE_AGES:
                self.pauses_open.labels(reason.value, age).set(figures.open.get((reason.value, age), 0))
        earliest = figures.earliest_deadline
        self.earliest_deadline.set(earliest.timestamp() if earliest is not None else 0.0)
        self.sweeper_lag.set(figures.sweeper_lag_seconds)

    def report_outbox(self, lag: OutboxLag) -> None:
        self.outbox_pending.set(lag.pending)
        self.outbox_oldest.set(lag.oldest_seconds or 0.0)
