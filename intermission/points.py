"""Named points in a worker's work, where an observer may watch it pass.

They name the moments at which a crash is most dangerous to the exactly-once guarantees: a claim just
committed, a command committed but not acknowledged, a non-retry-safe call that ran but whose result is
not saved, a step boundary, a pause. The crash tests and the soak install an observer that SIGKILLs the
process at one of them (``tests/support/crash.py``), which is how recovery from each is proved with a real
kill. An observer may also raise, which is how the refusal path is shown to settle a delivery even when
building its refusal fails. Production installs none; reaching a point then costs one comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

AFTER_CLAIM: Final = "after_claim"  # a claim committed; the run was not handed to the executor yet
AFTER_COMMIT: Final = "after_commit"  # a command's transaction committed; its message is not acknowledged
# A batch of commands committed together (group commit); none of their messages is acknowledged yet.
AFTER_BATCH_COMMIT: Final = "after_batch_commit"
AFTER_STARTED: Final = "after_started"  # a non-retry-safe call ran; its result is not saved yet
BETWEEN_STEPS: Final = "between_steps"  # a step boundary was saved; the next step has not begun
AFTER_PAUSE: Final = "after_pause"  # a pause committed
REFUSING: Final = "refusing"  # a command is refused; its refusal is not built or published yet
POINTS: Final = frozenset(
    {AFTER_CLAIM, AFTER_COMMIT, AFTER_BATCH_COMMIT, AFTER_STARTED, BETWEEN_STEPS, AFTER_PAUSE, REFUSING}
)

Observer = Callable[[str], None]

_observer: Observer | None = None


def observe(observer: Observer | None) -> None:
    """Call ``observer`` with the point's name whenever this process reaches one (None: stop)."""
    global _observer
    _observer = observer


def reach(point: str) -> None:
    if _observer is not None:
        _observer(point)
