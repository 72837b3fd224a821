"""What the harness did, as the checker needs it: every run it planned, every command it sent (with what
it expects of it), every notice its host and bus heard, and every fault it injected.

The checker compares this with what the product did (the database, the events captured from
``intermission.events``, the dead-lettered copies); nothing here is trusted as evidence of the product's
behaviour, only as a record of the harness's intentions.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from intermission.schemas.scope import Scope


def seeded(*parts: object) -> random.Random:
    """A random generator seeded by ``parts`` (reproducible for the same seed; not for secrets)."""
    return random.Random(":".join(str(p) for p in parts))  # noqa: S311 - a soak's choices, not a secret


class Expect(StrEnum):
    """What a command must lead to."""

    # Exactly one effect, and no refusal.
    APPLY = "apply"
    # A refusal (a command.rejected event and a dead-lettered copy) with a code in ``codes``; no effect.
    REJECT = "reject"
    # Exactly one of the two: one effect, or a refusal with a code in ``codes``. For commands that race
    # with something else on purpose (a deadline, a cancel, a competing answer).
    EITHER = "either"
    # Neither an effect nor a refusal: acknowledged as a duplicate. A bus reply identical to one already
    # admitted for its pause is that reply again (its admission is its idempotency record), whatever its
    # message_id and whenever it comes.
    DUPLICATE = "duplicate"
    # Refused by the BROKER at publish (ACCESS_REFUSED: a confined user keying another scope's command), so
    # never delivered to the fleet: no effect, no command.rejected event, no dead-lettered copy.
    BROKER_REFUSES = "broker_refuses"


class Fate(StrEnum):
    """What the harness does with a run's pauses, decided when the run is started."""

    COMPLETE = "complete"  # answer every pause: the run completes
    DENY = "deny"  # deny its first approval: the run fails with the decider's reason
    EXPIRE = "expire"  # leave its first pause unanswered past a short deadline: failed, suspension_expired
    CANCEL = "cancel"  # cancel it at its first pause: cancelled
    ABANDON = "abandon"  # leave its first pause unanswered, with no deadline: it stays paused
    RACE_DEADLINE = "race_deadline"  # answer its first pause right around its deadline: completed or expired
    RACE_CANCEL = "race_cancel"  # answer and cancel its first pause at once: completed or cancelled


# The end states each fate allows. "failed:<prefix>" requires the run's error to start with <prefix>.
EXPIRED = "failed:suspension_expired"
ALLOWED_ENDS: dict[Fate, frozenset[str]] = {
    Fate.COMPLETE: frozenset({"completed"}),
    Fate.DENY: frozenset({"failed:soak-deny"}),
    Fate.EXPIRE: frozenset({EXPIRED}),
    Fate.CANCEL: frozenset({"cancelled"}),
    Fate.ABANDON: frozenset({"paused"}),
    Fate.RACE_DEADLINE: frozenset({"completed", EXPIRED}),
    Fate.RACE_CANCEL: frozenset({"completed", "cancelled"}),
}


@dataclass
class SentCommand:
    """One command the harness published (a re-send under the same message id counts in ``sends``)."""

    message_id: str | None
    key: str
    run_id: str | None
    scope: Scope | None
    # Who published it: host (the host of its run's scope), bus, an approver's user name, mallory, or raw
    # (hand-built bytes, on the connection of the host of the scope its key names).
    sender: str
    # Why: start, answer, cancel, or the fault kind that sent it.
    purpose: str
    expect: Expect
    codes: frozenset[str] = frozenset()
    sent_at: float = field(default_factory=time.monotonic)
    sends: int = 1
    confirmed: bool = False
    # Commands of one group race on purpose: exactly one of them has an effect.
    group: str | None = None
    # The suspension it answers, when it answers one.
    suspension_id: int | None = None
    # A different command was later sent under this message id on purpose (message_id_conflict): the
    # refusal with that code belongs to the other command, not to this one.
    conflicted: bool = False
    # The routing key it was published under (its scope is the one whose stream hears its refusal).
    routing_key: str | None = None
    # Another tenant's scope it reaches for (mallory's forgeries): nothing of it may be heard or applied there.
    victim: Scope | None = None
    # The broker's refusal of the publish (ACCESS_REFUSED), when it refused it.
    refused_by_broker: str | None = None
    note: str = ""

    def describe(self) -> str:
        where = f" run {self.run_id}" if self.run_id else ""
        scope = f" at {self.scope}" if self.scope else ""
        mid = self.message_id or "(no message id)"
        if len(mid) > 80:
            mid = mid[:40] + "..." + mid[-20:]
        return f"{self.key} {mid}{where}{scope} from {self.sender} ({self.purpose})"


