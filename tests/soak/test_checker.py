"""The soak's invariant checker on a small synthetic world (no I/O): a clean history passes, and each broken
guarantee is reported precisely (the run or message, what was expected, what was found)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from bench.soak.checker import (
    FLOOR_REFUSALS_PER_SECOND,
    LATENCY_ALLOWANCE_SECONDS,
    SERVER_FAULT_RECOVERY_SECONDS,
    Checker,
    CheckResult,
    Evidence,
    Snapshot,
    flood_bound,
)
from bench.soak.ledger import Expect, Fate, FloodRecord, Ledger, RunPlan, SentCommand
from bench.soak.observe import DeadLetter, Event
from intermission.schemas.scope import Scope

SCOPE = Scope(app="soak", tenant="t0")
MALLORY = Scope(app="soak-foreign", tenant="mallory")
NOW = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "soak-1-00000"
# The run's key, as the checker names runs: (app, tenant, id).
KEY = (SCOPE.app, SCOPE.tenant, RUN)
SCOPED = {"app": SCOPE.app, "tenant": SCOPE.tenant}
ANSWER = f"answer:{RUN}:1"
FORGED_REPLY = "non_bus_reply:abc"

Row = dict[str, Any]


def notice_body() -> str:
    return json.dumps(
        {
            "suspension_id": 1,
            "run_id": RUN,
            "run_revision": 1,
            "reason": "external_tool",
            "pending": [],
            "scope": {"app": SCOPE.app, "tenant": SCOPE.tenant},
        }
    )


def outbox_row(n: int, key: str, body: str, correlation: str | None) -> Row:
    return {
        "id": n,
        "message_id": f"00000000-0000-0000-0000-00000000000{n}",
        "routing_key": key,
        "body": body,
        "correlation_id": correlation,
        "run_id": RUN,
        "app": SCOPE.app,
        "tenant": SCOPE.tenant,
        "sent_at": NOW,
    }


def world() -> tuple[Ledger, list[Row], dict[str, Any]]:
    """A run that paused once, was answered and completed; one forged reply that was refused."""
    ledger = Ledger(seed=1)
    plan = RunPlan(RUN, SCOPE, "lookup", Fate.COMPLETE, 0, f"start:{RUN}", heard_by_host=[1], handled={1})
    ledger.runs[RUN] = plan
    for mid, key, sender, purpose, expect, codes in (
        (f"start:{RUN}", "run.start", "host", "start", Expect.APPLY, frozenset[str]()),
        (ANSWER, "run.resume", "host", "answer", Expect.APPLY, frozenset[str]()),
        (FORGED_REPLY, "run.reply", "mallory", "non_bus_reply", Expect.REJECT, frozenset({"forbidden"})),
    ):
        ledger.sent(
            SentCommand(
                mid,
                key,
                RUN,
                SCOPE,
                sender,
                purpose,
                expect,
                codes=codes,
                confirmed=True,
                suspension_id=1,
                routing_key=f"{key}.{SCOPE.routing_suffix()}",
            )
        )
    outbox = [
        outbox_row(1, f"notice.external_tool.{SCOPE.app}.{SCOPE.tenant}", notice_body(), f"start:{RUN}"),
        outbox_row(2, f"run.resumed.{SCOPE.app}.{SCOPE.tenant}", json.dumps({"run_id": RUN, "revision": 2}), ANSWER),
        outbox_row(3, f"run.completed.{SCOPE.app}.{SCOPE.tenant}", json.dumps({"run_id": RUN, "revision": 3}), ANSWER),
    ]
    db: dict[str, Any] = {
        "runs": {
            KEY: {
                "id": RUN,
                "app": SCOPE.app,
                "tenant": SCOPE.tenant,
                "state": "completed",
                "revision": 3,
                "lease_owner": None,
                "lease_expires_at": None,
                "error": None,
                "ended_at": NOW,
            }
        },
        "run_events": [
            {**SCOPED, "run_id": RUN, "kind": "paused", "revision": 1, "data": json.dumps({"suspension_id": 1})},
            {**SCOPED, "run_id": RUN, "kind": "completed", "revision": 3, "data": "{}"},
        ],
        "inbox": {
            (SCOPE.app, SCOPE.tenant, f"start:{RUN}"): inbox_row(SCOPE, f"start:{RUN}", "run.start"),
            (SCOPE.app, SCOPE.tenant, ANSWER): inbox_row(SCOPE, ANSWER, "run.resume"),
        },
        "charges": [{**SCOPED, "run_id": RUN, "call_id": "call-0-0", "times": 1, "at": [NOW]}],
        "forged": [],
        "rejections": [refusal(FORGED_REPLY, "forbidden")],
        # Dead-lettered copies: (message id, x-intermission-error).
        "dead": [(FORGED_REPLY, "forbidden")],
    }
    return ledger, outbox, db


def inbox_row(scope: Scope, mid: str, key: str) -> Row:
    return {"app": scope.app, "tenant": scope.tenant, "message_id": mid, "routing_key": key, "run_id": RUN}


def refusal(mid: str, code: str, scope: Scope = SCOPE) -> dict[str, Any]:
    return {"message_id": mid, "routing_key": "run.reply", "code": code, "detail": code, "scope": scope.model_dump()}


def check(ledger: Ledger, outbox: list[Row], db: dict[str, Any]) -> CheckResult:
    # Every row was heard, and so were the events a breakage says were heard without a row.
    events = [
        Event(r["message_id"], r["routing_key"], r["correlation_id"], r["body"], json.loads(r["body"]), 1.0)
        for r in [*outbox, *db.get("heard_without_row", [])]
    ]
    for body in db["rejections"]:
        events.append(
            Event(
                f"rejected:{body['message_id']}",
                f"command.rejected.{body['scope']['app']}.{body['scope']['tenant']}",
                None,
                json.dumps(body),
                body,
                1.0,
            )
        )
    dead = [DeadLetter(mid, None, "run.reply", code, None, 10, RUN, 1.0) for mid, code in db["dead"]]
    snap = Snapshot(
        now=NOW,
        runs=cast("Any", db["runs"]),
        suspensions=cast("Any", db.get("suspensions", {})),
        progress={},
        run_events=cast("Any", db["run_events"]),
        outbox=cast("Any", outbox),
        inbox=cast("Any", db["inbox"]),
        charges=cast("Any", db["charges"]),
        checkpoints=[],
        admissions=[],
        foreign_rows={"runs": 0},
        forged=db["forged"],
    )
    return Checker(ledger, Evidence(events=events, dead=dead), snap, foreign_app="soak-foreign", mallory="m").check()


def test_a_clean_history_passes_every_invariant() -> None:
    result = check(*world())
    assert result.violations == []
    assert result.checked["one_effect_per_command"] >= 3
    assert result.checked["notices_match_pauses"] >= 2


Breakage = Callable[[Ledger, list[Row], dict[str, Any]], None]


def _double_charge(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["charges"][0].update(times=2, at=[NOW, NOW + timedelta(seconds=2)])


def _refused_answer(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["rejections"] = [refusal(ANSWER, "not_suspended")]
    db["dead"] = [(ANSWER, "not_suspended")]


def _second_effect(_ledger: Ledger, outbox: list[Row], _db: dict[str, Any]) -> None:
    outbox.append(outbox_row(4, f"run.resumed.{SCOPE.app}.{SCOPE.tenant}", json.dumps({"revision": 4}), ANSWER))


def _unsent(_ledger: Ledger, outbox: list[Row], _db: dict[str, Any]) -> None:
    outbox[2]["sent_at"] = None


def _left_running(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["runs"][KEY].update(state="running", lease_owner="worker-1", lease_expires_at=NOW - timedelta(seconds=5))


def _forged_applied(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["forged"] = [("session_messages", KEY)]


def _lost_notice(_ledger: Ledger, outbox: list[Row], _db: dict[str, Any]) -> None:
    del outbox[0]


def _event_without_row(_ledger: Ledger, outbox: list[Row], db: dict[str, Any]) -> None:
    # What a failover that lost a committed event looks like: heard on the bus, gone from the new primary.
    db["heard_without_row"] = [outbox.pop(2)]


def _unrefused_forgery(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["rejections"] = []
    db["dead"] = []


def _refused_for_the_wrong_reason(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["rejections"] = [refusal(FORGED_REPLY, "not_suspended")]
    db["dead"] = [(FORGED_REPLY, "not_suspended")]


@pytest.mark.parametrize(
    ("breakage", "invariant", "words"),
    [
        (_double_charge, "no_double_charge", f"run {RUN} of soak/t0 call call-0-0: expected at most one charge"),
        (_refused_answer, "one_effect_per_command", "expected exactly one effect and no refusal; found 1 effect(s)"),
        (_second_effect, "one_effect_per_command", "found 2 effect(s)"),
        (_unsent, "outbox_delivered", "expected marked sent; found unsent"),
        (_event_without_row, "outbox_delivered", "expected an outbox row with its message id"),
        (_left_running, "no_running_after_drain", "found running, lease worker-1"),
        (
            _forged_applied,
            "scope_and_authority",
            f"run {RUN} of soak/t0: expected no forged or foreign payload applied",
        ),
        (_lost_notice, "notices_match_pauses", "expected exactly one Notice in the outbox; found 0"),
        (_unrefused_forgery, "one_effect_per_command", "expected a command.rejected event with a code in"),
        (_refused_for_the_wrong_reason, "one_effect_per_command", "found codes ['not_suspended']"),
    ],
)
def test_each_broken_guarantee_is_reported_precisely(breakage: Breakage, invariant: str, words: str) -> None:
    ledger, outbox, db = copy.deepcopy(world())
    breakage(ledger, outbox, db)
    found = [str(v) for v in check(ledger, outbox, db).violations if v.invariant == invariant]
    assert any(words in v for v in found), found


def test_a_refusal_repeated_on_a_redelivery_after_the_run_moved_on_is_no_violation() -> None:
    # Refusals record nothing: a refused command delivered again is judged against the run's new state.
    ledger, outbox, db = copy.deepcopy(world())
    db["rejections"] = [refusal(FORGED_REPLY, "forbidden"), refusal(FORGED_REPLY, "not_suspended")]
    result = check(ledger, outbox, db)
    assert result.violations == []
    assert result.stats["refusals_repeated_on_redelivery"] == 1


STALE_REPLY = "stale:0000000000000001"


def _with_stale_bus_reply(ledger: Ledger) -> None:
    ledger.sent(
        SentCommand(
            STALE_REPLY,
            "run.reply",
            RUN,
            SCOPE,
            "bus",
            "reordered_commands",
            Expect.DUPLICATE,
            codes=frozenset(),
            confirmed=True,
            suspension_id=1,
        )
    )


def test_a_stale_bus_reply_acknowledged_as_a_duplicate_is_no_violation() -> None:
    # The bus's reply identical to the admitted one is that reply again: no effect and no refusal.
    ledger, outbox, db = copy.deepcopy(world())
    _with_stale_bus_reply(ledger)
    assert check(ledger, outbox, db).violations == []


def test_a_stale_bus_reply_that_was_refused_is_reported() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_stale_bus_reply(ledger)
    db["rejections"].append(refusal(STALE_REPLY, "run_conflict"))
    found = [str(v) for v in check(ledger, outbox, db).violations if v.invariant == "one_effect_per_command"]
    assert any("expected no effect and no refusal (a duplicate)" in v for v in found), found


def _answer_recorded_at_another_scope(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    del db["inbox"][(SCOPE.app, SCOPE.tenant, ANSWER)]
    db["inbox"][(MALLORY.app, MALLORY.tenant, ANSWER)] = inbox_row(MALLORY, ANSWER, "run.resume")


def _refusal_told_to_the_body_scope(_ledger: Ledger, _outbox: list[Row], db: dict[str, Any]) -> None:
    db["rejections"] = [refusal(FORGED_REPLY, "forbidden", scope=MALLORY)]


def _legit_answer_refused_at_publish(ledger: Ledger, _outbox: list[Row], _db: dict[str, Any]) -> None:
    ledger.commands[1].refused_by_broker = "ACCESS_REFUSED - write access to topic refused"


@pytest.mark.parametrize(
    ("breakage", "invariant", "words"),
    [
        (_answer_recorded_at_another_scope, "one_effect_per_command", "an inbox record at soak-foreign/mallory"),
        (_refusal_told_to_the_body_scope, "scope_and_authority", "its refusals under command.rejected.soak.t0"),
        (_legit_answer_refused_at_publish, "one_effect_per_command", "expected taken by the broker"),
    ],
)
def test_inbox_records_and_refusals_are_judged_per_scope(breakage: Breakage, invariant: str, words: str) -> None:
    ledger, outbox, db = copy.deepcopy(world())
    breakage(ledger, outbox, db)
    found = [str(v) for v in check(ledger, outbox, db).violations if v.invariant == invariant]
    assert any(words in v for v in found), found


KEYED_FOR_THE_VICTIM = "cross_tenant_key:0000000000000001"
BODY_OF_THE_VICTIM = "cross_tenant_body:0000000000000002"


def _with_mallorys_forgeries(ledger: Ledger, db: dict[str, Any]) -> None:
    """Mallory, confined to its own scope, reaches for the run's pause both ways: keyed for the victim's
    scope (the broker refuses the publish), and keyed for its own with the victim's body (forbidden, told
    to mallory's scope)."""
    ledger.sent(
        SentCommand(
            KEYED_FOR_THE_VICTIM,
            "run.resume",
            RUN,
            SCOPE,
            "mallory",
            "cross_tenant_key",
            Expect.BROKER_REFUSES,
            suspension_id=1,
            routing_key=f"run.resume.{SCOPE.routing_suffix()}",
            victim=SCOPE,
            refused_by_broker="ACCESS_REFUSED - write access to topic 'run.resume.soak.t0' refused",
        )
    )
    ledger.sent(
        SentCommand(
            BODY_OF_THE_VICTIM,
            "run.resume",
            RUN,
            SCOPE,
            "mallory",
            "cross_tenant_body",
            Expect.REJECT,
            codes=frozenset({"forbidden"}),
            confirmed=True,
            suspension_id=1,
            routing_key=f"run.resume.{MALLORY.routing_suffix()}",
            victim=SCOPE,
        )
    )
    db["rejections"].append(refusal(BODY_OF_THE_VICTIM, "forbidden", scope=MALLORY))
    db["dead"].append((BODY_OF_THE_VICTIM, "forbidden"))


