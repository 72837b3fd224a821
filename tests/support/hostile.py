"""Hostile message parts for the tests and the soak: what a foreign or broken client can put on the wire
that this project's own clients never would."""

from __future__ import annotations


class RawText(str):
    """A header value that goes on the wire as a string header holding ``raw``, which need not be UTF-8:
    the AMQP client encodes a string by calling its ``encode``. It is how a foreign client's bytes are sent
    from here."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawText:
        made = super().__new__(cls, "raw")
        made.raw = raw
        return made

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


def nested(depth: int) -> bytes:
    """A JSON body whose scope nests ``depth`` arrays deep: small, and deeper than any parser should walk."""
    return b'{"scope": ' + b"[" * depth + b"]" * depth + b"}"


def padded_id(base: str, size: int = 250) -> str:
    """``base`` padded to ``size`` bytes: an id that fits AMQP's 255 bytes but not once prefixed."""
    return base + "-" + "m" * (size - len(base.encode()) - 1)
