"""The sweeper's pacing: a second's worth of commands in one burst, then a wait, across page boundaries."""

from __future__ import annotations

import asyncio

import pytest

from intermission.publishers import sweeper
from intermission.publishers.sweeper import _Pacer


async def test_a_pacer_lets_a_seconds_worth_go_at_once_across_pages_then_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []

    async def recorded(_stop: asyncio.Event, seconds: float) -> None:
        waits.append(seconds)  # recorded, not slept

    monkeypatch.setattr(sweeper, "wait_or_stop", recorded)
    pacer = _Pacer(5.0)
    stop = asyncio.Event()
    bursts: list[int] = []
    # Three pages of 3, as the sweeper hands them over.
    for page in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        while page:
            take = pacer.allowance()
            burst, page = page[:take], page[take:]
            bursts.append(len(burst))
            await pacer.spent(len(burst), stop)

    # 3 + 2 fill the first second (then a wait), 1 + 3 are the second second's start.
    assert bursts == [3, 2, 1, 3]
    assert len(waits) == 1
    assert 0 < waits[0] <= 1.0


def test_a_pacer_below_one_command_a_second_still_sends_one_at_a_time() -> None:
    assert _Pacer(0.5).allowance() == 1
