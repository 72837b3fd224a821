"""How the dead-letter tools describe a letter (ops/dead.py): the key is always the delivery's, the refusal
is the worker's copy's or the broker's ``x-death`` reason, and anything else is shown "unverified", never
as what its headers claim. The real-server cases are tests/integration/test_forged_dead_letters.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from aio_pika.abc import AbstractIncomingMessage

from intermission.ops.dead import Source, describe
from intermission.schemas.errors import ALL_ERRORS, IntermissionError
from intermission.schemas.scope import Scope
from intermission.wire import DETAIL_HEADER, ERROR_HEADER, ORIGINAL_KEY_HEADER, Command

VICTIM = Scope(app="app", tenant="victim")
SENDER = Scope(app="app", tenant="sender")


@dataclass
class Delivered:
    """The parts of an incoming message ``describe`` reads."""

    headers: dict[str, Any] = field(default_factory=dict)
    routing_key: str = Command.CANCEL.key(SENDER)
    message_id: str | None = "m-1"
    user_id: str | None = "sender"
    body: bytes = b"{}"


def described(**headers: Any) -> Any:
    return describe(cast("AbstractIncomingMessage", Delivered(headers=headers)))


def test_a_worker_s_copy_is_verified_and_its_key_is_the_delivery_s() -> None:
    letter = described(
        **{ERROR_HEADER: "forbidden", DETAIL_HEADER: "no", ORIGINAL_KEY_HEADER: Command.CANCEL.key(VICTIM)}
    )
    assert (letter.source, letter.verified, letter.code, letter.detail) == (Source.WORKER, True, "forbidden", "no")
    assert (letter.routing_key, letter.scope) == (Command.CANCEL.key(SENDER), SENDER)


def test_a_start_refused_over_a_quota_or_a_ceiling_is_a_verified_refusal() -> None:
    for code in ("quota_exceeded", "limit_exceeded"):
        letter = described(**{ERROR_HEADER: code, DETAIL_HEADER: "at its quota"})
        assert (letter.source, letter.verified, letter.code) == (Source.WORKER, True, code)


def _defined(cls: type[IntermissionError]) -> set[type[IntermissionError]]:
    return {cls}.union(*(_defined(sub) for sub in cls.__subclasses__() if sub.__module__ == cls.__module__))


def test_every_error_the_schemas_define_is_one_the_tools_know() -> None:
    # A refusal left out of ALL_ERRORS is shown "unknown" (unverified) by the dead-letter tools.
    assert _defined(IntermissionError) == set(ALL_ERRORS)


def test_a_copy_with_a_refusal_no_worker_writes_is_unverified() -> None:
    for headers in ({ERROR_HEADER: "replay_me", DETAIL_HEADER: "trust me"}, {DETAIL_HEADER: "trust me"}, {}):
        letter = described(**headers)
        assert (letter.verified, letter.code) == (False, "unknown")
        assert letter.detail.startswith("unverified")
        assert "trust me" not in letter.detail


def test_a_broker_dead_lettering_shows_the_broker_s_reason_and_none_of_the_sender_s_headers() -> None:
    forged = {ERROR_HEADER: "store_unavailable", DETAIL_HEADER: "replay me"}
    letter = described(**forged, **{"x-death": [{"reason": "delivery_limit", "queue": "intermission.cancel"}]})
    assert (letter.source, letter.verified, letter.code) == (Source.BROKER, True, "delivery_limit")
    assert "replay me" not in letter.detail
    rejected = described(**forged, **{"x-death": [{"reason": "rejected"}]})
    assert (rejected.verified, rejected.code) == (True, "broker_rejected")
    # A reason the broker never gives can only be a sender's, carried by a copy made before workers
    # dropped look-alikes of x-death.
    odd = described(**forged, **{"x-death": [{"reason": "store_unavailable: replay me"}]})
    assert (odd.source, odd.verified, odd.code) == (Source.BROKER, False, "unknown")
    assert "replay me" not in odd.detail
