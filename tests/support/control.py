"""Commands applied in-process: the same engine operations the RabbitMQ consumers apply, handed straight to
this process's fleet. Tests use it; production commands arrive through ``consumers/``."""

from __future__ import annotations

from intermission import points
from intermission.engine.commands import Cancel, Claimed, Decide, Expire, Reply, Resume, Start
from intermission.engine.core import Engine
from intermission.engine.starts import RunDefaults
from intermission.engine.transition import Applicable
from intermission.fleet.runtime import Fleet
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    StartCommand,
)


class LocalControl:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.stores = fleet.stores

    def defaults(self) -> RunDefaults:
        return RunDefaults(
            pause_ttl_seconds=self.fleet.settings.pause_ttl_seconds,
            max_steps=self.fleet.settings.max_steps,
            max_tool_calls=self.fleet.settings.max_tool_calls,
        )

    @property
    def engine(self) -> Engine:
        """The fleet's engine, under its lease, with the settings' defaults."""
        return self.fleet.engine.under(defaults=self.defaults())

    async def _apply(self, operation: Applicable[Claimed | None]) -> Claimed | None:
        claimed = await self.engine.apply(operation)
        if claimed is None:
            return None
        points.reach(points.AFTER_CLAIM)
        self.fleet.submit(claimed)
        return claimed

    async def start(self, cmd: StartCommand, correlation_id: str | None = None) -> Claimed | None:
        return await self._apply(Start(cmd, correlation_id=correlation_id))

    async def resume(self, cmd: ResumeCommand, correlation_id: str | None = None) -> Claimed | None:
        return await self._apply(Resume(cmd, correlation_id=correlation_id))

    async def decide(
        self, cmd: DecideCommand, principal: str | None, correlation_id: str | None = None
    ) -> Claimed | None:
        return await self._apply(Decide(cmd, principal, correlation_id=correlation_id))

    async def cancel(self, cmd: CancelCommand, correlation_id: str | None = None) -> Claimed | None:
        return await self._apply(Cancel(cmd, correlation_id=correlation_id))

    async def expire(self, cmd: ExpireCommand, correlation_id: str | None = None) -> Claimed | None:
        return await self._apply(Expire(cmd, correlation_id=correlation_id))

    async def reply(self, cmd: ReplyCommand, correlation_id: str | None = None) -> Claimed | None:
        """The bus's reply, from inside the process: the caller vouches that it is the bus."""
        return await self._apply(Reply(cmd, correlation_id=correlation_id))
