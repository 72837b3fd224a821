"""Scope: who a run belongs to.

Every read and write works at the caller's EXACT scope. The original matched older methods by prefix,
so a broader caller could read or claim a deeper run; Intermission never does, because a scope that
matches more than itself is an authority widening nobody asked for.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, StringConstraints

from intermission.schemas.base import Model
from intermission.schemas.errors import InvalidScope

SCOPE_PART_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_SCOPE_PART = re.compile(SCOPE_PART_PATTERN)

ScopePart = Annotated[str, StringConstraints(pattern=SCOPE_PART_PATTERN)]


class Scope(Model):
    """An app and a tenant, each ``[A-Za-z0-9_-]{1,64}``."""

    model_config = Model.model_config | {"frozen": True, "extra": "forbid"}

    app: ScopePart = Field(description="the application the run belongs to")
    tenant: ScopePart = Field(description="the tenant within the application")

    def routing_suffix(self) -> str:
        """The ``<app>.<tenant>`` tail of an event routing key."""
        return f"{self.app}.{self.tenant}"

    def __str__(self) -> str:
        return f"{self.app}/{self.tenant}"


def require_scope(scope: Any) -> Scope:
    """Check a caller's scope before any database access.

    A Scope built with ``model_construct`` (or anything else handed in its place) skips pydantic's
    validation, so the store checks again here rather than trusting the type: a zero scope must fail
    before a query is sent, not match rows whose scope happens to be empty.
    """
    if not isinstance(scope, Scope):
        raise InvalidScope("a scope is required")
    for part_name in ("app", "tenant"):
        part = getattr(scope, part_name, None)
        # fullmatch, not match: "$" also matches before a trailing newline, so "acme\n" would pass.
        if not isinstance(part, str) or _SCOPE_PART.fullmatch(part) is None:
            raise InvalidScope(f"scope {part_name} must match {SCOPE_PART_PATTERN}")
    return scope


class Reach(Model):
    """The scopes a person may see and act for, as the broker grants them: every scope (an identity trusted
    with the whole vhost), or exactly ``scopes`` (a user confined by ``intermission grant``; none at all when
    it was granted nothing). The web console restricts every read to it, in SQL."""

    model_config = Model.model_config | {"frozen": True, "extra": "forbid"}

    every_scope: bool = False
    scopes: tuple[Scope, ...] = ()

    def covers(self, scope: Scope) -> bool:
        return self.every_scope or scope in self.scopes

    @property
    def is_empty(self) -> bool:
        return not self.every_scope and not self.scopes
