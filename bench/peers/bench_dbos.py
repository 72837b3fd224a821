#!/usr/bin/env python3
"""DBOS Transact: N workflows paused in DBOS.recv(), then resumed by N DBOS.send() calls.

  bench_dbos.py one --n 1000 [--sender same|proc] [--workflow sync|async] [--sender-threads 8] [--pool 20]
                    [--serial] [--state-bytes 0] [--settle 11] [--db NAME] [--keep-db]
  bench_dbos.py sender ...   (internal: the second-process sender, driven by `one`)

Per resume, DBOS does this: the sender's ``send()`` inserts a row into DBOS's notifications table (its own
transaction, in the sender's process); the paused workflow's ``recv()``, woken by LISTEN/NOTIFY in the
workflow's process, consumes that row and checkpoints what it received; the workflow then runs one
``@DBOS.step``, whose output is checkpointed, and returns, and DBOS commits the workflow's SUCCESS status
and output. Every one of those is a PostgreSQL transaction of its own. How that differs from
Intermission's resume: there is no broker (the "message" is a row in PostgreSQL and the wake-up a
NOTIFY), and the workflow's process keeps the paused run in memory (a thread blocked in recv, with the
default sync workflow) rather than a snapshot it loads when a command claims the run.

The workflow:  recv(topic="resume", timeout_seconds=3600)  ->  one @DBOS.step  ->  return
(--workflow async: the same as `async def` with `await DBOS.recv_async(...)`, started with
DBOS.start_workflow_async; the default sync workflow holds one executor thread per waiting run).
Phases:
  1. create a fresh database (--db), DBOS.launch() (runs DBOS's migrations),
     start N workflows (DBOS.start_workflow, fixed ids run-<i>), wait until every one has
     checkpointed recv's timeout (its DBOS.sleep row), i.e. is parked in recv, settle.
  2. t0; send N messages (DBOS.send from this process, or DBOSClient.send from a second
     process started before t0 and released at t0), each timed just before the call;
     each workflow's completion is the moment its WorkflowHandleFuture resolves, which is
     after DBOS has committed the SUCCESS status and output.
  3. resumes/s = N / (last completion - first send). Latency = completion - send (per run);
     'wake' = recv returned inside the workflow - send; 'tail' = completion - wake.
The result is checked: every workflow returned its message + 1, every row is SUCCESS.
CPU is this process, the sender process and PostgreSQL (common.CpuSampler). The last line on stdout is
the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

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

DB = "peers_dbos"  # set from --db by main()
TOPIC = "resume"
WAKE: dict[int, float] = {}
PARKED = "SELECT count(*) FROM dbos.operation_outputs WHERE function_name = 'DBOS.sleep'"


def wait_parked(n: int, t_start: float) -> None:
    """Every workflow has written recv's timeout row (DBOS.sleep), i.e. is waiting in recv."""
    import psycopg

    with psycopg.connect(dsn(DB), autocommit=True) as c:
        while True:
            k = c.execute(PARKED).fetchone()[0]
            if k >= n:
                return
            if time.time() - t_start > 600:
                raise RuntimeError(f"only {k}/{n} workflows reached recv")
            time.sleep(0.05)


