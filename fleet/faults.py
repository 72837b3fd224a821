"""Crash points: named places where a worker can be killed for real, to prove recovery.

When ``INTERMISSION_CRASH_AT`` names a point, the process sends itself SIGKILL the moment it reaches it
(after ``INTERMISSION_CRASH_AFTER`` earlier passes, default 0): no cleanup, no finally blocks, exactly what
a kernel OOM kill or a lost machine does. Unset, a crash point costs one comparison. The crash tests and
the soak harness use these; production never sets the variable.
"""

from __future__ import annotations

import os
import signal
from typing import Final

AFTER_CLAIM: Final = "after_claim"  # a claim committed; the run was not handed to the executor yet
AFTER_COMMIT: Final = "after_commit"  # a command's transaction committed; its message is not acknowledged
AFTER_STARTED: Final = "after_started"  # a non-retry-safe call ran; its result is not saved yet
BETWEEN_STEPS: Final = "between_steps"  # a step boundary was saved; the next step has not begun
AFTER_PAUSE: Final = "after_pause"  # a pause committed
POINTS: Final = frozenset({AFTER_CLAIM, AFTER_COMMIT, AFTER_STARTED, BETWEEN_STEPS, AFTER_PAUSE})

_target = os.environ.get("INTERMISSION_CRASH_AT", "")
_remaining = int(os.environ.get("INTERMISSION_CRASH_AFTER", "0") or 0)


def crash_point(name: str) -> None:
    global _remaining
    if name != _target:
        return
    if _remaining > 0:
        _remaining -= 1
        return
    os.kill(os.getpid(), signal.SIGKILL)
