"""Who holds a running run: a takeover of runs whose lease lapsed (their worker died), and a graceful stop's
release of a lease.

Lease RENEWAL is not here: a worker renews every lease it holds in one statement per tick over a connection
of its own (``store/leases.py``), so that no renewal waits behind the work it keeps alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from intermission.engine.claims import check_first, check_lease
from intermission.engine.transition import Family, OfRun, Transition
from intermission.schemas.errors import InvalidArgument, InvalidContinuation, RunNotReclaimable
from intermission.schemas.run import Lease, Run
from intermission.schemas.scope import Scope, require_scope
from intermission.schemas.suspension import Progress
from intermission.store import rows
from intermission.store.rows import Out


@dataclass(frozen=True)
class Reclaimed:
    run: Run
    progress: Progress | None


@dataclass(frozen=True)
class Unreadable:
    """A run taken over whose stored row or snapshot does not decode: it can never be continued."""

    run_id: str
    # As stored, unvalidated: the end that quarantines the run is written under it, at its revision.
    scope: Scope
    revision: int
    detail: str


class TakeOverRow(NamedTuple):
    """``intermission_take_over_v2``."""

    owner: str
    lease_ttl: float
    lapsed_limit: int
    run_id: str | None
    app: str | None
    tenant: str | None
    first_continuation: str | None
    first_started: str | None
    first_done: str | None
    first_ending: str | None
    first_approved: str | None


TAKE_OVER = Family("take_over", "take_over_v2", TakeOverRow)


@dataclass(frozen=True)
class ReclaimLapsed(Transition[list[Reclaimed | Unreadable]]):
    """Take up to ``limit`` running runs of any scope whose lease lapsed, each under ``lease`` with its
    progress handed over, skipping runs another worker is taking right now.

    Each run is decoded on its own, after the takeover commits: a run or snapshot that cannot be read comes
    back as ``Unreadable`` (held by ``lease`` now, for the caller to end) and the rest of the batch as usual.
    Decoding inside the transaction would let one bad row roll back the whole batch on every sweep of every
    worker, and since it sorts first each time, no lapsed run would ever move."""

    family: ClassVar[Family] = TAKE_OVER

    lease: Lease
    limit: int

    def __post_init__(self) -> None:
        check_lease(self.lease)
        if self.limit < 1:
            raise InvalidArgument("limit must be at least 1")

    def row(self) -> TakeOverRow:
        return TakeOverRow(
            self.lease.owner, self.lease.ttl_seconds, self.limit, None, None, None, None, None, None, None, None
        )

    def result(self, outs: Sequence[Out]) -> list[Reclaimed | Unreadable]:
        reclaimed: list[Reclaimed | Unreadable] = []
        for out in outs:
            try:
                run = rows.run_from_row(out["run"])
                reclaimed.append(Reclaimed(run, rows.taken_progress(out["progress"], run)))
            except (InvalidContinuation, ValueError) as exc:  # ValueError: pydantic's, and an unknown state's
                raw = out["run"]
                scope = Scope.model_construct(app=raw["app"], tenant=raw["tenant"])
                # Never the value itself: a stored row may hold what must not reach a log or an event.
                detail = (
                    exc.detail
                    if isinstance(exc, InvalidContinuation)
                    else f"stored run is malformed ({type(exc).__name__})"
                )
                reclaimed.append(
                    Unreadable(run_id=raw["id"], scope=scope, revision=raw["revision"], detail=detail[:500])
                )
        return reclaimed


@dataclass(frozen=True)
class TakeOverRun(OfRun[Run]):
    """Take over the running run ``run_id`` whose lease lapsed, under ``lease``, writing ``first`` in the same
    transaction (or handing its snapshot over as it stands). The revision does not change. Decoded before its
    commit: a run that cannot be read is not taken. RunNotReclaimable when it is not running under a lapsed
    lease (or not there at all: the caller tells the two apart)."""

    family: ClassVar[Family] = TAKE_OVER
    atomic: ClassVar[bool] = True

    lease: Lease
    first: Progress | None = None

    def __post_init__(self) -> None:
        require_scope(self.scope)
        check_lease(self.lease)
        if self.first is not None:
            check_first(self.first, self.lease.owner, self.run_id)

    def row(self) -> TakeOverRow:
        snapshot = rows.progress_arguments(self.first) if self.first is not None else {}
        return TakeOverRow(
            self.lease.owner,
            self.lease.ttl_seconds,
            1,
            self.run_id,
            self.scope.app,
            self.scope.tenant,
            snapshot.get("continuation"),
            snapshot.get("started"),
            snapshot.get("done"),
            snapshot.get("ending"),
            snapshot.get("approved"),
        )

    def wrote(self, outs: Sequence[Out]) -> bool:
        return len(outs) > 0

    def result(self, outs: Sequence[Out]) -> Run:
        if not outs:
            raise RunNotReclaimable(f"run {self.run_id} is not running under a lapsed lease")
        return rows.run_from_row(outs[0]["run"])


class RunKeyRow(NamedTuple):
    """``intermission_run_key_v1``: a run by its whole key, and who asks (for a lease's release)."""

    run_id: str
    app: str
    tenant: str
    owner: str | None


RELEASE = Family("release", "release_leases_v1", RunKeyRow)


@dataclass(frozen=True)
class ReleaseLease(OfRun[bool]):
    """Let the lease ``owner`` holds on a run lapse now (a graceful stop), so another worker may take the run
    at once. Whether it held one."""

    family: ClassVar[Family] = RELEASE

    owner: str

    def row(self) -> RunKeyRow:
        return RunKeyRow(self.run_id, self.scope.app, self.scope.tenant, self.owner)

    def result(self, outs: Sequence[Out]) -> bool:
        return bool(outs and outs[0]["found"])
