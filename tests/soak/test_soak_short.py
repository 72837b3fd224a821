"""The short soak (bench/soak) as part of the suite: workers and sweepers as subprocesses under random faults
(kills, crash points, RabbitMQ and PostgreSQL outages, bad and forged commands) against the real servers,
then every invariant of docs/invariants.md checked on everything that happened. Its hosts, approvers and
mallory are RabbitMQ users confined to their scopes by the broker; the workers, the sweepers and the bus
have identities of their own.

It asserts counts, never wall-clock figures: enough runs and faults to mean something, and no violation.
The seed is random (``INTERMISSION_SOAK_SEED`` fixes it) and printed, so a failure can be replayed with
``python -m bench.soak --profile short --seed N``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak.servers import restore_after_crash

ROOT = Path(__file__).resolve().parents[2]
# The short profile takes about two and a half minutes on two cores; the harness bounds itself well
# inside this (load, then a drain of at most a minute).
WITHIN_SECONDS = 300
MIN_RUNS = 300
MIN_FAULTS = 20


@pytest.mark.timeout(WITHIN_SECONDS + 60)
def test_the_short_soak_breaks_no_invariant(tmp_path: Path) -> None:
    seed = int(os.environ.get("INTERMISSION_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
    report_path = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "bench.soak", "--profile", "short", "--seed", str(seed), "--json", str(report_path)]
    proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=WITHIN_SECONDS)
    except subprocess.TimeoutExpired:
        # SIGINT lets the harness undo any outage in progress and remove its database and vhost.
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"the soak (seed {seed}) did not finish within {WITHIN_SECONDS} s:\n{output[-4000:]}")
    finally:
        # A harness that died mid-outage leaves a marker; never leave a server down for everyone else.
        restore_after_crash()
    tail = output[-6000:]
    assert report_path.exists(), f"no report (seed {seed}, exit {proc.returncode}):\n{tail}"
    report = json.loads(report_path.read_text())
    assert report["violations"] == [], f"seed {seed}:\n{tail}"
    assert proc.returncode == 0, f"seed {seed}:\n{tail}"
    assert report["runs_started"] >= MIN_RUNS, tail
    assert report["faults_total"] >= MIN_FAULTS, tail
    # Every invariant was actually exercised, and every kind of fault came up.
    assert all(count > 0 for count in report["invariants_checked"].values()), report["invariants_checked"]
    kinds = (
        "worker_sigkill",
        "worker_sigterm",
        "worker_crash_point",
        "rabbitmq_restart",
        "pg_terminate_backends",
        "hostile_message",
        # Headers that used to take a worker's whole connection down: nested 500 deep, nearly a frame.
        "nested_header",
        "near_frame_header",
        # Mallory, confined to its own scope, keying a command for another tenant's (the broker refuses it)
        # and keying one for itself with that tenant's body (the worker refuses it, telling mallory only).
        "cross_tenant_key",
        "cross_tenant_body",
        # Mallory's command with refusal headers forged to name another tenant's key: its dead letter is
        # still shown under mallory's own.
        "forged_dead_letter",
        # A tenant's burst of starts over its quota, with another tenant's probe run right behind it.
        "tenant_flood",
    )
    for kind in kinds:
        assert report["faults_by_kind"].get(kind, 0) > 0, (kind, report["faults_by_kind"])
    assert report["commands_refused_at_publish"] > 0, tail
    assert report["floods"]["starts_refused"] > 0, report["floods"]
    # The 30 s outage needs a local cluster to stop (the harness notes it when there is none).
    no_cluster = any("no local PostgreSQL cluster" in note for note in report["notes"])
    assert no_cluster or report["faults_by_kind"].get("pg_outage_long", 0) > 0, report["faults_by_kind"]
    assert report["pauses"] > 0, tail
    assert report["resumes"] > 0, tail
    assert report["drained"], tail
