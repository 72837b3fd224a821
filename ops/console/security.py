"""What keeps a browser session honest: CSRF tokens on every form, response headers that let the pages
load nothing from anywhere else, and redirects that stay on the console.

The session cookie itself is Starlette's ``SessionMiddleware`` (signed, HttpOnly, SameSite=Strict, and
Secure with ``INTERMISSION_CONSOLE_HTTPS_ONLY``); it holds the session's random id, or before login only the
login form's CSRF token. SameSite=Strict already keeps other sites' forms from carrying the cookie; the
token is the second lock, and the one that also covers the login form (a login CSRF would sign a person
in as someone else).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Final

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The pages load their one stylesheet and one script from the console itself, and nothing else: no inline
# script or style (so an injected one would not run), no frames, forms that post only here.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS: Final = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
}


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_matches(expected: str | None, given: object) -> bool:
    """Whether a form's CSRF token is the one its session was given (in constant time)."""
    if not expected or not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def local_path(target: object, default: str = "/inbox") -> str:
    """``target`` when it is a path of this console (``/runs/...``), else ``default``: a redirect after a form
    never leads off the console (``//elsewhere`` or ``https://...`` are refused)."""
    if not isinstance(target, str) or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    if any(ord(c) < 0x20 for c in target):
        return default
    return target


class SecurityHeaders:
    """Adds ``HEADERS`` to every response, and ``Cache-Control: no-store`` to every page (what a person's
    scopes hold must not stay in a shared cache or the browser's history)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = str(scope.get("path", "")).startswith("/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers.setdefault(name, value)
                if not static:
                    headers.setdefault("cache-control", "no-store")
            await send(message)

        await self.app(scope, receive, with_headers)
