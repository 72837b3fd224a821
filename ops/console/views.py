"""What the templates are given: times, arguments and scopes as a person reads them.

Arguments are shown as the run's publication policy lets them out of the fleet (``store/runs.py``
``publishable``, applied by the store's reads): a run with ``publication.redact_arguments`` shows
``[redacted]``, exactly as its Notices do. Everything reaches the page through Jinja2's autoescaping.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from intermission.ops.dead import DeadLetter
from intermission.schemas.scope import Reach, Scope


def when(moment: datetime | None) -> str:
    """A moment as people read it: ``2026-12-02 11:04:05 UTC``."""
    if moment is None:
        return "-"
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def iso(moment: datetime | None) -> str:
    """The machine-readable form, for ``<time datetime>``."""
    return moment.astimezone(UTC).isoformat() if moment is not None else ""


def until(moment: datetime | None, now: datetime | None = None) -> str:
    """How far a deadline is: ``in 23 h 59 min``, ``passed``, or ``no deadline``."""
    if moment is None:
        return "no deadline"
    seconds = int((moment - (now or datetime.now(UTC))).total_seconds())
    if seconds <= 0:
        return "passed"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"in {days} d {hours} h"
    if hours:
        return f"in {hours} h {minutes} min"
    return f"in {minutes} min" if minutes else "in less than a minute"


def pretty_arguments(arguments: str) -> str:
    """A call's JSON-encoded arguments, indented for reading; verbatim when they are not JSON."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False, sort_keys=True)
    except ValueError:
        return arguments


def reach_label(reach: Reach) -> str:
    if reach.every_scope:
        return "every scope"
    if not reach.scopes:
        return "no scope"
    return ", ".join(str(s) for s in sorted(reach.scopes, key=str))


def page_number(asked: str | None, pages: int) -> int:
    """The page a query asks for, within 1..``pages``; 1 for anything else."""
    return int(asked) if asked is not None and asked.isdigit() and 1 <= int(asked) <= pages else 1


def visible_letters(letters: list[DeadLetter], reach: Reach) -> list[tuple[DeadLetter, Scope | None]]:
    """The dead letters a person may see: those keyed for one of their scopes; the ones that name no
    scope only to a person trusted with every scope."""
    return [
        (letter, letter.scope)
        for letter in letters
        if reach.every_scope or (letter.scope is not None and reach.covers(letter.scope))
    ]
