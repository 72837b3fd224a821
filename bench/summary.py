"""``bench.resume``'s figures, from one measurement to the printed table: pure functions, no I/O.

Each repetition measures every system once; each measurement becomes one row of :class:`Figures` (the same
fields whatever the system). Across repetitions each figure is summarised as its median with the min and
max (:func:`spread`); the ratios are taken within each repetition (Intermission and a peer measured minutes
apart on the same machine) and then summarised the same way; the targets of issue 17 are read from those
medians. A system that was not measured, or a peer that failed, is ``None`` in a repetition: it is left
out of the figures, and a target that needs it is "not measured" rather than met or not.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

BARE = "bare"
UNLOADED = "unloaded"
# The broker alone: the two quorum-queue hops every unloaded resume crosses (bench/floor.py).
FLOOR = "floor"
LANGGRAPH = "langgraph"
DBOS = "dbos"
PEERS = (LANGGRAPH, DBOS)


def intermission(workers: int) -> str:
    return f"intermission_{workers}w"


ONE = intermission(1)
TWO = intermission(2)

# Issue 17's targets.
TARGET_TO_LANGGRAPH = 1.5
TARGET_TO_DBOS = 6.0
TARGET_TO_BARE = 0.6
TARGET_CPU_MS = 3.0
TARGET_UNLOADED_P50_MS = 8.0
TARGET_UNLOADED_P99_MS = 20.0
TARGET_TWO_TO_ONE = 1.0
TARGET_WORKER_MIB = 200.0


@dataclass(frozen=True)
class Figures:
    """One system measured once. CPU is milliseconds per resume (per message for the bare pipeline):
    ``app`` is the system's own Python processes (Intermission: its workers and the sweeper; a peer: its
    processes, the caller included), ``driver`` the benchmark's host side (Intermission and the bare
    pipeline only: a peer's caller is inside its ``app``), ``other`` busy time of the machine that no
    group accounts for. ``rabbitmq`` is None for the peers, which use no broker."""

    per_second: float | None
    p50_ms: float | None
    p99_ms: float | None
    app_ms: float | None
    postgres_ms: float | None
    rabbitmq_ms: float | None
    driver_ms: float | None = None
    other_ms: float | None = None
    peak_mib: float | None = None

    @property
    def total_ms(self) -> float | None:
        """CPU of every process of the system: app, PostgreSQL and RabbitMQ (the driver is not counted)."""
        parts = [self.app_ms, self.postgres_ms]
        if any(p is None for p in parts):
            return None
        return sum(p for p in parts if p is not None) + (self.rabbitmq_ms or 0.0)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def of_limit(measured: Mapping[str, Any]) -> Figures:
    """The bare pipeline's measurement (``measure_limit``)."""
    cpu = measured["cpu_ms_per_message"]
    return Figures(
        per_second=_number(measured["per_second"]),
        p50_ms=_number(measured["latency_ms"]["p50"]),
        p99_ms=_number(measured["latency_ms"]["p99"]),
        app_ms=_number(cpu.get("python")),
        postgres_ms=_number(cpu.get("postgres")),
        rabbitmq_ms=_number(cpu.get("rabbitmq")),
        driver_ms=_number(cpu.get("driver")),
        other_ms=_number(cpu.get("other")),
        peak_mib=_number(measured.get("peak_rss_mib")),
    )


def of_intermission(measured: Mapping[str, Any]) -> Figures:
    """An Intermission measurement (``measure_intermission``): its ``python`` group is the workers and the
    sweeper; its peak memory the largest of its workers'."""
    cpu = measured["cpu_ms_per_resume"]
    peaks = [float(p) for p in measured.get("peak_rss_mib", [])]
    return Figures(
        per_second=_number(measured["per_second"]),
        p50_ms=_number(measured["latency_ms"]["p50"]),
        p99_ms=_number(measured["latency_ms"]["p99"]),
        app_ms=_number(cpu.get("python")),
        postgres_ms=_number(cpu.get("postgres")),
        rabbitmq_ms=_number(cpu.get("rabbitmq")),
        driver_ms=_number(cpu.get("driver")),
        other_ms=_number(cpu.get("other")),
        peak_mib=max(peaks) if peaks else None,
    )


def of_unloaded(measured: Mapping[str, Any]) -> Figures:
    """The unloaded measurement: latency and memory only."""
    peaks = [float(p) for p in measured.get("peak_rss_mib", [])]
    return _latency_only(measured, max(peaks) if peaks else None)


def of_floor(measured: Mapping[str, Any]) -> Figures:
    """The broker's floor: latency only."""
    return _latency_only(measured, None)


def _latency_only(measured: Mapping[str, Any], peak_mib: float | None) -> Figures:
    return Figures(
        per_second=None,
        p50_ms=_number(measured["latency_ms"]["p50"]),
        p99_ms=_number(measured["latency_ms"]["p99"]),
        app_ms=None,
        postgres_ms=None,
        rabbitmq_ms=None,
        peak_mib=peak_mib,
    )


