from __future__ import annotations

import pytest

from intermission.schemas.errors import NotSuspended
from intermission.schemas.run import RunState
from intermission.schemas.scope import Scope
from intermission.schemas.suspension import ClaimVersion, LeasedClaim, Progress
from intermission.store import Stores
from tests.support.factories import lease, paused_run


async def test_claim_then_second_claim(stores: Stores, scope: Scope) -> None:
    p = await paused_run(stores, scope)
    held = lease()
    got = await stores.suspensions.claim_suspension_leased(
        scope,
        LeasedClaim(
            version=ClaimVersion(run_id=p.run.id, suspension_id=p.suspension.id, run_revision=p.revision),
            lease=held,
            first=Progress(run_id=p.run.id, owner=held.owner, continuation=p.suspension.continuation),
        ),
    )
    assert got.claimed_run is not None
    assert got.claimed_run.state is RunState.RUNNING
    assert got.claimed_run.revision == p.revision + 1
    with pytest.raises(NotSuspended):
        await stores.suspensions.claim_suspension(scope, p.run.id)
    prog = await stores.progress.get_progress(scope, p.run.id)
    assert prog.continuation.prepared == b"\x00\x01opaque\xff"