def test_mallorys_forgeries_refused_by_the_broker_and_in_its_own_scope_are_no_violation() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_mallorys_forgeries(ledger, db)
    result = check(ledger, outbox, db)
    assert result.violations == []
    assert result.stats["refused_by_the_broker"] == 1


def test_a_forgery_the_broker_took_is_reported() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_mallorys_forgeries(ledger, db)
    keyed = ledger.commands[-2]
    keyed.refused_by_broker, keyed.confirmed = None, True
    found = [str(v) for v in check(ledger, outbox, db).violations]
    assert any("expected refused by the broker at publish (ACCESS_REFUSED); found confirmed" in v for v in found), found


def test_a_forgery_refused_at_publish_that_had_an_effect_is_reported() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_mallorys_forgeries(ledger, db)
    db["inbox"][(SCOPE.app, SCOPE.tenant, KEYED_FOR_THE_VICTIM)] = inbox_row(SCOPE, KEYED_FOR_THE_VICTIM, "run.resume")
    found = [str(v) for v in check(ledger, outbox, db).violations]
    assert any("expected never delivered: no effect" in v for v in found), found
    assert any("expected no inbox record of it in any scope; found records at ['soak/t0']" in v for v in found), found


def test_a_forgery_refused_in_the_victims_scope_is_reported() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_mallorys_forgeries(ledger, db)
    db["rejections"][-1] = refusal(BODY_OF_THE_VICTIM, "forbidden", scope=SCOPE)
    found = [str(v) for v in check(ledger, outbox, db).violations if v.invariant == "scope_and_authority"]
    assert any(
        "expected nothing of it heard in soak/t0's events; found ['command.rejected.soak.t0']" in v for v in found
    )
    assert any("expected its refusals under command.rejected.soak-foreign.mallory" in v for v in found), found


