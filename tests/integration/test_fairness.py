"""No tenant takes the fleet (README, "Threat model"; docs/decisions.md, "Fairness between tenants"):

- a start over the fleet's ceilings (``max_steps``, ``budget.max_tool_calls``) is refused ``limit_exceeded``
  and writes nothing;
- a scope at its quota of live runs, or of starts a second, is refused ``quota_exceeded`` in the start's
  own transaction, writes nothing, and never slows another scope; starts racing at the limit from many
  connections never pass it;
- a worker continues at most ``INTERMISSION_RUNS_IN_FLIGHT`` runs at once; the commands past it wait in
  the worker unacknowledged and every run still completes;
- a tenant flooding starts at its quota holds at most its quota of runs, and another tenant's run
  completes behind the flood.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import pytest
from click.testing import CliRunner, Result

from intermission.agent.executor import RunContext
from intermission.engine.commands import Start
from intermission.engine.core import Engine
from intermission.engine.holding import ReclaimLapsed
from intermission.engine.starts import Quota, RunDefaults
from intermission.engine.transition import Applicable
from intermission.fleet.runtime import Fleet
from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker, running_worker
from intermission.ops.cli import main
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.config import Budget, RunConfig
from intermission.schemas.errors import LimitExceeded, QuotaExceeded
from intermission.schemas.run import Lease
from intermission.schemas.scope import Scope
from intermission.store import Stores
from intermission.store.inbox import AlreadyApplied, Receipt
from intermission.store.quotas import set_quota
from intermission.wire import EVENTS_EXCHANGE, Command
from tests.conftest import MakeStores, race
from tests.integration.test_messaging import LOOKUP, one_run_served, start
from tests.integration.test_operator_cli import env_of, parsed
from tests.support.amqp import Broker, CaptureFactory, Vhost
from tests.support.factories import lease as held_by
from tests.support.factories import running_run
from tests.support.fleet import fast_settings
from tests.support.inspect import Inspector
from tests.support.waiting import eventually

WAIT = 30.0
DEFAULTS = RunDefaults(pause_ttl_seconds=0, max_steps=8, max_steps_limit=100, max_tool_calls_limit=1000)


def lease() -> Lease:
    return Lease(owner=f"w-{uuid.uuid4().hex[:6]}", ttl_seconds=30)


async def rows_of(db: Inspector, run_id: str) -> tuple[int, int]:
    runs = await db.con.fetchval("SELECT count(*) FROM runs WHERE id = $1", run_id)
    inbox = await db.con.fetchval("SELECT count(*) FROM inbox WHERE run_id = $1", run_id)
    return int(runs), int(inbox)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (RunConfig(max_steps=101), "config.max_steps is 101, over this fleet's limit of 100"),
        (RunConfig(budget=Budget(max_tool_calls=1001)), "config.budget.max_tool_calls is 1001"),
    ],
)
async def test_a_start_over_the_fleet_s_ceilings_is_refused_and_writes_nothing(
    config: RunConfig,
    field: str,
    worker: Worker,
    settings: Settings,
    stores: Stores,
    host: HostClient,
    scope: Scope,
    db: Inspector,
    amqp_vhost: Vhost,
    capture: CaptureFactory,
) -> None:
    assert (settings.max_steps_limit, settings.max_tool_calls_limit) == (1000, 10_000)
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, f"command.rejected.{scope.routing_suffix()}")
    over = config.model_copy(
        update={"max_steps": config.max_steps * 10, "budget": Budget(max_tool_calls=config.budget.max_tool_calls * 10)}
    )
    cmd = start(scope, LOOKUP, config=over)
    await host.start(cmd)
    [event] = await refused.wait_count(1, within=WAIT)
    assert event.json()["code"] == "limit_exceeded"
    assert await rows_of(db, cmd.run_id) == (0, 0)
    # The same ceiling at the store, with the limits of DEFAULTS.
    with pytest.raises(LimitExceeded, match=re.escape(field)):
        await StoresStart(stores).start(start(scope, LOOKUP, config=config), DEFAULTS)


TOKENS = RunDefaults(pause_ttl_seconds=0, max_steps=8, max_total_tokens_limit=50_000, max_tokens_limit=4_000)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (RunConfig(budget=Budget(max_total_tokens=50_001)), "config.budget.max_total_tokens is 50001"),
        (RunConfig(max_tokens=4_001), "config.max_tokens is 4001, over this fleet's limit of 4000"),
    ],
)
async def test_a_start_over_a_token_ceiling_is_refused_and_writes_nothing(
    config: RunConfig, field: str, stores: Stores, scope: Scope, db: Inspector
) -> None:
    cmd = start(scope, LOOKUP, config=config)
    with pytest.raises(LimitExceeded, match=re.escape(field)):
        await StoresStart(stores).start(cmd, TOKENS)
    assert await rows_of(db, cmd.run_id) == (0, 0)


async def test_a_start_leaving_the_token_budgets_unset_is_given_the_ceilings_and_one_within_keeps_its_own(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    unset = start(scope, LOOKUP)
    within = start(scope, LOOKUP, config=RunConfig(max_tokens=100, budget=Budget(max_total_tokens=1_000)))
    for cmd in (unset, within):
        assert await StoresStart(stores).start(cmd, TOKENS) is not None

    async def stored(run_id: str) -> tuple[int, int]:
        row = await db.con.fetchrow(
            "SELECT (config->'budget'->>'max_total_tokens')::int AS total, (config->>'max_tokens')::int AS turn "
            "FROM runs WHERE id = $1",
            run_id,
        )
        assert row is not None
        return row["total"], row["turn"]

    # "No limit" in a start is the fleet's ceiling once it has one: the stored config, which every resume
    # reads, says so.
    assert await stored(unset.run_id) == (50_000, 4_000)
    assert await stored(within.run_id) == (1_000, 100)


class StoresStart:
    """The start operation, as a worker's handler applies it: through an engine over ``stores``, under a
    lease and the fleet's defaults."""

    def __init__(self, stores: Stores) -> None:
        self.stores = stores

    async def start(self, cmd: StartCommand, defaults: RunDefaults) -> Any:
        engine = Engine.over(self.stores).under(lease=lease(), defaults=defaults)
        return await engine.apply(Start(cmd, Receipt.of(f"m-{cmd.run_id}", "run.start", cmd)))


