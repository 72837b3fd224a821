"""Settings, from the environment (prefix ``INTERMISSION_``), each with a default that works on a
developer's machine. A bad setting stops the process at start with a message naming it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from intermission.publishers.amqp import AmqpUrlError, amqp_nodes, safe_url
from intermission.schemas.limits import MAX_PAUSE_TTL_SECONDS


@dataclass(frozen=True)
class ManagementAccess:
    url: str
    user: str
    password: str
    vhost: str


_URLS = frozenset({"database_url", "amqp_url", "management_url"})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INTERMISSION_", extra="ignore", frozen=True)

    # One server, or several hosts of which asyncpg takes the first that is a primary:
    # postgresql://user@pg1:5432,pg2:5432/intermission?target_session_attrs=read-write (README: cluster).
    database_url: str = "postgresql://postgres@localhost:5432/intermission"
    # One database connection attempt, over the WHOLE host list (asyncpg spends one budget on all hosts).
    database_connect_timeout_seconds: float = Field(default=60.0, gt=0)
    # One broker, or the nodes of a cluster as one comma-separated list sharing credentials, vhost and
    # options: amqp://user:pw@rabbit1:5672,rabbit2:5672,rabbit3/vhost (publishers/amqp.py: amqp_nodes).
    amqp_url: str = "amqp://guest:guest@localhost:5672/"
    # How long one node may take to accept a connection before the next one is tried. Short: a node that
    # died without a RST (a lost machine) costs this much on every connect that reaches it.
    amqp_connect_timeout_seconds: float = Field(default=5.0, gt=0)
    # The wait after a failed (re)connect attempt (every node tried) before the next one.
    amqp_reconnect_seconds: float = Field(default=5.0, gt=0)
    # Which node of INTERMISSION_AMQP_URL's list this process tries first (0 for the first listed): the
    # node in the process's own zone, say. Unset, the start is taken from the pid, so that the processes
    # of a machine spread over the nodes. Reconnects go on from the node used last either way.
    amqp_first_node: int | None = Field(default=None, ge=0)
    # The RabbitMQ user whose broker-validated user_id marks a message as the messaging bus's reply.
    bus_user: str = "intermission-bus"
    # Deliveries each command queue's consumer may hold unacknowledged (RabbitMQ's prefetch, per consumer).
    prefetch: int = Field(default=16, ge=1, le=1000)
    # Statements the engine's committer runs at once in this worker, every kind of transition together: fewer
    # than the pool's connections, so the relay, the lease line and the reads always find one.
    commands_in_flight: int = Field(default=6, ge=1, le=1000)
    # Group commit (engine/committer.py): how many transitions of one kind that wait together one statement
    # carries at most (1: each alone), and how many statements of one kind run at once. Nothing waits for a
    # batch to fill. One statement of a kind at a time: a command's read and its claim are two kinds, so a
    # worker still has two of its commands' statements in flight, as the batch path before the engine had
    # (a read and a claim in turn, two batches at once); two of each made half-size batches under load,
    # twice the statements and commits, and cost 12 % of resumes/s in bench/resume.py (docs/decisions.md).
    command_batch_size: int = Field(default=32, ge=1, le=1000)
    command_batches_in_flight: int = Field(default=1, ge=1, le=1000)
    # How long a command is held and retried while the database is unavailable before it is requeued:
    # longer than a managed database's failover (typically 30-120 s).
    command_retry_seconds: float = Field(default=180.0, ge=0)
    # The largest body of any command but run.reply (whose limit follows from its 8 MiB input).
    max_command_bytes: int = Field(default=1024 * 1024, ge=1024, le=16 * 1024 * 1024)
    # After this many deliveries a command that keeps failing (transiently) is dead-lettered by the broker.
    delivery_limit: int = Field(default=10, ge=1, le=1000)
    pool_max_size: int = Field(default=10, ge=1, le=200)
    lease_seconds: float = Field(default=30.0, gt=0)
    lease_renew_seconds: float = Field(default=10.0, gt=0)
    reclaim_interval_seconds: float = Field(default=5.0, gt=0)
    reclaim_batch: int = Field(default=32, ge=1, le=1000)
    relay_batch: int = Field(default=256, ge=1, le=10000)
    # The poll that backs up LISTEN/NOTIFY.
    # How long the outbox row of an event published from memory after its commit (a claim's run.resumed:
    # publishers/relay.py, hand_over) waits before the relays may publish it instead: enough for the
    # publication's confirm and the row's marking, short because it is how late such an event is when its
    # worker dies right after the commit (plus up to relay_poll_seconds). 0: every event goes through the
    # relays.
    outbox_hold_seconds: float = Field(default=3.0, ge=0)
    relay_poll_seconds: float = Field(default=5.0, gt=0)
    # How long a publisher waits for a batch's confirms before retrying it.
    publish_timeout_seconds: float = Field(default=10.0, gt=0)
    # Broker refusals of one outbox row (a nack, a return, a channel closed over it; never an outage) after
    # which the relay quarantines it. Between refusals the row waits 1 s, doubled each time, at most 10 s,
    # so the default gives a full subscriber queue about 15 s to make room.
    outbox_max_attempts: int = Field(default=5, ge=1)
    sweep_interval_seconds: float = Field(default=60.0, gt=0)
    sweep_batch: int = Field(default=100, ge=1, le=10000)
    # run.expire commands a sweeper publishes per second at most, so that working through a backlog does
    # not starve the claims of workers on the same machines (bench/scaling.py).
    sweep_max_rate: float = Field(default=500.0, gt=0)
    # The deadline of a pause; 0 means pauses never expire.
    pause_ttl_seconds: int = Field(default=86400, ge=0, le=MAX_PAUSE_TTL_SECONDS)
    # The default max_steps of a run whose config leaves it unset.
    max_steps: int = Field(default=32, ge=1)
    # The default budget.max_tool_calls of a run whose config leaves it unset (0): the tool calls a whole
    # run may ask for. Per run, like every budget: it bounds each turn too (a turn cannot ask for more than
    # what is left), where a per-turn cap would still let max_steps turns of it through. 256 is 8 calls a
    # step over the default 32 steps.
    max_tool_calls: int = Field(default=256, ge=1)
    # The most a start may ask for (0: no ceiling). A start over them is refused limit_exceeded: one tenant's
    # run asking for a million steps would otherwise hold a worker for as long as it likes.
    max_steps_limit: int = Field(default=1000, ge=0)
    max_tool_calls_limit: int = Field(default=10_000, ge=0)
    # The most tokens a run may spend in all (budget.max_total_tokens) and one model turn may write
    # (max_tokens); 0: no ceiling, the default, as before. Both are 0 ("no limit") in a start that leaves
    # them out, so with a ceiling set such a start is given the ceiling (old hosts keep working, within the
    # bound); one asking for more than the ceiling is refused limit_exceeded.
    max_total_tokens_limit: int = Field(default=0, ge=0)
    max_tokens_limit: int = Field(default=0, ge=0)
    # Every scope's quotas unless `intermission quotas set` gives it its own (0: none): live runs (not
    # ended) and runs started a second, enforced in the start's transaction (quota_exceeded).
    quota_live_runs: int = Field(default=0, ge=0)
    quota_starts_per_second: float = Field(default=0.0, ge=0)
    # Runs one worker continues at once (0: no cap). Past it, the commands that would start or resume a run
    # wait unacknowledged in the worker (nothing is lost), and takeovers wait for room.
    runs_in_flight: int = Field(default=256, ge=0)
    shutdown_grace_seconds: float = Field(default=20.0, ge=0)
    # Retention (store/migrations/0008_retention.sql, store/retention.py). An ended run and everything
    # about it is kept this long after it ended; paused and running runs are never pruned.
    retention_seconds: float = Field(default=30 * 86400.0, gt=0)
    # The idempotency window: a command re-sent after its inbox record is this old is a NEW command.
    inbox_retention_seconds: float = Field(default=7 * 86400.0, gt=0)
    # Sent events; a subscriber deduplicates by message_id, so nothing reads a sent row but an operator.
    outbox_retention_seconds: float = Field(default=300.0, gt=0)
    # A session's messages, unless a live run of that session may still read them.
    session_retention_seconds: float = Field(default=30 * 86400.0, gt=0)
    # The most messages of its session a run loads (the most recent ones): a run's snapshot holds its
    # history, and must not grow with the age of its session. A run's context.max_messages, when set and
    # smaller, bounds it further.
    session_history_messages: int = Field(default=200, ge=1, le=100_000)
    # The sweeper prunes every interval (0: never; `intermission prune` still does on demand), in batches,
    # deleting at most prune_max_rows_per_second so that it never takes the claims' CPU.
    prune_interval_seconds: float = Field(default=60.0, ge=0)
    prune_batch: int = Field(default=500, ge=1, le=100_000)
    prune_max_rows_per_second: float = Field(default=5000.0, gt=0)
    # A cap on intermission.dead (0: none). With it the queue refuses new dead letters when full
    # (reject-publish) rather than drop old ones; fixed when the queue is first declared.
    dead_max_length: int = Field(default=0, ge=0)
    # 0 turns the Prometheus endpoint off.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Where the metrics endpoint listens: loopback unless the operator says otherwise (in a container,
    # 0.0.0.0 with the port published on the host's loopback), since it tells anyone who reads it about
    # every tenant's traffic.
    metrics_host: str = "127.0.0.1"
    # How often the readiness checks behind /readyz (on the metrics port) are refreshed, and the most one
    # database probe may take: /readyz follows an outage within about this long.
    health_probe_seconds: float = Field(default=2.0, gt=0, le=60)
    # "module:attribute" of the executor factory; the default is the agent loop with the scripted model.
    executor: str = "intermission.agent.loop:default_executor"
    log_level: str = "INFO"
    # RabbitMQ's management HTTP API, for `intermission grant` and the demo's users; its credentials default to
    # AMQP_URL's.
    management_url: str = "http://localhost:15672"
    management_user: str | None = None
    management_password: SecretStr | None = None
    # The web console (`intermission console`, ops/console/). The key that signs its session cookie: unset, a
    # random one is made at every start (sessions live in the console's memory, with each person's AMQP
    # connection, so a restart ends them anyway).
    console_secret: SecretStr | None = None
    # A console session ends after this long without a request (its AMQP connection is closed then), and
    # after console_session_max_seconds whatever happens.
    console_idle_seconds: float = Field(default=1800.0, gt=0)
    console_session_max_seconds: float = Field(default=12 * 3600.0, gt=0)
    # Send the session cookie only over HTTPS (Secure): on whenever a TLS proxy serves the console.
    console_https_only: bool = False
    # Sessions the console holds at once (each one a person's AMQP connection, a queue and a task): past it a
    # login is refused until one ends. A person's own sessions past console_sessions_per_user end, oldest
    # first, as new ones begin.
    console_max_sessions: int = Field(default=1000, ge=1, le=100_000)
    console_sessions_per_user: int = Field(default=8, ge=1, le=1000)
    # Requests in flight at once, and live-update streams open at once, past which the console answers 503.
    console_max_requests: int = Field(default=64, ge=1, le=10_000)
    console_max_streams: int = Field(default=512, ge=1, le=100_000)

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        # The URLs may carry passwords: a repr (a traceback's locals, a test's failure report, a debug log)
        # shows them masked, as the logs do.
        for name, value in super().__repr_args__():
            yield name, safe_url(value) if name in _URLS and isinstance(value, str) else value

    def management(self) -> ManagementAccess:
        """Where and as whom the grant commands reach the management API, and for which vhost."""
        amqp = urlsplit(self.amqp_url)
        password = self.management_password.get_secret_value() if self.management_password else None
        return ManagementAccess(
            url=self.management_url,
            user=self.management_user or unquote(amqp.username or "guest"),
            password=password if password is not None else unquote(amqp.password or "guest"),
            vhost=unquote(amqp.path[1:]) if len(amqp.path) > 1 else "/",
        )

    @model_validator(mode="after")
    def _amqp_nodes_parse(self) -> Settings:
        # A malformed node list stops the process at start, naming the setting, rather than at its first
        # connect.
        try:
            amqp_nodes(self.amqp_url)
        except AmqpUrlError as exc:
            raise ValueError(f"INTERMISSION_AMQP_URL: {exc}") from None
        return self

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> Settings:
        for name, default, ceiling in (
            ("MAX_STEPS", self.max_steps, self.max_steps_limit),
            ("MAX_TOOL_CALLS", self.max_tool_calls, self.max_tool_calls_limit),
        ):
            if ceiling and default > ceiling:
                raise ValueError(f"INTERMISSION_{name} ({default}) is over INTERMISSION_{name}_LIMIT ({ceiling})")
        return self

    @model_validator(mode="after")
    def _renew_before_lapse(self) -> Settings:
        if self.lease_renew_seconds >= self.lease_seconds:
            raise ValueError(
                "INTERMISSION_LEASE_RENEW_SECONDS must be shorter than INTERMISSION_LEASE_SECONDS, "
                "or a lease lapses between renewals"
            )
        return self
