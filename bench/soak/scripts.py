"""The demo-agent scripts the soak starts runs with, and the fates it gives them.

Every pause reason appears (``lookup`` → external_tool, ``send_email`` → approval with or without named
approvers, ``ask_agent`` → agent_reply), with non-retry-safe ``charge`` calls around the pauses and
``echo``/``sleep`` steps that keep runs busy in the workers while they are killed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.soak.ledger import Fate

Turn = dict[str, Any]
Call = dict[str, Any]


def _charge(rng: random.Random) -> Call:
    return {"tool": "charge", "arguments": {"amount": rng.randint(1, 500)}}


def _sleep(rng: random.Random, lo: float = 0.05, hi: float = 0.6) -> Call:
    return {"tool": "sleep", "arguments": {"seconds": round(rng.uniform(lo, hi), 2)}}


def _echo(rng: random.Random) -> Call:
    return {"tool": "echo", "arguments": {"n": rng.randint(0, 9999)}}


def _lookup(rng: random.Random) -> Call:
    return {"tool": "lookup", "arguments": {"query": f"q{rng.randint(0, 9999)}"}}


def _ask(rng: random.Random) -> Call:
    return {"tool": "ask_agent", "arguments": {"agent": "pricer", "question": f"quote {rng.randint(1, 99)} seats?"}}


def _email(rng: random.Random, approvers: list[str] | None) -> Call:
    arguments: dict[str, Any] = {"to": "billing@example.com", "subject": f"invoice {rng.randint(1, 999)}", "body": "."}
    if approvers is not None:
        arguments["approvers"] = approvers
    return {"tool": "send_email", "arguments": arguments}


def _turn(*calls: Call) -> Turn:
    return {"call": list(calls)}


def _say(text: str) -> Turn:
    return {"say": text}


@dataclass(frozen=True)
class Template:
    name: str
    weight: float
    # The reasons it pauses for, in order (empty: it never pauses).
    pauses: tuple[str, ...]
    build: Callable[[random.Random, list[str]], list[Turn]]


def _named(rng: random.Random, approvers: list[str]) -> list[str]:
    return rng.sample(approvers, rng.randint(1, len(approvers)))


TEMPLATES: tuple[Template, ...] = (
    Template("quick", 1.0, (), lambda r, a: [_turn(_echo(r)), _say("quick done")]),
    Template("sleepy", 1.0, (), lambda r, a: [_turn(_sleep(r, 0.2, 1.2)), _turn(_charge(r)), _say("slept")]),
    Template(
        "lookup",
        2.0,
        ("external_tool",),
        lambda r, a: [_turn(_charge(r)), _turn(_lookup(r)), _turn(_charge(r), _echo(r)), _say("looked up")],
    ),
    Template(
        "multi_lookup",
        1.0,
        ("external_tool",),
        lambda r, a: [_turn(_lookup(r), _lookup(r)), _turn(_sleep(r)), _say("two lookups")],
    ),
    Template(
        "approval_named",
        1.5,
        ("approval",),
        lambda r, a: [_turn(_charge(r)), _turn(_email(r, _named(r, a))), _say("mailed")],
    ),
    Template(
        "approval_any",
        1.0,
        ("approval",),
        lambda r, a: [_turn(_email(r, None)), _turn(_charge(r)), _say("mailed, charged")],
    ),
    Template("ask", 1.5, ("agent_reply",), lambda r, a: [_turn(_ask(r)), _turn(_echo(r)), _say("asked")]),
    Template(
        "mixed",
        1.0,
        ("external_tool", "agent_reply"),
        lambda r, a: [_turn(_lookup(r), _ask(r)), _turn(_charge(r)), _say("mixed")],
    ),
    Template(
        "chain",
        1.0,
        ("agent_reply", "external_tool", "approval"),
        lambda r, a: [
            _turn(_ask(r)),
            _turn(_lookup(r)),
            _turn(_email(r, _named(r, a))),
            _turn(_charge(r)),
            _say("chained"),
        ],
    ),
    Template(
        "long",
        1.0,
        ("external_tool",),
        lambda r, a: [
            _turn(_sleep(r, 0.5, 1.5)),
            _turn(_charge(r)),
            _turn(_sleep(r, 0.3, 1.0)),
            _turn(_lookup(r)),
            _say("long done"),
        ],
    ),
)

FATE_WEIGHTS: tuple[tuple[Fate, float], ...] = (
    (Fate.COMPLETE, 0.72),
    (Fate.DENY, 0.05),
    (Fate.EXPIRE, 0.06),
    (Fate.CANCEL, 0.05),
    (Fate.ABANDON, 0.015),
    (Fate.RACE_DEADLINE, 0.055),
    (Fate.RACE_CANCEL, 0.05),
)


@dataclass(frozen=True)
class Chosen:
    template: Template
    fate: Fate
    script: list[Turn]
    pause_ttl_seconds: int


# The runs of a tenant's flood and its probe pause at once, for a tool result: a flood's run is left paused
# (abandon) so that its scope stays at its quota for the whole soak; the probe's first Notice is what the
# checker times, and the run is then answered and completes like any other.
FLOODED = Template("flooded", 0.0, ("external_tool",), lambda r, a: [_turn(_lookup(r)), _say("never answered")])
PROBE = Template("probe", 0.0, ("external_tool",), lambda r, a: [_turn(_lookup(r)), _say("probed")])


def flooded(rng: random.Random) -> Chosen:
    return Chosen(template=FLOODED, fate=Fate.ABANDON, script=FLOODED.build(rng, []), pause_ttl_seconds=0)


def probe(rng: random.Random) -> Chosen:
    return Chosen(template=PROBE, fate=Fate.COMPLETE, script=PROBE.build(rng, []), pause_ttl_seconds=0)


def choose(rng: random.Random, approvers: list[str], deadline: tuple[int, int]) -> Chosen:
    template = rng.choices(TEMPLATES, weights=[t.weight for t in TEMPLATES])[0]
    script = template.build(rng, approvers)
    fate = Fate.COMPLETE
    if template.pauses:
        fate = rng.choices([f for f, _ in FATE_WEIGHTS], weights=[w for _, w in FATE_WEIGHTS])[0]
        if fate is Fate.DENY and "approval" not in template.pauses:
            fate = Fate.COMPLETE
    ttl = rng.randint(*deadline) if fate in (Fate.EXPIRE, Fate.RACE_DEADLINE) else 0
    return Chosen(template=template, fate=fate, script=script, pause_ttl_seconds=ttl)
