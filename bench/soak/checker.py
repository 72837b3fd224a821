"""The invariant checker: reads the soak database (runs, suspensions, progress, run events, the outbox,
the inbox, checkpoints, resume admissions, session messages and the ``demo_charges`` ledger), every event
captured from ``intermission.events`` and every message that reached ``intermission.dead``, and compares
them with what the harness did (the ledger). Each broken invariant is a ``Violation`` that names the run or
the message, what was expected and what was found.

The invariants (docs/invariants.md, as the soak can observe them):

- ``runs_settled``: every run ended, or is paused with exactly one live suspension (the one of its last
  pause), as its plan allows; an ended run holds no suspension, no progress and no lease; no run exists
  that the harness did not start.
- ``no_running_after_drain``: no run is left ``running`` (with or without a live lease).
- ``no_double_charge``: no non-retry-safe call ran twice (``demo_charges``: no (run, call_id) twice).
- ``notices_match_pauses``: every pause wrote exactly one Notice, which was delivered; every delivered
  Notice matches a pause (suspension, run and revision).
- ``notices_heard``: the host's (and for agent asks the bus's) durable subscription delivered every notice.
- ``one_effect_per_command``: every accepted command has exactly one effect (inbox rows, keyed by scope and
  message id, and ``run.resumed`` events per message id), every refused one a ``command.rejected`` event
  with the expected code and a dead-lettered copy carrying it, every one the broker was to refuse at publish
  (a confined user keying another scope's command) refused there and never delivered (no effect, refusal or
  copy); no command the broker refused that its sender may publish; racing commands have exactly one effect
  per race; nothing is refused or applied that the harness did not send, and nothing is dead-lettered by the
  broker's delivery limit.
- ``scope_and_authority``: nothing at another scope or without authority changed anything: no row at the
  foreign scope, no forged payload anywhere in the database, every decided checkpoint decided by a
  principal it accepts; every refusal heard in the scope its command's routing key names (never the scope a
  body merely claims); nothing of a command that reached for another tenant (mallory's) heard in that
  tenant's scope or recorded in any scope's inbox.
- ``outbox_delivered``: nothing is left unsent in the outbox, every row reached the events exchange with
  its own message id and body, and every event heard (refusals aside) still has its row.
- ``expiries``: a run whose pause deadline passed unanswered ended failed with a ``suspension_expired``
  error after that deadline, no run expired that was answered in time, and no live pause is past its
  deadline.
- ``ends_match_events``: every ended run wrote exactly one terminal event, of the kind its state says.
- ``flood_fairness``: behind each tenant's flood of starts (``tenant_flood``), another tenant's probe run
  reached its first Notice within ``flood_bound`` (the flood's size over the fleet's floor rate of
  refusals, plus an allowance), with the length of every worker fault during its wait added; a probe whose
  wait overlapped a server fault (and its recovery) is excused and counted apart, never one that was not
  heard at all. The flooding scope never held more runs than its quota of live runs, and each of the
  flood's starts was applied (its run exists) or refused ``quota_exceeded`` (no run), never both.

A run is named by its key, (app, tenant, id), everywhere: a run id is unique only within its scope, so a run
of a plan's id at another scope (a tenant reusing the id) is another run, and one the harness never started.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from bench.soak.ledger import EXPIRED, Expect, Fate, FloodRecord, Ledger, RunPlan, SentCommand
from bench.soak.observe import DeadLetter, Event
from intermission.schemas.scope import Scope
from intermission.wire import rejected_key, scope_of_command_key

INVARIANTS: dict[str, str] = {
    "runs_settled": "every run ended, or is paused with exactly one live suspension, as its plan allows",
    "no_running_after_drain": "no run left running (with or without a live lease) after the drain",
    "no_double_charge": "no non-retry-safe call ran twice (demo_charges)",
    "notices_match_pauses": "every pause produced exactly one delivered Notice; every Notice matches a pause",
    "notices_heard": "the host's and the bus's durable subscriptions delivered every notice",
    "one_effect_per_command": "every accepted command had exactly one effect, every refused one a refusal",
    "scope_and_authority": "nothing at another scope or without authority changed anything",
    "outbox_delivered": "nothing left unsent in the outbox; every row delivered as written; every event a row",
    "expiries": "a pause whose deadline passed unanswered ended its run failed with suspension_expired",
    "ends_match_events": "every ended run wrote exactly one terminal event of its state's kind",
    "flood_fairness": "behind a tenant's flood, another tenant's run paused within the bound; quota held",
}

# A refused command that is delivered again (its acknowledgement was lost) is judged again, against the
# state the run has moved to since: refusals record nothing, by design. Its later refusals may name that
# state; its first must be the expected one.
REDELIVERY_CODES = frozenset({"not_suspended", "run_conflict", "invalid_state"})
TERMINAL_KEYS = {"completed": "completed", "cancelled": "cancelled", "failed": "failed", "expired": "failed"}
EXPIRE_PREFIX = EXPIRED.split(":", 1)[1]
FORGED = "FORGED"

# The bound on a probe's wait behind a flood (docs/invariants.md, 22; docs/decisions.md, "Fairness between
# tenants"): the flood's refusals ahead of it at the fleet's floor rate, plus an allowance for everything
# else. Commands are shared FIFO queues, so the probe's start waits for the flood's starts before it; past
# the flooding scope's quota each is one short refusal. ``python -m bench.flood`` measured one worker
# alone on a loaded two-core machine at 180 to 290 starts a second through a whole flood (1,000 and 5,000
# starts at quota 100); in the soak three workers, two sweepers, the harness and both servers share those
# two cores, so the floor is taken per worker at a seventh of the slowest figure (the three together at
# 75 a second, under half of what one worker alone managed).
FLOOR_REFUSALS_PER_SECOND = 25.0
# The probe's own start, first turn, pause, Notice and delivery (0.2 s measured on an idle machine), a
# lease lapsed under it by a SIGKILL (2 s) and its reclaim (0.3 s), with room for the soak's load.
LATENCY_ALLOWANCE_SECONDS = 10.0
# Worker faults are judged, their length added to the bound: a fleet lives with them every day. Server
# faults (broker and database outages, backend terminations, a cluster's failovers and partitions) excuse
# a probe whose wait overlaps them or the recovery after them (the workers reconnect every 5 s, their loops
# back off up to 10 s): what the probe then measures is the outage, not the flood.
WORKER_FAULTS = frozenset({"worker_sigkill", "worker_sigterm", "worker_crash_point", "worker_stall"})
SERVER_FAULT_RECOVERY_SECONDS = 10.0


def flood_bound(size: int, workers: int) -> float:
    """How long a run started right behind a flood of ``size`` starts may wait for its first Notice, with
    ``workers`` workers alive."""
    return size / (FLOOR_REFUSALS_PER_SECOND * max(1, workers)) + LATENCY_ALLOWANCE_SECONDS


def _overlaps(a: float, b: float, c: float, d: float) -> bool:
    """Whether the intervals [a, b] and [c, d] share an instant."""
    return a <= d and c <= b


@dataclass(frozen=True)
class Violation:
    invariant: str
    subject: str
    expected: str
    found: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.subject}: expected {self.expected}; found {self.found}"


@dataclass
class CheckResult:
    checked: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    # Invariants a site checks besides the soak's own (``bench/soak/site.py``), with what each means.
    site_invariants: dict[str, str] = field(default_factory=dict)

    def fail(self, invariant: str, subject: str, expected: str, found: str) -> None:
        self.violations.append(Violation(invariant, subject, expected, found))


@dataclass(frozen=True)
class Evidence:
    events: list[Event]
    dead: list[DeadLetter]


# A run's key: (app, tenant, id).
RunKey = tuple[str, str, str]


def run_key(row: asyncpg.Record | dict[str, Any], column: str = "run_id") -> RunKey:
    """The key of the run a row names (``column`` holds the run id: ``id`` in runs, ``run_id`` elsewhere)."""
    return (row["app"], row["tenant"], row[column])


def describe(key: RunKey) -> str:
    return f"{key[2]} of {key[0]}/{key[1]}"


@dataclass
class Snapshot:
    """Everything the checker reads from the database, read once after the drain. Runs, their pauses and
    their progress by run key."""

    now: datetime
    runs: dict[RunKey, asyncpg.Record]
    suspensions: dict[RunKey, list[asyncpg.Record]]
    progress: dict[RunKey, asyncpg.Record]
    run_events: list[asyncpg.Record]
    outbox: list[asyncpg.Record]
    # Keyed as the table is: (app, tenant, message_id).
    inbox: dict[tuple[str, str, str], asyncpg.Record]
    charges: list[asyncpg.Record]
    checkpoints: list[asyncpg.Record]
    admissions: list[asyncpg.Record]
    foreign_rows: dict[str, int]
    # Where a forged payload was found: the table, and the run of the row that holds it.
    forged: list[tuple[str, RunKey]]


FOREIGN_TABLES = (
    "runs",
    "suspensions",
    "progress",
    "checkpoints",
    "run_events",
    "outbox",
    "inbox",
    "resume_admissions",
    "resume_starts",
    "resume_expiries",
    "resume_closures",
    "session_messages",
)


async def read_snapshot(database_url: str, foreign_app: str) -> Snapshot:
    """Read the database, retrying a few times if the connection is lost (the servers were just restarted)."""
    for attempt in range(10):
        try:
            return await _read(database_url, foreign_app)
        except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError, TimeoutError):
            if attempt == 9:
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


async def _read(database_url: str, foreign_app: str) -> Snapshot:
    con = await asyncpg.connect(database_url, timeout=10)
    try:
        async with con.transaction(isolation="repeatable_read", readonly=True):
            now = await con.fetchval("SELECT now()")
            runs = {run_key(r, "id"): r for r in await con.fetch("SELECT * FROM runs")}
            suspensions: dict[RunKey, list[asyncpg.Record]] = defaultdict(list)
            for r in await con.fetch("SELECT id, run_id, app, tenant, reason::text, expires_at FROM suspensions"):
                suspensions[run_key(r)].append(r)
            progress = {
                run_key(r): r for r in await con.fetch("SELECT run_id, app, tenant, owner, ending FROM progress")
            }
            run_events = await con.fetch("SELECT run_id, app, tenant, kind, revision, data, created_at FROM run_events")
            outbox = await con.fetch(
                "SELECT id, message_id::text AS message_id, routing_key, body, correlation_id, run_id, app, tenant,"
                " sent_at FROM outbox ORDER BY id"
            )
            inbox = {(r["app"], r["tenant"], r["message_id"]): r for r in await con.fetch("SELECT * FROM inbox")}
            charges = await con.fetch(
                "SELECT app, tenant, run_id, call_id, count(*) AS times,"
                " array_agg(charged_at ORDER BY charged_at) AS at"
                " FROM demo_charges GROUP BY app, tenant, run_id, call_id"
            )
            checkpoints = await con.fetch("SELECT * FROM checkpoints")
            admissions = await con.fetch(
                "SELECT run_id, suspension_id, app, tenant, claimed_revision,"
                " position(convert_to($1, 'UTF8') in input) > 0 AS forged FROM resume_admissions",
                FORGED,
            )
            foreign_rows = {
                table: int(await con.fetchval(f"SELECT count(*) FROM {table} WHERE app = $1", foreign_app))  # noqa: S608
                for table in FOREIGN_TABLES
            }
            forged: list[tuple[str, RunKey]] = []
            for table, column, run_column in (
                ("session_messages", "message::text", "run_id"),
                ("runs", "input || coalesce(output, '') || coalesce(error, '')", "id"),
                ("checkpoints", "coalesce(reason, '')", "run_id"),
                ("progress", "continuation::text || done::text", "run_id"),
                ("suspensions", "continuation::text", "run_id"),
            ):
                for r in await con.fetch(
                    f"SELECT app, tenant, {run_column} AS run_id FROM {table} WHERE strpos({column}, $1) > 0",  # noqa: S608
                    FORGED,
                ):
                    forged.append((table, run_key(r)))
    finally:
        await con.close()
    return Snapshot(
        now=now,
        runs=runs,
        suspensions=dict(suspensions),
        progress=progress,
        run_events=list(run_events),
        outbox=list(outbox),
        inbox=inbox,
        charges=list(charges),
        checkpoints=list(checkpoints),
        admissions=list(admissions),
        foreign_rows=foreign_rows,
        forged=forged,
    )


def _end_token_ok(allowed: frozenset[str], state: str, error: str | None) -> bool:
    for option in allowed:
        if option == state:
            return True
        if option.startswith("failed:") and state == "failed" and (error or "").startswith(option[len("failed:") :]):
            return True
    return False


def _json(text: str) -> dict[str, Any]:
    parsed = json.loads(text)
    assert isinstance(parsed, dict)
    return parsed


def _at(row: asyncpg.Record, scope: Scope | None) -> bool:
    return scope is not None and (row["app"], row["tenant"]) == (scope.app, scope.tenant)


class Checker:
    def __init__(self, ledger: Ledger, evidence: Evidence, snap: Snapshot, *, foreign_app: str, mallory: str) -> None:
        self.ledger = ledger
        self.evidence = evidence
        self.snap = snap
        self.foreign_app = foreign_app
        self.mallory = mallory
        self.result = CheckResult()
        # Indexes.
        self.paused: dict[int, asyncpg.Record] = {}
        for event in snap.run_events:
            if event["kind"] == "paused":
                self.paused[int(_json(event["data"])["suspension_id"])] = event
        self.outbox_notices: dict[int, list[asyncpg.Record]] = defaultdict(list)
        self.resumed_rows: dict[str | None, list[asyncpg.Record]] = defaultdict(list)
        self.terminal_rows: dict[RunKey, list[asyncpg.Record]] = defaultdict(list)
        self.last_notice: dict[RunKey, dict[str, Any]] = {}
        for row in snap.outbox:
            key = row["routing_key"]
            if key.startswith("notice."):
                body = _json(row["body"])
                self.outbox_notices[int(body["suspension_id"])].append(row)
                self.last_notice[run_key(row)] = body
            elif key.startswith("run.resumed."):
                self.resumed_rows[row["correlation_id"]].append(row)
            elif key.startswith("run."):
                self.terminal_rows[run_key(row)].append(row)
        self.captured: dict[str, list[Event]] = defaultdict(list)
        self.refusals: dict[str, list[dict[str, Any]]] = defaultdict(list)
        # The routing keys each command's refusals were heard under.
        self.refusal_keys: dict[str, list[str]] = defaultdict(list)
        # The events that name a command: caused by it (correlation id) or about it (a refusal's body).
        self.mentions: dict[str, list[Event]] = defaultdict(list)
        self.unattributed: list[dict[str, Any]] = []
        for captured in evidence.events:
            if captured.message_id is not None:
                self.captured[captured.message_id].append(captured)
            named = {captured.correlation_id}
            if captured.routing_key.startswith("command.rejected.") and captured.body is not None:
                mid = captured.body.get("message_id")
                if isinstance(mid, str) and mid:
                    self.refusals[mid].append(captured.body)
                    self.refusal_keys[mid].append(captured.routing_key)
                    named.add(mid)
                else:
                    self.unattributed.append(captured.body)
            for mid in named:
                if mid:
                    self.mentions[mid].append(captured)
        self.inbox_by_mid: dict[str, list[asyncpg.Record]] = defaultdict(list)
        for (_app, _tenant, mid), row in snap.inbox.items():
            self.inbox_by_mid[mid].append(row)
        self.dead_by_mid: dict[str, list[DeadLetter]] = defaultdict(list)
        for dead in evidence.dead:
            if dead.message_id:
                self.dead_by_mid[dead.message_id].append(dead)

    def fail(self, invariant: str, subject: str, expected: str, found: str) -> None:
        self.result.fail(invariant, subject, expected, found)

    def plan_of(self, key: RunKey) -> RunPlan | None:
        """The plan of the run ``key`` names: the harness's run ids are its own, and a run of one of them is
        that plan's only at the plan's scope (at another it is a run the harness never started)."""
        plan = self.ledger.runs.get(key[2])
        return plan if plan is not None and (plan.scope.app, plan.scope.tenant) == key[:2] else None

    def check(self) -> CheckResult:
        self.runs_settled()
        self.no_running()
        self.no_double_charge()
        self.notices()
        self.commands()
        self.scope_and_authority()
        self.outbox_delivered()
        self.expiries()
        self.ends_match_events()
        self.flood_fairness()
        self.stats()
        return self.result

    # --- runs --------------------------------------------------------------------------------------

    def runs_settled(self) -> None:
        inv = "runs_settled"
        for plan in self.ledger.runs.values():
            key = (plan.scope.app, plan.scope.tenant, plan.run_id)
            row = self.snap.runs.get(key)
            if row is None and plan.flood is not None:
                continue  # a flood's start refused quota_exceeded has no run: flood_fairness judges it
            self.result.checked[inv] += 1
            subject = f"run {plan.run_id} ({plan.template}, fate {plan.fate.value})"
            if row is None:
                self.fail(inv, subject, f"a run at {plan.scope} (started as {plan.start_message_id})", "no run row")
                continue
            state, error = row["state"], row["error"]
            if not _end_token_ok(plan.allowed_ends, state, error):
                self.fail(inv, subject, f"an end in {sorted(plan.allowed_ends)}", f"{state} (error {error!r})")
            live = self.snap.suspensions.get(key, [])
            if state == "paused":
                pauses = [e for e in self.paused.values() if run_key(e) == key]
                latest = max(pauses, key=lambda e: e["revision"]) if pauses else None
                if len(live) != 1:
                    self.fail(inv, subject, "exactly one live suspension while paused", f"{len(live)}")
                elif latest is None or int(_json(latest["data"])["suspension_id"]) != live[0]["id"]:
                    self.fail(
                        inv,
                        subject,
                        "its live suspension to be its last pause",
                        f"suspension {live[0]['id']}, last paused event {latest and latest['data']}",
                    )
                elif latest["revision"] != row["revision"]:
                    self.fail(inv, subject, f"revision {latest['revision']} (its last pause)", f"{row['revision']}")
            elif state in ("completed", "failed", "cancelled"):
                if live:
                    self.fail(inv, subject, "no live suspension once ended", f"suspensions {[s['id'] for s in live]}")
                if key in self.snap.progress:
                    self.fail(inv, subject, "no progress row once ended", f"{dict(self.snap.progress[key])}")
                if row["lease_owner"] is not None:
                    self.fail(inv, subject, "no lease once ended", f"lease held by {row['lease_owner']}")
        for key, row in self.snap.runs.items():
            if self.plan_of(key) is None:
                self.result.checked[inv] += 1
                self.fail(inv, f"run {describe(key)}", "only runs the harness started", f"a {row['state']} run")

    def no_running(self) -> None:
        inv = "no_running_after_drain"
        for key, row in self.snap.runs.items():
            self.result.checked[inv] += 1
            if row["state"] == "running":
                owner, until = row["lease_owner"], row["lease_expires_at"]
                live = until is not None and until > self.snap.now
                self.fail(
                    inv,
                    f"run {describe(key)}",
                    "ended or paused after the drain",
                    f"running, lease {owner} until {until} ({'live' if live else 'lapsed'})",
                )
            elif row["state"] == "created":
                self.fail(inv, f"run {describe(key)}", "ended or paused after the drain", "created, never run")

    def no_double_charge(self) -> None:
        inv = "no_double_charge"
        for row in self.snap.charges:
            self.result.checked[inv] += 1
            if row["times"] > 1:
                times = ", ".join(t.isoformat(timespec="milliseconds") for t in row["at"])
                self.fail(
                    inv,
                    f"run {describe(run_key(row))} call {row['call_id']}",
                    "at most one charge (charge is not retry-safe)",
                    f"{row['times']} charges, at {times}",
                )
            if self.plan_of(run_key(row)) is None:
                self.fail(inv, f"run {describe(run_key(row))}", "charges only by runs the harness started", "a charge")

    # --- notices -----------------------------------------------------------------------------------

    def notices(self) -> None:
        inv = "notices_match_pauses"
        for sid, event in self.paused.items():
            self.result.checked[inv] += 1
            run_id, revision = event["run_id"], event["revision"]
            subject = f"pause {sid} of run {run_id} (revision {revision})"
            rows = self.outbox_notices.get(sid, [])
            if len(rows) != 1:
                self.fail(inv, subject, "exactly one Notice in the outbox", f"{len(rows)}")
                continue
            body = _json(rows[0]["body"])
            if run_key(rows[0]) != run_key(event) or body["run_id"] != run_id or body["run_revision"] != revision:
                self.fail(
                    inv,
                    subject,
                    f"a Notice for run {describe(run_key(event))} at revision {revision}",
                    f"run {body['run_id']} of {rows[0]['app']}/{rows[0]['tenant']} at revision {body['run_revision']}",
                )
            if not self.captured.get(rows[0]["message_id"]):
                self.fail(
                    inv,
                    subject,
                    f"its Notice {rows[0]['message_id']} delivered on intermission.events",
                    "never captured",
                )
            self._heard(sid, run_key(event), body["reason"])
        for mid, deliveries in self.captured.items():
            first = deliveries[0]
            if not first.routing_key.startswith("notice.") or first.body is None:
                continue
            self.result.checked[inv] += 1
            announced = first.body.get("suspension_id")
            paused = self.paused.get(announced) if isinstance(announced, int) else None
            scope = first.body.get("scope")
            named = (
                (scope.get("app"), scope.get("tenant"), first.body.get("run_id")) if isinstance(scope, dict) else None
            )
            if paused is None or run_key(paused) != named:
                self.fail(
                    inv,
                    f"notice {mid}",
                    "a pause it announces (paused event of that run)",
                    f"none for suspension {announced} of run {first.body.get('run_id')} of {scope}",
                )
            elif paused["revision"] != first.body.get("run_revision"):
                self.fail(
                    inv,
                    f"notice {mid}",
                    f"revision {paused['revision']} of pause {announced}",
                    f"revision {first.body.get('run_revision')}",
                )

    def _heard(self, sid: int, key: RunKey, reason: str) -> None:
        plan = self.plan_of(key)
        if plan is None:
            return
        run_id = key[2]
        inv = "notices_heard"
        self.result.checked[inv] += 1
        if sid not in plan.heard_by_host:
            self.fail(
                inv,
                f"pause {sid} of run {run_id}",
                "its notice delivered to the host's subscription",
                "never delivered",
            )
        if reason == "agent_reply" and sid not in plan.heard_by_bus:
            self.fail(
                inv, f"pause {sid} of run {run_id}", "its notice delivered to the bus's subscription", "never delivered"
            )

    # --- commands ----------------------------------------------------------------------------------

    def _effects(self, command: SentCommand) -> tuple[int, list[str]]:
        """How many effects ``command`` had, and any inconsistency found on the way. Its inbox record is the
        one at its scope (the inbox is keyed by scope and message id); one at any other scope is an effect
        too, and a wrong one."""
        mid, key, run_id = command.message_id, command.key, command.run_id
        assert mid is not None
        problems: list[str] = []
        rows = self.inbox_by_mid.get(mid, [])
        mine = [r for r in rows if _at(r, command.scope)]
        for row in rows:
            if not _at(row, command.scope):
                problems.append(f"an inbox record at {row['app']}/{row['tenant']}, not at {command.scope}")
        inbox = mine[0] if mine else None
        resumed = self.resumed_rows.get(mid, [])
        for row in resumed:
            if run_id is not None and (row["run_id"] != run_id or not _at(row, command.scope)):
                problems.append(f"run.resumed for run {describe(run_key(row))}, not {run_id} of {command.scope}")
        if inbox is not None and inbox["routing_key"] != key:
            problems.append(f"inbox records it as {inbox['routing_key']}")
        # A reply's message_id is recorded in the inbox with its admission, which is its claim and writes
        # its run.resumed event: the same one-to-one as a resume's or a decision's.
        if key in ("run.resume", "run.decide", "run.reply"):
            if inbox is not None and not resumed:
                problems.append("an inbox record without a run.resumed event")
            if resumed and inbox is None:
                problems.append("a run.resumed event without an inbox record at its scope")
            return max(len(resumed), len(rows)), problems
        if resumed:
            problems.append(f"{len(resumed)} run.resumed event(s) for a {key}")
        return len(rows), problems

    def commands(self) -> None:
        inv = "one_effect_per_command"
        group_effects: dict[str, list[tuple[SentCommand, int]]] = defaultdict(list)
        for mid, sent in self.ledger.by_message_id().items():
            original = sent[0]
            conflicts = [c for c in sent[1:] if c.purpose == "message_id_conflict"]
            effects, problems = self._effects(original)
            codes = [r.get("code") for r in self.refusals.get(mid, [])]
            dead = self.dead_by_mid.get(mid, [])
            dead_codes = [d.error for d in dead if d.error is not None]
            broker_dead = [d for d in dead if d.error is None]
            for conflict in conflicts:
                self.result.checked[inv] += 1
                if "message_id_conflict" not in codes or "message_id_conflict" not in dead_codes:
                    self.fail(
                        inv,
                        f"command {conflict.describe()}",
                        "a message_id_conflict refusal and dead-lettered copy",
                        f"refusals {codes}, dead-lettered with {dead_codes}",
                    )
                codes = [c for c in codes if c != "message_id_conflict"]
                dead_codes = [c for c in dead_codes if c != "message_id_conflict"]
            self.result.checked[inv] += 1
            subject = f"command {original.describe()}"
            for problem in problems:
                self.fail(inv, subject, "a consistent effect", problem)
            if broker_dead and effects == 0:
                self.fail(
                    inv,
                    subject,
                    "an effect or a refusal",
                    f"dead-lettered by the broker with neither (x-death {broker_dead[0].death})",
                )
            self._judge(inv, subject, original, effects, codes, dead_codes)
            if original.group:
                group_effects[original.group].append((original, effects))
        for group, members in group_effects.items():
            self.result.checked[inv] += 1
            total = sum(e for _, e in members)
            if total != 1 and all(c.confirmed for c, _ in members):
                self.fail(
                    inv,
                    f"race {group}",
                    "exactly one effect among the racing commands",
                    f"{total}: " + ", ".join(f"{c.message_id}={e}" for c, e in members),
                )
        self._unexpected(inv)

    def _judge(
        self, inv: str, subject: str, command: SentCommand, effects: int, codes: list[Any], dead: list[str]
    ) -> None:
        refused = bool(codes)
        if command.expect is Expect.BROKER_REFUSES:
            self._judge_broker_refusal(inv, subject, command, effects, codes, dead)
            return
        if command.refused_by_broker is not None:
            self.fail(
                inv,
                subject,
                "taken by the broker (its sender may publish it)",
                f"refused at publish: {command.refused_by_broker}",
            )
            return
        expected = [c for c in codes if c in command.codes]
        again = [c for c in codes if c not in command.codes]
        if expected and again and all(c in REDELIVERY_CODES for c in again):
            # Refused as expected, then refused again on a redelivery after the run moved on.
            self.result.stats["refusals_repeated_on_redelivery"] = (
                self.result.stats.get("refusals_repeated_on_redelivery", 0) + 1
            )
            self.ledger.notes.append(
                f"{command.describe()} was refused {expected[0]}, then {again[0]} when delivered again"
            )
            again = []
        wrong = sorted({str(c) for c in again})
        dead_ok = any(c in command.codes for c in dead)
        if not command.confirmed and effects == 0 and not refused:
            return  # never confirmed by the broker: it may never have arrived
        if command.expect is Expect.APPLY:
            if effects != 1 or refused:
                self.fail(
                    inv,
                    subject,
                    "exactly one effect and no refusal",
                    f"{effects} effect(s)" + (f", refused {codes}" if refused else ""),
                )
        elif command.expect is Expect.REJECT:
            if effects:
                self.fail(inv, subject, f"a refusal {sorted(command.codes)} and no effect", f"{effects} effect(s)")
            if not refused:
                self.fail(inv, subject, f"a command.rejected event with a code in {sorted(command.codes)}", "none")
            elif wrong:
                self.fail(inv, subject, f"a refusal with a code in {sorted(command.codes)}", f"codes {wrong}")
            if not dead_ok:
                self.fail(
                    inv,
                    subject,
                    f"a dead-lettered copy with x-intermission-error in {sorted(command.codes)}",
                    f"copies with {dead}",
                )
        elif command.expect is Expect.DUPLICATE:
            if effects or refused:
                self.fail(
                    inv,
                    subject,
                    "no effect and no refusal (a duplicate)",
                    f"{effects} effect(s)" + (f", refused {codes}" if refused else ""),
                )
        else:
            if effects and refused:
                self.fail(inv, subject, "an effect or a refusal, not both", f"{effects} effect(s) and refusals {codes}")
            elif effects > 1:
                self.fail(inv, subject, "at most one effect", f"{effects}")
            elif not effects and not refused:
                self.fail(inv, subject, "an effect or a refusal", "neither")
            elif refused and (wrong or not dead_ok):
                self.fail(
                    inv,
                    subject,
                    f"a refusal with a code in {sorted(command.codes)} and its dead-lettered copy",
                    f"codes {codes}, copies with {dead}",
                )

    def _judge_broker_refusal(
        self, inv: str, subject: str, command: SentCommand, effects: int, codes: list[Any], dead: list[str]
    ) -> None:
        """A command keyed for a scope its sender is not granted: the broker refuses the publish, so the
        fleet never sees it."""
        if command.confirmed:
            self.fail(inv, subject, "refused by the broker at publish (ACCESS_REFUSED)", "confirmed by the broker")
        elif command.refused_by_broker is None:
            self.ledger.notes.append(f"{command.describe()} was neither refused nor confirmed: {command.note}")
        elif "ACCESS_REFUSED" not in command.refused_by_broker:
            self.fail(inv, subject, "an ACCESS_REFUSED from the broker", command.refused_by_broker)
        if effects or codes or dead or self.dead_by_mid.get(command.message_id or ""):
            self.fail(
                inv,
                subject,
                "never delivered: no effect, no refusal and no dead-lettered copy",
                f"{effects} effect(s), refusals {codes}, copies "
                f"{[d.error for d in self.dead_by_mid.get(command.message_id or '', [])]}",
            )

    def _unexpected(self, inv: str) -> None:
        sent = self.ledger.by_message_id()
        for body in self.unattributed:
            self.result.checked[inv] += 1
            self.fail(
                inv,
                f"a refusal of {body.get('routing_key')} (run {body.get('run_id')})",
                "refusals only of commands the harness sent",
                f"one without a message id: {body.get('code')}",
            )
        for mid, bodies in self.refusals.items():
            if mid not in sent:
                self.result.checked[inv] += 1
                first = bodies[0]
                self.fail(
                    inv,
                    f"message {mid} ({first.get('routing_key')}, run {first.get('run_id')})",
                    "refusals only of commands the harness sent",
                    f"refused {first.get('code')}: {first.get('detail')}",
                )
        for (_app, _tenant, mid), row in self.snap.inbox.items():
            if mid not in sent:
                self.result.checked[inv] += 1
                if mid.startswith("expire:"):
                    self._sweeper_expiry(inv, mid, row)
                else:
                    self.fail(
                        inv,
                        f"inbox {mid}",
                        "records only of commands the harness or a sweeper sent",
                        f"{row['routing_key']} for run {row['run_id']}",
                    )
        for correlation, rows in self.resumed_rows.items():
            if correlation is None or correlation not in sent:
                self.result.checked[inv] += 1
                self.fail(
                    inv,
                    f"run.resumed of run {rows[0]['run_id']}",
                    "caused by a command the harness sent",
                    f"correlation id {correlation}",
                )
        for dead in self.evidence.dead:
            if dead.error is None and (dead.message_id is None or dead.message_id not in sent):
                self.result.checked[inv] += 1
                self.fail(
                    inv,
                    f"dead-lettered {dead.routing_key} {dead.message_id}",
                    "no command lost to the delivery limit",
                    f"x-death {dead.death}",
                )

    def _sweeper_expiry(self, inv: str, mid: str, row: asyncpg.Record) -> None:
        run = self.snap.runs.get(run_key(row))
        if run is None or run["state"] != "failed" or not (run["error"] or "").startswith(EXPIRE_PREFIX):
            self.fail(
                inv,
                f"expiry {mid}",
                "its run ended failed, suspension_expired",
                f"{run['state'] if run else 'no run'} ({run['error'] if run else ''})",
            )

    # --- scope and authority -----------------------------------------------------------------------

    def scope_and_authority(self) -> None:
        inv = "scope_and_authority"
        for table, count in self.snap.foreign_rows.items():
            self.result.checked[inv] += 1
            if count:
                self.fail(inv, f"table {table}", f"no row at scope {self.foreign_app}/*", f"{count} rows")
        self.result.checked[inv] += len(self.snap.runs)
        for table, key in self.snap.forged:
            self.fail(inv, f"run {describe(key)}", "no forged or foreign payload applied", f"one in {table}")
        for row in self.snap.admissions:
            self.result.checked[inv] += 1
            if row["forged"]:
                self.fail(
                    inv,
                    f"run {row['run_id']} pause {row['suspension_id']}",
                    "only the bus's replies admitted",
                    "a forged reply admitted",
                )
        for row in self.snap.checkpoints:
            self.result.checked[inv] += 1
            subject = f"checkpoint {row['id']} of run {row['run_id']}"
            if row["state"] in ("approved", "denied"):
                decider = row["decided_by"]
                if row["approvers"] and decider not in row["approvers"]:
                    self.fail(inv, subject, f"a decision by one of {list(row['approvers'])}", f"decided by {decider}")
                if decider == self.mallory:
                    self.fail(inv, subject, "no decision by a non-approver", f"decided by {decider}")
                plan = self.plan_of(run_key(row))
                if plan is not None and row["state"] == "denied" and plan.fate is not Fate.DENY:
                    self.fail(
                        inv,
                        subject,
                        "approved (the harness only approves this run)",
                        f"denied by {decider}: {row['reason']}",
                    )
        for command in self.ledger.commands:
            if command.message_id is not None and command.routing_key is not None:
                self._refusals_heard_at_the_key(inv, command)
            if command.message_id is not None and command.victim is not None:
                self._nothing_at_the_victim(inv, command, command.victim)
        forged = [c for c in self.ledger.commands if c.expect in (Expect.REJECT, Expect.BROKER_REFUSES)]
        self.result.stats["bad_commands"] = len(forged)
        self.result.stats["refused_by_the_broker"] = sum(1 for c in self.ledger.commands if c.refused_by_broker)

    def _refusals_heard_at_the_key(self, inv: str, command: SentCommand) -> None:
        """A refusal goes to the stream of the scope the command's routing key names (which the broker vouches
        for), never to the one its body claims."""
        assert command.message_id is not None
        assert command.routing_key is not None
        heard = self.refusal_keys.get(command.message_id, [])
        if not heard:
            return
        self.result.checked[inv] += 1
        wanted = rejected_key(scope_of_command_key(command.routing_key))
        wrong = sorted({k for k in heard if k != wanted})
        if wrong:
            self.fail(
                inv,
                f"command {command.describe()}",
                f"its refusals under {wanted} (the scope of its key {command.routing_key})",
                f"refusals under {wrong}",
            )

    def _nothing_at_the_victim(self, inv: str, command: SentCommand, victim: Scope) -> None:
        """A command that reached for another tenant's run changed nothing there and told it nothing."""
        assert command.message_id is not None
        self.result.checked[inv] += 1
        subject = f"command {command.describe()}, reaching for {victim}"
        heard = [
            e.routing_key
            for e in self.mentions.get(command.message_id, [])
            if ".".join(e.routing_key.split(".")[-2:]) == victim.routing_suffix()
        ]
        if heard:
            self.fail(inv, subject, f"nothing of it heard in {victim}'s events", f"{sorted(set(heard))}")
        recorded = self.inbox_by_mid.get(command.message_id, [])
        if recorded:
            where = sorted({f"{r['app']}/{r['tenant']}" for r in recorded})
            self.fail(inv, subject, "no inbox record of it in any scope", f"records at {where}")
        # The dead-letter tools (as the observer reads the queue) show it under the key it was sent with,
        # never as the victim's, whatever refusal headers it carried.
        shown_as_victims = [
            d.routing_key
            for d in self.dead_by_mid.get(command.message_id, [])
            if scope_of_command_key(d.routing_key) == victim
        ]
        if shown_as_victims:
            self.fail(inv, subject, "its dead letters shown under the key it was sent with", f"{shown_as_victims}")

    # --- outbox ------------------------------------------------------------------------------------

    def outbox_delivered(self) -> None:
        inv = "outbox_delivered"
        for row in self.snap.outbox:
            self.result.checked[inv] += 1
            subject = f"outbox {row['message_id']} ({row['routing_key']}, run {row['run_id']})"
            if row["sent_at"] is None:
                self.fail(inv, subject, "marked sent", "unsent")
            deliveries = self.captured.get(row["message_id"], [])
            if not deliveries:
                self.fail(inv, subject, "delivered on intermission.events", "never captured")
                continue
            for delivery in deliveries:
                if delivery.routing_key != row["routing_key"] or delivery.text != row["body"]:
                    self.fail(
                        inv,
                        subject,
                        "every delivery with the row's routing key and body",
                        f"{delivery.routing_key}: {delivery.text[:200]}",
                    )
                    break
        # The other way round: every event heard came from an outbox row that is still there. On a cluster
        # this is what says a failover lost no committed event: the relay publishes only committed rows, so
        # an event heard without its row means a commit the new primary does not have. Refusals are the
        # one kind published straight from the consumer (they record nothing, by design).
        rows = {row["message_id"] for row in self.snap.outbox}
        for mid, deliveries in self.captured.items():
            if deliveries[0].routing_key.startswith("command.rejected."):
                continue
            self.result.checked[inv] += 1
            if mid not in rows:
                self.fail(
                    inv,
                    f"event {mid} ({deliveries[0].routing_key})",
                    "an outbox row with its message id (it was committed before it was published)",
                    "no such row",
                )

    # --- expiries ----------------------------------------------------------------------------------

    def expiries(self) -> None:
        inv = "expiries"
        for key, row in self.snap.runs.items():
            run_id = describe(key)
            plan = self.plan_of(key)
            expired = row["state"] == "failed" and (row["error"] or "").startswith(EXPIRE_PREFIX)
            if plan is not None and plan.fate is Fate.EXPIRE:
                self.result.checked[inv] += 1
                if not expired:
                    self.fail(
                        inv,
                        f"run {run_id}",
                        "failed with suspension_expired (its pause was left unanswered)",
                        f"{row['state']} ({row['error']!r})",
                    )
            if not expired:
                continue
            self.result.checked[inv] += 1
            notice = self.last_notice.get(key)
            deadline = datetime.fromisoformat(notice["expires_at"]) if notice and notice.get("expires_at") else None
            if deadline is None:
                self.fail(inv, f"run {run_id}", "an expiry only of a pause with a deadline", "its last pause had none")
            elif row["ended_at"] is None or row["ended_at"] < deadline:
                self.fail(
                    inv,
                    f"run {run_id}",
                    f"to end after its deadline {deadline.isoformat()}",
                    f"ended at {row['ended_at']}",
                )
            if plan is not None and plan.fate not in (Fate.EXPIRE, Fate.RACE_DEADLINE):
                self.fail(
                    inv,
                    f"run {run_id}",
                    f"no expiry (fate {plan.fate.value}: every pause answered)",
                    f"failed: {row['error']}",
                )
        for key, live in self.snap.suspensions.items():
            run_id = describe(key)
            for suspension in live:
                self.result.checked[inv] += 1
                expires = suspension["expires_at"]
                run = self.snap.runs.get(key)
                if expires is not None and expires < self.snap.now and run is not None and run["state"] == "paused":
                    self.fail(
                        inv,
                        f"pause {suspension['id']} of run {run_id}",
                        f"expired by the sweepers (deadline {expires.isoformat()})",
                        f"still paused at {self.snap.now.isoformat()}",
                    )

    def ends_match_events(self) -> None:
        inv = "ends_match_events"
        by_run: dict[RunKey, list[asyncpg.Record]] = defaultdict(list)
        for event in self.snap.run_events:
            if event["kind"] in TERMINAL_KEYS:
                by_run[run_key(event)].append(event)
        for key, row in self.snap.runs.items():
            if row["state"] not in ("completed", "failed", "cancelled"):
                continue
            self.result.checked[inv] += 1
            run_id = describe(key)
            events = by_run.get(key, [])
            outbox = self.terminal_rows.get(key, [])
            kinds = [e["kind"] for e in events]
            keys = [r["routing_key"].split(".")[1] for r in outbox]
            if len(events) != 1 or TERMINAL_KEYS[events[0]["kind"]] != row["state"]:
                self.fail(inv, f"run {run_id}", f"one terminal run event of state {row['state']}", f"{kinds}")
            if len(outbox) != 1 or TERMINAL_KEYS.get(keys[0]) != row["state"]:
                self.fail(inv, f"run {run_id}", f"one terminal outbox event of state {row['state']}", f"{keys}")
            expired = (row["error"] or "").startswith(EXPIRE_PREFIX)
            if expired and keys and keys[0] != "expired":
                self.fail(inv, f"run {run_id}", "a run.expired event for an expiry", f"run.{keys[0]}")

    # --- floods ------------------------------------------------------------------------------------

    def flood_fairness(self) -> None:
        inv = "flood_fairness"
        floods = self.ledger.floods
        if not floods:
            return
        sent = self.ledger.by_message_id()
        figures: list[dict[str, Any]] = []
        for flood in floods:
            outcomes = self._flood_starts(inv, flood.name, [sent[mid][0] for mid in flood.starts])
            figures.append({"name": flood.name, "size": flood.size, "workers": flood.workers, **outcomes})
            figures[-1].update(self._probe(inv, flood, sent))
        # Its runs are never answered (they stay paused, live), so the scope never held more than it holds now.
        scope, quota = floods[0].scope, floods[0].quota
        held = sum(1 for r in self.snap.runs.values() if _at(r, scope))
        self.result.checked[inv] += 1
        if held > quota:
            self.fail(inv, f"scope {scope}", f"at most its quota of {quota} live runs", f"{held} runs")
        judged = [f for f in figures if f.get("wait") is not None and f.get("excused") is None]
        self.result.stats["floods"] = figures
        self.result.stats["flood_runs_held"] = held
        self.result.stats["flood_probes_judged"] = len(judged)
        self.result.stats["flood_probes_excused"] = sum(1 for f in figures if f.get("excused") is not None)
        self.result.stats["flood_probe_wait_max"] = max((f["wait"] for f in judged), default=None)

    def _flood_starts(self, inv: str, name: str, starts: list[SentCommand]) -> dict[str, int]:
        """Each start of a flood applied (a run, its inbox record) or refused (no run), never both; the
        codes and dead copies are ``one_effect_per_command``'s."""
        outcomes = {"applied": 0, "refused": 0, "unconfirmed": 0}
        for command in starts:
            assert command.message_id is not None
            assert command.run_id is not None
            self.result.checked[inv] += 1
            subject = f"{name} start {command.describe()}"
            assert command.scope is not None  # a flood's start is keyed for the flooder's scope
            row = self.snap.runs.get((command.scope.app, command.scope.tenant, command.run_id))
            recorded = bool(self.inbox_by_mid.get(command.message_id))
            refused = bool(self.refusals.get(command.message_id))
            if refused and row is not None:
                self.fail(inv, subject, "no run for a start refused quota_exceeded", f"a {row['state']} run")
            elif recorded and row is None:
                self.fail(inv, subject, "its run, once applied (inbox record)", "no run")
            elif row is not None and not recorded:
                self.fail(inv, subject, "a run only for an applied start", "a run without its inbox record")
            if row is not None:
                outcomes["applied"] += 1
            elif refused:
                outcomes["refused"] += 1
            elif not command.confirmed:
                outcomes["unconfirmed"] += 1
        return outcomes

    def _probe(self, inv: str, flood: FloodRecord, sent: dict[str, list[SentCommand]]) -> dict[str, Any]:
        """The probe behind ``flood``: its first Notice within the bound, the worker faults during its wait
        added; excused if its wait overlapped a server fault or the recovery after one."""
        bound = flood_bound(flood.size, flood.workers)
        figures: dict[str, Any] = {"bound": round(bound, 2), "wait": None, "excused": None}
        plan = self.ledger.runs.get(flood.probe_run or "")
        starts = sent.get(plan.start_message_id, []) if plan is not None else []
        if plan is None or not starts or not starts[0].confirmed:
            # The load ended (or the harness gave up on the broker) before the probe was started.
            self.ledger.notes.append(f"{flood.name}: no probe was started behind it")
            return figures
        self.result.checked[inv] += 1
        began = starts[0].sent_at
        subject = f"probe run {plan.run_id} behind {flood.name} ({flood.size} starts, {flood.workers} workers)"
        formula = (
            f"{flood.size} / ({FLOOR_REFUSALS_PER_SECOND:g} x {max(1, flood.workers)}) + {LATENCY_ALLOWANCE_SECONDS:g}"
        )
        if plan.first_heard is None:
            self.fail(inv, subject, f"its first Notice within {bound:.1f} s ({formula})", "never heard")
            return figures
        heard = plan.first_heard
        wait = heard - began
        figures["wait"] = round(wait, 2)
        # Faults that found nothing to act on (no worker, no local cluster) did nothing to weigh.
        infra = [f for f in self.ledger.faults if f.infrastructure and f.done]
        servers = [
            f
            for f in infra
            if f.kind not in WORKER_FAULTS
            and _overlaps(f.at, (f.ended or f.at) + SERVER_FAULT_RECOVERY_SECONDS, began, heard)
        ]
        if servers:
            figures["excused"] = sorted({f.kind for f in servers})
            return figures
        workers = [f for f in infra if f.kind in WORKER_FAULTS and _overlaps(f.at, f.ended or f.at, began, heard)]
        allowed = bound + sum((f.ended or f.at) - f.at for f in workers)
        figures["allowed"] = round(allowed, 2)
        if wait > allowed:
            during = f", with {', '.join(f.kind for f in workers)} during it" if workers else ""
            self.fail(
                inv,
                subject,
                f"its first Notice within {allowed:.1f} s ({formula}{during})",
                f"{wait:.1f} s after its start was sent",
            )
        return figures

    # --- figures -----------------------------------------------------------------------------------

    def stats(self) -> None:
        states = Counter(r["state"] for r in self.snap.runs.values())
        expired = sum(
            1
            for r in self.snap.runs.values()
            if r["state"] == "failed" and (r["error"] or "").startswith(EXPIRE_PREFIX)
        )
        self.result.stats.update(
            {
                "runs_by_state": dict(sorted(states.items())),
                "expired_runs": expired,
                "pauses": len(self.paused),
                "pauses_by_reason": dict(
                    sorted(Counter(_json(rows[0]["body"])["reason"] for rows in self.outbox_notices.values()).items())
                ),
                "resumes": sum(len(rows) for rows in self.resumed_rows.values()),
                "notices_delivered": sum(
                    1 for m, d in self.captured.items() if d and d[0].routing_key.startswith("notice.")
                ),
                "event_deliveries": len(self.evidence.events),
                "redeliveries": len(self.evidence.events) - len(self.captured),
                "refusals": len(self.refusals) + len(self.unattributed),
                "dead_lettered": len(self.evidence.dead),
                "inbox_rows": len(self.snap.inbox),
                "sweeper_expiries_applied": sum(1 for _, _, m in self.snap.inbox if m.startswith("expire:")),
                "charges": sum(int(r["times"]) for r in self.snap.charges),
                "outbox_rows": len(self.snap.outbox),
                "checkpoints_decided": sum(1 for r in self.snap.checkpoints if r["state"] in ("approved", "denied")),
            }
        )


async def check(
    database_url: str, ledger: Ledger, evidence: Evidence, *, foreign_app: str, mallory: str
) -> CheckResult:
    snap = await read_snapshot(database_url, foreign_app)
    return Checker(ledger, evidence, snap, foreign_app=foreign_app, mallory=mallory).check()


def plan_summary(plans: dict[str, RunPlan]) -> dict[str, int]:
    return dict(sorted(Counter(p.fate.value for p in plans.values()).items()))
