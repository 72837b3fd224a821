"""The cluster's server faults, each with the proof that it was real.

- ``rabbit_leader_kill``: SIGKILL of the RabbitMQ node that leads most of the command queues (its Erlang
  VM, not a stop: no goodbye to its clients or its peers), held down, then started again; it rejoins the
  cluster and its quorum queue members catch up. Proof: the node led command queues, workers were
  connected to it, and every worker consumed again from the surviving nodes while it was down.
- ``pg_failover``: SIGKILL of the PostgreSQL primary's whole process group, then promotion of the
  synchronous standby (as a failover manager would: Patroni's ``synchronous_mode`` without ``strict``,
  which serves alone until a standby is back), then a new standby rebuilt from it in the old primary's
  place (``pg_basebackup``) and made synchronous again. Proof: the standby was synchronous when the
  primary died, the primary's processes were gone, and every process of the fleet had sessions on the new
  primary.
- ``worker_stall``: SIGSTOP of a worker for longer than its leases, then SIGCONT.
- ``worker_partition`` (long profile): a worker in a network namespace of its own, cut off from the
  RabbitMQ node it is connected to and later healed (``bench/cluster/partition.py``). Proof: it was on that
  node, and it connected to another while cut off.

Each fault appends a ``Proof`` (its facts and what, if anything, did not hold); the site's check turns
problems into ``faults_real`` violations.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from bench.cluster.partition import Namespace, Relay
from bench.cluster.servers import NETNS_PREFIX, STANDBY_NAME, PgServer, RabbitNode, Servers, binaries
from bench.soak.procs import Proc
from bench.soak.site import SoakRun
from intermission.wire import COMMAND_QUEUES

WAIT_SECONDS = 90.0
# PostgreSQL names a session's process by its application_name (fleet/identity.session_name and the lease
# line's "intermission-leases worker@host:pid:...").
SESSION_PID = re.compile(r"pid=(\d+)|@[^:]*:(\d+):")


@dataclass
class Proof:
    kind: str
    at: float
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class ClusterFaults:
    def __init__(self, servers: Servers, run: SoakRun, *, node_down: tuple[float, float], stall_seconds: float) -> None:
        self.servers = servers
        self.run = run
        self.node_down = node_down
        self.stall_seconds = stall_seconds
        # Which server is which changes at every failover.
        self.primary: PgServer = servers.primary
        self.standby: PgServer = servers.standby
        self.proofs: list[Proof] = []
        self.failovers = 0

    # --- RabbitMQ ---------------------------------------------------------------------------------

    def _other(self, node: RabbitNode | None) -> RabbitNode:
        return next(n for n in self.servers.rabbits if n != node)

    async def _json(self, via: RabbitNode, *args: str) -> list[dict[str, Any]]:
        out = await via.ctl("-q", *args, "--formatter", "json")
        # The tool's stderr comes along (a warning line, now and then): the answer is the JSON array.
        start = out.find("[")
        parsed = json.loads(out[start:]) if start != -1 else []
        return parsed if isinstance(parsed, list) else []

    async def queues(self, via: RabbitNode) -> list[dict[str, Any]]:
        return await self._json(
            via, "list_queues", "-p", self.run.env.vhost, "name", "type", "leader", "members", "online"
        )

    async def _consumers(self, via: RabbitNode) -> dict[str, int]:
        rows = await self._json(via, "list_queues", "-p", self.run.env.vhost, "name", "consumers")
        return {str(r["name"]): int(r["consumers"]) for r in rows}

    async def _workers_on(self, via: RabbitNode, node: RabbitNode) -> int:
        """How many connections the workers' user has on ``node`` (asked of the live node ``via``)."""
        worker = self.run.env.user("worker")
        connections = await self._json(via, "list_connections", "user", "port")
        return sum(1 for c in connections if c.get("user") == worker and int(c.get("port", 0)) == node.port)

    async def kill_leader(self) -> str:
        queues = await self.queues(self.servers.rabbits[0])
        commands = set(COMMAND_QUEUES.values())
        leaders = Counter(str(q["leader"]) for q in queues if q["name"] in commands)
        target = next(n for n in self.servers.rabbits if n.name == leaders.most_common(1)[0][0])
        survivor = self._other(target)
        proof = Proof("rabbit_leader_kill", time.monotonic())
        on_target = await self._workers_on(survivor, target)
        pinned: Proc | None = None
        if on_target == 0:
            # The fleet's workers spread over the nodes by pid, and none landed on this one: start one more
            # that tries it first (INTERMISSION_AMQP_FIRST_NODE), so that the kill costs a worker its node.
            index = self.servers.rabbits.index(target)
            pinned = await self.run.pool.start_extra_worker(
                "pinned", overrides={"INTERMISSION_AMQP_FIRST_NODE": str(index)}
            )
            began = time.monotonic()
            while on_target == 0 and time.monotonic() - began < WAIT_SECONDS and pinned.alive:
                await asyncio.sleep(0.5)
                on_target = await self._workers_on(survivor, target)
            proof.facts["pinned_worker"] = pinned.name
            if on_target == 0:
                proof.problems.append(f"no worker was connected to {target.name} when it was killed")
        proof.facts.update(
            node=target.name,
            command_queues_led=leaders[target.name],
            worker_connections_on_node=on_target,
        )
        hold = self.run.rng.uniform(*self.node_down)
        pid = target.kill()
        began = time.monotonic()
        if pid is None:
            proof.problems.append(f"{target.name} had no pid to kill")
        try:
            # While it is down, every command queue must be served again: a leader elected among the
            # survivors and every worker consuming there.
            wanted = len(self.run.pool.live())
            while True:
                try:
                    counts = await self._consumers(survivor)
                    if all(counts.get(q, 0) >= wanted for q in commands):
                        proof.facts["consuming_again_after_s"] = round(time.monotonic() - began, 2)
                        break
                except RuntimeError:
                    pass
                if time.monotonic() - began > WAIT_SECONDS:
                    proof.problems.append(f"the workers were not all consuming again within {WAIT_SECONDS:.0f} s")
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(max(0.0, hold - (time.monotonic() - began)))
        finally:
            down = time.monotonic() - began
            await target.start()
            if pinned is not None:
                await self.run.pool.stop_extra(pinned)
        proof.facts["down_s"] = round(down, 1)
        proof.facts["back_after_s"] = round(time.monotonic() - began, 1)
        self.proofs.append(proof)
        return (
            f"{target.name} (led {leaders[target.name]} command queues, {on_target} worker connections) "
            f"killed, down {down:.1f} s"
        )

    # --- PostgreSQL -------------------------------------------------------------------------------

    async def _fetch(self, server: PgServer, sql: str, *args: object) -> list[asyncpg.Record]:
        con = await asyncpg.connect(server.dsn, timeout=10)
        try:
            return list(await con.fetch(sql, *args))
        finally:
            await con.close()

    async def _sync_standby(self, server: PgServer) -> bool:
        rows = await self._fetch(server, "SELECT application_name, sync_state FROM pg_stat_replication")
        return any(r["application_name"] == STANDBY_NAME and r["sync_state"] == "sync" for r in rows)

    async def failover(self) -> str:
        bin_dir = binaries()
        assert bin_dir is not None
        old, new = self.primary, self.standby
        proof = Proof("pg_failover", time.monotonic())
        proof.facts["synchronous_before"] = await self._sync_standby(old)
        if not proof.facts["synchronous_before"]:
            proof.problems.append("the standby was not synchronous when the primary was killed")
        group = old.kill_group()
        began = time.monotonic()
        if group is None:
            proof.problems.append(f"{old.name} was not running")
        # A process polled, not an event to wait on: the kernel reaps the postmaster in its own time.
        for _ in range(200):
            if not old.running():
                break
            await asyncio.sleep(0.05)
        if old.running():
            proof.problems.append(f"{old.name}'s postmaster survived SIGKILL of its group")
        # A failover manager notices the loss before it acts.
        await asyncio.sleep(self.run.rng.uniform(1.0, 3.0))
        await new.promote(bin_dir)
        # Alone now: it must not wait for a standby that is not there (the rebuild makes it synchronous
        # again). Commits in between are on one server only, as with any failover manager's non-strict mode.
        await self._set_synchronous(new, "")
        self.primary, self.standby = new, old
        self.failovers += 1
        promoted = time.monotonic() - began
        proof.facts.update(killed_port=old.port, promoted_port=new.port, promoted_after_s=round(promoted, 1))
        moved, missing = await self._sessions_moved(new)
        proof.facts["processes_on_new_primary"] = moved
        proof.facts["all_sessions_moved_after_s"] = round(time.monotonic() - began, 1)
        if missing:
            proof.problems.append(f"processes without a session on the new primary: {missing}")
        rebuilt = time.monotonic()
        await old.follow(bin_dir, new, self.servers.hba())
        await self._set_synchronous(new, STANDBY_NAME)
        while not await self._sync_standby(new):
            if time.monotonic() - rebuilt > WAIT_SECONDS:
                proof.problems.append("the rebuilt standby did not become synchronous")
                break
            await asyncio.sleep(0.3)
        proof.facts["standby_rebuilt_in_s"] = round(time.monotonic() - rebuilt, 1)
        self.proofs.append(proof)
        return (
            f"primary :{old.port} killed (group {group}), standby :{new.port} promoted after {promoted:.1f} s, "
            f"{len(moved)} processes moved, standby rebuilt in {proof.facts['standby_rebuilt_in_s']} s"
        )

    async def _set_synchronous(self, server: PgServer, names: str) -> None:
        con = await asyncpg.connect(server.dsn, timeout=10)
        try:
            # ALTER SYSTEM takes no parameters: the value is one of two constants of ours.
            await con.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
            await con.execute("SELECT pg_reload_conf()")
        finally:
            await con.close()

    async def _sessions_moved(self, server: PgServer) -> tuple[list[str], list[str]]:
        """Waits until every running process of the fleet has a session on ``server``; returns the names of
        those that have, and of those still without one when the wait ended."""
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            rows = await self._fetch(
                server, "SELECT application_name FROM pg_stat_activity WHERE datname = $1", self.run.env.database
            )
            pids = {int(m.group(1) or m.group(2)) for r in rows if (m := SESSION_PID.search(r["application_name"]))}
            running = self.run.pool.pids()
            moved = sorted(name for pid, name in running.items() if pid in pids)
            missing = sorted(name for pid, name in running.items() if pid not in pids)
            if not missing or time.monotonic() > deadline:
                return moved, missing
            await asyncio.sleep(0.5)

    # --- workers ----------------------------------------------------------------------------------

    async def stall(self) -> str | None:
        return await self.run.pool.stall_worker(self.stall_seconds)

    async def partition(self, hold: tuple[float, float]) -> str | None:
        namespace = Namespace(f"{NETNS_PREFIX}{os.getpid()}")
        await asyncio.to_thread(namespace.create)
        rabbit_ports = [n.port for n in self.servers.rabbits]
        relay = Relay(namespace, [*rabbit_ports, self.servers.primary.port, self.servers.standby.port])
        proof = Proof("worker_partition", time.monotonic())
        try:
            await relay.start()
            proc = await self.run.pool.start_extra_worker("netns", enter=namespace.enter())
            try:
                began = time.monotonic()
                while not any(relay.active[p] for p in rabbit_ports):
                    if time.monotonic() - began > WAIT_SECONDS or not proc.alive:
                        proof.problems.append("the worker in the namespace never connected to a node")
                        self.proofs.append(proof)
                        return None
                    await asyncio.sleep(0.2)
                # Let it take work before it is cut off.
                await asyncio.sleep(5.0)
                port = next(p for p in rabbit_ports if relay.active[p])
                before = {p: relay.connections[p] for p in rabbit_ports}
                relay.partition(port)
                cut = time.monotonic()
                proof.facts.update(worker=proc.name, cut_from_port=port)
                seconds = self.run.rng.uniform(*hold)
                moved_after: float | None = None
                while time.monotonic() - cut < seconds:
                    if moved_after is None and any(relay.connections[p] > before[p] for p in rabbit_ports if p != port):
                        moved_after = time.monotonic() - cut
                    await asyncio.sleep(0.2)
                relay.heal(port)
                proof.facts["cut_for_s"] = round(time.monotonic() - cut, 1)
                proof.facts["connected_elsewhere_after_s"] = round(moved_after, 1) if moved_after is not None else None
                if moved_after is None:
                    proof.problems.append(f"the cut-off worker did not connect to another node within {seconds:.0f} s")
                # Healed: it works on for a while before it is stopped.
                await asyncio.sleep(5.0)
            finally:
                await self.run.pool.stop_extra(proc)
        finally:
            await relay.close()
            await asyncio.to_thread(namespace.remove)
        self.proofs.append(proof)
        return f"{proof.facts['worker']} cut from :{proof.facts['cut_from_port']} for {proof.facts['cut_for_s']} s"
