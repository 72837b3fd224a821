"""A record of the demo's charges kept OUTSIDE the database: one line per call of the ``charge`` tool's
handler, written and flushed to disk before the charge reaches the database.

The soak counts double charges in ``demo_charges``, but on a cluster the database itself fails over: a
charge written on the old primary and lost with it would hide a second one made on the new primary. The
journal is what a card processor's statement is to a real charge: it outlives any database timeline, so
"no (run, call_id) twice in the journal" is the check that holds across failovers. A run is named by its
key, its scope and id (a run id is unique only within its scope).

``INTERMISSION_TEST_CHARGE_JOURNAL`` names the file (appended to by every worker at once: each line is one
``write`` of an ``O_APPEND`` descriptor, which the kernel never interleaves on a local file system).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from intermission.schemas.scope import Scope
from intermission.store.ledger import DemoLedger

ENV = "INTERMISSION_TEST_CHARGE_JOURNAL"


@dataclass(frozen=True)
class JournalEntry:
    app: str
    tenant: str
    run_id: str
    call_id: str
    pid: int


def append(path: Path, scope: Scope, run_id: str, call_id: str) -> None:
    entry = {"app": scope.app, "tenant": scope.tenant, "run_id": run_id, "call_id": call_id, "pid": os.getpid()}
    line = json.dumps(entry) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> list[JournalEntry]:
    """Every entry; a torn last line (a worker killed mid-write) is not an entry."""
    if not path.exists():
        return []
    entries: list[JournalEntry] = []
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        entries.append(
            JournalEntry(str(raw["app"]), str(raw["tenant"]), str(raw["run_id"]), str(raw["call_id"]), int(raw["pid"]))
        )
    return entries


def install_from_environment() -> None:
    """Make every charge of this process write its journal line first, when ``ENV`` names a file."""
    target = os.environ.get(ENV, "")
    if not target:
        return
    path = Path(target)
    booked = DemoLedger.charge

    async def charge(self: DemoLedger, run_id: str, call_id: str, amount: Decimal) -> int:
        append(path, self.scope, run_id, call_id)
        return await booked(self, run_id, call_id, amount)

    DemoLedger.charge = charge  # type: ignore[method-assign]
