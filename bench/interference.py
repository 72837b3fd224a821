"""How much any RabbitMQ publishing on the same machine slows a PostgreSQL commit loop: the control for
``bench/scaling.py``'s sweeper figures.

    python -m bench.interference [--seconds S] [--rates 50,500] [--bursts 50,1]
                                 [--database-url DSN] [--amqp-url URL]

It times one small insert-and-commit after another for ``--seconds`` on a connection of its own (p50,
p99), first with nothing else running, then beside a publisher in ANOTHER process that publishes
persistent messages with confirms to a quorum queue of its own at each rate, in bursts (``--bursts``
per second). Nothing of Intermission runs: if the p99 grows here as much as beside the expiry sweeper, the
growth is the machine's (its cores shared by the database, the broker and the timed loop), not the
sweeper's design. The table is printed; nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

import aio_pika
import asyncpg

from bench.infra import DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, percentile


async def commits(dsn: str, seconds: float) -> tuple[int, float, float]:
    """(count, p50 ms, p99 ms) of insert-and-commit transactions run back to back for ``seconds``."""
    con = await asyncpg.connect(dsn)
    table = f"interference_{uuid.uuid4().hex[:8]}"
    try:
        await con.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, v text)")
        timings: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            began = time.perf_counter()
            async with con.transaction():
                await con.execute(f"INSERT INTO {table} (v) VALUES ($1)", "x" * 200)  # noqa: S608 - our name
            timings.append(time.perf_counter() - began)
        return len(timings), percentile(timings, 50) * 1000, percentile(timings, 99) * 1000
    finally:
        await con.execute(f"DROP TABLE IF EXISTS {table}")
        await con.close()


async def publish(url: str, rate: float, bursts: int, seconds: float) -> None:
    """Publish ``rate`` persistent messages a second with confirms, in ``bursts`` bursts a second."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(
            f"interference-{uuid.uuid4().hex[:8]}", durable=True, arguments={"x-queue-type": "quorum"}
        )
        size = max(1, int(rate / bursts))
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                began = time.monotonic()
                await asyncio.gather(
                    *(
                        channel.default_exchange.publish(
                            aio_pika.Message(b"x" * 300, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                            routing_key=queue.name,
                        )
                        for _ in range(size)
                    )
                )
                await asyncio.sleep(max(0.0, size / rate - (time.monotonic() - began)))
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


async def main(opts: argparse.Namespace) -> None:
    print(f"{'beside':<32} {'commits':>8} {'p50 ms':>7} {'p99 ms':>7}")
    count, p50, p99 = await commits(opts.database_url, opts.seconds)
    print(f"{'nothing':<32} {count:>8} {p50:>7.2f} {p99:>7.2f}", flush=True)
    for rate in opts.rates:
        for bursts in opts.bursts:
            publisher = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.interference", "--publish", str(rate), str(bursts),
                str(opts.seconds + 2), "--amqp-url", opts.amqp_url,
            )  # fmt: skip
            await asyncio.sleep(1.0)  # it connects and declares its queue first
            count, p50, p99 = await commits(opts.database_url, opts.seconds)
            await publisher.wait()
            label = f"{rate:g} msg/s in {bursts} bursts/s"
            print(f"{label:<32} {count:>8} {p50:>7.2f} {p99:>7.2f}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.interference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[50.0, 500.0])
    parser.add_argument("--bursts", type=lambda s: [int(x) for x in s.split(",")], default=[50, 1])
    parser.add_argument(
        "--database-url", default=os.environ.get("INTERMISSION_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    parser.add_argument("--amqp-url", default=os.environ.get("INTERMISSION_BENCH_AMQP_URL", DEFAULT_AMQP_URL))
    # Internal: the publisher process.
    parser.add_argument("--publish", nargs=3, metavar=("RATE", "BURSTS", "SECONDS"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = parse()
    if options.publish:
        rate, bursts, seconds = options.publish
        asyncio.run(publish(options.amqp_url, float(rate), int(bursts), float(seconds)))
    else:
        asyncio.run(main(options))
