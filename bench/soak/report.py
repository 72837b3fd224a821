"""The soak's report: what ran, what was injected, what was checked, and every violation."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.soak.checker import FLOOR_REFUSALS_PER_SECOND, INVARIANTS, LATENCY_ALLOWANCE_SECONDS, CheckResult
from bench.soak.ledger import Ledger
from bench.soak.profile import Profile


@dataclass
class Report:
    profile: Profile
    seed: int
    ledger: Ledger
    result: CheckResult
    completions: list[float]
    setup_seconds: float
    total_seconds: float
    drained: bool
    crashes_fired: dict[str, int]
    crashes_not_reached: int
    processes_started: int
    publish_retries: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def load_seconds(self) -> float:
        return self.ledger.load_ended - self.ledger.load_started

    @property
    def drain_seconds(self) -> float:
        return self.ledger.drain_ended - self.ledger.load_ended

    @property
    def violations(self) -> list[str]:
        return [str(v) for v in self.result.violations]

    def invariants(self) -> dict[str, str]:
        """Every invariant checked, the soak's and its site's, with what it means."""
        return {**INVARIANTS, **self.result.site_invariants}

    def recovery(self) -> list[float]:
        """For each fault injected, the seconds until the next run.completed was delivered after it."""
        done = sorted(self.completions)
        gaps: list[float] = []
        for fault in self.ledger.faults:
            if not fault.done:
                continue
            index = bisect.bisect_left(done, fault.at)
            if index < len(done):
                gaps.append(done[index] - fault.at)
        return gaps

    def floods(self) -> dict[str, Any]:
        """The tenants' floods (``tenant_flood``): their starts' outcomes and the probes' waits behind them."""
        stats = self.result.stats
        each: list[dict[str, Any]] = stats.get("floods", [])
        return {
            "floods": len(each),
            "size": self.profile.flood_size,
            "quota": self.profile.flood_quota,
            "bound": f"size / ({FLOOR_REFUSALS_PER_SECOND:g} x workers alive) + {LATENCY_ALLOWANCE_SECONDS:g} s",
            "starts_applied": sum(f["applied"] for f in each),
            "starts_refused": sum(f["refused"] for f in each),
            "runs_held": stats.get("flood_runs_held", 0),
            "probes_judged": stats.get("flood_probes_judged", 0),
            "probes_excused": stats.get("flood_probes_excused", 0),
            "probe_wait_max_seconds": stats.get("flood_probe_wait_max"),
            "each": each,
        }

    def as_dict(self) -> dict[str, Any]:
        stats = self.result.stats
        gaps = self.recovery()
        faults = self.ledger.fault_counts()
        active = self.load_seconds + self.drain_seconds
        return {
            "profile": self.profile.name,
            "seed": self.seed,
            "load_seconds": round(self.load_seconds, 1),
            "drain_seconds": round(self.drain_seconds, 1),
            "total_seconds": round(self.total_seconds, 1),
            "drained": self.drained,
            "runs_started": sum(1 for c in self.ledger.commands if c.purpose == "start" and c.confirmed),
            # A flood's starts are counted with its flood, not as planned runs.
            "runs_planned_by_fate": dict(
                sorted(Counter(p.fate.value for p in self.ledger.runs.values() if p.flood is None).items())
            ),
            "runs_by_state": stats.get("runs_by_state", {}),
            "expired_runs": stats.get("expired_runs", 0),
            "pauses": stats.get("pauses", 0),
            "pauses_by_reason": stats.get("pauses_by_reason", {}),
            "resumes": stats.get("resumes", 0),
            "resumes_per_second": round(stats.get("resumes", 0) / active, 2) if active > 0 else 0.0,
            "commands_sent": len(self.ledger.commands),
            "commands_by_purpose": dict(sorted(Counter(c.purpose for c in self.ledger.commands).items())),
            "commands_unconfirmed": [
                c.describe() + f": {c.note}"
                for c in self.ledger.commands
                if not c.confirmed and c.refused_by_broker is None
            ],
            # Refused at publish by the broker's permissions (ACCESS_REFUSED): mallory keying another scope.
            "commands_refused_at_publish": sum(1 for c in self.ledger.commands if c.refused_by_broker is not None),
            "refusals": stats.get("refusals", 0),
            "dead_lettered": stats.get("dead_lettered", 0),
            "event_deliveries": stats.get("event_deliveries", 0),
            "redeliveries": stats.get("redeliveries", 0),
            "charges": stats.get("charges", 0),
            "faults_total": sum(faults.values()),
            "faults_by_kind": dict(sorted(faults.items())),
            "faults_not_injected": sum(1 for f in self.ledger.faults if not f.done),
            "crash_points_fired": dict(sorted(self.crashes_fired.items())),
            "crash_points_not_reached": self.crashes_not_reached,
            "processes_started": self.processes_started,
            "publish_retries": self.publish_retries,
            "fault_to_next_completed_run": {
                "faults_measured": len(gaps),
                "median_seconds": round(statistics.median(gaps), 2) if gaps else None,
                "max_seconds": round(max(gaps), 2) if gaps else None,
            },
            "floods": self.floods(),
            "invariants_checked": {name: self.result.checked.get(name, 0) for name in self.invariants()},
            "violations": self.violations,
            "unexpected_exits": list(self.ledger.unexpected_exits),
            "notes": list(self.ledger.notes),
            **self.extra,
        }

    def text(self) -> str:
        d = self.as_dict()
        lines = [
            f"== Intermission soak: profile {d['profile']}, seed {d['seed']} ==",
            f"time: load {d['load_seconds']} s, drain {d['drain_seconds']} s"
            f"{'' if d['drained'] else ' (DRAIN TIMED OUT)'}, total {d['total_seconds']} s",
            f"runs: {d['runs_started']} started; by state {_kv(d['runs_by_state'])}; expired {d['expired_runs']}",
            f"      planned fates {_kv(d['runs_planned_by_fate'])}",
            f"pauses: {d['pauses']} ({_kv(d['pauses_by_reason'])})",
            f"resumes: {d['resumes']} ({d['resumes_per_second']} per second over load and drain)",
            f"commands sent: {d['commands_sent']} ({_kv(d['commands_by_purpose'])}); "
            f"refused at publish by the broker: {d['commands_refused_at_publish']}; "
            f"never confirmed by the broker: {len(d['commands_unconfirmed'])}",
            f"refusals: {d['refusals']}; dead-lettered copies: {d['dead_lettered']}; "
            f"event deliveries: {d['event_deliveries']} ({d['redeliveries']} redeliveries); charges: {d['charges']}",
            f"faults injected: {d['faults_total']} ({d['faults_not_injected']} could not be)",
        ]
        lines += [f"  {kind:<24} {count}" for kind, count in d["faults_by_kind"].items()]
        fired = _kv(d["crash_points_fired"]) or "none"
        lines.append(f"  crash points fired: {fired}; not reached: {d['crash_points_not_reached']}")
        recovery = d["fault_to_next_completed_run"]
        lines.append(
            f"time from a fault to the next completed run: median {recovery['median_seconds']} s, "
            f"max {recovery['max_seconds']} s (over {recovery['faults_measured']} faults)"
        )
        lines.append(f"processes started: {d['processes_started']}; harness publish retries: {d['publish_retries']}")
        lines += _flood_lines(d["floods"])
        lines.append("invariants checked:")
        meaning = self.invariants()
        lines += [f"  {name:<24} {count:>6}  {meaning[name]}" for name, count in d["invariants_checked"].items()]
        if d["unexpected_exits"]:
            lines.append(f"processes that exited on their own: {len(d['unexpected_exits'])}")
            lines += [f"  {e}" for e in d["unexpected_exits"][:20]]
        if d["notes"]:
            lines.append("notes:")
            lines += [f"  {n}" for n in d["notes"][:30]]
        lines.append(f"violations: {len(d['violations'])}")
        lines += [f"  {v}" for v in d["violations"][:200]]
        if len(d["violations"]) > 200:
            lines.append(f"  ... and {len(d['violations']) - 200} more")
        return "\n".join(lines)


