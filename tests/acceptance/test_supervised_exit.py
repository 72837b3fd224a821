"""A worker whose background task keeps failing stops with a non-zero status and says why, so that the
process supervisor (systemd, Kubernetes, compose) restarts it, rather than consuming commands whose events
nobody publishes.

The fault is a broken deployment: the outbox table is gone (say, a migration went wrong), so every pass of
the relay fails with an error no retry can cure.
"""

from __future__ import annotations

import asyncio
import sys

from intermission.fleet.settings import Settings
from tests.acceptance.test_messaging_faults import WAIT
from tests.support.inspect import Inspector
from tests.support.worker_process import ROOT, worker_env


async def test_a_worker_whose_relay_keeps_failing_exits_non_zero_with_the_reason(
    settings: Settings, db: Inspector
) -> None:
    await db.con.execute("ALTER TABLE outbox RENAME TO outbox_gone")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "intermission.ops.cli",
        "worker",
        cwd=ROOT,
        env=worker_env(settings, INTERMISSION_RELAY_POLL_SECONDS="0.1"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(WAIT):
        _, err = await proc.communicate()
    said = err.decode()
    assert proc.returncode == 1, said[-3000:]
    assert "worker failed (task_failed): outbox-relay failed 5 times within 60 s" in said, said[-3000:]
    assert said.count('"action": "task_restarting"') == 4, said[-3000:]