# --- a tenant's flood, and the probe run behind it ------------------------------------------------------

FLOOD = Scope(app="soak", tenant="flood")
APPLIED = "soak-1-flood1-00000"
REFUSED = "soak-1-flood1-00001"
SENT_AT = 100.0
# The flood's two starts, with three workers alive: 2 / (25 x 3) + 10.
BOUND = flood_bound(2, 3)


def _with_flood(ledger: Ledger, outbox: list[Row], db: dict[str, Any], *, waited: float) -> None:
    """The flooder's two starts at a quota of one live run: the first applied (a run paused for good), the
    second refused quota_exceeded; the world's run is the probe behind them, its first Notice heard
    ``waited`` seconds after its start was sent."""
    flood = FloodRecord(name="flood1", scope=FLOOD, size=2, quota=1, workers=3, probe_run=RUN)
    for run_id in (APPLIED, REFUSED):
        mid = f"start:{run_id}"
        ledger.runs[run_id] = RunPlan(run_id, FLOOD, "flooded", Fate.ABANDON, 0, mid, flood="flood1")
        ledger.sent(
            SentCommand(
                mid,
                "run.start",
                run_id,
                FLOOD,
                "flooder",
                "tenant_flood",
                Expect.EITHER,
                codes=frozenset({"quota_exceeded"}),
                confirmed=True,
                routing_key=f"run.start.{FLOOD.routing_suffix()}",
            )
        )
        flood.starts.append(mid)
    ledger.floods.append(flood)
    plan = ledger.runs[APPLIED]
    plan.heard_by_host, plan.handled, plan.left_paused = [2], {2}, 2
    notice = {
        "suspension_id": 2,
        "run_id": APPLIED,
        "run_revision": 1,
        "reason": "external_tool",
        "pending": [],
        "scope": FLOOD.model_dump(),
    }
    outbox.append(
        {
            **outbox_row(9, f"notice.external_tool.{FLOOD.routing_suffix()}", json.dumps(notice), f"start:{APPLIED}"),
            "run_id": APPLIED,
            "app": FLOOD.app,
            "tenant": FLOOD.tenant,
        }
    )
    db["runs"][(FLOOD.app, FLOOD.tenant, APPLIED)] = {
        **db["runs"][KEY],
        "id": APPLIED,
        "tenant": FLOOD.tenant,
        "state": "paused",
        "revision": 1,
        "ended_at": None,
    }
    db["suspensions"] = {
        (FLOOD.app, FLOOD.tenant, APPLIED): [
            {"id": 2, "run_id": APPLIED, "app": FLOOD.app, "tenant": FLOOD.tenant, "reason": "external_tool"}
            | {"expires_at": None}
        ]
    }
    db["run_events"].append(
        {
            "run_id": APPLIED,
            "app": FLOOD.app,
            "tenant": FLOOD.tenant,
            "kind": "paused",
            "revision": 1,
            "data": json.dumps(notice),
        }
    )
    db["inbox"][(FLOOD.app, FLOOD.tenant, f"start:{APPLIED}")] = inbox_row(FLOOD, f"start:{APPLIED}", "run.start")
    db["rejections"].append(refusal(f"start:{REFUSED}", "quota_exceeded", scope=FLOOD))
    db["dead"].append((f"start:{REFUSED}", "quota_exceeded"))
    # The probe: the world's run, started right behind the flood.
    ledger.commands[0].sent_at = SENT_AT
    ledger.runs[RUN].first_heard = SENT_AT + waited