def _flood_lines(floods: dict[str, Any]) -> list[str]:
    if not floods["floods"]:
        return ["floods: none"]
    lines = [
        f"floods: {floods['floods']} of {floods['size']} starts at a quota of {floods['quota']} live runs: "
        f"{floods['starts_applied']} applied, {floods['starts_refused']} refused quota_exceeded; "
        f"{floods['runs_held']} runs held by the flooding scope",
        f"  probes behind them: {floods['probes_judged']} judged, max wait {floods['probe_wait_max_seconds']} s "
        f"(bound {floods['bound']}); {floods['probes_excused']} excused by a server fault",
    ]
    for f in floods["each"]:
        if f["wait"] is None:
            probe = "no probe heard"
        elif f["excused"] is not None:
            probe = f"probe waited {f['wait']} s, excused ({', '.join(f['excused'])})"
        else:
            probe = f"probe waited {f['wait']} s of {f['allowed']} s allowed (bound {f['bound']} s)"
        lost = f", never confirmed {f['unconfirmed']}" if f["unconfirmed"] else ""
        lines.append(
            f"  {f['name']}: {f['size']} starts, {f['workers']} workers; applied {f['applied']}, "
            f"refused {f['refused']}{lost}; {probe}"
        )
    return lines


def _kv(mapping: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in mapping.items())
