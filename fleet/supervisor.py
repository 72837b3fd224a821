"""One supervisor per process for its background loops: the outbox relay (and the LISTEN listener inside
it), the reclaim sweep, the lease keeper and the expiry sweeper.

Each loop handles the failures it expects (the database or broker away) itself, with backoff. What it does
not expect would otherwise end its task in silence: an asyncio task's exception is only seen by whoever
awaits it, and a worker whose relay died keeps consuming commands whose events nobody publishes. So the
supervisor owns every such task: an unexpected exception is logged with its traceback and the loop is
started again after a backoff that grows with consecutive failures. A loop that fails ``max_failures``
times within ``window_seconds`` is not going to heal in this process (a bug, a broken deployment): the
supervisor gives up and the process stops with a non-zero status, so that ITS supervisor (systemd,
Kubernetes, compose) restarts it and says so where operators look.

A loop that returns normally (its stop was set) is done and is not restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from intermission.schemas.errors import IntermissionError

log = logging.getLogger("intermission.supervisor")

Loop = Callable[[], Coroutine[Any, Any, None]]


class SupervisedTaskFailed(IntermissionError):
    """A background loop kept failing; the process must stop and be restarted."""

    code = "task_failed"


class Supervisor:
    def __init__(
        self,
        *,
        max_failures: int = 5,
        window_seconds: float = 60.0,
        first_backoff_seconds: float = 0.2,
        max_backoff_seconds: float = 10.0,
        on_restart: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.max_failures = max_failures
        self.window_seconds = window_seconds
        self.first_backoff_seconds = first_backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        # Called with the loop's name at every restart: the worker counts them for metrics.
        self.on_restart = on_restart
        self.restarts: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Loops waiting out their backoff after a failure, and the one the supervisor gave up on: what the
        # readiness endpoint reports as not running (``states``).
        self._restarting: set[str] = set()
        self._given_up: str | None = None
        self._gave_up = asyncio.Event()
        self._failure: SupervisedTaskFailed | None = None

    def start(self, name: str, loop: Loop) -> None:
        """Run ``loop()`` under supervision, as the task ``name``."""
        if name in self._tasks and not self._tasks[name].done():
            raise RuntimeError(f"{name} is supervised already")
        self.restarts.setdefault(name, 0)
        self._tasks[name] = asyncio.create_task(self._keep(name, loop), name=name)

    def running(self, name: str) -> bool:
        task = self._tasks.get(name)
        return task is not None and not task.done()

    def states(self) -> dict[str, str]:
        """Each supervised loop's state: ``running``, ``restarting`` (failed, waiting out its backoff),
        ``failed`` (given up on) or ``stopped`` (returned, or cancelled)."""
        states: dict[str, str] = {}
        for name, task in self._tasks.items():
            if name == self._given_up:
                states[name] = "failed"
            elif name in self._restarting:
                states[name] = "restarting"
            elif task.done():
                states[name] = "stopped"
            else:
                states[name] = "running"
        return states

    @property
    def failure(self) -> SupervisedTaskFailed | None:
        """Why the supervisor gave up, once it has."""
        return self._failure

    async def wait_given_up(self) -> SupervisedTaskFailed:
        await self._gave_up.wait()
        assert self._failure is not None
        return self._failure

    async def _keep(self, name: str, loop: Loop) -> None:
        failures: deque[float] = deque()
        while True:
            try:
                await loop()
                return
            except Exception as exc:
                now = time.monotonic()
                failures.append(now)
                while failures and failures[0] < now - self.window_seconds:
                    failures.popleft()
                if len(failures) >= self.max_failures:
                    log.critical(
                        "a background task keeps failing; stopping the process",
                        exc_info=exc,
                        extra={"action": "task_gave_up", "task": name, "failures": len(failures)},
                    )
                    self._failure = SupervisedTaskFailed(
                        f"{name} failed {len(failures)} times within {self.window_seconds:g} s; "
                        f"last: {type(exc).__name__}: {exc}"
                    )
                    self._given_up = name
                    self._gave_up.set()
                    return
                # Full jitter over a doubling ceiling: several workers that failed together do not restart
                # their loops in step.
                ceiling = min(self.max_backoff_seconds, self.first_backoff_seconds * 2 ** (len(failures) - 1))
                backoff = random.uniform(ceiling / 2, ceiling)  # noqa: S311 - jitter, not cryptography
                log.error(
                    "a background task failed; restarting it",
                    exc_info=exc,
                    extra={
                        "action": "task_restarting",
                        "task": name,
                        "failures": len(failures),
                        "backoff_seconds": round(backoff, 2),
                    },
                )
                self.restarts[name] += 1
                self.on_restart(name)
                self._restarting.add(name)
                try:
                    await asyncio.sleep(backoff)
                finally:
                    self._restarting.discard(name)

    async def cancel(self, name: str) -> None:
        """Stop supervising ``name`` and cancel it now."""
        task = self._tasks.pop(name, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self, grace: float = 5.0) -> None:
        """Let every loop finish (their stops are set by their owners first), then cancel what is left."""
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._tasks.clear()