def of_peer(outcome: Mapping[str, Any]) -> Figures | None:
    """A peer's outcome (``bench.peer_runs.parse_peer_output``); None when it failed. Its PostgreSQL time is
    its own database's backends and the server's shared processes."""
    if not outcome.get("ok"):
        return None
    result = outcome["result"]
    cpu = result.get("cpu", {})
    latency = result.get("latency", {})
    ours, shared = _number(cpu.get("pg_ours_ms_per_resume")), _number(cpu.get("pg_aux_ms_per_resume"))
    return Figures(
        per_second=_number(result.get("resumes_per_s")),
        p50_ms=_number(latency.get("p50_ms")),
        p99_ms=_number(latency.get("p99_ms")),
        app_ms=_number(cpu.get("py_ms_per_resume")),
        postgres_ms=None if ours is None else ours + (shared or 0.0),
        rabbitmq_ms=None,
        other_ms=_number(cpu.get("other_ms_per_resume")),
    )


# --- across repetitions ---------------------------------------------------------------------------------


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min and max of the values that are there (None is left out), and how many there were."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


Repetition = Mapping[str, Figures | None]


def summarise(reps: Sequence[Repetition], systems: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per system, each figure's spread over the repetitions that measured it, and the largest peak."""
    out: dict[str, dict[str, Any]] = {}
    for system in systems:
        measured = [r[system] for r in reps if r.get(system) is not None]
        rows = [m for m in measured if m is not None]
        peaks = [m.peak_mib for m in rows if m.peak_mib is not None]
        out[system] = {
            "measured": len(rows),
            "repetitions": len(reps),
            "per_second": spread(m.per_second for m in rows),
            "p50_ms": spread(m.p50_ms for m in rows),
            "p99_ms": spread(m.p99_ms for m in rows),
            "app_ms": spread(m.app_ms for m in rows),
            "postgres_ms": spread(m.postgres_ms for m in rows),
            "rabbitmq_ms": spread(m.rabbitmq_ms for m in rows),
            "total_ms": spread(m.total_ms for m in rows),
            "driver_ms": spread(m.driver_ms for m in rows),
            "other_ms": spread(m.other_ms for m in rows),
            "peak_mib": max(peaks) if peaks else None,
        }
    return out


RATIOS = {
    "intermission_1w_to_langgraph": (ONE, LANGGRAPH),
    "intermission_1w_to_dbos": (ONE, DBOS),
    "intermission_1w_to_bare": (ONE, BARE),
    "intermission_2w_to_1w": (TWO, ONE),
}


def ratio(numerator: Figures | None, denominator: Figures | None) -> float | None:
    if numerator is None or denominator is None:
        return None
    if numerator.per_second is None or not denominator.per_second:
        return None
    return numerator.per_second / denominator.per_second


def rep_ratios(rep: Repetition) -> dict[str, float | None]:
    """The ratios of resumes/s within one repetition."""
    return {name: ratio(rep.get(a), rep.get(b)) for name, (a, b) in RATIOS.items()}


def ratios(reps: Sequence[Repetition]) -> dict[str, dict[str, Any]]:
    """Each ratio's spread over the repetitions: each value is taken within one repetition."""
    per_rep = [rep_ratios(r) for r in reps]
    return {name: {**spread(p[name] for p in per_rep), "values": [p[name] for p in per_rep]} for name in RATIOS}


# --- the targets ----------------------------------------------------------------------------------------


def _target(text: str, value: float | None, shown: str, met: bool | None) -> dict[str, Any]:
    return {
        "target": text,
        "value": shown if value is not None else "not measured",
        "measured": value,
        "met": met if value is not None else None,
    }


def _at_least(text: str, value: float | None, floor: float, shown: str) -> dict[str, Any]:
    return _target(text, value, shown, None if value is None else value >= floor)


def _at_most(text: str, value: float | None, ceiling: float, shown: str) -> dict[str, Any]:
    return _target(text, value, shown, None if value is None else value <= ceiling)


def _times(s: Mapping[str, Any]) -> str:
    if s["median"] is None:
        return ""
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f} over {s['n']})"


