"""Throttling logins: the console checks passwords against the broker, and must not be a faster way to
guess them, nor a way to keep a person out.

Failures are counted per user name AND source address, and per source address alone:

- a name tried from one address backs off after a few failures (1 s, 2 s, 4 s ... up to a minute), so one
  person's password is not guessed quickly from there, and a person who mistyped waits seconds;
- an address that fails across many names backs off too, so one password sprayed over every name is
  throttled as well;
- nothing is counted per name alone: failures from an attacker's address never slow the person down at
  their own address (backoff, not a ban, and never a lock-out).

A login is let through only when nothing of its own is in flight (one password check at a time per name
and address, a few per address): the check and the reservation happen together, before the await that asks
the broker, so a parallel burst cannot slip many checks past one decision. The state is bounded: entries
expire once their backoff and failure window pass, and past ``max_entries`` the least recently used go.
The address is the TCP peer's; behind a proxy it is the proxy's, and the per-address bounds then apply to
everyone behind it (say so to operators rather than trust a header anyone can send).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

# Failures of one name from one address before it backs off, and of one address across names.
FREE_FAILURES: Final = 3
FREE_ADDRESS_FAILURES: Final = 10
# The longest a backoff lasts, and how long a failure is remembered.
MAX_BACKOFF_SECONDS: Final = 60.0
FAILURE_WINDOW_SECONDS: Final = 600.0
# Password checks in flight at once from one address.
ADDRESS_IN_FLIGHT: Final = 4


@dataclass
class _Tally:
    failures: int = 0
    not_before: float = 0.0
    last_failure: float = 0.0
    in_flight: int = 0

    def backoff(self, now: float, free: int) -> None:
        self.failures += 1
        self.last_failure = now
        if self.failures > free:
            self.not_before = now + min(MAX_BACKOFF_SECONDS, 2.0 ** (self.failures - free - 1))

    def stale(self, now: float) -> bool:
        return self.in_flight == 0 and now >= self.not_before and now - self.last_failure > FAILURE_WINDOW_SECONDS


class LoginThrottle:
    def __init__(self, *, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._tallies: OrderedDict[tuple[str, str], _Tally] = OrderedDict()

    def _tally(self, key: tuple[str, str], now: float) -> _Tally:
        tally = self._tallies.get(key)
        if tally is None or tally.stale(now):
            tally = _Tally()
        self._tallies[key] = tally
        self._tallies.move_to_end(key)
        while len(self._tallies) > self.max_entries:
            oldest, first = next(iter(self._tallies.items()))
            if first.in_flight:  # a check in flight keeps its entry until it is finished
                self._tallies.move_to_end(oldest)
                break
            del self._tallies[oldest]
        return tally

    def begin(self, user: str, address: str, now: float) -> float | None:
        """Reserve a password check of ``user`` from ``address``; None when it may go ahead (``finish``
        must follow), else how many seconds to wait first."""
        pair = self._tally(("name", f"{address}\x00{user}"), now)
        source = self._tally(("address", address), now)
        wait = max(pair.not_before - now, source.not_before - now, 0.0)
        if wait > 0:
            return wait
        if pair.in_flight or source.in_flight >= ADDRESS_IN_FLIGHT:
            return 1.0
        pair.in_flight += 1
        source.in_flight += 1
        return None

    def finish(self, user: str, address: str, now: float, *, refused: bool | None) -> None:
        """End the check ``begin`` reserved: ``refused`` True when the broker refused the password, False
        when it accepted it, None when it could not say (unreachable), which counts for nothing."""
        pair = self._tally(("name", f"{address}\x00{user}"), now)
        source = self._tally(("address", address), now)
        pair.in_flight = max(0, pair.in_flight - 1)
        source.in_flight = max(0, source.in_flight - 1)
        if refused is False:
            pair.failures, pair.not_before = 0, 0.0
        elif refused:
            pair.backoff(now, FREE_FAILURES)
            source.backoff(now, FREE_ADDRESS_FAILURES)

    def __len__(self) -> int:
        return len(self._tallies)
