"""The cluster harness's profiles: the soak's ``Profile`` with four workers and the cluster's faults."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.soak.profile import Profile, scaled


@dataclass(frozen=True)
class ClusterProfile:
    soak: Profile
    # How long a killed RabbitMQ node stays down: uniform in [lo, hi] seconds.
    node_down: tuple[float, float]
    # How long a stalled worker stays stopped (its leases are 2 s).
    stall_seconds: float
    # Whether the deck holds worker partitions (network namespaces), and how long one lasts.
    partitions: bool
    partition_hold: tuple[float, float] = (20.0, 40.0)
    # Both heavy faults in the first deck, so that a short run sees each.
    heavy_per_deck: int = 1


PROFILES: dict[str, ClusterProfile] = {
    # CI: a node kill and a failover (with the standby rebuilt) among a dozen lighter faults, about four
    # minutes with the servers' boot.
    "short": ClusterProfile(
        soak=Profile(
            name="cluster-short",
            load_seconds=120.0,
            runs=240,
            workers=4,
            sweepers=2,
            infra_every=(3.0, 5.0),
            command_every=(0.8, 2.0),
            drain_seconds=120.0,
            rabbit_down=(0.0, 0.0),
            pg_down=(0.0, 0.0),
        ),
        node_down=(5.0, 8.0),
        stall_seconds=5.0,
        partitions=False,
        heavy_per_deck=2,
    ),
    # Repeated node kills and failovers (each rebuilding the standby), worker partitions; 20 minutes by
    # default, --minutes to change it.
    "long": ClusterProfile(
        soak=Profile(
            name="cluster-long",
            load_seconds=20 * 60.0,
            runs=20 * 60 * 2,
            workers=4,
            sweepers=2,
            infra_every=(8.0, 20.0),
            command_every=(1.0, 3.0),
            drain_seconds=240.0,
            rabbit_down=(0.0, 0.0),
            pg_down=(0.0, 0.0),
            light_per_deck=2,
        ),
        node_down=(5.0, 20.0),
        stall_seconds=5.0,
        partitions=True,
    ),
}


def resolve(name: str, *, minutes: float | None = None, runs: int | None = None) -> ClusterProfile:
    profile = PROFILES[name]
    return replace(profile, soak=scaled(profile.soak, minutes=minutes, runs=runs))
