"""A migration that adds a column while workers run: transitions hand back whole rows, which asyncpg decodes
by the row type it looked up once per connection. A connection whose cached type went stale fails that one
call with a transient error (which callers retry), forgets what it knew of types, and works again at once."""

from __future__ import annotations

import pytest

from intermission.schemas.errors import StoreUnavailable
from intermission.schemas.scope import Scope
from intermission.store import Stores
from tests.support.factories import paused_run, writes
from tests.support.inspect import Inspector


async def test_a_row_type_changed_under_a_live_pool_is_a_transient_error_once_then_read_anew(
    database_url: str, db: Inspector, scope: Scope
) -> None:
    stores = await Stores.connect(database_url, min_size=1, max_size=1)
    try:
        first, second = await paused_run(stores, scope), await paused_run(stores, scope)
        claimed = await writes(stores, scope).suspensions.claim_suspension(first.run.id)
        assert claimed.run.id == first.run.id  # the runs and suspensions row types are now cached

        await db.con.execute("ALTER TABLE runs ADD COLUMN added_by_a_later_release text")

        with pytest.raises(StoreUnavailable):
            await writes(stores, scope).suspensions.claim_suspension(second.run.id)
        # The failed call wrote nothing, and the retry reads the new row type.
        assert (await db.run(second.run.id))["state"] == "paused"
        again = await writes(stores, scope).suspensions.claim_suspension(second.run.id)
        assert again.run.id == second.run.id
        assert (await db.run(second.run.id))["state"] == "running"
    finally:
        await stores.close()
