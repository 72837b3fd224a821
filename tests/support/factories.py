"""Build runs in the states tests need, through the engine's real transitions."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from intermission.engine.core import Engine
from intermission.engine.runs import Pause
from intermission.engine.seed import ScopedEngine
from intermission.schemas.config import RunConfig
from intermission.schemas.llm import Message, Role
from intermission.schemas.run import Lease, NewRun, Run
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Continuation, PendingCall, SuspendReason, Suspension
from intermission.store import Stores

LEASE_TTL = 30.0


def writes(stores: Stores, scope: Scope, through: Engine | None = None) -> ScopedEngine:
    """The original package's store API at ``scope``, writing through ``through`` (an engine of the test's,
    say one that hands its events to a sink), or through an engine of its own over ``stores``."""
    return (through or Engine.over(stores)).at(scope)


def owner() -> str:
    return f"test-worker-{uuid.uuid4().hex[:12]}"


def lease(who: str | None = None, ttl: float = LEASE_TTL) -> Lease:
    return Lease(owner=who or owner(), ttl_seconds=ttl)


def continuation(step: int = 1, **changes: object) -> Continuation:
    base = Continuation(
        messages=[
            Message(role=Role.USER, content="history from an earlier run"),
            Message(role=Role.USER, content="look this up"),
        ],
        system_prompt="You are a careful agent.",
        step_index=step,
        tokens_used=42,
        new_messages_from=1,
        session_id="session-1",
        prepared=b"\x00\x01opaque\xff",
        config=RunConfig(max_steps=8, tools=["lookup", "echo"], tools_restricted=True),
    )
    return base.model_copy(update=changes)


@dataclass
class PausedRun:
    run: Run
    suspension: Suspension
    revision: int


async def running_run(
    stores: Stores,
    scope: Scope,
    *,
    holder: Lease | None = None,
    run_id: str | None = None,
    pause_ttl_seconds: int = 0,
    through: Engine | None = None,
) -> tuple[Run, Lease]:
    held = holder or lease()
    created = await writes(stores, scope, through).runs.create_run(
        NewRun(
            run_id=run_id or f"run-{uuid.uuid4().hex[:12]}",
            agent_id="demo",
            input="hi",
            pause_ttl_seconds=pause_ttl_seconds,
        ),
        held,
    )
    return created.run, held


async def paused_run(
    stores: Stores,
    scope: Scope,
    *,
    reason: SuspendReason = SuspendReason.EXTERNAL_TOOL,
    ttl_seconds: float | None = 0,
    pending: list[PendingCall] | None = None,
    approvers: list[str] | None = None,
    run_id: str | None = None,
    through: Engine | None = None,
) -> PausedRun:
    run, held = await running_run(stores, scope, run_id=run_id, through=through)
    paused = await writes(stores, scope, through).runs.pause_run(
        run.id,
        held.owner,
        Pause(
            reason=reason,
            pending=pending or [PendingCall(id="c1", name="lookup", arguments='{"query": "q"}')],
            continuation=continuation(),
            approvers=approvers or [],
            ttl_seconds=ttl_seconds,
        ),
    )
    return PausedRun(run=run, suspension=paused.suspension, revision=paused.notice.run_revision)
