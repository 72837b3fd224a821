"""What a transition is: one change of the store (or one read a change is checked against), a value the
engine commits.

A ``Transition`` knows everything about itself but when it runs: its ``Family`` (the batch function it goes
through, and the composite row that function takes, named once as a ``NamedTuple`` whose fields are the
composite's), its ``row``, the complete events its commit writes, and how an output row (or a refusal)
reads back as its result. The committer (``engine/committer.py``) decides when: it groups the transitions
of one family that wait at the same moment into one statement.

Anything that takes more than one statement (a command that reads, checks and claims; a reply that is
admitted, then started) is an ``Operation``: plain async code over ``Steps.commit``, each step group
committed with whatever else is waiting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, Protocol, TypeVar

from intermission.engine.events import OutboxEvent
from intermission.schemas.scope import Scope
from intermission.store.rows import Out

if TYPE_CHECKING:
    from intermission.engine.starts import RunDefaults
    from intermission.schemas.run import Lease

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

# A run's key, by which a batch orders its rows: two batches then take the rows they share in one order.
RunKey = tuple[str, str, str]
NO_KEY: RunKey = ("", "", "")


@dataclass(frozen=True)
class Family:
    """One batch function and the composite row it takes.

    ``statement`` names the statement (``store/queries/engine.sql``) that calls the batch function with ONE
    array of ``row`` and, when ``held``, the outbox hold. ``success`` is the outcomes (an output row's
    ``outcome``) that mean the transition wrote what it was asked to, its events included. ``reads`` marks a
    family that only reads.
    """

    name: str
    statement: str
    row: type[NamedTuple]
    held: bool = False
    success: frozenset[str] = frozenset()
    reads: bool = False

    def written(self, outs: Sequence[Out]) -> bool:
        return bool(self.success) and len(outs) > 0 and outs[0]["outcome"] in self.success


class Steps(Protocol):
    """What an operation is given: the engine's commit of one transition (group committed), and the terms
    a worker applies commands under."""

    async def commit(self, transition: Transition[R]) -> R: ...

    @property
    def lease(self) -> Lease: ...

    @property
    def defaults(self) -> RunDefaults: ...


class Applicable(Protocol[R_co]):
    """Anything the engine applies: a transition, or an operation made of several."""

    async def apply_in(self, steps: Steps) -> R_co: ...


class Transition(ABC, Generic[R]):
    """One row of one family's batch function (see the module docstring)."""

    family: ClassVar[Family]
    # The committer decodes this transition's result before its statement commits, and a result that cannot
    # be decoded rolls the statement back: for a claim or a grant that hands over what it wrote (a pause's
    # continuation), which must not commit without anyone having it.
    atomic: ClassVar[bool] = False

    def key(self) -> RunKey:
        """The run this transition changes (NO_KEY: none in particular)."""
        return NO_KEY

    @abstractmethod
    def row(self) -> NamedTuple:
        """The family's composite row; raises a typed error for a value the store cannot take."""

    def events(self) -> Sequence[OutboxEvent]:
        """The events this transition writes when it succeeds, complete (none by default)."""
        return ()

    def wrote(self, outs: Sequence[Out]) -> bool:
        """Whether the output rows say this transition wrote what it was asked to (and its events)."""
        return self.family.written(outs)

    @abstractmethod
    def result(self, outs: Sequence[Out]) -> R:
        """The result of the transition from its output rows, or its typed refusal raised."""

    async def apply_in(self, steps: Steps) -> R:
        return await steps.commit(self)


@dataclass(frozen=True)
class OfRun(Transition[R]):
    """A transition of one run, named by its scope and id: its key, and the first two fields of every
    transition that changes one run."""

    scope: Scope
    run_id: str

    def key(self) -> RunKey:
        return (self.scope.app, self.scope.tenant, self.run_id)


class Operation(ABC, Generic[R]):
    """Several transitions, one after another, with the checks between them."""

    @abstractmethod
    async def apply_in(self, steps: Steps) -> R: ...


def only(outs: Sequence[Out]) -> Out:
    """The one output row of a transition whose function returns exactly one."""
    if len(outs) != 1:
        raise RuntimeError(f"a transition returned {len(outs)} rows, not one")
    return outs[0]