def targets(
    summary: Mapping[str, Mapping[str, Any]], ratio_spreads: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Issue 17's targets, each met (True), not met (False) or not measured (None), from the medians over
    the repetitions (ratios: the median of the ratios taken within each repetition)."""
    to_lg = ratio_spreads["intermission_1w_to_langgraph"]
    to_dbos = ratio_spreads["intermission_1w_to_dbos"]
    to_bare = ratio_spreads["intermission_1w_to_bare"]
    two = ratio_spreads["intermission_2w_to_1w"]
    one = summary.get(ONE, {})
    unloaded = summary.get(UNLOADED, {})
    cpu = one.get("total_ms", {}).get("median")
    p50 = unloaded.get("p50_ms", {}).get("median")
    p99 = unloaded.get("p99_ms", {}).get("median")
    peaks = [s["peak_mib"] for name, s in summary.items() if name.startswith("intermission_") or name == UNLOADED]
    peak = max((p for p in peaks if p is not None), default=None)
    return [
        _at_least(
            "Intermission, 1 worker >= 1.5x LangGraph (resumes/s, same run)",
            to_lg["median"],
            TARGET_TO_LANGGRAPH,
            _times(to_lg),
        ),
        _at_least(
            "Intermission, 1 worker >= 6x DBOS (resumes/s, same run)",
            to_dbos["median"],
            TARGET_TO_DBOS,
            _times(to_dbos),
        ),
        _at_least(
            "Intermission, 1 worker >= 0.6x the bare pipeline (same run)",
            to_bare["median"],
            TARGET_TO_BARE,
            _times(to_bare),
        ),
        _at_most(
            "all processes (worker + sweeper, PostgreSQL, RabbitMQ) <= 3.0 ms CPU per resume, 1 worker",
            cpu,
            TARGET_CPU_MS,
            f"{cpu:.2f} ms" if cpu is not None else "",
        ),
        _at_most(
            "unloaded latency p50 <= 8 ms", p50, TARGET_UNLOADED_P50_MS, f"{p50:.1f} ms" if p50 is not None else ""
        ),
        _at_most(
            "unloaded latency p99 <= 20 ms", p99, TARGET_UNLOADED_P99_MS, f"{p99:.1f} ms" if p99 is not None else ""
        ),
        _at_least("2 workers not slower than 1 (ratio >= 1.0)", two["median"], TARGET_TWO_TO_ONE, _times(two)),
        _target(
            "a worker's peak memory < 200 MB",
            peak,
            f"{peak:.0f} MiB (VmHWM, the largest of every worker)" if peak is not None else "",
            None if peak is None else peak < TARGET_WORKER_MIB,
        ),
    ]


# --- the table ------------------------------------------------------------------------------------------


def _cell(s: Mapping[str, Any], digits: int = 1, *, ranged: bool = False) -> str:
    if s["median"] is None:
        return "-"
    text = f"{s['median']:.{digits}f}"
    if ranged and s["n"] > 1:
        text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
    return text


QUIET_SHARE = 0.1


def noisy(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The systems during whose measurement the machine was not quiet: busy time nobody accounts for
    ("other") above a tenth of the system's own CPU (medians)."""
    found: list[str] = []
    for system, s in summary.items():
        other, total = s.get("other_ms", {}).get("median"), s.get("total_ms", {}).get("median")
        if other is not None and total and other > QUIET_SHARE * total:
            found.append(system)
    return found


def table(
    summary: Mapping[str, Mapping[str, Any]],
    labels: Mapping[str, str],
    ratio_spreads: Mapping[str, Mapping[str, Any]],
    found: Sequence[Mapping[str, Any]],
    failures: Sequence[str] = (),
) -> str:
    """The printed result: one row per system, then the ratios and the targets."""
    header = (
        "system",
        "resumes/s median (min-max)",
        "p50 ms",
        "p99 ms",
        "app ms",
        "pg ms",
        "mq ms",
        "total ms",
        "driver ms",
        "other ms",
        "peak MiB",
    )
    rows: list[tuple[str, ...]] = [header]
    for system, label in labels.items():
        s = summary.get(system)
        if s is None:
            continue
        if not s["measured"]:
            rows.append((label, "failed" if s["repetitions"] else "-", *("-" for _ in header[2:])))
            continue
        rows.append(
            (
                label + ("" if s["measured"] == s["repetitions"] else f" [{s['measured']}/{s['repetitions']} reps]"),
                _cell(s["per_second"], 0, ranged=True),
                _cell(s["p50_ms"]),
                _cell(s["p99_ms"]),
                _cell(s["app_ms"], 2),
                _cell(s["postgres_ms"], 2),
                _cell(s["rabbitmq_ms"], 2) if system not in PEERS else "n/a",
                _cell(s["total_ms"], 2),
                _cell(s["driver_ms"], 2),
                _cell(s["other_ms"], 2),
                f"{s['peak_mib']:.0f}" if s["peak_mib"] is not None else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(
        "CPU: milliseconds per resume (per message for the bare pipeline), medians over the repetitions. app: the"
    )
    lines.append(
        "system's Python processes (Intermission: workers + sweeper; a peer: all of its own, its caller included);"
    )
    lines.append(
        "total = app + pg + mq; driver: the benchmark's host side; other: machine busy time nobody accounts for."
    )
    loud = noisy(summary)
    if loud:
        lines.append(
            "warning: the machine was not quiet (other > 10 % of total) while measuring "
            + ", ".join(labels.get(system, system) for system in loud)
            + ": those figures are for development, not for the record"
        )
    for failure in failures:
        lines.append(f"  failed: {failure}")
    lines.append("")
    lines.append("ratios of resumes/s, each within one repetition: median (min-max)")
    for name, s in ratio_spreads.items():
        lines.append(f"  {name.replace('_', ' ')}: {_times(s) or 'not measured'}")
    lines.append("")
    lines.append("targets (issue 17):")
    for t in found:
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"  [{verdict}] {t['target']}: {t['value']}")
    return "\n".join(lines)


def as_json(figures: Figures | None) -> dict[str, Any] | None:
    if figures is None:
        return None
    return {**asdict(figures), "total_ms": figures.total_ms}