def _infra_fault(ledger: Ledger, kind: str, at: float, lasted: float) -> None:
    ledger.fault(kind, "for the test", at=SENT_AT + at, infrastructure=True, ended=SENT_AT + at + lasted)


def flood_violations(result: CheckResult) -> list[str]:
    return [str(v) for v in result.violations if v.invariant == "flood_fairness"]


def test_the_bound_is_the_floods_refusals_at_the_floor_rate_plus_the_allowance() -> None:
    assert flood_bound(300, 3) == 300 / (FLOOR_REFUSALS_PER_SECOND * 3) + LATENCY_ALLOWANCE_SECONDS
    # No worker alive is taken as one: the bound stays finite.
    assert flood_bound(300, 0) == flood_bound(300, 1)


def test_a_flood_accounted_and_a_probe_within_the_bound_pass() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND - 0.5)
    result = check(ledger, outbox, db)
    assert result.violations == []
    # Each start, the quota and the probe.
    assert result.checked["flood_fairness"] == 4
    assert result.stats["flood_probes_judged"] == 1
    assert result.stats["flood_probes_excused"] == 0
    [figures] = result.stats["floods"]
    assert (figures["applied"], figures["refused"]) == (1, 1)


def test_a_probe_that_waited_past_the_bound_is_reported() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND + 0.5)
    [found] = flood_violations(check(ledger, outbox, db))
    assert f"probe run {RUN} behind flood1 (2 starts, 3 workers)" in found
    assert f"expected its first Notice within {BOUND:.1f} s (2 / (25 x 3) + 10)" in found
    assert f"found {BOUND + 0.5:.1f} s after its start was sent" in found


