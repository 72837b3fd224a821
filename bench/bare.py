"""The bare pipeline: the machine's limit for a resume-shaped message, in one Python process.

``python -m bench.bare DSN AMQP_URL [--prefetch N] [--shape cte|transaction] [--loop uvloop|asyncio]``

It consumes messages from a small quorum queue of its own (``bench.bare.commands``), and for each one runs
ONE claim-shaped transaction on a small table of its own (an ``UPDATE … RETURNING`` that moves a row to
running under a lease, plus a 4 KB snapshot upsert), publishes one event with a publisher confirm to a
topic exchange of its own (``bench.bare.events``), and acknowledges the message. Nothing else: no
validation, no inbox, no outbox, no run to continue. ``bench.resume`` drives it with the same message
size, the same prefetch and the same number of commands in flight as the product, on the same servers.

It is built to be the best one can do for that work from one process, so that the product is compared
with a real upper bound: by default the claim and the snapshot are one statement (data-modifying CTE, one
round trip, its own transaction), each in-flight slot has a connection of its own (no pool, so no
per-release reset), prepared statements, and uvloop when it is installed. ``--shape transaction`` runs the
two statements inside BEGIN/COMMIT instead, for comparison.

It prints ``ready`` once it consumes and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import uuid
from typing import Any, Final

import aio_pika
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

QUEUE: Final = "bench.bare.commands"
COMMANDS: Final = "bench.bare.commands"
EVENTS: Final = "bench.bare.events"
SNAPSHOT_BYTES: Final = 4096

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS bench_claims (
    id               text PRIMARY KEY,
    state            text NOT NULL,
    revision         bigint NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS bench_snapshots (
    id         text PRIMARY KEY,
    owner      text NOT NULL,
    snapshot   jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
)
"""

# One statement: the claim (conditioned on the row being paused) and the snapshot written with it.
CLAIM_CTE: Final = """
WITH claimed AS (
    UPDATE bench_claims
       SET state = 'running', revision = revision + 1, lease_owner = $2,
           lease_expires_at = now() + interval '30 seconds', updated_at = now()
     WHERE id = $1 AND state = 'paused'
    RETURNING id, revision
), snap AS (
    INSERT INTO bench_snapshots (id, owner, snapshot)
    SELECT id, $2, $3::jsonb FROM claimed
    ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, snapshot = excluded.snapshot, updated_at = now()
    RETURNING id
)
SELECT c.id, c.revision FROM claimed c JOIN snap s ON s.id = c.id
"""

CLAIM: Final = """
UPDATE bench_claims
   SET state = 'running', revision = revision + 1, lease_owner = $2,
       lease_expires_at = now() + interval '30 seconds', updated_at = now()
 WHERE id = $1 AND state = 'paused'
RETURNING id, revision
"""

SNAPSHOT: Final = """
INSERT INTO bench_snapshots (id, owner, snapshot) VALUES ($1, $2, $3::jsonb)
ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, snapshot = excluded.snapshot, updated_at = now()
"""


def snapshot_document(size: int = SNAPSHOT_BYTES) -> str:
    """A continuation-like JSON document of ``size`` bytes."""
    base: dict[str, Any] = {
        "schema_version": 1,
        "system_prompt": "You are the Intermission demo agent.",
        "step_index": 1,
        "messages": [],
    }
    text = json.dumps(base)
    filler = max(0, size - len(text) - len('{"role":"user","content":""}'))
    base["messages"] = [{"role": "user", "content": "x" * filler}]
    return json.dumps(base)


async def prepare(dsn: str, ids: list[str]) -> None:
    """The bare pipeline's tables, with every row paused."""
    con = await asyncpg.connect(dsn)
    try:
        await con.execute(SCHEMA)
        await con.execute("TRUNCATE bench_claims, bench_snapshots")
        await con.copy_records_to_table("bench_claims", records=[(i, "paused") for i in ids], columns=["id", "state"])
        await con.execute("ANALYZE bench_claims")
    finally:
        await con.close()


async def declare(channel: AbstractChannel) -> None:
    """The same kinds of queue and exchanges as the product's: a durable quorum queue behind a direct
    exchange, and a durable topic exchange for events."""
    commands = await channel.declare_exchange(COMMANDS, aio_pika.ExchangeType.DIRECT, durable=True)
    await channel.declare_exchange(EVENTS, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    await queue.bind(commands, routing_key=QUEUE)


async def serve(dsn: str, amqp_url: str, prefetch: int, shape: str) -> None:
    owner = f"bare@{os.getpid()}"
    snapshot = snapshot_document()
    connections: asyncio.Queue[asyncpg.Connection[Any]] = asyncio.Queue()
    opened = await asyncio.gather(*(asyncpg.connect(dsn) for _ in range(prefetch)))
    for con in opened:
        connections.put_nowait(con)
    connection = await aio_pika.connect_robust(amqp_url, client_properties={"connection_name": "bench bare"})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        consume = await connection.channel()
        await consume.set_qos(prefetch_count=prefetch)
        await declare(consume)
        publish = await connection.channel(publisher_confirms=True)
        events = await publish.get_exchange(EVENTS, ensure=False)
        queue = await consume.get_queue(QUEUE, ensure=False)

        async def claim(run_id: str) -> int:
            con = await connections.get()
            try:
                if shape == "cte":
                    row = await con.fetchrow(CLAIM_CTE, run_id, owner, snapshot)
                else:
                    async with con.transaction():
                        row = await con.fetchrow(CLAIM, run_id, owner)
                        if row is not None:
                            await con.execute(SNAPSHOT, run_id, owner, snapshot)
            finally:
                connections.put_nowait(con)
            return -1 if row is None else int(row["revision"])

        async def handle(message: AbstractIncomingMessage) -> None:
            body = json.loads(message.body)
            run_id = body["version"]["run_id"]
            scope = body["scope"]
            revision = await claim(run_id)
            kind = "completed" if revision >= 0 else "failed"
            event = {"kind": kind, "run_id": run_id, "revision": revision, "scope": scope, "output": "done"}
            await events.publish(
                aio_pika.Message(
                    json.dumps(event).encode(),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=str(uuid.uuid4()),
                    correlation_id=message.message_id,
                    type=f"run.{kind}",
                ),
                routing_key=f"run.{kind}.{scope['app']}.{scope['tenant']}",
            )
            await message.ack()

        tag = await queue.consume(handle)
        print("ready", flush=True)
        await stop.wait()
        await queue.cancel(tag)
    finally:
        await connection.close()
        await asyncio.gather(*(con.close() for con in opened), return_exceptions=True)


def run_loop(loop_name: str, main: Any) -> None:
    """Run ``main`` under uvloop when asked for and installed, else asyncio's own loop."""
    if loop_name == "uvloop":
        try:
            import uvloop
        except ImportError:
            loop_name = "asyncio"
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare", description=__doc__.split("\n\n")[0])
    parser.add_argument("dsn")
    parser.add_argument("amqp_url")
    parser.add_argument("--prefetch", type=int, default=16)
    parser.add_argument("--shape", choices=("cte", "transaction"), default="cte")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    run_loop(args.loop, serve(args.dsn, args.amqp_url, args.prefetch, args.shape))


if __name__ == "__main__":
    main()