async def test_a_scope_at_its_live_runs_quota_is_refused_and_another_scope_is_not(
    stores: Stores, scope: Scope, other_scope: Scope, db: Inspector
) -> None:
    await set_quota(stores.db, scope, live_runs=2, starts_per_second=None)
    for _ in range(2):
        assert await StoresStart(stores).start(start(scope, LOOKUP), DEFAULTS) is not None
    third = start(scope, LOOKUP)
    with pytest.raises(QuotaExceeded, match="live runs"):
        await StoresStart(stores).start(third, DEFAULTS)
    assert await rows_of(db, third.run_id) == (0, 0)
    # Another scope, under the fleet's default (none), starts as it likes.
    for _ in range(3):
        assert await StoresStart(stores).start(start(other_scope, LOOKUP), DEFAULTS) is not None
    # Once a run of the scope ends, a start fits again.
    await db.con.execute(
        "UPDATE runs SET state = 'completed', ended_at = now(), lease_owner = NULL, lease_expires_at = NULL "
        "WHERE id = (SELECT id FROM runs WHERE app = $1 AND tenant = $2 LIMIT 1)",
        scope.app,
        scope.tenant,
    )
    assert await StoresStart(stores).start(start(scope, LOOKUP), DEFAULTS) is not None


async def test_a_scope_past_its_starts_a_second_is_refused_and_a_repeat_is_still_a_duplicate(
    stores: Stores, scope: Scope, db: Inspector
) -> None:
    # A bucket of one start, refilled once in a thousand seconds: the second start is over it.
    quota = RunDefaults(pause_ttl_seconds=0, max_steps=8, quota=Quota(starts_per_second=0.001))
    first = start(scope, LOOKUP)
    assert await StoresStart(stores).start(first, quota) is not None
    second = start(scope, LOOKUP)
    with pytest.raises(QuotaExceeded, match="this second"):
        await StoresStart(stores).start(second, quota)
    assert await rows_of(db, second.run_id) == (0, 0)
    # The first start sent again is answered as the duplicate it is, not refused by the quota.
    with pytest.raises(AlreadyApplied):
        await StoresStart(stores).start(first, quota)


async def test_starts_racing_at_the_quota_from_many_connections_never_pass_it(
    stores: Stores, make_stores: MakeStores, scope: Scope, db: Inspector
) -> None:
    await set_quota(stores.db, scope, live_runs=5, starts_per_second=None)
    # Each contender on a connection of its own, with an engine of its own: one engine would group commit
    # the starts into one statement, a sequence rather than a race.
    contenders = await make_stores(20)
    results = await race(20, lambda i: StoresStart(contenders[i]).start(start(scope, LOOKUP), DEFAULTS))
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(refused) == 15, results
    assert all(not isinstance(r, BaseException) for r in results if not isinstance(r, QuotaExceeded))
    live = await db.con.fetchval(
        "SELECT count(*) FROM runs WHERE app = $1 AND tenant = $2 AND ended_at IS NULL", scope.app, scope.tenant
    )
    assert live == 5


