"""Bounds on every request the console takes, applied before any route or form parser sees it.

Starlette parses a form when a handler asks for it, whatever its size: a urlencoded body is read whole
into memory and a multipart one is spooled to disk, so ``/login`` and ``/logout`` (which parse before
anything checks who is asking) took up to a gigabyte from anyone. No page of the console takes a file or
a long text, so a small limit on every body is enough; multipart is refused outright. Requests in flight
are bounded too, and the long-lived event streams apart from them, so that neither a burst of requests
nor pages left open hold the console's memory, its database pool or its broker channels without end: past
a bound a request is answered 503 at once rather than queued.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The largest form the console shows is a decision with its reason: a few KB.
MAX_BODY_BYTES: Final = 16 * 1024


class BodyTooLarge(Exception):
    """The body grew past the limit while it was being read."""


async def _answer(send: Send, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestBounds:
    """ASGI middleware: body size, content type, and requests and streams in flight, for every route."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_requests: int = 64,
        max_streams: int = 256,
        stream_paths: Iterable[str] = ("/events",),
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_requests = max_requests
        self.max_streams = max_streams
        self.stream_paths = frozenset(stream_paths)
        self.requests = 0
        self.streams = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if headers.get(b"content-type", b"").lower().startswith(b"multipart/"):
            await _answer(send, 415, "no page of the console takes multipart bodies")
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _answer(send, 413, f"a body may hold at most {self.max_body_bytes} bytes")
            return
        streaming = scope.get("path") in self.stream_paths
        # Counted without awaiting in between: the check and the count cannot be raced.
        if (streaming and self.streams >= self.max_streams) or (not streaming and self.requests >= self.max_requests):
            await _answer(send, 503, "the console is busy; try again in a moment")
            return
        if streaming:
            self.streams += 1
        else:
            self.requests += 1
        try:
            await self._bounded(scope, receive, send)
        finally:
            if streaming:
                self.streams -= 1
            else:
                self.requests -= 1

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request with its body counted as it is read (a chunked body declares no length)."""
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            await _answer(send, 413, f"a body may hold at most {self.max_body_bytes} bytes")
