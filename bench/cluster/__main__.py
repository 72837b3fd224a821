"""``python -m bench.cluster``: boot the cluster's servers beside the machine's own, say where they are,
and remove them again.

    python -m bench.cluster --boot-only [--seconds S] [--dir DIR]
    python -m bench.cluster --cleanup

``--boot-only`` starts three RabbitMQ nodes joined in one cluster and a PostgreSQL primary with a
synchronous standby (``bench/cluster/servers.py``), prints their URLs, the cluster's status and the
replication state, keeps them ``--seconds`` (default 0), then removes everything. ``--cleanup`` removes
what a harness that was killed left behind. The workload, the faults and the checks are not built yet.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import asyncpg

from bench.cluster.servers import Servers, cleanup


async def boot_only(folder: Path, seconds: float) -> int:
    servers = Servers(folder)
    try:
        await servers.start()
        print(f"INTERMISSION_AMQP_URL={servers.amqp_url}")
        print(f"INTERMISSION_DATABASE_URL={servers.database_url}")
        print((await servers.cluster_status()).strip())
        con = await asyncpg.connect(servers.primary.dsn)
        try:
            rows = await con.fetch("SELECT application_name, state, sync_state FROM pg_stat_replication")
            print("replication:", [tuple(r.values()) for r in rows])
        finally:
            await con.close()
        await asyncio.sleep(seconds)
        return 0
    finally:
        for problem in await cleanup(folder):
            print(f"not cleaned up: {problem}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--boot-only", action="store_true")
    parser.add_argument("--cleanup", action="store_true")
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if args.cleanup:
        problems = asyncio.run(cleanup())
        for problem in problems:
            print(problem, file=sys.stderr)
        sys.exit(1 if problems else 0)
    if not args.boot_only:
        parser.error("only --boot-only and --cleanup exist so far")
    folder = args.dir or Path(tempfile.mkdtemp(prefix="intermission-cluster-"))
    sys.exit(asyncio.run(boot_only(folder, args.seconds)))


if __name__ == "__main__":
    main()