class HeldRuns:
    """An executor whose runs wait to be let go, counting how many run at once."""

    def __init__(self) -> None:
        self.active = 0
        self.most = 0
        self.changed = asyncio.Event()
        self.go = asyncio.Semaphore(0)
        self.started: list[Scope] = []

    async def execute(self, ctx: RunContext) -> None:
        self.started.append(ctx.scope)
        self.active += 1
        self.most = max(self.most, self.active)
        self.changed.set()
        try:
            await self.go.acquire()
        finally:
            self.active -= 1
        await ctx.complete("done")


async def test_a_worker_continues_at_most_its_cap_of_runs_and_the_rest_wait_unacknowledged(
    settings: Settings,
    stores: Stores,
    host: HostClient,
    scope: Scope,
    db: Inspector,
    rabbit: Broker,
    amqp_vhost: Vhost,
) -> None:
    held = HeldRuns()
    capped = settings.model_copy(update={"runs_in_flight": 2})
    async with running_worker(capped, executor=held, stores=stores):
        commands = [start(scope, {"say": "hi"}) for _ in range(5)]
        for cmd in commands:
            await host.start(cmd)

        async def two_running_three_held() -> bool:
            out = await rabbit.run(
                "list_queues", "-p", amqp_vhost.name, "name", "messages_unacknowledged", "--no-table-headers"
            )
            held_back = {line.split()[0]: line.split()[1] for line in out.splitlines() if len(line.split()) == 2}
            return held.active == 2 and held_back.get(Command.START.queue) == "3"

        # Every start reached the worker: two run, three wait unacknowledged for room.
        await eventually(two_running_three_held, within=WAIT, what="two runs in flight and three starts held")
        for _ in commands:
            held.go.release()

        async def all_completed() -> bool:
            done = await db.con.fetchval(
                "SELECT count(*) FROM runs WHERE id = ANY($1::text[]) AND state = 'completed'",
                [c.run_id for c in commands],
            )
            return bool(done == len(commands))

        await eventually(all_completed, within=WAIT, what="all five runs completed")
    assert held.most == 2


async def test_past_the_cap_a_worker_serves_the_waiting_scopes_in_turn_so_a_flood_does_not_go_first(
    settings: Settings, stores: Stores, host: HostClient, scope: Scope, other_scope: Scope, db: Inspector
) -> None:
    flood, victim = scope, other_scope
    held = HeldRuns()
    capped = settings.model_copy(update={"runs_in_flight": 2})
    assert capped.prefetch >= 9  # every start below reaches the worker
    async with running_worker(capped, executor=held, stores=stores) as w:
        flooding = [start(flood, {"say": "hi"}) for _ in range(8)]
        for cmd in flooding:
            await host.start(cmd)

        async def flood_running_and_waiting() -> bool:
            return held.active == 2 and w.fleet.admission.waiting() == 6

        await eventually(flood_running_and_waiting, within=WAIT, what="two flood runs running, six starts waiting")
        cmd = start(victim, {"say": "hi"})
        await host.start(cmd)

        async def seven_waiting() -> bool:
            return w.fleet.admission.waiting() == 7

        await eventually(seven_waiting, within=WAIT, what="the other tenant's start waiting in the worker")
        # Places free one at a time: the first goes to the scope whose turn it is (the flood's, waiting
        # longest), the next to the other tenant, ahead of the flood's five other waiting starts.
        for started in (3, 4):
            held.go.release()

            async def next_started(count: int = started) -> bool:
                return len(held.started) == count

            await eventually(next_started, within=WAIT, what=f"run {started} started")
        assert held.started == [flood, flood, flood, victim]
        for _ in range(9):
            held.go.release()

        async def all_completed() -> bool:
            done = await db.con.fetchval(
                "SELECT count(*) FROM runs WHERE id = ANY($1::text[]) AND state = 'completed'",
                [c.run_id for c in [*flooding, cmd]],
            )
            return bool(done == 9)

        await eventually(all_completed, within=WAIT, what="all nine runs completed")
    # The database's order says the same: the other tenant's run was created after three of the flood's.
    before = await db.con.fetchval(
        "SELECT count(*) FROM runs WHERE app = $1 AND tenant = $2"
        " AND created_at < (SELECT created_at FROM runs WHERE id = $3)",
        flood.app,
        flood.tenant,
        cmd.run_id,
    )
    assert before == 3
    assert held.most == 2


