"""The operator's commands on real data made through the product (a worker in this process, a host over
RabbitMQ, the store's own write paths), run in-process as an operator types them, their ``--json`` parsed:
``runs list|show|cancel``, ``pauses extend|expire``, ``notices replay`` and ``doctor``. Each also with a run
that is not there (exit 1), a bad flag (exit 2, click's usage error) and a server that is down (exit 2, one
line naming the server, its password masked, nothing on stdout)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner, Result
from yarl import URL

from intermission.engine.events import OutboxEvent
from intermission.fleet.worker import Worker
from intermission.ops.cli import main
from intermission.publishers.clients import HostClient
from intermission.schemas.commands import StartCommand
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.script import ScriptTurn
from intermission.schemas.suspension import Notice, SuspendReason
from intermission.store import Stores
from intermission.wire import EVENTS_EXCHANGE, SCHEMA_VERSION, SCHEMA_VERSION_HEADER, TRACEPARENT_HEADER
from tests.integration.test_operator_metrics import dead_letter
from tests.support import outbox as support_outbox
from tests.support.factories import lease, paused_run, running_run
from tests.support.inspect import Inspector
from tests.support.metrics import free_port
from tests.support.waiting import eventually

if TYPE_CHECKING:
    from tests.support.amqp import CaptureFactory
    from tests.support.confined import Management

WAIT = 30.0
# Who administers the test broker (tests/support/amqp.py's URL, guest by default).
ADMIN = URL(os.environ.get("INTERMISSION_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"))
SECRET = "s3cret-pw"  # noqa: S105 - a made-up password the output must not show


def env_of(database_url: str, amqp_url: str, management_url: str = "http://127.0.0.1:15672") -> dict[str, str]:
    return {
        "INTERMISSION_DATABASE_URL": database_url,
        "INTERMISSION_AMQP_URL": amqp_url,
        "INTERMISSION_MANAGEMENT_URL": management_url,
        # The test broker's administrator, whatever the AMQP URL says (a test points that at a closed port).
        "INTERMISSION_MANAGEMENT_USER": ADMIN.user or "guest",
        "INTERMISSION_MANAGEMENT_PASSWORD": ADMIN.password or "guest",
        "INTERMISSION_DATABASE_CONNECT_TIMEOUT_SECONDS": "5",
        "INTERMISSION_AMQP_CONNECT_TIMEOUT_SECONDS": "2",
    }


@pytest.fixture(autouse=True)
def _no_operator_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The commands read INTERMISSION_* from the environment: only what each test passes counts (the tests'
    # own INTERMISSION_TEST_* stay).
    for name in [n for n in os.environ if n.startswith("INTERMISSION_") and not n.startswith("INTERMISSION_TEST_")]:
        monkeypatch.delenv(name)


async def cli(env: dict[str, str], *args: str) -> Result:
    # In a thread: the command runs its own event loop, as it does in a shell.
    return await asyncio.to_thread(CliRunner().invoke, main, list(args), env=env)


def parsed(result: Result) -> Any:
    assert result.exit_code in (0, 1), (result.exit_code, result.output, result.exception)
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def closed_database() -> str:
    return f"postgresql://postgres:{SECRET}@127.0.0.1:{free_port()}/intermission"


def closed_broker() -> str:
    return f"amqp://guest:{SECRET}@127.0.0.1:{free_port()}/"


def assert_down(result: Result, server: str) -> None:
    """Exit 2, one line on stderr naming the server, the password masked, nothing on stdout, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert f"cannot reach {server} at " in result.stderr
    assert SECRET not in result.stderr
    assert "***" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def assert_usage(result: Result, said: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert said in result.stderr, result.stderr


def assert_missing(result: Result, said: str) -> None:
    assert result.exit_code == 1, result.output
    assert said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


async def paused_through_the_host(
    host: HostClient, stores: Stores, scope: Scope, *, ttl: int | None = None, tool: str = "lookup"
) -> str:
    """A run started by the host that pauses on an external tool (a worker must run): its id."""
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    script = [
        ScriptTurn.model_validate({"call": [{"tool": tool, "arguments": {"query": "q"}}]}),
        ScriptTurn.model_validate({"say": "done"}),
    ]
    await host.start(StartCommand(scope=scope, run_id=run_id, agent_id="demo", script=script, pause_ttl_seconds=ttl))

    async def paused() -> bool:
        found = await stores.across_scopes.find_run_scopes(run_id)
        return bool(found) and (await stores.at(scope).runs.get_run(run_id)).state is RunState.PAUSED

    await eventually(paused, within=WAIT, what="the run paused")
    return run_id


# --- runs list -----------------------------------------------------------------------------------------


async def test_runs_list_filters_by_scope_state_reason_age_and_deadline_and_pages(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope, database_url: str
) -> None:
    env = env_of(database_url, closed_broker())
    soon = await paused_run(stores, scope, ttl_seconds=3600)
    later = await paused_run(stores, scope, ttl_seconds=5 * 86400)
    approval = await paused_run(stores, other_scope, reason=SuspendReason.APPROVAL, ttl_seconds=0)
    running, _ = await running_run(stores, scope)
    await db.con.execute("UPDATE runs SET updated_at = now() - interval '3 days' WHERE id = $1", later.run.id)

    every = parsed(await cli(env, "runs", "list", "--json"))
    assert {r["id"] for r in every["runs"]} == {soon.run.id, later.run.id, approval.run.id, running.id}
    assert every["next"] is None
    by_id = {r["id"]: r for r in every["runs"]}
    assert by_id[soon.run.id]["reason"] == "external_tool"
    assert by_id[soon.run.id]["suspension_id"] == soon.suspension.id
    assert by_id[running.id]["reason"] is None
    assert by_id[running.id]["state"] == "running"

    async def ids(*args: str) -> list[str]:
        return [r["id"] for r in parsed(await cli(env, "runs", "list", "--json", *args))["runs"]]

    assert await ids("--app", scope.app, "--tenant", scope.tenant, "--state", "paused") == [soon.run.id, later.run.id]
    assert await ids("--reason", "approval") == [approval.run.id]
    assert await ids("--state", "running") == [running.id]
    assert await ids("--deadline-within", "2h") == [soon.run.id]
    assert await ids("--older-than", "2d") == [later.run.id]
    assert await ids("--older-than", "1h30m", "--reason", "external_tool") == [later.run.id]
    assert await ids("--app", "nobody", "--tenant", "here") == []

    # Newest change first, a page at a time, every run once.
    first = parsed(await cli(env, "runs", "list", "--json", "--limit", "2"))
    assert len(first["runs"]) == 2
    assert first["next"]
    second = parsed(await cli(env, "runs", "list", "--json", "--limit", "2", "--after", first["next"]))
    paged = [r["id"] for r in first["runs"] + second["runs"]]
    assert sorted(paged) == sorted(by_id)
    assert len(paged) == 4
    assert paged == [r["id"] for r in every["runs"]]

    # For people: a table on stdout, the count on stderr.
    table = await cli(env, "runs", "list", "--reason", "approval")
    assert table.exit_code == 0, table.output
    assert approval.run.id in table.stdout
    assert "approval" in table.stdout
    assert "1 run(s)" in table.stderr


async def test_runs_list_refuses_bad_flags_and_names_a_database_that_is_down(database_url: str) -> None:
    env = env_of(database_url, closed_broker())
    assert_usage(await cli(env, "runs", "list", "--state", "sleeping"), "Invalid value for '--state'")
    assert_usage(await cli(env, "runs", "list", "--older-than", "5x"), "is not a duration")
    assert_usage(await cli(env, "runs", "list", "--app", "acme"), "give --app and --tenant together")
    assert_usage(await cli(env, "runs", "list", "--after", "yesterday"), "not a cursor")
    assert_down(await cli(env_of(closed_database(), closed_broker()), "runs", "list", "--json"), "PostgreSQL")


# --- runs show -----------------------------------------------------------------------------------------


async def test_runs_show_a_run_with_its_pause_progress_admissions_events_and_trace(
    worker: Worker, host: HostClient, stores: Stores, scope: Scope, other_scope: Scope, database_url: str, amqp_url: str
) -> None:
    env = env_of(database_url, amqp_url)
    run_id = await paused_through_the_host(host, stores, scope, ttl=3600)
    await worker.drain()

    shown = parsed(await cli(env, "runs", "show", run_id, "--json"))  # no --app/--tenant: the id is unique
    assert shown["run"]["id"] == run_id
    assert shown["run"]["scope"] == {"app": scope.app, "tenant": scope.tenant}
    assert shown["run"]["state"] == "paused"
    pause = await stores.at(scope).suspensions.get_suspension(run_id)
    assert shown["pause"]["live"] is True
    assert shown["pause"]["suspension_id"] == pause.id
    assert shown["pause"]["reason"] == "external_tool"
    assert shown["pause"]["pending"] == [{"id": c.id, "name": c.name} for c in pause.pending]
    assert pause.expires_at is not None
    assert datetime.fromisoformat(shown["pause"]["expires_at"]) == pause.expires_at
    assert shown["progress"] is None  # a paused run has none
    assert shown["admissions"] == []
    assert [e["kind"] for e in shown["events"]] == ["paused"]
    keys = [o["routing_key"] for o in shown["outbox"]]
    assert keys == [f"notice.external_tool.{scope.app}.{scope.tenant}"]
    assert all(o["sent_at"] is not None for o in shown["outbox"])
    # The trace its pause recorded and its Notice carries: none when nothing records (it started without one).
    assert shown["trace_id"] == pause.continuation.traceparent
    assert "body" not in shown["outbox"][0]

    # The trace is the traceparent of the run's latest outbox row that has one.
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    await support_outbox.insert(
        stores,
        scope,
        OutboxEvent(
            routing_key=f"run.resumed.{scope.app}.{scope.tenant}",
            body="{}",
            headers={SCHEMA_VERSION_HEADER: SCHEMA_VERSION, TRACEPARENT_HEADER: traceparent},
        ),
        run_id=run_id,
    )
    traced = parsed(await cli(env, "runs", "show", run_id, "--app", scope.app, "--tenant", scope.tenant, "--json"))
    assert traced["trace_id"] == traceparent

    for_people = await cli(env, "runs", "show", run_id)
    assert for_people.exit_code == 0, for_people.output
    assert run_id in for_people.stdout
    assert f"live pause {pause.id}: external_tool" in for_people.stdout
    assert traceparent in for_people.stdout

    assert_missing(await cli(env, "runs", "show", "no-such-run", "--json"), "no run no-such-run")
    wrong = await cli(env, "runs", "show", run_id, "--app", other_scope.app, "--tenant", other_scope.tenant)
    assert_missing(wrong, f"no run {run_id} at scope {other_scope}")
    assert_usage(await cli(env, "runs", "show", run_id, "--tenant", "t1"), "give --app and --tenant together")
    assert_usage(await cli(env, "runs", "show", run_id, "--colour"), "No such option")
    assert_down(await cli(env_of(closed_database(), amqp_url), "runs", "show", run_id), "PostgreSQL")


async def test_runs_show_and_list_tell_runs_of_one_id_in_two_scopes_apart(
    stores: Stores, db: Inspector, scope: Scope, other_scope: Scope, database_url: str
) -> None:
    """A run id is unique only within its scope: an id two scopes hold needs --app/--tenant to name a run,
    and a listing pages through both runs of it even when they changed at the same moment."""
    env = env_of(database_url, closed_broker())
    run_id = f"shared-{uuid.uuid4().hex[:10]}"
    mine = await paused_run(stores, scope, run_id=run_id)
    theirs = await paused_run(stores, other_scope, run_id=run_id, reason=SuspendReason.APPROVAL)

    ambiguous = await cli(env, "runs", "show", run_id, "--json")
    assert_missing(ambiguous, f"run {run_id} is in several scopes ({scope}, {other_scope})")
    for which, paused in ((scope, mine), (other_scope, theirs)):
        shown = parsed(await cli(env, "runs", "show", run_id, "--app", which.app, "--tenant", which.tenant, "--json"))
        assert shown["run"]["scope"] == {"app": which.app, "tenant": which.tenant}
        assert shown["pause"]["suspension_id"] == paused.suspension.id
        assert shown["pause"]["reason"] == paused.suspension.reason.value

    await db.con.execute("UPDATE runs SET updated_at = now() - interval '1 hour' WHERE id = $1", run_id)
    first = parsed(await cli(env, "runs", "list", "--json", "--limit", "1"))
    second = parsed(await cli(env, "runs", "list", "--json", "--limit", "1", "--after", first["next"]))
    last = parsed(await cli(env, "runs", "list", "--json", "--limit", "1", "--after", second["next"]))
    listed = [(r["id"], r["app"], r["tenant"]) for r in first["runs"] + second["runs"] + last["runs"]]
    assert sorted(listed) == sorted([(run_id, s.app, s.tenant) for s in (scope, other_scope)])
    assert last["next"] is None
    assert_usage(await cli(env, "runs", "list", "--after", f"2026-01-01T00:00:00+00:00~{run_id}"), "not a cursor")


# --- runs cancel ---------------------------------------------------------------------------------------


async def test_runs_cancel_goes_through_the_command_path_and_reports_the_outcome(
    worker: Worker, host: HostClient, stores: Stores, scope: Scope, database_url: str, amqp_url: str
) -> None:
    env = env_of(database_url, amqp_url)
    run_id = await paused_through_the_host(host, stores, scope)

    done = await cli(env, "runs", "cancel", run_id, "--reason", "an operator's test", "--json")
    assert done.exit_code == 0, done.output
    said = parsed(done)
    assert said["outcome"] == "cancelled"
    assert said["heard"] is True
    assert said["run_id"] == run_id
    assert said["scope"] == str(scope)
    run = await stores.at(scope).runs.get_run(run_id)
    assert run.state is RunState.CANCELLED
    assert said["revision"] == run.revision
    # The worker applied it as any cancel: its message id is in the inbox.
    async with stores.db.connection() as con:
        recorded = await con.raw.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", said["message_id"])
    assert recorded == 1

    # A run that ended already: the worker refuses the cancel, and the command says so.
    again = await cli(env, "runs", "cancel", run_id, "--json")
    assert again.exit_code == 1, again.output
    refused = json.loads(again.stdout)
    assert refused["outcome"] == "rejected"
    # An ended run is no longer in any state a cancel applies to.
    assert refused["code"] == "invalid_state"
    assert "refused (invalid_state)" in again.stderr

    assert_missing(await cli(env, "runs", "cancel", "no-such-run"), "no run no-such-run")
    assert_usage(await cli(env, "runs", "cancel", run_id, "--wait", "soon"), "is not a duration")
    assert_down(await cli(env_of(database_url, closed_broker()), "runs", "cancel", run_id), "RabbitMQ")
    assert_down(await cli(env_of(closed_database(), amqp_url), "runs", "cancel", run_id), "PostgreSQL")


# --- pauses extend | expire ----------------------------------------------------------------------------


async def test_pauses_extend_and_expire_move_the_deadline_and_expire_through_a_worker(
    worker: Worker, host: HostClient, stores: Stores, db: Inspector, scope: Scope, database_url: str, amqp_url: str
) -> None:
    env = env_of(database_url, amqp_url)
    run_id = await paused_through_the_host(host, stores, scope, ttl=3600)
    pause = await stores.at(scope).suspensions.get_suspension(run_id)
    assert pause.expires_at is not None

    extended = parsed(await cli(env, "pauses", "extend", run_id, "--by", "2h", "--json"))
    assert extended["suspension_id"] == pause.id
    assert datetime.fromisoformat(extended["previous"]) == pause.expires_at
    assert datetime.fromisoformat(extended["expires_at"]) == pause.expires_at + timedelta(hours=2)
    stored = await db.suspension(run_id)
    assert stored is not None
    assert stored["expires_at"] == pause.expires_at + timedelta(hours=2)
    (moved,) = [e for e in await stores.at(scope).runs.list_run_events(run_id) if e["kind"] == "deadline_moved"]
    data = moved["data"]
    assert isinstance(data, dict)
    assert data["how"] == "extend"
    assert data["moved_by"]

    expired = await cli(env, "pauses", "expire", run_id, "--json")
    assert expired.exit_code == 0, expired.output
    said = json.loads(expired.stdout)
    assert said["outcome"] == "expired"
    assert said["suspension_id"] == pause.id
    # The sweeper's own command: the same deterministic id a sweeper would publish for this pause.
    assert said["message_id"] == f"expire:{run_id}:{pause.id}"
    assert (await stores.at(scope).runs.get_run(run_id)).state is not RunState.PAUSED

    no_pause = await cli(env, "pauses", "extend", run_id, "--by", "1h")
    assert_missing(no_pause, f"run {run_id} has no live pause")
    assert_missing(await cli(env, "pauses", "expire", "no-such-run"), "no run no-such-run")
    assert_usage(await cli(env, "pauses", "extend", run_id, "--by", "0s"), "must be longer than 0s")
    assert_usage(await cli(env, "pauses", "extend", run_id, "--by", "a while"), "is not a duration")
    assert_usage(await cli(env, "pauses", "extend", run_id), "Missing option '--by'")
    assert_down(await cli(env_of(closed_database(), amqp_url), "pauses", "extend", run_id, "--by", "1h"), "PostgreSQL")
    # Expire reaches the broker before it moves anything: with the broker down, nothing moved.
    other = await paused_through_the_host(host, stores, scope, ttl=3600)
    before = await db.suspension(other)
    assert_down(await cli(env_of(database_url, closed_broker()), "pauses", "expire", other), "RabbitMQ")
    assert await db.suspension(other) == before


# --- notices replay ------------------------------------------------------------------------------------


async def test_notices_replay_publishes_the_live_pause_notice_again_under_its_first_message_id(
    worker: Worker,
    host: HostClient,
    stores: Stores,
    scope: Scope,
    database_url: str,
    amqp_url: str,
    capture: CaptureFactory,
) -> None:
    env = env_of(database_url, amqp_url)
    heard = await capture(amqp_url, EVENTS_EXCHANGE, "notice.#")
    run_id = await paused_through_the_host(host, stores, scope)
    (first,) = await heard.wait_count(1, within=WAIT)

    replayed = parsed(await cli(env, "notices", "replay", run_id, "--json"))
    assert replayed["message_id"] == first.message_id
    both = await heard.wait_count(2, within=WAIT)
    copy = both[1]
    assert copy.message_id == first.message_id
    assert copy.body == first.body
    assert copy.routing_key == first.routing_key
    assert copy.headers == first.headers
    assert copy.correlation_id == first.correlation_id
    assert Notice.model_validate_json(copy.body).run_id == run_id

    assert_missing(await cli(env, "notices", "replay", "no-such-run"), "no run no-such-run")
    assert_usage(await cli(env, "notices", "replay"), "Missing argument 'RUN_ID'")
    assert_down(await cli(env_of(database_url, closed_broker()), "notices", "replay", run_id), "RabbitMQ")


# --- doctor --------------------------------------------------------------------------------------------


def checks(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in document["checks"]}


async def test_doctor_says_all_is_well_beside_a_healthy_worker(
    worker: Worker, database_url: str, amqp_url: str, management: Management
) -> None:
    env = env_of(database_url, amqp_url, management.url)
    last: Result | None = None

    async def healthy() -> bool:
        nonlocal last
        # The management API counts consumers a few seconds late.
        last = await cli(env, "doctor", "--json")
        return last.exit_code == 0

    await eventually(healthy, within=WAIT, what="doctor all ok")
    assert last is not None
    found = json.loads(last.stdout)
    assert found["healthy"] is True
    assert found["unreachable"] == []
    assert {name: c["status"] for name, c in checks(found).items()} == dict.fromkeys(
        ["stale_leases", "outbox_lag", "outbox_quarantine", "replicas", "dead_letters", "consumers"], "ok"
    )
    assert "none configured" in checks(found)["replicas"]["found"]
    assert "doctor: all is well" in last.stderr


async def test_doctor_finds_what_is_wrong_and_exits_1(
    stores: Stores, db: Inspector, scope: Scope, database_url: str, amqp_url: str, management: Management
) -> None:
    env = env_of(database_url, amqp_url, management.url)
    # Nobody runs: a lapsed lease nobody took over, unsent events, a quarantined one, a dead letter, and no
    # consumer on any command queue.
    stale, _ = await running_run(stores, scope, holder=lease("a-worker-that-died", ttl=0.1))
    await db.wait_lease_lapsed(stale.id)
    await paused_run(stores, scope)
    (poisoned,) = await support_outbox.insert(
        stores, scope, OutboxEvent(routing_key=f"run.completed.{scope.app}.{scope.tenant}", body="{}")
    )
    await db.con.execute("UPDATE outbox SET quarantined_at = now(), attempts = 5 WHERE message_id = $1", poisoned)
    await dead_letter(amqp_url)

    ran = await cli(env, "doctor", "--json", "--lease-grace", "0s", "--outbox-lag", "0s")
    assert ran.exit_code == 1, ran.output
    found = checks(json.loads(ran.stdout))
    assert found["stale_leases"]["status"] == "fail"
    assert found["stale_leases"]["details"] == {
        "total": 1,
        "runs": [{"id": stale.id, "app": scope.app, "tenant": scope.tenant}],
    }
    assert found["outbox_lag"]["status"] == "fail"
    assert found["outbox_lag"]["details"]["pending"] == 1
    assert found["outbox_quarantine"]["status"] == "fail"
    assert found["outbox_quarantine"]["details"] == {"quarantined": 1}
    assert found["dead_letters"]["status"] == "warn"
    assert found["dead_letters"]["details"]["depth"] == 1
    assert found["consumers"]["status"] == "fail"
    assert "intermission.resume" in found["consumers"]["found"]
    assert found["replicas"]["status"] == "ok"
    assert all(c["action"] for c in found.values() if c["status"] != "ok")
    # The same checks with the default grace: a lease lapsed a moment ago is not stale yet.
    calmer = checks(json.loads((await cli(env, "doctor", "--json")).stdout))
    assert calmer["stale_leases"]["status"] == "ok"

    # For people: a table with what to do.
    table = await cli(env, "doctor")
    assert table.exit_code == 1
    assert "outbox_quarantine" in table.stdout
    assert "intermission outbox list --quarantined" in table.stdout
    assert "check(s) need attention" in table.stderr
    # What the doctor saw, listed by the commands it names.
    dead = parsed(await cli(env, "dead", "list", "--json"))
    assert dead["depth"] == 1
    assert dead["letters"][0]["code"] == "invalid_message"
    listed = parsed(await cli(env, "outbox", "list", "--quarantined", "--json"))
    assert [r["message_id"] for r in listed["rows"]] == [poisoned]


async def test_doctor_names_each_server_it_cannot_reach_and_exits_2(
    database_url: str, amqp_url: str, management: Management
) -> None:
    down = await cli(env_of(closed_database(), closed_broker(), f"http://127.0.0.1:{free_port()}"), "doctor", "--json")
    assert down.exit_code == 2, down.output
    found = json.loads(down.stdout)
    assert found["unreachable"] == sorted(["PostgreSQL", "RabbitMQ", "the RabbitMQ management API"])
    assert all(c["status"] == "fail" for c in found["checks"])
    assert SECRET not in down.stdout + down.stderr

    only_broker = await cli(env_of(database_url, closed_broker(), management.url), "doctor", "--json")
    assert only_broker.exit_code == 2
    found = json.loads(only_broker.stdout)
    assert found["unreachable"] == ["RabbitMQ"]
    assert checks(found)["dead_letters"]["unreachable"] == "RabbitMQ"
    assert checks(found)["stale_leases"]["status"] == "ok"
    assert_usage(await cli(env_of(database_url, amqp_url), "doctor", "--lease-grace", "long"), "is not a duration")
