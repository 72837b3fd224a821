"""The cluster harness's short profile (bench/cluster) as part of the suite: the soak's workload on three
RabbitMQ nodes and a PostgreSQL primary with a synchronous standby, booted beside the machine's own
servers, with the queue-leading node SIGKILLed and brought back, the primary's process group SIGKILLed
and the standby promoted (and a new standby rebuilt), workers killed and stalled; then the soak's
invariants and the cluster's own (no call charged twice in a journal kept outside the database, every
fault proven real, every quorum queue healthy).

It asserts counts and proofs, never wall-clock figures. The seed is random (``INTERMISSION_SOAK_SEED``
fixes it) and printed, so a failure can be replayed with ``python -m bench.cluster --profile short --seed N``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.cluster.servers import MARKER, RABBIT_BIN, binaries

ROOT = Path(__file__).resolve().parents[2]
# About three minutes on two cores (boot, 120 s of load, drain, checks, removal); the harness bounds its
# own drain well inside this.
WITHIN_SECONDS = 480
PORTS = (5701, 5702, 5703, 5801, 5802)

pytestmark = pytest.mark.skipif(
    not (RABBIT_BIN / "rabbitmq-server").exists() or binaries() is None,
    reason="the cluster harness needs RabbitMQ's and PostgreSQL's server binaries on this machine",
)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_harness(argv: list[str], within: float) -> tuple[int, str]:
    proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", "bench.cluster", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        # SIGINT lets the harness remove its servers.
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"bench.cluster {argv} did not finish within {within} s:\n{output[-4000:]}")
    return proc.returncode, output


@pytest.fixture
def no_cluster_left() -> Any:
    yield
    # Whatever happened, nothing of the harness's may outlive the test.
    subprocess.run([sys.executable, "-m", "bench.cluster", "--cleanup"], cwd=ROOT, check=False, timeout=180)


@pytest.mark.timeout(WITHIN_SECONDS + 120)
@pytest.mark.usefixtures("no_cluster_left")
def test_the_short_cluster_profile_loses_nothing_when_nodes_die(tmp_path: Path) -> None:
    seed = int(os.environ.get("INTERMISSION_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
    report_path = tmp_path / "cluster.json"
    code, output = run_harness(["--profile", "short", "--seed", str(seed), "--json", str(report_path)], WITHIN_SECONDS)
    tail = output[-8000:]
    assert report_path.exists(), f"no report (seed {seed}, exit {code}):\n{tail}"
    report = json.loads(report_path.read_text())
    assert report["violations"] == [], f"seed {seed}:\n{tail}"
    assert code == 0, f"seed {seed}:\n{tail}"
    assert report["drained"], tail
    # Every invariant was exercised, the cluster's own among them.
    checked = report["invariants_checked"]
    for name in ("no_double_charge_across_timelines", "faults_real", "cluster_healthy"):
        assert name in checked, checked
    assert all(count > 0 for count in checked.values()), checked
    for kind in ("rabbit_leader_kill", "pg_failover", "worker_stall", "worker_sigkill", "worker_crash_point"):
        assert report["faults_by_kind"].get(kind, 0) > 0, (kind, report["faults_by_kind"])

    cluster = report["cluster"]
    proofs = cluster["fault_proofs"]
    assert all(p["problems"] == [] for p in proofs), proofs
    kills = [p for p in proofs if p["kind"] == "rabbit_leader_kill"]
    failovers = [p for p in proofs if p["kind"] == "pg_failover"]
    assert kills, proofs
    assert failovers, proofs
    # The killed node led command queues, and workers were on it.
    assert all(p["command_queues_led"] > 0 for p in kills), kills
    assert all(p["worker_connections_on_node"] > 0 for p in kills), kills
    # Replication was synchronous when the primary died, and every process's pool reached the new one.
    assert all(p["synchronous_before"] for p in failovers), failovers
    assert all(p["processes_on_new_primary"] for p in failovers), failovers
    assert cluster["failovers"] == len(failovers)
    # The database's charges are all in the journal kept outside it (which may hold more: a worker killed
    # between its journal line and its insert).
    assert cluster["journal_entries"] >= report["charges"] > 0, (cluster["journal_entries"], report["charges"])

    # And it removed everything it started.
    assert not MARKER.exists()
    assert not any(listening(port) for port in PORTS)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("no_cluster_left")
def test_cleanup_removes_the_servers_of_a_harness_that_was_killed() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.cluster", "--boot-only", "--seconds", "600"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    try:
        # Booted once it says where the servers are (it prints the URLs after every one is up).
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("replication:"):
                break
        assert any("sync" in line for line in seen if line.startswith("replication:")), seen
        assert all(listening(port) for port in PORTS)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    # Killed: the servers it started are still there, and the marker names them.
    assert MARKER.exists()
    assert listening(5701)
    assert listening(5801)
    done = subprocess.run(
        [sys.executable, "-m", "bench.cluster", "--cleanup"], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not MARKER.exists()
    assert not any(listening(port) for port in PORTS)
