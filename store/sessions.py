"""Sessions: the conversations runs load their history from and append their own messages to (the
append is part of the end transition)."""

from __future__ import annotations

from intermission.schemas.llm import Message
from intermission.schemas.scope import Scope
from intermission.store.db import Database
from intermission.store.rows import load_model


class SessionStore:
    def __init__(self, db: Database, scope: Scope) -> None:
        self.db = db
        self.scope = scope

    async def load(self, session_id: str) -> list[Message]:
        """The session's messages in order, at this exact scope."""
        async with self.db.connection() as con:
            found = await con.fetch("load_session", self.scope.app, self.scope.tenant, session_id)
        return [load_model(Message, r["message"], "session message") for r in found]
