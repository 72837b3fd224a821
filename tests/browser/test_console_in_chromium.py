"""The web console as a person uses it, in headless Chromium (README, "The web console").

An approver logs in with the keyboard alone, sees an approval appear while the page is open (it is started
after the page loaded: the live update, not a reload, brings it), approves it with a reason and sees the
run complete; a person the pause does not name is refused by the worker and the run stays paused (read in
the database); a person granted tenant A sees nothing of tenant B. The tests save the README's screenshots
(desktop and a 375 px phone): into INTERMISSION_SCREENSHOTS_DIR when it is set (docs/screenshots renews the
README's), else into a temporary folder.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, ConsoleMessage, Page, expect

from intermission.fleet.worker import Worker
from intermission.publishers.clients import HostClient
from intermission.schemas.config import PublicationPolicy
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.browser.conftest import PHONE, Browse
from tests.support.amqp import AmqpUser
from tests.support.confined import Confiner
from tests.support.console import Served, approval_pause
from tests.support.inspect import Inspector

# Where the screenshots go: a folder of the test session's own, so that a run leaves the checkout clean; with
# INTERMISSION_SCREENSHOTS_DIR=docs/screenshots the run renews the README's pictures (docs/testing.md).
SCREENSHOTS = Path(
    os.environ.get("INTERMISSION_SCREENSHOTS_DIR") or Path(tempfile.gettempdir()) / "intermission-screenshots"
)
WAIT_MS = 20_000
DAY = 86_400
TENANT_A = Scope(app="billing", tenant="acme")
TENANT_B = Scope(app="billing", tenant="globex")
PAYMENT = {"to": "accounts@supplier.example", "subject": "Invoice 4711: EUR 12,400", "body": "Pay by Friday."}


class Problems:
    """What went wrong inside the pages: script errors and console errors (a CSP violation is one)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        # Addresses the test itself asks for expecting an error status (Chromium logs those as errors).
        self.expected: set[str] = set()

    def watch(self, page: Page) -> Page:
        page.on("pageerror", lambda error: self.found.append(f"page error: {error}"))
        page.on("console", self._console)
        return page

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error" and message.location.get("url") not in self.expected:
            self.found.append(f"console error: {message.text} ({message.location.get('url')})")


@pytest.fixture
def problems() -> Iterator[Problems]:
    seen = Problems()
    yield seen
    assert seen.found == []


async def shot(page: Page, name: str) -> None:
    await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


async def open_page(context: BrowserContext, problems: Problems) -> Page:
    return problems.watch(context.pages[0] if context.pages else await context.new_page())


async def log_in_with_the_keyboard(page: Page, console: Served, user: AmqpUser) -> None:
    await page.goto(f"{console.url}/login")
    await expect(page.get_by_label("User")).to_be_focused()  # autofocus: nothing to click
    await page.keyboard.type(user.name)
    await page.keyboard.press("Tab")
    await expect(page.get_by_label("Password")).to_be_focused()
    await page.keyboard.type(user.password)
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("heading", name="Inbox", level=1)).to_be_visible()


async def log_in(page: Page, console: Served, user: AmqpUser) -> None:
    await page.goto(f"{console.url}/login")
    await page.get_by_label("User").fill(user.name)
    await page.get_by_label("Password").fill(user.password)
    await page.get_by_role("button", name="Log in").click()
    await expect(page.get_by_role("heading", name="Inbox", level=1)).to_be_visible()


async def live(page: Page) -> None:
    """Wait until the page's live-update stream is open."""
    await expect(page.locator("#live-status")).to_have_text(re.compile("^Live"), timeout=WAIT_MS)


async def test_an_approver_sees_an_approval_arrive_live_approves_it_with_the_keyboard_and_the_run_completes(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    browse: Browse,
    problems: Problems,
    db: Inspector,
) -> None:
    alice = await confiner.confined(TENANT_A, prefix="alice")
    page = await open_page(await browse(), problems)
    await page.goto(f"{console.url}/login")
    await shot(page, "console-login")
    await log_in_with_the_keyboard(page, console, alice)
    await expect(page.get_by_text("Nothing is waiting on a person in your scopes.")).to_be_visible()
    await live(page)

    # Paused after the page loaded: only the live update can bring it.
    run_id = await approval_pause(
        host, stores, TENANT_A, approvers=[alice.name], run_id="invoice-4711", arguments=PAYMENT, pause_ttl_seconds=DAY
    )
    card = page.locator("#approvals-list > li").filter(has_text=run_id)
    await expect(card).to_be_visible(timeout=WAIT_MS)
    await expect(card).to_contain_text("send_email")
    await expect(card).to_contain_text("accounts@supplier.example")
    await expect(card).to_contain_text(alice.name)  # who may approve
    await expect(card).to_contain_text(str(TENANT_A))
    await shot(page, "console-inbox")

    # Keyboard only: into the reason, type it, Tab to Approve, Enter.
    await card.get_by_label(re.compile("^Reason")).focus()
    await page.keyboard.type("Invoice matches the purchase order.")
    await page.keyboard.press("Tab")
    await expect(card.get_by_role("button", name="Approve")).to_be_focused()
    await page.keyboard.press("Enter")

    outcome = page.locator("#outcome")
    await expect(outcome).to_contain_text("A worker applied your decision", timeout=WAIT_MS)
    await expect(page.locator("#decisions-list")).to_contain_text("applied")
    await shot(page, "console-approved")

    # To the run, by the outcome's link (keyboard again), where it is seen to complete.
    await outcome.get_by_role("link", name=run_id).focus()
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("heading", name=f"Run {run_id}")).to_be_visible()
    await expect(page.locator("#run-state")).to_have_text("completed", timeout=WAIT_MS)
    await expect(page.locator("#run-parts")).to_contain_text(alice.name)  # the decider, on the checkpoint
    await expect(page.locator("#run-parts")).to_contain_text("Invoice matches the purchase order.")
    await shot(page, "console-run")

    row = await db.con.fetchrow("SELECT state::text, output FROM runs WHERE id = $1", run_id)
    assert row is not None
    assert (row["state"], row["output"]) == ("completed", "sent")
    assert await db.con.fetchval("SELECT decided_by FROM checkpoints WHERE run_id = $1", run_id) == alice.name


