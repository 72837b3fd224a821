"""A worker process for crash tests: applies a plan of commands in-process, then drains.

Run as ``python -m tests.acceptance.crash_worker DSN PLAN_JSON [serve]`` with ``INTERMISSION_CRASH_AT``
naming a crash point (``tests/support/crash.py``); the process SIGKILLs itself there. With ``serve`` it keeps serving
(reclaim sweep on) until SIGTERM, then stops gracefully. The plan is a list of
``{"kind": "start"|"resume"|"decide"|"cancel"|"expire", "command": {...}, "principal"?: str}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from intermission.agent.loop import default_executor
from intermission.fleet.runtime import Fleet
from intermission.fleet.settings import Settings
from intermission.fleet.signals import stop_on_signals
from intermission.schemas.commands import CancelCommand, DecideCommand, ExpireCommand, ResumeCommand, StartCommand
from intermission.store import Stores
from tests.support.control import LocalControl
from tests.support.crash import install_from_environment


async def main(dsn: str, plan: list[dict[str, Any]], serve: bool) -> None:
    settings = Settings(
        database_url=dsn, lease_seconds=1.5, lease_renew_seconds=0.4, reclaim_interval_seconds=0.2, pause_ttl_seconds=0
    )
    stores = await Stores.connect(dsn)
    fleet = Fleet(stores, settings, default_executor())
    control = LocalControl(fleet)
    for step in plan:
        kind, body = step["kind"], step["command"]
        if kind == "start":
            await control.start(StartCommand.model_validate(body))
        elif kind == "resume":
            await control.resume(ResumeCommand.model_validate(body))
        elif kind == "decide":
            await control.decide(DecideCommand.model_validate(body), principal=step.get("principal"))
        elif kind == "cancel":
            await control.cancel(CancelCommand.model_validate(body))
        elif kind == "expire":
            await control.expire(ExpireCommand.model_validate(body))
        else:
            raise SystemExit(f"unknown plan step {kind!r}")
    if serve:
        stop = asyncio.Event()
        with stop_on_signals(stop):
            print("serving", flush=True)
            await fleet.start()
            await stop.wait()
    else:
        async with asyncio.timeout(60):
            await fleet.drain()
    await fleet.stop()
    await stores.close()


if __name__ == "__main__":
    install_from_environment()
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), serve=sys.argv[3:] == ["serve"]))
