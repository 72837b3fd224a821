"""The benchmarks run and produce their figures: ``python -m bench.resume --quick``,
``python -m bench.scaling --quick`` and ``python -m bench.storage --quick``, each in a subprocess against
the tests' PostgreSQL and RabbitMQ.

Only the presence of the figures is checked, never their values: a quick run's numbers mean nothing, and
no test asserts a time.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.amqp import Broker

ROOT = Path(__file__).resolve().parents[2]
LATENCY = {"p50", "p90", "p99", "max", "count"}
CPU = {"python", "postgres", "rabbitmq", "driver", "machine_busy", "other"}


def holds(figures: dict[str, Any], *keys: str) -> None:
    """``figures`` has every one of ``keys``."""
    missing = set(keys) - set(figures)
    assert not missing, f"missing {sorted(missing)} in {sorted(figures)}"


def latency(figures: dict[str, Any]) -> None:
    holds(figures, *LATENCY)


async def bench(module: str, out: Path, pg_server: str, rabbit: Broker, *extra: str) -> dict[str, Any]:
    figures, _ = await bench_printed(module, out, pg_server, rabbit, *extra)
    return figures


async def bench_printed(
    module: str, out: Path, pg_server: str, rabbit: Broker, *extra: str
) -> tuple[dict[str, Any], str]:
    """The figures a quick run wrote, and what it printed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        "--quick",
        *extra,
        "--database-url",
        pg_server,
        "--amqp-url",
        rabbit.base_url,
        "--rabbitmqctl",
        shlex.join(rabbit.ctl),
        "--out",
        str(out),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    raw, _ = await proc.communicate()
    printed = raw.decode(errors="replace")
    assert proc.returncode == 0, printed[-4000:]
    assert f"results: {out}" in printed
    figures: dict[str, Any] = json.loads(await asyncio.to_thread(out.read_text))
    return figures, printed


@pytest.mark.timeout(240)
async def test_the_resume_benchmark_produces_its_figures(pg_server: str, rabbit: Broker, tmp_path: Path) -> None:
    # Two repetitions, so that the figures are aggregated over more than one; no peers (a quick run never
    # needs their venv).
    figures, printed = await bench_printed("bench.resume", tmp_path / "resume.json", pg_server, rabbit, "--reps", "2")
    assert figures["benchmark"] == "resume"
    holds(figures["machine"], "date", "nproc", "memory_gib", "lscpu", "python", "postgres_server", "rabbitmq")
    holds(figures["machine"], "dbos", "langgraph")
    assert figures["options"]["reps"] == 2
    assert figures["options"]["peers"] == []
    assert "peers' venv" not in printed
    assert len(figures["repetitions"]) == 2
    for raw in figures["repetitions"]:
        limit = raw["limit"]
        holds(limit, "per_second", "latency_ms", "cpu_ms_per_message", "peak_rss_mib")
        latency(limit["latency_ms"])
        holds(limit["cpu_ms_per_message"], *CPU)
        assert set(raw["intermission"]) == {"1", "2"}
        for measured in raw["intermission"].values():
            holds(measured, "per_second", "latency_ms", "cpu_ms_per_resume", "peak_rss_mib", "database_per_resume")
            holds(measured, "sweeper_cpu_ms_per_resume", "sweeper_peak_rss_mib", "sweeper_warnings")
            assert measured["sweeper"] is True
            latency(measured["latency_ms"])
            holds(measured["cpu_ms_per_resume"], *CPU)
        latency(raw["unloaded"]["latency_ms"])
        latency(raw["floor"]["latency_ms"])
        assert raw["unloaded"]["sweeper"] is True
        assert raw["peers"] == {}
        holds(raw["figures"], "bare", "intermission_1w", "intermission_2w", "unloaded", "floor")
    summary = figures["summary"]
    assert set(summary) == {"bare", "intermission_1w", "intermission_2w", "unloaded", "floor"}
    for system in ("bare", "intermission_1w", "intermission_2w"):
        assert summary[system]["measured"] == 2
        holds(summary[system]["per_second"], "median", "min", "max", "n")
        assert summary[system]["per_second"]["n"] == 2
    holds(
        figures["ratios"],
        "intermission_1w_to_langgraph",
        "intermission_1w_to_dbos",
        "intermission_1w_to_bare",
        "intermission_2w_to_1w",
    )
    assert figures["ratios"]["intermission_1w_to_bare"]["n"] == 2
    assert figures["ratios"]["intermission_1w_to_langgraph"]["n"] == 0
    assert len(figures["targets"]) == 8
    for target in figures["targets"]:
        holds(target, "target", "value", "met")
    # The peers' targets are not measured without them; the others are met or not.
    assert [t["met"] is None for t in figures["targets"]] == [True, True] + [False] * 6
    assert "targets (issue 17):" in printed


@pytest.mark.timeout(240)
async def test_the_scaling_benchmark_produces_its_figures(pg_server: str, rabbit: Broker, tmp_path: Path) -> None:
    figures = await bench("bench.scaling", tmp_path / "scaling.json", pg_server, rabbit)
    assert figures["benchmark"] == "scaling"
    assert len(figures["sizes"]) == 2
    for measured in figures["sizes"].values():
        latency(measured["claim"])
        latency(measured["resume"])
    sweeper = figures["sweeper"]
    latency(sweeper["baseline"]["claim"])
    latency(sweeper["during_sweep"]["claim"])
    holds(sweeper, "sweep_published", "sweep_completed", "sweep_per_second")
    assert len(figures["targets"]) == 2
    for target in figures["targets"]:
        holds(target, "target", "value", "met")


@pytest.mark.timeout(180)
async def test_the_storage_benchmark_prints_its_minutes_and_ratios_and_prunes(
    pg_server: str, rabbit: Broker, tmp_path: Path
) -> None:
    figures, printed = await bench_printed("bench.storage", tmp_path / "storage.json", pg_server, rabbit)
    assert figures["benchmark"] == "storage"
    minutes = figures["minutes"]
    assert len(minutes) == figures["options"]["minutes"] == 4
    for m in minutes:
        assert f"minute {m['minute'] + 1}/4 " in printed
        holds(m, "tables", "total_bytes", "claim_ms", "ended", "runs_by_state", "pruning", "steady", "cpu_percent")
        latency(m["claim_ms"])
        assert {"runs", "inbox", "outbox", "session_messages"} <= set(m["tables"])
        for table in m["tables"].values():
            holds(table, "live_rows", "dead_rows", "bytes")
    # Every minute's block has its table lines and its total; the end has both ratios and the HOT share.
    assert printed.count("  runs        ") >= 4
    assert printed.count("  total       ") >= 4
    assert "size: last minute" in printed
    assert "p99 on / off = " in printed
    assert "HOT updates of runs" in printed
    assert figures["size_ratio"] is not None
    assert figures["claim_p99_ratio"] is not None
    assert len(figures["targets"]) == 2
    # Pruning removed ended runs, so the runs kept are far fewer than the runs started.
    assert figures["pruned"].get("runs", 0) > 0
    assert sum(minutes[-1]["runs_by_state"].values()) < figures["runs_started"]
