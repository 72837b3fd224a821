from __future__ import annotations

import pytest

from intermission.schemas.errors import NotSuspended
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, LeasedClaim, Progress
from intermission.store import Stores
from tests.support.factories import lease, paused_run, writes


async def test_claim_then_second_claim(stores: Stores, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    held = lease()
    got = await writes(stores, scope).suspensions.claim_suspension_leased(
        LeasedClaim(
            version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
            lease=held,
            first=Progress(run_id=p.run.id, owner=held.owner, continuation=p.suspension.continuation),
        ),
    )
    assert got.run is not None
    assert got.run.state is RunState.RUNNING
    assert got.run.revision == p.revision + 1
    with pytest.raises(NotSuspended):
        await writes(stores, scope).suspensions.claim_suspension(p.run.id)
    prog = await stores.at(scope).progress.get_progress(p.run.id)
    assert prog.continuation.prepared == b"\x00\x01opaque\xff"
