"""Durations as operators type them: ``90s``, ``30m``, ``2h``, ``1d``, ``1w``, or several parts, ``1h30m``."""

from __future__ import annotations

import re
from typing import Final

UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")


def parse_duration(text: str) -> float:
    """Seconds in ``text``; ValueError naming the accepted forms when it is not a duration."""
    cleaned = text.strip().lower()
    if not _WHOLE.fullmatch(cleaned):
        raise ValueError(f"{text!r} is not a duration: use e.g. 90s, 30m, 2h, 1d or 1h30m")
    return sum(float(amount) * UNITS[unit] for amount, unit in _PART.findall(cleaned))


def describe_duration(seconds: float) -> str:
    """A duration for people, to the second: ``1h30m``, ``45s``, ``2d3h``."""
    left = round(abs(seconds))
    parts = []
    for unit in ("d", "h", "m", "s"):
        amount, left = divmod(left, UNITS[unit])
        if amount:
            parts.append(f"{amount}{unit}")
    text = "".join(parts) or "0s"
    return f"-{text}" if seconds < 0 else text
