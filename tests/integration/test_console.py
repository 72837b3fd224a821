"""The web console's routes against the real servers (README, "The web console"): a person logs in with
their RabbitMQ credentials, sees only the scopes the broker grants them, and their decisions are published
on their own connection, where the broker validates ``user_id`` and the worker holds the pause's approvers.

The console is served by uvicorn on a free port (``tests/support/console.py``) and spoken to over HTTP;
the users are real RabbitMQ users confined by ``intermission grant``'s own code; a real worker applies
what the console publishes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest

from intermission.fleet.settings import Settings
from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient
from intermission.schemas.config import PublicationPolicy
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.amqp import Broker
from tests.support.confined import Confiner, Management
from tests.support.console import (
    Served,
    approval_pause,
    browsing,
    console_settings,
    csrf_of,
    log_in,
    serving,
)
from tests.support.inspect import Inspector
from tests.support.waiting import eventually

WAIT = 20.0
EMAIL = {"to": "cfo@example.com", "subject": "Q3 numbers", "body": "attached"}


@pytest.fixture
async def console(settings: Settings, management: Management, confiner: Confiner) -> AsyncIterator[Served]:
    # After the confiner: the people's connections close with the console, before their users are deleted.
    async with serving(console_settings(settings, management)) as served:
        yield served


def decision_form(page: str, run_id: str) -> dict[str, str]:
    """The hidden fields of the decision form of ``run_id``'s pause on ``page``."""
    forms = re.findall(r'<form method="post" action="/decide" class="decide">(.*?)</form>', page, re.DOTALL)
    for form in forms:
        fields = dict(re.findall(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)">', form))
        if fields.get("run_id") == run_id:
            return fields
    raise AssertionError(f"no decision form for {run_id}")


async def decide(client: httpx.AsyncClient, run_id: str, decision: str, reason: str = "") -> httpx.Response:
    inbox = await client.get("/inbox")
    fields = decision_form(inbox.text, run_id)
    return await client.post("/decide", data={**fields, "decision": decision, "reason": reason}, follow_redirects=True)


async def test_a_bad_password_is_refused_and_opens_no_session(
    console: Served, confiner: Confiner, scope: Scope
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    async with browsing(console.url) as client:
        refused = await log_in(client, user, password="not-" + user.password)
        assert refused.status_code == 401
        assert "RabbitMQ refused this user and password." in refused.text
        assert (await client.get("/inbox")).status_code == 303  # to the login page
        assert await confiner.connections_of(user.name) == []

        # Without the form's token the right password is refused too: a login from another site's form.
        assert (await client.post("/login", data={"user": user.name, "password": user.password})).status_code == 400

        welcome = await log_in(client, user)
        assert welcome.status_code == 303
        assert welcome.headers["location"] == "/inbox"
        cookie = welcome.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=strict" in cookie
        inbox = await client.get("/inbox")
        assert inbox.status_code == 200
        assert f"Signed in as <strong>{user.name}</strong>" in inbox.text
        assert f"Scopes: {scope}" in inbox.text
        assert user.password not in inbox.text
        assert "script-src 'self'" in inbox.headers["content-security-policy"]


async def test_a_person_sees_only_the_scopes_the_broker_grants_them(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    rabbit: Broker,
    scope: Scope,
    other_scope: Scope,
) -> None:
    mine = await approval_pause(host, stores, scope)
    theirs = await approval_pause(host, stores, other_scope)
    user = await confiner.confined(scope, prefix="alice")
    async with browsing(console.url) as client:
        await log_in(client, user)
        for path in ("/inbox", "/runs", "/inbox?fragment=approvals", "/runs?fragment=runs"):
            page = (await client.get(path)).text
            assert mine in page, path
            assert theirs not in page, path
            assert str(other_scope) not in page, path
        found = await client.get(f"/runs/{scope.app}/{scope.tenant}/{mine}")
        assert found.status_code == 200
        # Another tenant's run, under its own scope or under the person's: the same "no such run".
        for app, tenant in ((other_scope.app, other_scope.tenant), (scope.app, scope.tenant)):
            missing = await client.get(f"/runs/{app}/{tenant}/{theirs}")
            assert missing.status_code == 404
            assert theirs not in missing.text.replace(f"/runs/{app}/{tenant}/{theirs}", "")

    # An identity trusted with the whole vhost (the test's host user) sees every scope.
    async with browsing(console.url) as client:
        await log_in(client, rabbit.host)
        page = (await client.get("/inbox")).text
        assert "Scopes: every scope" in page
        assert mine in page
        assert theirs in page

    # A user granted nothing has no permission on the vhost at all: RabbitMQ refuses its login.
    nobody = await confiner.add_user("nobody")
    async with browsing(console.url) as client:
        assert (await log_in(client, nobody)).status_code == 401


async def test_an_approval_is_published_on_the_persons_connection_and_the_worker_applies_it(
    console: Served, worker: Worker, host: HostClient, stores: Stores, confiner: Confiner, db: Inspector, scope: Scope
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    run_id = await approval_pause(host, stores, scope, approvers=[user.name])
    async with browsing(console.url) as client:
        await log_in(client, user)
        inbox = (await client.get("/inbox")).text
        assert "send_email" in inbox
        assert "cfo@example.com" in inbox
        assert f"Who may approve</dt><dd>{user.name}</dd>" in inbox
        answered = await decide(client, run_id, "approve", reason="numbers checked")
        assert answered.status_code == 200
        assert "A worker applied your decision" in answered.text
        assert 'class="notice notice-applied"' in answered.text

    async def completed() -> bool:
        row = await db.con.fetchrow("SELECT state::text, output FROM runs WHERE id = $1", run_id)
        return row is not None and (row["state"], row["output"]) == ("completed", "sent")

    await eventually(completed, within=WAIT, what="the run completed")
    checkpoint = await db.con.fetchrow("SELECT state, decided_by, reason FROM checkpoints WHERE run_id = $1", run_id)
    assert checkpoint is not None
    assert dict(checkpoint) == {"state": "approved", "decided_by": user.name, "reason": "numbers checked"}


async def test_a_person_the_pause_does_not_name_is_refused_by_the_worker_and_the_run_stays_paused(
    console: Served, worker: Worker, host: HostClient, stores: Stores, confiner: Confiner, db: Inspector, scope: Scope
) -> None:
    alice = await confiner.confined(scope, prefix="alice")
    mallory = await confiner.confined(scope, prefix="mallory")
    run_id = await approval_pause(host, stores, scope, approvers=[alice.name])
    before = await db.con.fetchrow("SELECT state::text, revision FROM runs WHERE id = $1", run_id)
    async with browsing(console.url) as client:
        await log_in(client, mallory)
        inbox = (await client.get("/inbox")).text
        assert "You are not among this pause's approvers" in inbox
        answered = await decide(client, run_id, "approve")
        assert "Refused: forbidden." in answered.text
        assert 'class="notice notice-refused"' in answered.text
        # The dead-letter queue keeps the refused decision, and shows it in the person's scope.
        dead = (await client.get("/dead")).text
        assert "forbidden" in dead
        assert f"run.decide.{scope.app}.{scope.tenant}" in dead
    after = await db.con.fetchrow("SELECT state::text, revision FROM runs WHERE id = $1", run_id)
    assert before is not None
    assert after is not None
    assert dict(after) == dict(before)
    assert after["state"] == "paused"
    assert await db.con.fetchval("SELECT state FROM checkpoints WHERE run_id = $1", run_id) == "pending"


async def test_a_form_without_its_token_publishes_nothing(
    console: Served, worker: Worker, host: HostClient, stores: Stores, confiner: Confiner, db: Inspector, scope: Scope
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    run_id = await approval_pause(host, stores, scope, approvers=[user.name])
    async with browsing(console.url) as client:
        await log_in(client, user)
        fields = decision_form((await client.get("/inbox")).text, run_id)
        for token in ("", "forged"):
            refused = await client.post("/decide", data={**fields, "csrf": token, "decision": "approve"})
            assert refused.status_code == 400
    assert await db.con.fetchval("SELECT state::text FROM runs WHERE id = $1", run_id) == "paused"
    assert (
        await db.con.fetchval("SELECT count(*) FROM inbox WHERE run_id = $1 AND routing_key LIKE 'run.decide%'", run_id)
        == 0
    )


async def test_a_decision_for_a_scope_not_granted_is_refused_before_it_is_sent(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    db: Inspector,
    scope: Scope,
    other_scope: Scope,
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    theirs = await approval_pause(host, stores, other_scope)
    pause = await db.con.fetchrow("SELECT id, checkpoint_id FROM suspensions WHERE run_id = $1", theirs)
    revision = await db.con.fetchval("SELECT revision FROM runs WHERE id = $1", theirs)
    assert pause is not None
    async with browsing(console.url) as client:
        await log_in(client, user)
        csrf = csrf_of((await client.get("/inbox")).text)
        refused = await client.post(
            "/decide",
            data={
                "csrf": csrf,
                "app": other_scope.app,
                "tenant": other_scope.tenant,
                "run_id": theirs,
                "suspension_id": str(pause["id"]),
                "run_revision": str(revision),
                "checkpoint_id": str(pause["checkpoint_id"]),
                "decision": "approve",
            },
        )
        assert refused.status_code == 403
    assert await db.con.fetchval("SELECT state::text FROM runs WHERE id = $1", theirs) == "paused"


async def test_redacted_arguments_stay_redacted_in_the_console(
    console: Served, worker: Worker, host: HostClient, stores: Stores, confiner: Confiner, scope: Scope
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    run_id = await approval_pause(
        host, stores, scope, approvers=[user.name], publication=PublicationPolicy(redact_arguments=True)
    )
    async with browsing(console.url) as client:
        await log_in(client, user)
        for path in ("/inbox", f"/runs/{scope.app}/{scope.tenant}/{run_id}"):
            page = (await client.get(path)).text
            assert "[redacted]" in page, path
            # The arguments are hidden as in the run's Notices (the note, which Notices carry, stays).
            assert "attached" not in page, path
            assert "&#34;body&#34;" not in page, path


async def test_the_event_stream_tells_a_page_when_a_run_pauses_in_the_persons_scopes(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    scope: Scope,
    other_scope: Scope,
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    async with browsing(console.url) as client:
        await log_in(client, user)
        async with client.stream("GET", "/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.aiter_lines()
            # Another tenant's pause is not heard (the person's subscription may not bind it); theirs is.
            await approval_pause(host, stores, other_scope)
            run_id = await approval_pause(host, stores, scope)
            async with asyncio.timeout(WAIT):
                async for line in lines:
                    if line.startswith("data: {"):
                        change = json.loads(line.removeprefix("data: "))
                        assert change["scope"] == str(scope), change
                        if change["run_id"] == run_id and change["kind"] == "notice":
                            break
    async with browsing(console.url) as anonymous:
        assert (await anonymous.get("/events")).status_code == 401


async def test_a_session_follows_the_grants_and_ends_when_the_last_scope_is_revoked(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    management: Management,
    scope: Scope,
    other_scope: Scope,
) -> None:
    user = await confiner.confined(scope, prefix="alice")
    theirs = await approval_pause(host, stores, other_scope)
    grants = management.grants(confiner.vhost.name)
    try:
        async with browsing(console.url) as client:
            await log_in(client, user)
            assert theirs not in (await client.get("/inbox")).text
            await grants.grant(user.name, other_scope)

            async def shown() -> bool:
                return theirs in (await client.get("/inbox")).text

            # The grants are read again every few seconds: a new scope shows without logging in again.
            await eventually(shown, within=WAIT, what="the granted scope's pause shown")
            await grants.revoke(user.name, other_scope)
            await grants.revoke(user.name, scope)

            async def ended() -> bool:
                return (await client.get("/inbox")).status_code == 303

            await eventually(ended, within=WAIT, what="the session ended")
            assert (await client.get("/inbox")).headers["location"] == "/login"
    finally:
        await grants.close()
