"""Sessions: the conversations runs load their history from and append their own messages to (the
append is part of the end transition)."""

from __future__ import annotations

from intermission.schemas.llm import Message, Role
from intermission.schemas.scope import Scope
from intermission.store.db import Database
from intermission.store.rows import load_model


class SessionStore:
    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def load(self, session_id: str, *, most: int = 1_000_000) -> list[Message]:
        """The session's most recent messages (at most ``most``) in order, at this exact scope. A window
        never opens on tool results: the assistant turn that asked for them was cut off, and a model
        provider refuses a tool message that answers no call it can see."""
        async with self.db.connection() as con:
            found = await con.fetch("load_session", self.scope.app, self.scope.tenant, session_id, most)
        return history([r["message"] for r in found])


def history(stored: list[str]) -> list[Message]:
    """A session's stored messages (oldest first) as a run loads them: never opening on tool results, whose
    assistant turn was cut off by the window (a model provider refuses a tool message that answers no call
    it can see)."""
    messages = [load_model(Message, raw, "session message") for raw in stored]
    start = 0
    while start < len(messages) and messages[start].role is Role.TOOL:
        start += 1
    return messages[start:]
