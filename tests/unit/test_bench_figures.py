"""The pure parts of ``bench.resume``: figures aggregated over repetitions, the ratios and issue 17's targets,
a peer's JSON line (and a peer that failed), the peers' venv check and the options. No server, no clock:
every figure here is made up."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import peer_runs, resume, summary
from bench.summary import BARE, DBOS, FLOOR, LANGGRAPH, ONE, TWO, UNLOADED, Figures


def fig(per_second: float | None, *, app: float = 1.0, pg: float = 1.0, mq: float | None = 0.5, **kw: Any) -> Figures:
    return Figures(
        per_second=per_second,
        p50_ms=kw.get("p50", 10.0),
        p99_ms=kw.get("p99", 20.0),
        app_ms=app,
        postgres_ms=pg,
        rabbitmq_ms=mq,
        peak_mib=kw.get("peak"),
    )


def rep(
    bare: float, one: float, two: float, lg: float | None, dbos: float | None, **unloaded: float
) -> dict[str, Figures | None]:
    return {
        BARE: fig(bare),
        ONE: fig(one, peak=60.0),
        TWO: fig(two, peak=70.0),
        LANGGRAPH: None if lg is None else fig(lg, mq=None),
        DBOS: None if dbos is None else fig(dbos, mq=None),
        UNLOADED: Figures(
            None, unloaded.get("p50", 5.0), unloaded.get("p99", 12.0), None, None, None, peak_mib=unloaded.get("peak")
        ),
    }


SYSTEMS = [BARE, ONE, TWO, LANGGRAPH, DBOS, UNLOADED]


# --- aggregation ----------------------------------------------------------------------------------------


def test_spread_is_the_median_with_min_and_max_of_the_values_present() -> None:
    assert summary.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summary.spread([4.0, 1.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 2}
    assert summary.spread([None, 5.0, None]) == {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1}
    assert summary.spread([None]) == {"median": None, "min": None, "max": None, "n": 0}
    assert summary.spread([]) == {"median": None, "min": None, "max": None, "n": 0}


def test_summarise_takes_each_systems_median_over_the_repetitions_that_measured_it() -> None:
    reps = [rep(700, 300, 280, 320, 90), rep(650, 350, 340, None, 80), rep(720, 310, 330, 300, 85)]
    s = summary.summarise(reps, SYSTEMS)
    assert s[ONE]["per_second"] == {"median": 310.0, "min": 300.0, "max": 350.0, "n": 3}
    assert s[BARE]["per_second"]["median"] == 700.0
    # LangGraph failed in the second repetition: it is left out, and said so.
    assert s[LANGGRAPH]["measured"] == 2
    assert s[LANGGRAPH]["repetitions"] == 3
    assert s[LANGGRAPH]["per_second"] == {"median": 310.0, "min": 300.0, "max": 320.0, "n": 2}
    # CPU: total = app + PostgreSQL + RabbitMQ; a peer has no RabbitMQ.
    assert s[ONE]["total_ms"]["median"] == pytest.approx(2.5)
    assert s[LANGGRAPH]["total_ms"]["median"] == pytest.approx(2.0)
    assert s[LANGGRAPH]["rabbitmq_ms"]["n"] == 0
    assert s[TWO]["peak_mib"] == 70.0
    assert s[UNLOADED]["per_second"]["n"] == 0


def test_a_system_no_repetition_measured_has_no_figures_but_is_listed() -> None:
    s = summary.summarise([rep(700, 300, 300, None, None)], SYSTEMS)
    assert s[DBOS]["measured"] == 0
    assert s[DBOS]["per_second"]["median"] is None


# --- ratios ---------------------------------------------------------------------------------------------


def test_ratios_are_taken_within_each_repetition_then_summarised() -> None:
    # The machine was slower in the second repetition, for everybody: the paired ratios stay at 1.5 and 2,
    # where the ratio of the medians would not.
    reps = [rep(1000, 600, 600, 400, 100), rep(500, 300, 330, 200, 50), rep(900, 450, 400, 300, 75)]
    r = summary.ratios(reps)
    assert r["intermission_1w_to_langgraph"]["median"] == pytest.approx(1.5)
    assert r["intermission_1w_to_langgraph"]["min"] == pytest.approx(1.5)
    assert r["intermission_1w_to_dbos"]["median"] == pytest.approx(6.0)
    assert r["intermission_1w_to_bare"]["values"] == pytest.approx([0.6, 0.6, 0.5])
    assert r["intermission_1w_to_bare"]["median"] == pytest.approx(0.6)
    assert r["intermission_2w_to_1w"]["values"] == pytest.approx([1.0, 1.1, 400 / 450])
    assert r["intermission_2w_to_1w"]["median"] == pytest.approx(1.0)


def test_a_ratio_with_a_failed_peer_is_left_out_of_that_repetition() -> None:
    r = summary.ratios([rep(1000, 600, 600, None, 100), rep(1000, 600, 600, 300, 100)])
    assert r["intermission_1w_to_langgraph"]["values"] == [None, pytest.approx(2.0)]
    assert r["intermission_1w_to_langgraph"]["n"] == 1
    assert summary.ratio(fig(1.0), fig(0.0)) is None
    assert summary.ratio(None, fig(1.0)) is None


# --- targets --------------------------------------------------------------------------------------------


def verdicts(found: list[dict[str, Any]]) -> list[bool | None]:
    return [t["met"] for t in found]


def test_every_target_met() -> None:
    reps = [rep(1000, 700, 720, 400, 100, p50=6.0, p99=15.0, peak=80.0)] * 3
    s = summary.summarise(reps, SYSTEMS)
    found = summary.targets(s, summary.ratios(reps))
    assert len(found) == 8
    assert verdicts(found) == [True] * 8
    for t in found:
        assert set(t) >= {"target", "value", "met", "measured"}


def test_every_target_not_met() -> None:
    base = rep(1000, 400, 300, 300, 100, p50=9.0, p99=25.0)
    heavy = {**base, ONE: fig(400, app=2.0, pg=1.5, mq=0.6, peak=250.0)}
    found = summary.targets(summary.summarise([heavy], SYSTEMS), summary.ratios([heavy]))
    assert verdicts(found) == [False] * 8
    by_name = {t["target"]: t for t in found}
    cpu = next(t for name, t in by_name.items() if "3.0 ms" in name)
    assert cpu["measured"] == pytest.approx(4.1)
    assert cpu["value"] == "4.10 ms"


def test_targets_at_their_limits_are_met() -> None:
    # exactly 1.5x, 6x, 0.6x, 3.0 ms, 8 ms, 20 ms, 1.0; memory must be under 200.
    edge = rep(1000, 600, 600, 400, 100, p50=8.0, p99=20.0, peak=199.9)
    edge[ONE] = fig(600, app=1.5, pg=1.0, mq=0.5, peak=60.0)
    found = summary.targets(summary.summarise([edge], SYSTEMS), summary.ratios([edge]))
    assert verdicts(found) == [True] * 8


def test_a_peer_not_run_makes_its_targets_not_measured() -> None:
    reps = [rep(1000, 700, 720, None, None)]
    found = summary.targets(summary.summarise(reps, [BARE, ONE, TWO, UNLOADED]), summary.ratios(reps))
    assert verdicts(found)[:2] == [None, None]
    assert found[0]["value"] == "not measured"
    assert None not in verdicts(found)[2:]


# --- a peer's output ------------------------------------------------------------------------------------


def peer_line(**overrides: Any) -> str:
    result = {
        "peer": "langgraph",
        "n": 1000,
        "resumes_per_s": 328.4,
        "latency": {"p50_ms": 1500.0, "p99_ms": 2900.0, "max_ms": 3000.0, "mean_ms": 1500.0},
        "cpu": {
            "py_ms_per_resume": 3.0,
            "pg_ours_ms_per_resume": 0.7,
            "pg_aux_ms_per_resume": 0.11,
            "other_ms_per_resume": 0.2,
        },
    }
    result.update(overrides)
    return json.dumps(result)


def test_a_peers_last_stdout_line_is_its_result() -> None:
    stdout = "some library's chatter\n" + peer_line() + "\n\n"
    outcome = peer_runs.parse_peer_output("langgraph", 0, stdout, "07:40:00 langgraph: 1000 threads interrupted\n")
    assert outcome["ok"] is True
    assert outcome["result"]["resumes_per_s"] == 328.4
    figures = summary.of_peer(outcome)
    assert figures is not None
    assert figures.per_second == 328.4
    assert figures.p50_ms == 1500.0
    assert figures.app_ms == 3.0
    assert figures.postgres_ms == pytest.approx(0.81)
    assert figures.rabbitmq_ms is None
    assert figures.total_ms == pytest.approx(3.81)


def test_a_peer_that_exited_with_an_error_is_failed_with_its_stderr_tail() -> None:
    stderr = "\n".join(f"line {i}" for i in range(100)) + "\nRuntimeError: only 3/1000 workflows completed\n"
    outcome = peer_runs.parse_peer_output("dbos", 1, "", stderr)
    assert outcome["ok"] is False
    assert outcome["peer"] == "dbos"
    assert outcome["error"] == "exited 1"
    tail = outcome["stderr_tail"].splitlines()
    assert len(tail) == peer_runs.STDERR_TAIL_LINES
    assert tail[-1] == "RuntimeError: only 3/1000 workflows completed"
    assert tail[0] == "line 81"
    assert summary.of_peer(outcome) is None


@pytest.mark.parametrize(
    ("returncode", "stdout", "error"),
    [
        (None, "", "did not finish"),
        (0, "", "printed no result on stdout"),
        (0, "\n  \n", "printed no result on stdout"),
        (0, peer_line() + "\nTraceback (most recent call last):", "its last stdout line is not JSON"),
        (0, "[1, 2]", "its result is not a JSON object"),
        (0, peer_line(peer="dbos"), "its result is another peer's ('dbos')"),
        (0, peer_line(resumes_per_s=None), "its result has no resumes/s (None)"),
        (0, peer_line(resumes_per_s=0), "its result has no resumes/s (0)"),
    ],
)
def test_a_peer_without_a_usable_result_is_failed(returncode: int | None, stdout: str, error: str) -> None:
    outcome = peer_runs.parse_peer_output("langgraph", returncode, stdout, "the stderr\n")
    assert outcome["ok"] is False
    assert outcome["error"].startswith(error)
    assert outcome["stderr_tail"] == "the stderr"


def test_failed_peers_are_listed_with_their_stderr_and_the_table_says_so() -> None:
    raw = {
        "repetition": 2,
        "peers": {
            "langgraph": {"peer": "langgraph", "ok": True, "result": json.loads(peer_line())},
            "dbos": peer_runs.failed("dbos", "exited 1", "psycopg.OperationalError: connection refused"),
        },
    }
    failures = resume.failures_of([raw])
    assert len(failures) == 1
    assert failures[0].startswith("dbos in repetition 2: exited 1")
    assert "psycopg.OperationalError: connection refused" in failures[0]

    reps = [rep(1000, 600, 600, 400, None)]
    s = summary.summarise(reps, SYSTEMS)
    labels = {BARE: "bare", ONE: "one", TWO: "two", LANGGRAPH: "langgraph", DBOS: "dbos", UNLOADED: "unloaded"}
    r = summary.ratios(reps)
    printed = summary.table(s, labels, r, summary.targets(s, r), failures)
    dbos_row = next(line for line in printed.splitlines() if line.startswith("dbos "))
    assert "failed" in dbos_row
    assert "failed: dbos in repetition 2: exited 1" in printed
    assert "[not measured] Intermission, 1 worker >= 6x DBOS" in printed
    assert "[met] Intermission, 1 worker >= 1.5x LangGraph" in printed
    langgraph_row = next(line for line in printed.splitlines() if line.startswith("langgraph "))
    assert "n/a" in langgraph_row


# --- the peers' venv and the options --------------------------------------------------------------------


def test_a_venv_with_every_pin_is_reused_and_one_without_is_mended() -> None:
    good = {**peer_runs.PINS, **dict.fromkeys(peer_runs.PRESENT, "1.0")}
    assert peer_runs.wrong_versions(good) == []
    older = {**good, "langgraph": "1.0.0", "psutil": None}
    assert peer_runs.wrong_versions(older) == ["langgraph==1.2.24 (has 1.0.0)", "psutil (none)"]
    assert len(peer_runs.wrong_versions({})) == len(peer_runs.PINS) + len(peer_runs.PRESENT)


def test_a_peer_runs_its_script_in_its_own_database() -> None:
    argv = peer_runs.PEERS["dbos"].argv(peer_runs.venv_python(peer_runs.DEFAULT_VENV), 1000, "intermission_bench_x")
    assert argv[0].endswith(".peers-venv/bin/python")
    assert argv[1].endswith("bench/peers/bench_dbos.py")
    assert argv[2:] == ["one", "--n", "1000", "--sender", "proc", "--db", "intermission_bench_x"]
    assert peer_runs.PEERS["langgraph"].arguments == ("--lock", "semaphore")
    env = peer_runs.peer_environment({"PEERS_RESULTS": "results-folder"})
    assert "PYTHONPATH" not in env
    assert env["PEERS_RESULTS"] == "results-folder"


def test_the_options_run_the_peers_by_default_but_not_in_a_quick_run() -> None:
    default = resume.parse([])
    assert (default.runs, default.reps, default.peers) == (1000, 3, ("langgraph", "dbos"))
    assert default.sweeper is True
    quick = resume.parse(["--quick"])
    assert (quick.runs, quick.reps, quick.peers) == (40, 1, ())
    assert resume.parse(["--quick", "--peers", "dbos"]).peers == ("dbos",)
    # Whatever order they are given in, a repetition runs LangGraph before DBOS.
    assert resume.parse(["--peers", "dbos,langgraph"]).peers == ("langgraph", "dbos")
    assert resume.parse(["--no-peers", "--reps", "2"]).peers == ()
    assert resume.parse(["--reps", "5", "--runs", "500"]).reps == 5


@pytest.mark.parametrize("argv", [["--peers", "temporal"], ["--peers", "dbos", "--no-peers"], ["--reps", "0"]])
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        resume.parse(argv)


def test_the_systems_follow_the_order_of_a_repetition() -> None:
    opts = resume.parse(["--peers", "dbos,langgraph"])
    assert resume.systems_of(opts) == [BARE, ONE, TWO, LANGGRAPH, DBOS, UNLOADED, FLOOR]
    labels = resume.labels_of(opts, {"langgraph": "1.2.24", "dbos": "3.4.0"})
    assert labels[LANGGRAPH] == "LangGraph 1.2.24 + PostgresSaver (no claim)"
    assert labels[DBOS] == "DBOS 3.4.0 send/recv"
    assert labels[ONE] == "Intermission, 1 worker + sweeper"


def test_a_measurement_with_much_unaccounted_cpu_is_called_not_quiet() -> None:
    quiet = Figures(100.0, 1.0, 2.0, app_ms=2.0, postgres_ms=1.0, rabbitmq_ms=1.0, other_ms=0.3)
    loud = Figures(100.0, 1.0, 2.0, app_ms=2.0, postgres_ms=1.0, rabbitmq_ms=1.0, other_ms=0.5)
    s = summary.summarise([{ONE: quiet, TWO: loud}], [ONE, TWO])
    assert summary.noisy(s) == [TWO]
    printed = summary.table(s, {ONE: "one", TWO: "two"}, summary.ratios([]), [])
    assert "warning: the machine was not quiet (other > 10 % of total) while measuring two:" in printed
