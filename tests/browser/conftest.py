"""The web console in a real browser: Debian's Chromium (``/usr/bin/chromium``, which ``.ci/run`` installs
when it is missing), headless, driven by Playwright's async API. Playwright's own browser download
(``playwright install``) is never used: it cannot download here, and the product is meant for the browsers
people have.

Each test gets a fresh browser profile (a new ``--user-data-dir``), and the console served by uvicorn on a
free port over the test's database and vhost, with a real worker beside it.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, Playwright, ViewportSize, async_playwright

from intermission.fleet.settings import Settings
from tests.support.confined import Confiner, Management
from tests.support.console import Served, console_settings, serving

CHROMIUM = Path("/usr/bin/chromium")
# Exactly these, and a fresh profile: without the background-networking ones Chromium knocks on Google's
# hosts at every start, which this machine's closed network refuses.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP: ViewportSize = {"width": 1280, "height": 900}
PHONE: ViewportSize = {"width": 375, "height": 812}

Browse = Callable[..., Awaitable[BrowserContext]]


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's chromium (apt-get install chromium; .ci/run does)")
    return CHROMIUM


@pytest.fixture(scope="session")
async def playwright(chromium: Path) -> AsyncIterator[Playwright]:
    async with async_playwright() as driver:
        yield driver


@pytest.fixture
async def browse(playwright: Playwright, chromium: Path) -> AsyncIterator[Browse]:
    """``await browse(viewport=...)``: a browser of its own (a fresh profile each), closed after the test."""
    opened: list[BrowserContext] = []
    folders: list[tempfile.TemporaryDirectory[str]] = []

    async def launch(viewport: ViewportSize | None = None) -> BrowserContext:
        folder = tempfile.TemporaryDirectory(prefix="intermission-chromium-")
        folders.append(folder)
        context = await playwright.chromium.launch_persistent_context(
            folder.name,
            executable_path=str(chromium),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport=viewport or DESKTOP,
            # The screenshots in the README are of a fixed, readable size.
            device_scale_factor=1,
            locale="en-GB",
            timezone_id="UTC",
        )
        opened.append(context)
        return context

    yield launch
    for context in opened:
        await context.close()
    for folder in folders:
        folder.cleanup()


@pytest.fixture
async def console(settings: Settings, management: Management, confiner: Confiner) -> AsyncIterator[Served]:
    # After the confiner: the people's connections close with the console, before their users are deleted.
    async with serving(console_settings(settings, management)) as served:
        yield served
