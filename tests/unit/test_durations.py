"""Durations as operators type them (``ops/durations.py``): what is accepted, what it means, what is refused."""

from __future__ import annotations

import pytest

from intermission.ops.durations import describe_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1w", 604800), ("1h30m", 5400), (" 1.5H ", 5400)],
)
def test_durations_in_every_unit_and_together(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "5x", "h", "-1h", "1h 30m", "soon", "1e3s"])
def test_what_is_not_a_duration_is_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"use e\.g\. 90s, 30m, 2h, 1d or 1h30m"):
        parse_duration(text)


def test_a_duration_for_people() -> None:
    assert describe_duration(5400) == "1h30m"
    assert describe_duration(0) == "0s"
    assert describe_duration(2 * 86400 + 3 * 3600 + 5) == "2d3h5s"
    assert describe_duration(-61) == "-1m1s"