async def test_a_person_the_pause_does_not_name_is_refused_and_the_run_stays_paused(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    browse: Browse,
    problems: Problems,
    db: Inspector,
) -> None:
    alice = await confiner.confined(TENANT_A, prefix="alice")
    mallory = await confiner.confined(TENANT_A, prefix="mallory")
    run_id = await approval_pause(
        host, stores, TENANT_A, approvers=[alice.name], run_id="invoice-4712", arguments=PAYMENT, pause_ttl_seconds=DAY
    )
    before = await db.con.fetchrow("SELECT state::text, revision FROM runs WHERE id = $1", run_id)

    page = await open_page(await browse(), problems)
    await log_in(page, console, mallory)
    card = page.locator("#approvals-list > li").filter(has_text=run_id)
    await expect(card).to_contain_text("You are not among this pause's approvers")
    await card.get_by_label(re.compile("^Reason")).fill("looks fine to me")
    await card.get_by_role("button", name="Approve").click()

    outcome = page.locator("#outcome")
    await expect(outcome).to_contain_text("Refused: forbidden.", timeout=WAIT_MS)
    await expect(outcome).to_contain_text(run_id)
    # Still waiting, for the person it names.
    await expect(page.locator("#approvals-list > li").filter(has_text=run_id)).to_be_visible()
    await shot(page, "console-refused")

    after = await db.con.fetchrow("SELECT state::text, revision FROM runs WHERE id = $1", run_id)
    assert before is not None
    assert after is not None
    assert dict(after) == dict(before)
    assert after["state"] == "paused"
    assert await db.con.fetchval("SELECT state FROM checkpoints WHERE run_id = $1", run_id) == "pending"

    await page.get_by_role("link", name="Dead letters").click()
    await expect(page.get_by_role("heading", name="Dead letters")).to_be_visible()
    await expect(page.locator("main")).to_contain_text("forbidden")
    await shot(page, "console-dead")


async def test_a_person_granted_tenant_a_sees_nothing_of_tenant_b(
    console: Served,
    worker: Worker,
    host: HostClient,
    stores: Stores,
    confiner: Confiner,
    browse: Browse,
    problems: Problems,
) -> None:
    ours = [
        await approval_pause(host, stores, TENANT_A, run_id="refund-88", arguments=PAYMENT, pause_ttl_seconds=DAY),
        await approval_pause(
            host,
            stores,
            TENANT_A,
            run_id="payroll-2026-12",
            arguments={"to": "bank@example.com", "subject": "Payroll December", "body": "see file"},
            publication=PublicationPolicy(redact_arguments=True),
            pause_ttl_seconds=3 * 3600,
        ),
    ]
    theirs = [
        await approval_pause(
            host, stores, TENANT_B, run_id="globex-secret-merger", arguments=PAYMENT, pause_ttl_seconds=DAY
        ),
        await approval_pause(host, stores, TENANT_B, run_id="globex-layoffs"),
    ]
    user = await confiner.confined(TENANT_A, prefix="acme-approver")

    page = await open_page(await browse(), problems)
    await log_in(page, console, user)
    await expect(page.locator(".who-scopes")).to_have_text(f"Scopes: {TENANT_A}")
    for pages in ("/inbox", "/runs"):
        await page.goto(f"{console.url}{pages}")
        main = page.locator("main")
        for run_id in ours:
            await expect(main).to_contain_text(run_id)
        html = await page.content()
        for run_id in theirs:
            assert run_id not in html, (pages, run_id)
        assert TENANT_B.tenant not in html, pages
        if pages == "/inbox":
            await expect(page.locator("#approvals-list > li").filter(has_text="payroll-2026-12")).to_contain_text(
                "[redacted]"
            )
            await shot(page, "console-inbox-tenant-a")
        else:
            await shot(page, "console-runs")

    # Not even by address.
    address = f"{console.url}/runs/{TENANT_B.app}/{TENANT_B.tenant}/{theirs[0]}"
    problems.expected.add(address)
    response = await page.goto(address)
    assert response is not None
    assert response.status == 404
    await expect(page.get_by_role("heading", name="No such run")).to_be_visible()

    # The same inbox on a phone, 375 px wide: no sideways scrolling, the buttons within reach.
    phone = await open_page(await browse(viewport=PHONE), problems)
    await log_in(phone, console, user)
    await expect(phone.locator("#approvals-list > li")).to_have_count(len(ours))
    width = await phone.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], width
    approve = phone.locator("#approvals-list > li").first.get_by_role("button", name="Approve")
    box = await approve.bounding_box()
    assert box is not None
    assert box["x"] >= 0
    assert box["x"] + box["width"] <= PHONE["width"]
    assert box["height"] >= 44  # a finger's target
    await shot(phone, "console-inbox-phone")
    await phone.goto(f"{console.url}/runs/{TENANT_A.app}/{TENANT_A.tenant}/{ours[0]}")
    await shot(phone, "console-run-phone")
