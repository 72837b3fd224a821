"""``intermission demo`` plays its three runs to completion through the real servers."""

from __future__ import annotations

from intermission.ops.demo import play
from intermission.schemas.run import RunState
from intermission.store import Stores
from tests.support.amqp import DELIVERY_LIMIT
from tests.support.fleet import fast_settings


async def test_the_demo_completes_a_run_for_each_pause_reason(stores: Stores, database_url: str, amqp_url: str) -> None:
    story: list[str] = []
    settings = fast_settings(database_url, amqp_url=amqp_url, delivery_limit=DELIVERY_LIMIT)
    assert await play(settings, story.append) == 3
    text = "\n".join(story)
    for reason in ("external_tool", "approval", "agent_reply"):
        assert f"paused ({reason})" in text
    assert "Done: 3 of 3 runs completed" in text
    runs = await stores.across_scopes.list_runs(RunState.COMPLETED, 10)
    assert {r.id.split("-")[0] for r in runs} == {"weather", "invoice", "quote"}
    async with stores.db.connection() as con:
        assert await con.raw.fetchval("SELECT count(*) FROM demo_charges") == 1
