"""``rabbitmqctl`` for the test suite, the soak and the benchmarks: ONE place that runs it, writes the
definitions it imports, hashes passwords for them, deletes vhosts and restarts the broker's app safely.

Every ``rabbitmqctl`` call boots an Erlang VM (about 0.5 s), so vhosts are made with one
``import_definitions`` and removed with one ``eval``.

Why deletions and restarts wait for the dead-letter workers first (RabbitMQ 3.10, reproduced on this
machine): a quorum queue with ``x-dead-letter-strategy: at-least-once`` starts a dead-letter worker under
the node-wide ``rabbit_fifo_dlx_sup`` when it is declared or recovered, and the worker's first act is a
call to its queue. Delete the queue (or its vhost) while that call is in flight and the worker crashes; a
vhost holds six such queues, so a deletion right after a ``start_app`` crashes enough workers at once for
``rabbit_fifo_dlx_sup`` to reach its restart intensity and die. It is not restarted: from then on every
declaration of such a queue on the node fails with ``INTERNAL_ERROR`` until the next ``stop_app`` /
``start_app``. So nothing here deletes a vhost, or returns from a restart, before every at-least-once queue
on the node has its worker and every worker has finished starting (``sys:get_state`` answers only after a
gen_server's ``handle_continue`` returned): an event waited for inside the node, with a deadline. In a
cluster a queue's dead-letter worker runs on its leader's node, so a node waits for the queues it leads.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CTL_SECONDS = 120.0
SETTLE_SECONDS = 60

# The Erlang expression behind settle_dead_lettering: "ok", "timeout", or "no_dead_letter_supervisor" when
# the node is already broken (see the module's docstring).
SETTLE_EXPRESSION = f"""
Local = fun(Q) -> case amqqueue:get_pid(Q) of {{_, Leader}} -> Leader =:= node(); _ -> true end end,
Wanted = fun() -> length([Q || Q <- rabbit_amqqueue:list(),
                              amqqueue:get_type(Q) =:= rabbit_quorum_queue,
                              lists:member({{<<"x-dead-letter-strategy">>, longstr, <<"at-least-once">>}},
                                           amqqueue:get_arguments(Q)),
                              Local(Q)]) end,
Settled = fun Loop(0) -> timeout;
              Loop(N) ->
                  case whereis(rabbit_fifo_dlx_sup) of
                      undefined -> no_dead_letter_supervisor;
                      _ ->
                          Workers = [P || {{_, P, _, _}} <- supervisor:which_children(rabbit_fifo_dlx_sup),
                                          is_pid(P)],
                          [catch sys:get_state(P, 10000) || P <- Workers],
                          case length(Workers) >= Wanted() of
                              true -> ok;
                              false -> timer:sleep(50), Loop(N - 1)
                          end
                  end
          end,
Settled({SETTLE_SECONDS * 20})
"""


class BrokerBroken(RuntimeError):
    """The node cannot declare at-least-once quorum queues any more; its app must be restarted."""


async def rabbitmqctl(ctl: Sequence[str], *args: str, within: float = CTL_SECONDS) -> str:
    """Run ``rabbitmqctl -q ARGS``; RuntimeError (with its stderr) when it fails or takes too long."""
    proc = await asyncio.create_subprocess_exec(
        *ctl, "-q", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(within):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"rabbitmqctl {args[0]} did not finish within {within} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {args[0]} failed ({proc.returncode}): {err.decode().strip()[:500]}")
    return out.decode()


def settle_expression(then: str = "ok") -> str:
    """An ``eval`` expression that settles the dead-letter workers and, if they settled, evaluates
    ``then``; otherwise it evaluates to the reason they did not."""
    return f"case begin {SETTLE_EXPRESSION.strip()} end of ok -> {then}; Why -> {{not_settled, Why}} end."


def _raise_unsettled(output: str) -> None:
    if "no_dead_letter_supervisor" in output:
        raise BrokerBroken(
            "RabbitMQ's rabbit_fifo_dlx_sup is gone (a RabbitMQ 3.10 crash, see bench/rabbitctl.py): "
            "run `rabbitmqctl stop_app && rabbitmqctl start_app`"
        )
    if "not_settled" in output:
        raise RuntimeError(f"RabbitMQ's dead-letter workers did not settle within {SETTLE_SECONDS} s: {output}")


async def settle_dead_lettering(ctl: Sequence[str]) -> None:
    """Return once every at-least-once quorum queue on the node has a started dead-letter worker."""
    _raise_unsettled((await rabbitmqctl(ctl, "eval", settle_expression())).strip())


async def restart_app(ctl: Sequence[str]) -> None:
    """``start_app``, then wait until the recovered queues' dead-letter workers have settled."""
    await rabbitmqctl(ctl, "start_app")
    await settle_dead_lettering(ctl)


def delete_expression(names: Sequence[str], users: Sequence[str], who: str) -> str:
    """An ``eval`` expression that deletes the vhosts ``names`` and the users ``users`` once the dead-letter
    workers have settled; its value lists what could not be deleted ("[]" when all went)."""
    vhosts = ",".join(f'<<"{n}">>' for n in names)
    people = ",".join(f'<<"{u}">>' for u in users)
    return settle_expression(
        f'[N || N <- [{vhosts}], (catch rabbit_vhost:delete(N, <<"{who}">>)) =/= ok] ++ '
        f'[U || U <- [{people}], (catch rabbit_auth_backend_internal:delete_user(U, <<"{who}">>)) =/= ok]'
    )


async def delete_vhosts(ctl: Sequence[str], names: Sequence[str], *, users: Sequence[str] = (), who: str) -> list[str]:
    """Delete the vhosts ``names`` and the users ``users`` once the dead-letter workers have settled, in ONE
    ``eval`` where the node allows it, else one by one. Returns what could not be deleted."""
    if not names and not users:
        return []
    try:
        output = (await rabbitmqctl(ctl, "eval", delete_expression(names, users, who))).strip()
    except RuntimeError:
        output = None
    if output is not None:
        _raise_unsettled(output)
        if output == "[]":
            return []
    problems: list[str] = []
    for args in (*(("delete_vhost", n) for n in names), *(("delete_user", u) for u in users)):
        try:
            await rabbitmqctl(ctl, *args)
        except RuntimeError as exc:
            if not any(gone in str(exc).lower() for gone in ("does_not_exist", "does not exist", "not found")):
                problems.append(f"{args[0]} {args[1]}: {exc}")
    return problems


def password_hash(password: str) -> str:
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt + sha256(salt + password)), 4-byte salt."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def user_definition(name: str, password: str) -> dict[str, Any]:
    return {
        "name": name,
        "password_hash": password_hash(password),
        "hashing_algorithm": "rabbit_password_hashing_sha256",
        "tags": [],
    }


def full_rights(user: str, vhost: str) -> dict[str, str]:
    return {"user": user, "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}


def write_definitions(folder: Path, definitions: dict[str, Any]) -> Path:
    """``definitions`` as a file ``rabbitmqctl import_definitions`` can read."""
    path = folder / "definitions.json"
    path.write_text(json.dumps(definitions))
    # Readable by all: rabbitmqctl may read it as the rabbitmq user. The hashes are of throwaway passwords.
    path.chmod(0o644)
    folder.chmod(0o755)
    return path