def start_sender_proc(a):
    proc = subprocess.Popen(  # noqa: S603 - this same script, with arguments of our own
        [
            sys.executable,
            os.path.abspath(__file__),
            "sender",
            "--n",
            str(a.n),
            "--threads",
            str(a.sender_threads),
            "--db",
            DB,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = proc.stdout.readline().strip()
    if ready != "ready":
        raise RuntimeError(f"sender did not start: {ready!r}")
    return proc


def send_all(a, sender_proc, send_t: dict, wait_done=None) -> float:
    """Sends the N resumes (timing each send's start); returns when the last send returned.
    --serial: one at a time, each after the previous run completed (unloaded latency)."""
    if sender_proc:
        sender_proc.stdin.write("go\n")
        sender_proc.stdin.flush()
        out = json.loads(sender_proc.stdout.readline())
        send_t.update({int(k): v for k, v in out["send_t"].items()})
        return out["send_end"]
    from dbos import DBOS

    def send(i):
        send_t[i] = time.time()
        DBOS.send(f"run-{i}", {"v": i}, TOPIC)

    if a.serial:
        for i in range(a.n):
            send(i)
            wait_done(i)
        return time.time()
    with ThreadPoolExecutor(a.sender_threads, thread_name_prefix="sender") as ex:
        list(ex.map(send, range(a.n)))
    return time.time()


def run_one(a) -> dict:
    from dbos import DBOS, SetWorkflowID

    create_db(DB)
    DBOS(
        config={
            "name": "peers-bench",
            "system_database_url": dsn(DB),
            "sys_db_pool_size": a.pool,
            "log_level": "WARNING",
            "run_admin_server": False,
        }
    )

    snapshot = snapshot_payload(a.state_bytes)

    # The step's return value is what DBOS checkpoints: with --state-bytes it stands in
    # for a progress snapshot of that size written on every resume.
    @DBOS.step()
    def small_step(v: int) -> dict:
        return {"v": v + 1, "snapshot": snapshot}

    @DBOS.workflow()
    def paused_run(i: int) -> int:
        msg = DBOS.recv(TOPIC, timeout_seconds=3600)
        WAKE[i] = time.time()
        return small_step(msg["v"])["v"]

    @DBOS.step()
    async def small_step_async(v: int) -> dict:
        return {"v": v + 1, "snapshot": snapshot}

    @DBOS.workflow()
    async def paused_run_async(i: int) -> int:
        msg = await DBOS.recv_async(TOPIC, timeout_seconds=3600)
        WAKE[i] = time.time()
        return (await small_step_async(msg["v"]))["v"]

    DBOS.launch()
    n = a.n
    done_t: dict[int, float] = {}
    all_done = threading.Event()
    one_done = [threading.Event() for _ in range(n)]
    lock = threading.Lock()

    def on_done(i):
        def cb(_fut):
            now = time.time()
            with lock:
                done_t[i] = now
                one_done[i].set()
                if len(done_t) == n:
                    all_done.set()

        return cb

    send_t: dict[int, float] = {}
    m: dict = {}

    def measure(futures) -> None:
        """Settle, then the timed resume phase; `futures` resolve when each workflow is done."""
        for i, f in enumerate(futures):
            f.add_done_callback(on_done(i))
        time.sleep(a.settle)
        sender_proc = start_sender_proc(a) if a.sender == "proc" else None
        m["s0"] = db_stats(DB)
        cpu = CpuSampler(DB)
        if sender_proc:
            cpu.add_pid(sender_proc.pid)
        cpu.start()
        m["t0"] = time.time()
        m["send_end"] = send_all(a, sender_proc, send_t, lambda i: one_done[i].wait(60))
        if not all_done.wait(timeout=900):
            raise RuntimeError(f"only {len(done_t)}/{n} workflows completed")
        m["cpu"] = cpu.stop(n)
        if sender_proc:
            sender_proc.wait(timeout=60)

    # ---- phase 1: N paused runs, then phase 2: N resumes
    t_start = time.time()
    if a.workflow == "sync":
        handles = []
        for i in range(n):
            with SetWorkflowID(f"run-{i}"):
                handles.append(DBOS.start_workflow(paused_run, i))
        wait_parked(n, t_start)
        pause_s = time.time() - t_start
        log(f"dbos: {n} workflows parked in recv after {pause_s:.1f}s; settling {a.settle}s")
        measure([h.future for h in handles])
        results = [h.future.result() for h in handles]
    else:
        # async workflows run as tasks on this thread's event loop; the timed phase runs in a
        # helper thread (it blocks) while the loop keeps serving the workflows.
        async def main_async():
            hs = []
            for i in range(n):
                with SetWorkflowID(f"run-{i}"):
                    hs.append(await DBOS.start_workflow_async(paused_run_async, i))
            await asyncio.to_thread(wait_parked, n, t_start)
            m["pause_s"] = time.time() - t_start
            log(f"dbos: {n} async workflows parked in recv after {m['pause_s']:.1f}s; settling {a.settle}s")
            await asyncio.to_thread(measure, [h.task for h in hs])
            return [h.task.result() for h in hs]

        results = asyncio.run(main_async())
        pause_s = m["pause_s"]
    t_end = max(done_t.values())

    DBOS.destroy()  # closes DBOS's pools: the backends exit and publish their counters
    time.sleep(0.5)
    s1 = db_stats(DB)

    # ---- checks (the futures hold the results in memory; the rows are read afterwards)
    import psycopg

    bad = [i for i in range(n) if results[i] != i + 1]
    if bad:
        raise RuntimeError(f"{len(bad)} wrong results, e.g. run-{bad[0]}")
    with psycopg.connect(dsn(DB), autocommit=True) as c:
        ok = c.execute("SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'").fetchone()[0]
        ops = c.execute("SELECT function_name, count(*) FROM dbos.operation_outputs GROUP BY 1 ORDER BY 1").fetchall()
    if ok != n:
        raise RuntimeError(f"{ok}/{n} workflows SUCCESS in the database")

    first_send = min(send_t.values())
    lat = [done_t[i] - send_t[i] for i in range(n)]
    wake = [WAKE[i] - send_t[i] for i in range(n)]
    tail = [done_t[i] - WAKE[i] for i in range(n)]
    res = {
        "peer": "dbos",
        "n": n,
        "workflow": a.workflow,
        "sender": a.sender,
        "serial": a.serial,
        "sender_threads": 1 if a.serial else a.sender_threads,
        "pool": a.pool,
        "state_bytes": a.state_bytes,
        "pause_phase_s": round(pause_s, 3),
        "resume_phase_s": round(t_end - first_send, 3),
        "resumes_per_s": round(n / (t_end - first_send), 1),
        "send_phase_s": round(m["send_end"] - m["t0"], 3),
        "sends_per_s": round(n / (m["send_end"] - m["t0"]), 1),
        "latency": lat_summary(lat),
        "wake_latency": lat_summary(wake),
        "tail_latency": lat_summary(tail),
        "cpu": m["cpu"],
        "db": stats_delta(m["s0"], s1, n),
        "operation_outputs": {k.rsplit(".", 1)[-1]: v for k, v in ops},
        "versions": versions("dbos", "sqlalchemy", "psycopg"),
    }
    if not a.keep_db:
        drop_db(DB)
    return res


def run_sender(a) -> None:
    """Second process: DBOSClient.send() to run-0..run-(n-1), released by 'go' on stdin."""
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=dsn(a.db))
    pool = ThreadPoolExecutor(a.threads, thread_name_prefix="sender")
    # warm the connection pool so that connecting is not timed
    list(pool.map(lambda _: client.list_workflows(limit=1), range(a.threads)))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    send_t: dict[int, float] = {}

    def send(i):
        send_t[i] = time.time()
        client.send(f"run-{i}", {"v": i}, TOPIC)

    list(pool.map(send, range(a.n)))
    send_end = time.time()
    print(json.dumps({"send_t": send_t, "send_end": send_end}), flush=True)
    pool.shutdown()
    client.destroy()


def main() -> None:
    global DB
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("one")
    o.add_argument("--n", type=int, default=200)
    o.add_argument("--sender", choices=("same", "proc"), default="same")
    o.add_argument(
        "--workflow",
        choices=("sync", "async"),
        default="sync",
        help="sync: def workflow + DBOS.recv (a thread per waiting run); "
        "async: async def workflow + await DBOS.recv_async",
    )
    o.add_argument("--sender-threads", type=int, default=8)
    o.add_argument(
        "--serial", action="store_true", help="send one resume at a time, each after the previous run completed"
    )
    o.add_argument("--pool", type=int, default=20, help="sys_db_pool_size (DBOS default 20)")
    o.add_argument(
        "--state-bytes", type=int, default=0, help="size of a string the step returns (checkpointed per resume)"
    )
    o.add_argument("--settle", type=float, default=11.0)
    o.add_argument("--db", default=DB, help="the database to create, use and drop")
    o.add_argument("--keep-db", action="store_true")
    s = sub.add_parser("sender")
    s.add_argument("--n", type=int, required=True)
    s.add_argument("--threads", type=int, default=8)
    s.add_argument("--db", default=DB)
    a = p.parse_args()
    DB = a.db
    if a.cmd == "one" and a.serial and a.sender != "same":
        p.error("--serial needs --sender same")
    if a.cmd == "sender":
        run_sender(a)
        return
    try:
        res = run_one(a)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: DBOS's non-daemon threads would keep the process alive
    log(
        f"dbos n={a.n} workflow={a.workflow} sender={a.sender}: {res['resumes_per_s']} resumes/s, "
        f"p50 {res['latency']['p50_ms']} ms, p99 {res['latency']['p99_ms']} ms"
    )
    emit(res)
    os._exit(0)  # DBOS leaves non-daemon threads behind after destroy()


if __name__ == "__main__":
    main()
