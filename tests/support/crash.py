"""Crash points made real: a process that SIGKILLs itself at a named point of its work.

``INTERMISSION_CRASH_AT`` names a point of ``intermission.points`` and ``INTERMISSION_CRASH_AFTER``
how many earlier passes to let by (default 0). The kill is SIGKILL: no cleanup, no ``finally`` blocks,
exactly what a kernel OOM kill or a lost machine does.

    python -m tests.support.crash worker     # the intermission CLI, crashing where the environment says

The crash tests and the soak start their crashing workers this way; the product itself never kills
itself. When ``INTERMISSION_TEST_CHARGE_JOURNAL`` names a file, the demo's charges are also journalled
there (``tests/support/charge_journal.py``), outside the database.
"""

from __future__ import annotations

import os
import signal

from intermission import points
from tests.support import charge_journal


def install_from_environment() -> None:
    target = os.environ.get("INTERMISSION_CRASH_AT", "")
    if not target:
        return
    if target not in points.POINTS:
        raise SystemExit(f"INTERMISSION_CRASH_AT={target!r} is not one of {sorted(points.POINTS)}")
    remaining = int(os.environ.get("INTERMISSION_CRASH_AFTER", "0") or 0)

    def crash(point: str) -> None:
        nonlocal remaining
        if point != target:
            return
        if remaining > 0:
            remaining -= 1
            return
        os.kill(os.getpid(), signal.SIGKILL)

    points.observe(crash)


def main() -> None:
    install_from_environment()
    charge_journal.install_from_environment()
    from intermission.ops.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
