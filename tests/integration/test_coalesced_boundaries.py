"""Step saves and run ends that happen at the same moment share one statement (group commit,
engine/committer.py), and each keeps its own outcome: many runs ending together each end once with their
own event; a lost lease or a value the database refuses among them fails only that call."""

from __future__ import annotations

import pytest

from intermission.engine.core import Engine
from intermission.engine.runs import END, SAVE, EndRun, SaveProgress
from intermission.schemas.errors import InvalidArgument, RunLeaseLost
from intermission.schemas.events import RunEventKind
from intermission.schemas.run import Run, RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import Progress
from intermission.store import Stores
from tests.support.factories import continuation, lease, running_run
from tests.support.fleet import outbox_keys

RUNS = 24


def end(scope: Scope, run: Run, owner: str, output: str) -> EndRun:
    return EndRun(scope, run.id, owner, run.revision, RunEventKind.COMPLETED, output=output)


async def test_runs_ending_together_share_a_statement_and_each_ends_once(
    stores: Stores, engine: Engine, scope: Scope
) -> None:
    held = [await running_run(stores, scope) for _ in range(RUNS)]
    runs = stores.at(scope).runs
    before = len(engine.scheduler.sizes(END))

    def ending(i: int) -> EndRun:
        run, holder = held[i]
        owner = "somebody-else" if i == 5 else holder.owner  # this one does not hold its run
        return end(scope, run, owner, f"output {i}")

    outcomes = await engine.apply_all([ending(i) for i in range(RUNS)])
    assert engine.scheduler.sizes(END)[before:] == [RUNS]  # they went together
    assert isinstance(outcomes[5], RunLeaseLost)
    for i, (run, _) in enumerate(held):
        stored = await runs.get_run(run.id)
        keys = await outbox_keys(stores, scope, run.id)
        if i == 5:
            assert stored.state is RunState.RUNNING
            assert f"run.completed.{scope.app}.{scope.tenant}" not in keys
            continue
        assert not isinstance(outcomes[i], BaseException)
        assert stored.state is RunState.COMPLETED
        assert stored.output == f"output {i}"
        assert keys.count(f"run.completed.{scope.app}.{scope.tenant}") == 1


async def test_a_value_the_database_refuses_fails_only_its_own_call(
    stores: Stores, engine: Engine, scope: Scope
) -> None:
    held = [await running_run(stores, scope) for _ in range(8)]
    runs = stores.at(scope).runs
    before = len(engine.scheduler.sizes(END))

    def ending(i: int) -> EndRun:
        run, holder = held[i]
        # PostgreSQL stores no U+0000 in text: the statement carrying it fails, whichever runs it.
        output = "bad \x00 output" if i == 3 else "fine"
        return end(scope, run, holder.owner, output)

    outcomes = await engine.apply_all([ending(i) for i in range(len(held))])
    # The statement of all eight failed; then each went alone, and only the one carrying the NUL failed.
    assert engine.scheduler.sizes(END)[before:] == [len(held)]
    assert isinstance(outcomes[3], InvalidArgument)
    for i, (run, _) in enumerate(held):
        stored = await runs.get_run(run.id)
        if i == 3:
            assert stored.state is RunState.RUNNING  # nothing of its end was written
        else:
            assert stored.state is RunState.COMPLETED


async def test_step_saves_at_the_same_moment_share_a_statement_and_each_is_its_own(
    stores: Stores, engine: Engine, scope: Scope
) -> None:
    held = [await running_run(stores, scope) for _ in range(RUNS)]
    at = stores.at(scope)
    before = len(engine.scheduler.sizes(SAVE))

    def save(i: int) -> SaveProgress:
        run, holder = held[i]
        owner = holder.owner if i != 7 else lease().owner  # a stranger's save is refused
        return SaveProgress(scope, Progress(run_id=run.id, owner=owner, continuation=continuation(step=i + 1)))

    outcomes = await engine.apply_all([save(i) for i in range(RUNS)])
    assert engine.scheduler.sizes(SAVE)[before:] == [RUNS]
    assert isinstance(outcomes[7], RunLeaseLost)
    for i, (run, _) in enumerate(held):
        if i == 7:
            with pytest.raises(Exception):  # noqa: B017, PT011 - ProgressNotFound: nothing was saved
                await at.progress.get_progress(run.id)
            continue
        saved = await at.progress.get_progress(run.id)
        assert saved.continuation.step_index == i + 1
        assert (await at.runs.get_run(run.id)).step_count == i + 1