async def test_a_takeover_holds_its_places_from_its_claim_so_no_command_takes_them_meanwhile(
    stores: Stores, scope: Scope, db: Inspector, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldRuns()
    fleet = Fleet(
        stores, fast_settings(database_url, lease_seconds=60.0, lease_renew_seconds=30.0, runs_in_flight=2), held
    )
    runs = [(await running_run(stores, scope, holder=held_by("a-worker-that-died", ttl=0.2)))[0] for _ in range(2)]
    await db.con.execute("UPDATE runs SET lease_expires_at = now() WHERE id = ANY($1::text[])", [r.id for r in runs])
    claimed, handed_over = asyncio.Event(), asyncio.Event()
    apply = fleet.engine.apply

    async def claim_then_wait(work: Applicable[Any]) -> Any:
        taken = await apply(work)
        if isinstance(work, ReclaimLapsed):
            claimed.set()
            await handed_over.wait()
        return taken

    monkeypatch.setattr(fleet.engine, "apply", claim_then_wait)
    sweep = asyncio.create_task(fleet.reclaim_once())
    await asyncio.wait_for(claimed.wait(), WAIT)
    # Both runs are this worker's in the database and not yet running here: their places are taken, so a
    # command that would start a third run waits.
    assert fleet.room() == 0
    admitted = asyncio.Event()

    async def a_command() -> None:
        async with fleet.admitting():
            admitted.set()

    command = asyncio.create_task(a_command())
    handed_over.set()
    assert await asyncio.wait_for(sweep, WAIT) == 2

    async def both_running() -> bool:
        return held.active == 2

    await eventually(both_running, within=WAIT, what="both taken-over runs running")
    assert not admitted.is_set()
    held.go.release()
    await asyncio.wait_for(command, WAIT)
    held.go.release()
    await fleet.drain()
    states = await db.con.fetch("SELECT state FROM runs WHERE id = ANY($1::text[])", [r.id for r in runs])
    assert [r["state"] for r in states] == ["completed", "completed"]
    assert held.most == 2


async def test_a_tenant_flooding_at_its_quota_holds_its_quota_and_another_tenant_s_run_completes(
    worker: Worker,
    stores: Stores,
    host: HostClient,
    scope: Scope,
    other_scope: Scope,
    db: Inspector,
    amqp_vhost: Vhost,
    capture: CaptureFactory,
) -> None:
    flood, victim = scope, other_scope
    await set_quota(stores.db, flood, live_runs=10, starts_per_second=None)
    refused = await capture(amqp_vhost.url(), EVENTS_EXCHANGE, f"command.rejected.{flood.routing_suffix()}")
    flooding = [start(flood, LOOKUP) for _ in range(300)]
    await asyncio.gather(*(host.start(cmd) for cmd in flooding))
    await one_run_served(host, victim, within=WAIT * 2)
    events = await refused.wait_count(290, within=WAIT * 2)
    assert {e.json()["code"] for e in events} == {"quota_exceeded"}
    flood_runs = await db.con.fetchval(
        "SELECT count(*) FROM runs WHERE app = $1 AND tenant = $2", flood.app, flood.tenant
    )
    assert flood_runs == 10


async def test_quotas_set_from_the_cli_are_enforced_and_listed_with_the_scope_s_live_runs(
    stores: Stores, scope: Scope, other_scope: Scope, db: Inspector, database_url: str, amqp_vhost: Vhost
) -> None:
    env = env_of(database_url, amqp_vhost.url())

    def cli(*args: str) -> Result:
        return CliRunner().invoke(main, ["quotas", *args], env=env)

    who = ["--app", scope.app, "--tenant", scope.tenant]
    set_out = parsed(
        await asyncio.to_thread(cli, "set", *who, "--live-runs", "1", "--starts-per-second", "50", "--json")
    )
    assert (set_out["quota"]["live_runs"], set_out["quota"]["starts_per_second"]) == (1, 50.0)
    assert await StoresStart(stores).start(start(scope, LOOKUP), DEFAULTS) is not None
    refused = start(scope, LOOKUP)
    with pytest.raises(QuotaExceeded, match="live runs"):
        await StoresStart(stores).start(refused, DEFAULTS)
    assert await rows_of(db, refused.run_id) == (0, 0)
    assert await StoresStart(stores).start(start(other_scope, LOOKUP), DEFAULTS) is not None

    listed = parsed(await asyncio.to_thread(cli, "list", "--json"))["quotas"]
    assert [(q["live_runs"], q["starts_per_second"], q["live"]) for q in listed] == [(1, 50.0, 1)]
    # An option left out goes back to the fleet's default (null), which here is no quota.
    reset = parsed(await asyncio.to_thread(cli, "set", *who, "--json"))["quota"]
    assert (reset["live_runs"], reset["starts_per_second"]) == (None, None)
    assert await StoresStart(stores).start(start(scope, LOOKUP), DEFAULTS) is not None
    bad = await asyncio.to_thread(cli, "set", *who, "--live-runs", "-1")
    assert bad.exit_code == 2, bad.output