def test_a_worker_fault_during_the_wait_adds_its_length_to_the_bound() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND + 0.5)
    _infra_fault(ledger, "worker_sigkill", at=1.0, lasted=1.0)
    assert check(ledger, outbox, db).violations == []


def test_a_worker_fault_shorter_than_the_overrun_does_not_excuse_it() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND + 2.0)
    _infra_fault(ledger, "worker_sigterm", at=1.0, lasted=1.0)
    [found] = flood_violations(check(ledger, outbox, db))
    assert f"within {BOUND + 1.0:.1f} s (2 / (25 x 3) + 10, with worker_sigterm during it)" in found


def test_a_worker_fault_outside_the_wait_adds_nothing() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND + 0.5)
    _infra_fault(ledger, "worker_sigkill", at=-30.0, lasted=1.0)
    assert len(flood_violations(check(ledger, outbox, db))) == 1


def test_a_probe_whose_wait_overlapped_a_server_fault_or_its_recovery_is_excused_and_counted() -> None:
    for at in (3.0, -SERVER_FAULT_RECOVERY_SECONDS - 1.0):
        ledger, outbox, db = copy.deepcopy(world())
        _with_flood(ledger, outbox, db, waited=BOUND * 5)
        _infra_fault(ledger, "rabbitmq_restart", at=at, lasted=2.0)
        result = check(ledger, outbox, db)
        assert result.violations == []
        assert result.stats["flood_probes_excused"] == 1
        assert result.stats["flood_probes_judged"] == 0
        assert result.stats["floods"][0]["excused"] == ["rabbitmq_restart"]


