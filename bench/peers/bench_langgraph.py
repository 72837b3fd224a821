#!/usr/bin/env python3
"""LangGraph + AsyncPostgresSaver: N threads interrupted in a node, then resumed with Command(resume=...).

  bench_langgraph.py one --n 1000 [--conc 16] [--lock shared|semaphore] [--durability async|sync|exit]
                         [--serial] [--state-bytes 0] [--settle 11] [--db NAME] [--keep-db]

Per resume, LangGraph does this: the caller (this process) awaits ``graph.ainvoke(Command(resume=...))``
for the thread; the checkpointer reads the thread's latest checkpoint and its pending writes, runs the
interrupted node again from its start with the resume value, and writes the new checkpoint, its blobs and
the task's writes through a psycopg pool. That is all: the resume is a function call in the process that
owns the graph. How that differs from Intermission's resume: there is no broker (no command consumed, no
event published, no acknowledgement: a caller's in-memory queue stands in for the messages), and there is
no claim: nothing stops two callers resuming the same thread at once, so a duplicate resume runs the node
twice and both runs' writes land, where Intermission refuses the second one with a conditioned claim.

The graph:  START -> ask -> END, where `ask` calls interrupt() and, once resumed, returns
{"answer": resume_value + 1}. One psycopg AsyncConnectionPool (min = max = conc, autocommit,
as the LangGraph docs set it up) backs one AsyncPostgresSaver.
  --lock shared     the library as shipped: every checkpointer call holds the saver's
                    instance asyncio.Lock, so at most one DB call runs at a time per saver
                    (langgraph issue #7259).
  --lock semaphore  the workaround from that issue: saver.lock = asyncio.Semaphore(conc),
                    so up to `conc` checkpointer calls use the pool at once.
Phases:
  1. a fresh database (--db), saver.setup(), N ainvoke(...) with thread_id run-<i>,
     `conc` at a time, each returning at the interrupt (checked); settle.
  2. t0: all N resumes are queued at once (a caller's own queue stands in for the resume
     messages); `conc` workers each take the next one and await
     graph.ainvoke(Command(resume={"v": i}), config). Completion = ainvoke returned (with
     durability=async the checkpoint writes are awaited before ainvoke returns).
  3. resumes/s = N / (last completion - t0); latency = completion - t0 (queueing included,
     like a burst of messages); service latency = completion - start of that ainvoke.
The result is checked: every thread's final state has answer = i + 1 and no pending interrupt.
CPU is this process and PostgreSQL (common.CpuSampler). The last line on stdout is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import TypedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Importable once the line above has put this folder on the path (the scripts run as files, not modules).
from common import (
    CpuSampler,
    create_db,
    db_stats,
    drop_db,
    dsn,
    emit,
    lat_summary,
    log,
    snapshot_payload,
    stats_delta,
    versions,
)

DEFAULT_DB = "peers_langgraph"


class State(TypedDict):
    i: int
    state: str
    answer: int | None


def build_graph(state_bytes: int):
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    snapshot = snapshot_payload(state_bytes)

    def ask(st: State) -> dict:
        msg = interrupt({"question": "approve?", "i": st["i"]})
        out: dict = {"answer": msg["v"] + 1}
        if state_bytes:
            # a new value of the `state` channel: the checkpoint after this step carries it,
            # standing in for a progress snapshot of that size written on every resume
            out["state"] = snapshot
        return out

    b = StateGraph(State)
    b.add_node("ask", ask)
    b.add_edge(START, "ask")
    b.add_edge("ask", END)
    return b


async def run_one(a) -> dict:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from langgraph.types import Command
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    db = a.db
    create_db(db)
    pool = AsyncConnectionPool(
        dsn(db),
        min_size=a.conc,
        max_size=a.conc,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    await pool.open(wait=True)
    saver = AsyncPostgresSaver(pool)
    await saver.setup()
    if a.lock == "semaphore":
        saver.lock = asyncio.Semaphore(a.conc)
    graph = build_graph(a.state_bytes).compile(checkpointer=saver)
    n = a.n

    def cfg(i):
        return {"configurable": {"thread_id": f"run-{i}"}}

    async def workers(jobs, fn):
        q: asyncio.Queue = asyncio.Queue()
        for j in jobs:
            q.put_nowait(j)

        async def w():
            while True:
                try:
                    j = q.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await fn(j)

        await asyncio.gather(*(w() for _ in range(a.conc)))

    # ---- phase 1: N paused runs
    t_start = time.time()

    async def pause(i):
        out = await graph.ainvoke({"i": i, "state": "", "answer": None}, cfg(i), durability=a.durability)
        if "__interrupt__" not in out:
            raise RuntimeError(f"run-{i} did not pause: {out}")

    await workers(range(n), pause)
    pause_s = time.time() - t_start
    log(f"langgraph: {n} threads interrupted after {pause_s:.1f}s; settling {a.settle}s")
    await asyncio.sleep(a.settle)

    s0 = db_stats(db)
    cpu = CpuSampler(db)
    cpu.start()

    # ---- phase 2: N resumes
    start_t: dict[int, float] = {}
    done_t: dict[int, float] = {}
    results: dict[int, dict] = {}

    async def resume(i):
        start_t[i] = time.time()
        results[i] = await graph.ainvoke(Command(resume={"v": i}), cfg(i), durability=a.durability)
        done_t[i] = time.time()

    t0 = time.time()
    if a.serial:
        for i in range(n):
            await resume(i)
    else:
        await workers(range(n), resume)
    t_end = max(done_t.values())
    cpu_d = cpu.stop(n)

    # ---- checks
    bad = [i for i in range(n) if results[i].get("answer") != i + 1 or "__interrupt__" in results[i]]
    if bad:
        raise RuntimeError(f"{len(bad)} wrong results, e.g. run-{bad[0]}: {results[bad[0]]}")
    for i in (0, n // 2, n - 1):
        snap = await graph.aget_state(cfg(i))
        if snap.next or snap.values.get("answer") != i + 1:
            raise RuntimeError(f"run-{i} not complete in the checkpointer: {snap}")
    counts = {}
    async with pool.connection() as c:
        for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes"):
            # The table names are the three above: none comes from outside.
            counts[table] = (await (await c.execute(f"SELECT count(*) AS k FROM {table}")).fetchone())["k"]  # noqa: S608
    await pool.close()
    await asyncio.sleep(0.5)
    s1 = db_stats(db)

    # --serial: one resume at a time, so a resume is 'sent' when its ainvoke starts
    lat = [done_t[i] - (start_t[i] if a.serial else t0) for i in range(n)]
    svc = [done_t[i] - start_t[i] for i in range(n)]
    res = {
        "peer": "langgraph",
        "n": n,
        "conc": a.conc,
        "serial": a.serial,
        "lock": a.lock,
        "durability": a.durability,
        "state_bytes": a.state_bytes,
        "pause_phase_s": round(pause_s, 3),
        "resume_phase_s": round(t_end - t0, 3),
        "resumes_per_s": round(n / (t_end - t0), 1),
        "latency": lat_summary(lat),
        "service_latency": lat_summary(svc),
        "cpu": cpu_d,
        "db": stats_delta(s0, s1, n),
        "rows_after": counts,
        "versions": versions(
            "langgraph", "langgraph-checkpoint", "langgraph-checkpoint-postgres", "psycopg", "psycopg-pool"
        ),
    }
    if not a.keep_db:
        drop_db(db)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("one")
    o.add_argument("--n", type=int, default=200)
    o.add_argument("--conc", type=int, default=16)
    o.add_argument(
        "--serial",
        action="store_true",
        help="resume one thread at a time (--conc 1 for the resume phase), latency from each call",
    )
    o.add_argument("--lock", choices=("shared", "semaphore"), default="shared")
    o.add_argument("--durability", choices=("async", "sync", "exit"), default="async")
    o.add_argument(
        "--state-bytes",
        type=int,
        default=0,
        help="size of a string the node writes to the state (checkpointed per resume)",
    )
    o.add_argument("--settle", type=float, default=11.0)
    o.add_argument("--db", default=DEFAULT_DB, help="the database to create, use and drop")
    o.add_argument("--keep-db", action="store_true")
    a = p.parse_args()
    res = asyncio.run(run_one(a))
    log(
        f"langgraph n={a.n} lock={a.lock}: {res['resumes_per_s']} resumes/s, "
        f"p50 {res['latency']['p50_ms']} ms, p99 {res['latency']['p99_ms']} ms, "
        f"service p50 {res['service_latency']['p50_ms']} ms"
    )
    emit(res)


if __name__ == "__main__":
    main()
