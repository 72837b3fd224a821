"""Starting a run: its config resolved once against the fleet's defaults and ceilings, then ONE transition
(``intermission_start_run_v2``) that creates it under the starter's lease with its first snapshot and the
command's inbox record, within its scope's quotas.

The caller picks the run id, unique within its scope (another scope's run of that id is another run). The
identical start again changes nothing and reports the run as it stands (``fresh`` false); a different start
under the same id in the same scope is RunExists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, NamedTuple

from intermission.engine.claims import check_first, check_lease
from intermission.engine.columns import lease_columns
from intermission.engine.transition import Family, RunKey, Transition, only
from intermission.schemas.config import RunConfig
from intermission.schemas.digest import digest
from intermission.schemas.errors import (
    LimitExceeded,
    MessageIdConflict,
    QuotaExceeded,
    RunExists,
    RunLeaseLost,
    UnsupportedConfig,
)
from intermission.schemas.run import Lease, NewRun, Run
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Progress
from intermission.store import rows
from intermission.store.inbox import AlreadyApplied, Receipt, inbox_arguments
from intermission.store.rows import Out

# The settings' default of budget.max_tool_calls (INTERMISSION_MAX_TOOL_CALLS, fleet/settings.py).
DEFAULT_MAX_TOOL_CALLS = 256


@dataclass(frozen=True)
class Quota:
    """The fleet's default quotas of a scope without a row of its own in ``scope_quotas`` (0: none)."""

    live_runs: int = 0
    starts_per_second: float = 0.0


NO_QUOTA: Final = Quota()


@dataclass(frozen=True)
class RunDefaults:
    """What a start takes from the settings when its command leaves it out, the most it may ask for (0: no
    ceiling), and the quotas of a scope that has none of its own."""

    pause_ttl_seconds: int
    max_steps: int
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
    max_steps_limit: int = 0
    max_tool_calls_limit: int = 0
    max_total_tokens_limit: int = 0
    max_tokens_limit: int = 0
    quota: Quota = NO_QUOTA


def _check_ceilings(config: RunConfig, defaults: RunDefaults) -> None:
    """LimitExceeded when a start asks for more than the fleet allows a run. Refused rather than clamped: a
    clamped run would fail at the smaller limit hours later, far from the start that caused it."""
    for field, asked, ceiling in (
        ("max_steps", config.max_steps, defaults.max_steps_limit),
        ("budget.max_tool_calls", config.budget.max_tool_calls, defaults.max_tool_calls_limit),
        ("budget.max_total_tokens", config.budget.max_total_tokens, defaults.max_total_tokens_limit),
        ("max_tokens", config.max_tokens, defaults.max_tokens_limit),
    ):
        if ceiling and asked > ceiling:
            raise LimitExceeded(f"config.{field} is {asked}, over this fleet's limit of {ceiling}")


def resolved_config(config: RunConfig, defaults: RunDefaults) -> RunConfig:
    """The config a run is stored with: flattened once, here, so its limits are the ones it started with,
    whichever worker continues it. Unset limits take the fleet's defaults, and unset (0, "no limit") token
    budgets the fleet's ceilings where it has them: a host that never sets them keeps working, and its run
    is bounded like any other."""
    _check_ceilings(config, defaults)
    budget = config.budget
    if config.max_steps == 0:
        config = config.model_copy(update={"max_steps": defaults.max_steps})
    if budget.max_tool_calls == 0:
        budget = budget.model_copy(update={"max_tool_calls": defaults.max_tool_calls})
    if budget.max_total_tokens == 0 and defaults.max_total_tokens_limit:
        budget = budget.model_copy(update={"max_total_tokens": defaults.max_total_tokens_limit})
    if config.max_tokens == 0 and defaults.max_tokens_limit:
        config = config.model_copy(update={"max_tokens": defaults.max_tokens_limit})
    return config if budget is config.budget else config.model_copy(update={"budget": budget})


