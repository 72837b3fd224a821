"""The README's example of plugging in a model runs for real through the fleet."""

from __future__ import annotations

from intermission.agent.plugins import load_executor
from intermission.fleet.runtime import Fleet
from intermission.schemas.commands import ResumeCommand, ToolAnswer
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion
from intermission.store import Stores
from tests.support.control import LocalControl
from tests.support.fleet import fast_settings, start_command


async def test_a_plugged_in_model_runs_pauses_and_resumes(stores: Stores, scope: Scope, database_url: str) -> None:
    settings = fast_settings(database_url, executor="tests.examples.keyword_model:executor")
    fleet = Fleet(stores, settings, load_executor(settings.executor))
    control = LocalControl(fleet)
    cmd = start_command(scope, [], input="capital of France")
    await control.start(cmd)
    await fleet.drain()
    s = await stores.at(scope).suspensions.get_suspension(cmd.run_id)
    assert s.pending[0].arguments == '{"query": "capital of France"}'
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    await control.resume(
        ResumeCommand(
            scope=scope,
            version=ClaimVersion(run_id=run.id, suspension_id=s.id, run_revision=run.revision),
            results=[ToolAnswer(call_id=s.pending[0].id, content="Paris")],
        )
    )
    await fleet.drain()
    run = await stores.at(scope).runs.get_run(cmd.run_id)
    assert (run.state, run.output) == (RunState.COMPLETED, "I found: Paris")
    await fleet.stop(grace=1)