def test_a_server_fault_that_found_nothing_to_act_on_excuses_nothing() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND + 0.5)
    _infra_fault(ledger, "pg_restart", at=1.0, lasted=0.0)
    ledger.faults[-1].done = False  # no local PostgreSQL cluster to stop
    assert len(flood_violations(check(ledger, outbox, db))) == 1


def test_a_server_fault_long_before_the_wait_excuses_nothing() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=BOUND + 0.5)
    _infra_fault(ledger, "pg_outage_long", at=-SERVER_FAULT_RECOVERY_SECONDS - 40.0, lasted=30.0)
    assert len(flood_violations(check(ledger, outbox, db))) == 1


def test_a_probe_never_heard_is_reported_even_during_a_server_fault() -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=1.0)
    ledger.runs[RUN].first_heard = None
    _infra_fault(ledger, "pg_restart", at=1.0, lasted=2.0)
    [found] = flood_violations(check(ledger, outbox, db))
    assert found.endswith("found never heard")


def _refused_start_that_ran(ledger: Ledger, outbox: list[Row], db: dict[str, Any]) -> None:
    db["runs"][(FLOOD.app, FLOOD.tenant, REFUSED)] = {**db["runs"][(FLOOD.app, FLOOD.tenant, APPLIED)], "id": REFUSED}


def _applied_start_without_its_run(ledger: Ledger, outbox: list[Row], db: dict[str, Any]) -> None:
    del db["runs"][(FLOOD.app, FLOOD.tenant, APPLIED)]


def _over_the_quota(ledger: Ledger, outbox: list[Row], db: dict[str, Any]) -> None:
    ledger.floods[0].quota = 0


@pytest.mark.parametrize(
    ("breakage", "words"),
    [
        (_refused_start_that_ran, f"flood1 start run.start start:{REFUSED}"),
        (_refused_start_that_ran, "expected no run for a start refused quota_exceeded; found a paused run"),
        (_applied_start_without_its_run, "expected its run, once applied (inbox record); found no run"),
        (_over_the_quota, f"scope {FLOOD}: expected at most its quota of 0 live runs; found 1 runs"),
    ],
)
def test_each_broken_guarantee_of_a_flood_is_reported(breakage: Breakage, words: str) -> None:
    ledger, outbox, db = copy.deepcopy(world())
    _with_flood(ledger, outbox, db, waited=1.0)
    breakage(ledger, outbox, db)
    found = flood_violations(check(ledger, outbox, db))
    assert any(words in v for v in found), found


def test_a_run_of_a_planned_id_at_another_scope_is_another_run_the_harness_never_started() -> None:
    # A run id is unique only within its scope: a tenant reusing the plan's id made a run of its own, which
    # neither hides the plan's run nor passes for it.
    ledger, outbox, db = copy.deepcopy(world())
    db["runs"][(MALLORY.app, MALLORY.tenant, RUN)] = {**db["runs"][KEY], "app": MALLORY.app, "tenant": MALLORY.tenant}
    found = [str(v) for v in check(ledger, outbox, db).violations]
    assert [v for v in found if v.startswith("[runs_settled]")] == [
        f"[runs_settled] run {RUN} of soak-foreign/mallory: expected only runs the harness started;"
        " found a completed run"
    ]
    # Everything found is about the foreign run (here: it wrote no events); the plan's run passes.
    assert found
    assert all(f"run {RUN} of soak-foreign/mallory" in v for v in found), found
