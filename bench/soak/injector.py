"""The fault injector: two loops while the load runs.

- Infrastructure faults, drawn from shuffled decks so every kind comes up in every profile: SIGKILL and
  SIGTERM of a worker (a new one is started each time), an extra worker started with
  ``INTERMISSION_CRASH_AT`` at one of the worker's crash points (it kills itself there), and the site's
  server faults (``bench/soak/site.py``): on the machine's own servers, terminating the soak database's
  backends and (one per deck, in turn) a RabbitMQ ``stop_app``/``start_app``, a PostgreSQL stop/start of
  30 s (a managed failover's length) or a short one.
- Command faults: malformed (a body acting in another scope than its key's among them), hostile (nested
  5,000 deep, a 250-byte message id, a header that is not UTF-8, numbers past what the database holds),
  headers nested 500 deep or filling nearly a frame, and oversized commands, an unknown run, duplicates
  and reordered commands, mallory's reach for another tenant's pause (keyed for the victim's scope:
  refused by the broker; keyed for its own with the victim's body: forbidden; the victim's run named in its
  own scope: not found), replies from users who are not the bus, decisions from non-approvers, answers of
  the wrong kind, mismatched results, re-used message ids, starts over ended runs and cancels of ended
  runs. Those that need a live pause or an ended run are posted as wishes to the actors. And a tenant's
  flood (``tenant_flood``): the flooding tenant publishes ``Profile.flood_size`` starts at once, over its
  quota of live runs, and another tenant's probe run is started right behind them (``actors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time

from bench.soak.actors import HEADER_VARIANTS, HOSTILE_VARIANTS, MALFORMED_VARIANTS, Simulator
from bench.soak.ledger import Ledger
from bench.soak.procs import ProcessPool
from bench.soak.profile import Profile
from bench.soak.site import FaultPlan
from intermission import points

log = logging.getLogger("soak.injector")

# The fleet's own faults; a site adds its server faults to them (``bench/soak/site.py``).
LIGHT = (
    "worker_sigkill",
    "worker_sigkill",
    "worker_sigterm",
    "worker_crash_point",
    "worker_crash_point",
)
# The crash points a worker process reaches (after_claim is the in-process control's, not the consumers').
CRASH_POINTS = (points.AFTER_COMMIT, points.AFTER_STARTED, points.BETWEEN_STEPS, points.AFTER_PAUSE)
# Malformed commands come twice a deck: they need no pause, and their eight variants (taken in turn) should
# all come up in the short profile.
COMMAND_DECK = (
    "malformed_command",
    "malformed_command",
    "hostile_message",
    "nested_header",
    "near_frame_header",
    "oversized_command",
    "unknown_run",
    "foreign_scope_command",
    "cross_tenant_key",
    "cross_tenant_body",
    "forged_dead_letter",
    "non_bus_reply",
    "non_approver_decision",
    "wrong_authority",
    "results_mismatch",
    "duplicate_command",
    "reordered_commands",
    "message_id_conflict",
    "run_exists",
    "cancel_ended",
    "tenant_flood",
)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


class Injector:
    def __init__(
        self,
        profile: Profile,
        rng: random.Random,
        ledger: Ledger,
        pool: ProcessPool,
        plan: FaultPlan,
        sim: Simulator,
    ) -> None:
        self.profile = profile
        self.rng = rng
        self.ledger = ledger
        self.pool = pool
        self.plan = plan
        self.sim = sim
        self._crashes = 0
        self._heavy = 0
        self._malformed = 0
        self._hostile = 0
        self._oversized = 0
        self._duplicates = 0
        self._floods = 0

    async def infra_loop(self, until: float, stop: asyncio.Event) -> None:
        deck: list[str] = []
        while not stop.is_set():
            await _wait(stop, self.rng.uniform(*self.profile.infra_every))
            if stop.is_set() or time.monotonic() >= until:
                return
            if not deck:
                deck = [*(LIGHT + self.plan.light) * self.profile.light_per_deck]
                for _ in range(self.plan.heavy_per_deck if self.plan.heavy else 0):
                    deck.append(self.plan.heavy[self._heavy % len(self.plan.heavy)])
                    self._heavy += 1
                self.rng.shuffle(deck)
            kind = deck.pop()
            at = time.monotonic()
            try:
                detail = await self._infra(kind)
            except Exception as exc:
                log.exception("fault %s failed", kind)
                self.ledger.fault(
                    kind,
                    f"could not inject: {type(exc).__name__}: {exc}",
                    at=at,
                    done=False,
                    infrastructure=True,
                    ended=time.monotonic(),
                )
                self.ledger.notes.append(f"{kind} could not be injected: {exc}")
                continue
            # Each action returns once its fault is undone (the server back, the worker replaced): its
            # interval is what the checker weighs a flood's probe against.
            ended = time.monotonic()
            if detail is None:
                self.ledger.fault(kind, "no target", at=at, done=False, infrastructure=True, ended=ended)
            else:
                self.ledger.fault(kind, detail, at=at, infrastructure=True, ended=ended)
                log.info("fault %s: %s", kind, detail)

    async def _infra(self, kind: str) -> str | None:
        if kind == "worker_sigkill":
            return await self.pool.kill_worker(signal.SIGKILL)
        if kind == "worker_sigterm":
            return await self.pool.kill_worker(signal.SIGTERM)
        if kind == "worker_crash_point":
            point = CRASH_POINTS[self._crashes % len(CRASH_POINTS)]
            started = await self.pool.crash_worker(point, self.rng.randint(0, 3))
            if started is not None:
                self._crashes += 1
                return f"{point}: {started}"
            return None
        action = self.plan.actions.get(kind)
        if action is None:
            raise AssertionError(f"no action for fault {kind!r}")
        return await action()

    async def command_loop(self, until: float, stop: asyncio.Event) -> None:
        deck: list[str] = []
        while not stop.is_set():
            await _wait(stop, self.rng.uniform(*self.profile.command_every))
            if stop.is_set() or time.monotonic() >= until:
                return
            if not deck:
                deck = list(COMMAND_DECK)
                self.rng.shuffle(deck)
            self._command(deck.pop())

    def _command(self, kind: str) -> None:
        sim = self.sim
        if kind == "malformed_command":
            variant = MALFORMED_VARIANTS[self._malformed % len(MALFORMED_VARIANTS)]
            self._malformed += 1
            sim.spawn(sim.malformed(variant), f"fault:{variant}")
        elif kind == "hostile_message":
            variant = HOSTILE_VARIANTS[self._hostile % len(HOSTILE_VARIANTS)]
            self._hostile += 1
            sim.spawn(sim.malformed(variant), f"fault:{variant}")
        elif kind in HEADER_VARIANTS:
            sim.spawn(sim.malformed(kind), f"fault:{kind}")
        elif kind == "oversized_command":
            # A 17 MiB body is heavy for the broker: one in three; the others are 8 MiB replies at a pause.
            if self._oversized % 3 == 0:
                sim.spawn(sim.malformed("oversized_body"), "fault:oversized_body")
            else:
                sim.wish(kind)
            self._oversized += 1
        elif kind == "unknown_run":
            sim.spawn(sim.unknown_run(), "fault:unknown_run")
        elif kind == "tenant_flood":
            self._floods += 1
            # The bound is per worker alive when the burst goes (a worker killed later is a fault the
            # checker weighs); crash-point workers are extras that die soon, so they are not counted.
            workers = len(self.pool.live())
            name = f"flood{self._floods}"
            sim.spawn(sim.flood(name, self.profile.flood_size, self.profile.flood_quota, workers), f"fault:{name}")
        elif kind == "duplicate_command":
            self._duplicates += 1
            if self._duplicates % 2:
                sim.spawn(self._duplicate_start(), "fault:duplicate_start")
            else:
                sim.wish(kind)
        else:
            sim.wish(kind)

    async def _duplicate_start(self) -> None:
        if not await self.sim.duplicate_start():
            self.sim.wish("duplicate_command")