@dataclass
class RunPlan:
    run_id: str
    scope: Scope
    template: str
    fate: Fate
    pause_ttl_seconds: int
    start_message_id: str
    deny_reason: str = ""
    # Suspension ids heard, in order, by the host's subscription and by the bus's.
    heard_by_host: list[int] = field(default_factory=list)
    heard_by_bus: list[int] = field(default_factory=list)
    # Suspension ids the harness acted on (answered, cancelled, or left alone on purpose).
    handled: set[int] = field(default_factory=set)
    # The legit answers, by suspension id: (message id, routing key, body as JSON, sender).
    answers: dict[int, tuple[str, str, str, str]] = field(default_factory=dict)
    # The end heard on the run events (kind), if any.
    ended: str | None = None
    # The suspension the harness leaves unanswered on purpose (abandon), once known.
    left_paused: int | None = None
    # The flood whose start this is (``tenant_flood``): such a start may be refused ``quota_exceeded``,
    # and then the run must not exist.
    flood: str | None = None
    # When the harness first heard of the run (its first Notice or its end, by either subscription).
    first_heard: float | None = None

    @property
    def allowed_ends(self) -> frozenset[str]:
        return ALLOWED_ENDS[self.fate]


@dataclass
class FaultRecord:
    kind: str
    at: float
    detail: str = ""
    # False when the fault could not be injected (no suitable target, a server tool missing...).
    done: bool = True
    # An infrastructure fault (a worker or a server, not a command), and when the injector had undone it
    # (the outage over, the killed worker replaced): the checker weighs a flood's probe against it.
    infrastructure: bool = False
    ended: float | None = None


@dataclass
class FloodRecord:
    """One tenant's burst of starts (``tenant_flood``) and the probe run another tenant started right
    behind it."""

    name: str
    scope: Scope
    size: int
    # The flooding scope's quota of live runs.
    quota: int
    # Normal workers alive when the burst was published (the bound's fleet).
    workers: int
    began: float = field(default_factory=time.monotonic)
    # Every start of the burst confirmed by the broker (or given up on).
    published: float | None = None
    # The message ids of its starts, in the order sent.
    starts: list[str] = field(default_factory=list)
    # The probe: its run (its start is the run's ``start:<run id>`` command, whose ``sent_at`` is when it
    # was sent; its run plan's ``first_heard`` when its first Notice or end was heard).
    probe_run: str | None = None


@dataclass
class Ledger:
    seed: int
    runs: dict[str, RunPlan] = field(default_factory=dict)
    commands: list[SentCommand] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    floods: list[FloodRecord] = field(default_factory=list)
    # Things the harness noticed that are not invariants of the product but belong in the report.
    notes: list[str] = field(default_factory=list)
    # Processes that exited without being told to (crash points excluded).
    unexpected_exits: list[str] = field(default_factory=list)
    load_started: float = 0.0
    load_ended: float = 0.0
    drain_ended: float = 0.0

    def sent(self, command: SentCommand) -> SentCommand:
        self.commands.append(command)
        return command

    def fault(
        self,
        kind: str,
        detail: str = "",
        *,
        at: float | None = None,
        done: bool = True,
        infrastructure: bool = False,
        ended: float | None = None,
    ) -> FaultRecord:
        record = FaultRecord(
            kind=kind,
            at=time.monotonic() if at is None else at,
            detail=detail,
            done=done,
            infrastructure=infrastructure,
            ended=ended,
        )
        self.faults.append(record)
        return record

    def fault_counts(self) -> Counter[str]:
        return Counter(f.kind for f in self.faults if f.done)

    def by_message_id(self) -> dict[str, list[SentCommand]]:
        found: dict[str, list[SentCommand]] = {}
        for command in self.commands:
            if command.message_id is not None:
                found.setdefault(command.message_id, []).append(command)
        return found