def start_digest(scope: Scope, new: NewRun) -> str:
    """Binds a start request, so a repeated start is recognised and a different one is run_exists."""
    return digest({"scope": scope, "run": new})


@dataclass(frozen=True)
class CreatedRun:
    run: Run
    # True only for the call that created it; a repeated identical start is a no-op.
    fresh: bool


class StartRow(NamedTuple):
    """``intermission_start_v2``: one start's row."""

    run_id: str
    app: str
    tenant: str
    # The run as the start asks for it, its config resolved against the fleet's defaults.
    agent_id: str
    input: str
    config: str
    script: str | None
    pause_ttl_seconds: int
    session_id: str
    start_digest: str
    # The lease it runs under and its first snapshot (all NULL: created, not running).
    lease_owner: str | None
    lease_ttl: float | None
    first_continuation: str | None
    # The start command's inbox record.
    message_id: str | None
    routing_key: str | None
    digest: str | None
    # The quotas of a scope that has no row of its own in scope_quotas.
    default_live_runs: int
    default_starts_per_second: float


START = Family("start", "start_runs_v2", StartRow)


@dataclass(frozen=True)
class StartRun(Transition[CreatedRun]):
    """Create ``new`` at ``scope``: running under ``lease`` with its ``first`` snapshot when one is given
    (created, otherwise), with ``receipt`` recorded in the inbox, within the scope's quotas (QuotaExceeded,
    nothing written)."""

    family: ClassVar[Family] = START

    scope: Scope
    new: NewRun
    lease: Lease | None = None
    first: Progress | None = None
    receipt: Receipt | None = None
    quota: Quota = NO_QUOTA

    def __post_init__(self) -> None:
        require_scope(self.scope)
        unsupported = self.new.config.unsupported()
        if unsupported:
            # Before anything is written: a run is never started on a config it would then silently ignore.
            raise UnsupportedConfig("; ".join(unsupported))
        if self.lease is not None:
            check_lease(self.lease)
        if self.first is not None:
            if self.lease is None:
                raise RunLeaseLost("the first progress snapshot must be owned by the lease owner")
            check_first(self.first, self.lease.owner, self.new.run_id)

    def key(self) -> RunKey:
        return (self.scope.app, self.scope.tenant, self.new.run_id)

    def row(self) -> StartRow:
        new, lease, first = self.new, self.lease, self.first
        inbox = inbox_arguments(self.receipt, self.scope)
        return StartRow(
            new.run_id,
            self.scope.app,
            self.scope.tenant,
            new.agent_id,
            new.input,
            rows.dump(new.config),
            None if new.script is None else rows.dump_list(rows.SCRIPT, new.script),
            new.pause_ttl_seconds,
            new.session_id or new.run_id,
            start_digest(self.scope, new),
            *lease_columns(lease),
            rows.dump(first.continuation) if first is not None else None,
            inbox["message_id"],
            inbox["routing_key"],
            inbox["digest"],
            self.quota.live_runs,
            self.quota.starts_per_second,
        )

    def result(self, outs: Sequence[Out]) -> CreatedRun:
        out = only(outs)
        outcome = out["outcome"]
        if outcome == "quota_live_runs":
            raise QuotaExceeded(f"scope {self.scope} holds as many live runs as its quota allows")
        if outcome == "quota_starts_per_second":
            raise QuotaExceeded(f"scope {self.scope} started as many runs this second as its quota allows")
        if outcome == "duplicate":
            assert self.receipt is not None
            raise AlreadyApplied(self.receipt.message_id, "applied")
        if outcome == "message_id_conflict":
            assert self.receipt is not None
            raise MessageIdConflict(f"message_id {self.receipt.message_id} was used for a different command")
        if outcome == "run_exists":
            raise RunExists(f"run id {self.new.run_id} holds a different run in this scope")
        return CreatedRun(rows.run_from_row(out["run"]), fresh=outcome == "created")
