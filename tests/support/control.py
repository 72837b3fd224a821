"""Commands applied in-process: the same store effects the RabbitMQ consumers apply, handed straight to
this process's fleet. Tests, the demo and one-shot tools use it; production commands arrive through
``consumers/``."""

from __future__ import annotations

from intermission import points
from intermission.fleet.runtime import Fleet
from intermission.schemas.commands import (
    CancelCommand,
    DecideCommand,
    ExpireCommand,
    ReplyCommand,
    ResumeCommand,
    StartCommand,
)
from intermission.store.commands import Claimed, RunDefaults


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

    def _hand_over(self, claimed: Claimed | None) -> Claimed | None:
        if claimed is None:
            return None
        points.reach(points.AFTER_CLAIM)
        self.fleet.submit(claimed)
        return claimed

    async def start(self, cmd: StartCommand, correlation_id: str | None = None) -> Claimed | None:
        claimed = await self.stores.commands.start(
            cmd, self.defaults(), self.fleet.lease(), correlation_id=correlation_id
        )
        return self._hand_over(claimed)

    async def resume(self, cmd: ResumeCommand, correlation_id: str | None = None) -> Claimed | None:
        claimed = await self.stores.commands.resume(cmd, self.fleet.lease(), correlation_id=correlation_id)
        return self._hand_over(claimed)

    async def decide(
        self, cmd: DecideCommand, principal: str | None, correlation_id: str | None = None
    ) -> Claimed | None:
        claimed = await self.stores.commands.decide(
            cmd, self.fleet.lease(), principal=principal, correlation_id=correlation_id
        )
        return self._hand_over(claimed)

    async def cancel(self, cmd: CancelCommand, correlation_id: str | None = None) -> Claimed | None:
        claimed = await self.stores.commands.cancel(cmd, self.fleet.lease(), correlation_id=correlation_id)
        return self._hand_over(claimed)

    async def expire(self, cmd: ExpireCommand, correlation_id: str | None = None) -> Claimed | None:
        claimed = await self.stores.commands.expire(cmd, self.fleet.lease(), correlation_id=correlation_id)
        return self._hand_over(claimed)

    async def reply(self, cmd: ReplyCommand, correlation_id: str | None = None) -> Claimed | None:
        """The bus's reply, from inside the process: the caller vouches that it is the bus."""
        claimed = await self.stores.commands.reply(cmd, self.fleet.lease(), correlation_id=correlation_id)
        return self._hand_over(claimed)
