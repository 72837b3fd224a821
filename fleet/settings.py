"""Settings, from the environment (prefix ``INTERMISSION_``), each with a default that works on a
developer's machine. A bad setting stops the process at start with a message naming it."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INTERMISSION_", extra="ignore", frozen=True)

    database_url: str = "postgresql://postgres@localhost:5432/intermission"
    amqp_url: str = "amqp://guest:guest@localhost:5672/"
    # The RabbitMQ user whose broker-validated user_id marks a message as the messaging bus's reply.
    bus_user: str = "intermission-bus"
    prefetch: int = Field(default=16, ge=1, le=1000)
    # After this many deliveries a command that keeps failing (transiently) is dead-lettered by the broker.
    delivery_limit: int = Field(default=10, ge=1, le=1000)
    pool_max_size: int = Field(default=10, ge=1, le=200)
    lease_seconds: float = Field(default=30.0, gt=0)
    lease_renew_seconds: float = Field(default=10.0, gt=0)
    reclaim_interval_seconds: float = Field(default=5.0, gt=0)
    reclaim_batch: int = Field(default=32, ge=1, le=1000)
    relay_batch: int = Field(default=256, ge=1, le=10000)
    # The poll that backs up LISTEN/NOTIFY.
    relay_poll_seconds: float = Field(default=5.0, gt=0)
    # How long a publisher waits for a batch's confirms before retrying it.
    publish_timeout_seconds: float = Field(default=10.0, gt=0)
    sweep_interval_seconds: float = Field(default=60.0, gt=0)
    sweep_batch: int = Field(default=100, ge=1, le=10000)
    # run.expire commands a sweeper publishes per second at most, so that working through a backlog does
    # not starve the claims of workers on the same machines (bench/scaling.py).
    sweep_max_rate: float = Field(default=500.0, gt=0)
    # The deadline of a pause; 0 means pauses never expire.
    pause_ttl_seconds: int = Field(default=86400, ge=0)
    # The default max_steps of a run whose config leaves it unset.
    max_steps: int = Field(default=32, ge=1)
    # The default budget.max_tool_calls of a run whose config leaves it unset (0): the tool calls a whole
    # run may ask for. Per run, like every budget: it bounds each turn too (a turn cannot ask for more than
    # what is left), where a per-turn cap would still let max_steps turns of it through. 256 is 8 calls a
    # step over the default 32 steps.
    max_tool_calls: int = Field(default=256, ge=1)
    shutdown_grace_seconds: float = Field(default=20.0, ge=0)
    # 0 turns the Prometheus endpoint off.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # "module:attribute" of the executor factory; the default is the agent loop with the scripted model.
    executor: str = "intermission.agent.loop:default_executor"
    log_level: str = "INFO"

    @model_validator(mode="after")
    def _renew_before_lapse(self) -> Settings:
        if self.lease_renew_seconds >= self.lease_seconds:
            raise ValueError(
                "INTERMISSION_LEASE_RENEW_SECONDS must be shorter than INTERMISSION_LEASE_SECONDS, "
                "or a lease lapses between renewals"
            )
        return self
