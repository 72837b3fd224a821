"""Resumes per second on the cluster with 1, 2 and 4 workers: ``bench.resume``'s Intermission phase
(N runs paused on ``lookup``, then resumed at once, from the first publish to the last ``run.completed``),
pointed at the cluster's URL lists. Every node and both PostgreSQL servers share this machine's cores with
the workers, so the curve says what the cluster costs, not what more machines would give."""

from __future__ import annotations

from typing import Any

from bench.cluster.servers import Servers
from bench.infra import RabbitAdmin, url_user
from bench.resume import Options, measure_intermission


async def scaling(
    servers: Servers, ctl: list[str], *, runs: int, workers: tuple[int, ...] = (1, 2, 4)
) -> dict[str, Any]:
    opts = Options(
        runs=runs,
        workers=list(workers),
        prefetch=16,
        window=64,
        unloaded_samples=0,
        database_url=servers.database_url,
        amqp_url=servers.amqp_url,
        rabbitmqctl=ctl,
        bare_shape="cte",
        quick=False,
        out=None,
        # As its figures were taken so far: workers only. bench.resume itself runs a sweeper beside them.
        sweeper=False,
    )
    admin = RabbitAdmin(ctl, url_user(servers.amqp_url))
    vhosts = dict(zip(workers, await admin.add_vhosts([f"cluster-w{n}" for n in workers]), strict=True))
    measured: dict[str, Any] = {}
    try:
        for n in workers:
            result = await measure_intermission(opts, admin, vhosts[n], n)
            measured[str(n)] = {
                "resumes_per_second": round(result["per_second"], 1),
                "latency_ms": result["latency_ms"],
                "cpu_ms_per_resume": result["cpu_ms_per_resume"],
            }
    finally:
        await admin.delete_all()
    return {"runs": runs, "workers": measured}
