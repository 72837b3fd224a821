"""Sessions: the conversations runs load their history from and append their own messages to."""

from __future__ import annotations

from intermission.schemas.llm import Message
from intermission.schemas.scope import Scope, require_scope
from intermission.store.db import Database
from intermission.store.rows import load_model


class SessionStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def load(self, scope: Scope, session_id: str) -> list[Message]:
        """The session's messages in order, at the exact scope."""
        require_scope(scope)
        async with self.db.connection() as con:
            found = await con.fetch("load_session", scope.app, scope.tenant, session_id)
        return [load_model(Message, r["message"], "session message") for r in found]
