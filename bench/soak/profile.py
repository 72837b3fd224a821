"""Soak profiles: how long, how many runs, how many processes and how often faults strike."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    # Length of the load phase (runs are started and faults injected), in seconds.
    load_seconds: float
    # Runs started over the load phase (paced evenly).
    runs: int
    workers: int
    sweepers: int
    # Seconds between two infrastructure faults (kills, crashes, server outages): uniform in [lo, hi].
    infra_every: tuple[float, float]
    # Seconds between two command faults (bad, foreign, forged, duplicated, reordered commands).
    command_every: tuple[float, float]
    # How long the drain may take before the checker is run on whatever state was reached.
    drain_seconds: float
    # How long a server stays down in an outage fault: uniform in [lo, hi] seconds.
    rabbit_down: tuple[float, float]
    pg_down: tuple[float, float]
    # The long PostgreSQL outage: as long as a managed failover.
    pg_long_down: float = 30.0
    # Each deck of infrastructure faults holds these light faults (several times each) and ONE heavy one
    # (a RabbitMQ or a PostgreSQL restart, alternately).
    light_per_deck: int = 1
    # Short deadlines for the runs that test them, in seconds.
    deadline_seconds: tuple[int, int] = (2, 4)
    # A tenant's flood (``tenant_flood``, once per deck of command faults): the starts it publishes at
    # once, and its scope's quota of live runs (its runs never end, so every start past the first
    # ``flood_quota`` of the soak is refused quota_exceeded).
    flood_size: int = 300
    flood_quota: int = 10


PROFILES: dict[str, Profile] = {
    # CI: on two cores this ends well inside four minutes, with at least 300 runs and 20 faults.
    "short": Profile(
        name="short",
        load_seconds=130.0,
        runs=330,
        workers=3,
        sweepers=2,
        infra_every=(4.0, 7.0),
        command_every=(0.8, 2.0),
        drain_seconds=60.0,
        rabbit_down=(1.0, 2.0),
        pg_down=(0.5, 1.5),
        light_per_deck=1,
    ),
    # The long soak (README: 30 minutes); --minutes shortens or lengthens it, --runs changes the total.
    "long": Profile(
        name="long",
        load_seconds=30 * 60.0,
        runs=30 * 60 * 2,
        workers=3,
        sweepers=2,
        infra_every=(8.0, 20.0),
        command_every=(1.0, 3.0),
        drain_seconds=180.0,
        rabbit_down=(1.0, 4.0),
        pg_down=(0.5, 3.0),
        light_per_deck=2,
        flood_size=1000,
    ),
}


def resolve(name: str, *, minutes: float | None = None, runs: int | None = None) -> Profile:
    """The named profile, with the load phase set to ``minutes`` (runs scaled to keep the same rate) and
    the total of runs set to ``runs`` when given."""
    return scaled(PROFILES[name], minutes=minutes, runs=runs)


def scaled(profile: Profile, *, minutes: float | None = None, runs: int | None = None) -> Profile:
    """``profile`` with its load phase set to ``minutes`` (runs scaled to keep the same rate) and its total
    of runs set to ``runs`` when given."""
    if minutes is not None:
        rate = profile.runs / profile.load_seconds
        profile = replace(profile, load_seconds=minutes * 60.0, runs=max(1, round(rate * minutes * 60.0)))
    if runs is not None:
        profile = replace(profile, runs=runs)
    return profile
