"""Session throughput of sparkqueue: many sessions drained by competing session receivers in separate processes.

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/bench_sessions.py [--quick] [--sessions N] [--per-session M] [--processes P]
                                             [--layout interleaved|grouped] [--settle batch|each]

A session-enabled queue (16 partitions) is filled with N sessions x M messages (default 1,000 x 10;
``--quick``: 100 x 10). P receiver processes (default 4, "spawn") then loop: accept
NEXT_AVAILABLE_SESSION with prefetch_count=100 (the accept's commit then delivers the session's first
messages, as the SDK's prefetch does), receive the session's messages (batches of 100 until one comes back short),
complete them, close the receiver (which releases the session at once). Reported:

- msg/s: messages completed / wall time from the start barrier until the last completion;
- accept-session latency p50/p99 (successful NEXT_AVAILABLE_SESSION accepts), and the other phases
  of a session cycle (receive, complete, close, whole cycle);
- a same-run floor: latency of a bare delta-rs append of one small row (``write_deltalake``, one
  commit), measured just before and just after the workload, and the accept/floor ratio.

``--layout interleaved`` (default) sends round by round, one message of every session per batch, so
a data file holds messages of many sessions (sessions whose messages trickle in); ``grouped`` sends
each session's messages together. ``--settle batch`` (default) completes a session's messages with
one ``complete_messages`` call (one commit per partition); ``each`` calls ``complete_message`` per
message as SDK code does. Results go to ``bench/results/sessions.json`` (``sessions-quick.json``
with ``--quick``). The machine is small and shared, so compare figures with their same-run floor.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from common import bulk
from common import latency_summary_ms as summary_ms

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BODY_SIZE = 256
QUEUE = "sessions"


# ---- statistics ------------------------------------------------------------------------------------


# ---- floor -------------------------------------------------------------------------------------------


def commit_floor(scratch: Path, commits: int, warmup: int = 5) -> list[float]:
    """Latencies (s) of a bare delta-rs append of one small sparkqueue-shaped row (one commit each)."""
    from deltalake import write_deltalake

    from sparkqueue.storage.schema import ENTITY_SCHEMA

    uri = str(scratch / f"floor-{uuid.uuid4().hex[:8]}")
    now = datetime.now(UTC)
    known = {
        "partition_id": 0,
        "sequence_number": 1,
        "available_at_utc": now,
        "sub_queue": "main",
        "state": "active",
        "kind": "message",
        "enqueued_time_utc": now,
        "delivery_count": 0,
        "message_id": "floor",
        "size_in_bytes": BODY_SIZE,
        "transfer_hop_count": 0,
        "body": os.urandom(BODY_SIZE),
    }
    row = pa.Table.from_pylist([{f.name: known.get(f.name) for f in ENTITY_SCHEMA}], schema=ENTITY_SCHEMA)
    out = []
    try:
        for i in range(warmup + commits):
            t0 = time.perf_counter()
            write_deltalake(uri, row, mode="append", partition_by=["partition_id"])
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(uri, ignore_errors=True)
    return out


# ---- workload ------------------------------------------------------------------------------------------


def fill(root: str, sessions: int, per: int, layout: str) -> dict[str, Any]:
    """Create the session queue and send sessions x per messages; returns send figures."""
    from sparkqueue import Message, Namespace

    body = os.urandom(BODY_SIZE)
    ns = Namespace(root)
    ns.create_queue(QUEUE, requires_session=True, lock_duration=timedelta(seconds=60))
    batches: list[list[Any]] = []
    if layout == "interleaved":
        for k in range(per):  # one message of every session per round
            msgs = [Message(body, session_id=f"s{i:05d}", message_id=f"s{i:05d}-{k}") for i in range(sessions)]
            batches.extend(msgs[j : j + 1000] for j in range(0, len(msgs), 1000))
    else:
        group = max(1, 1000 // per)
        for g in range(0, sessions, group):
            batches.append(
                [
                    Message(body, session_id=f"s{i:05d}", message_id=f"s{i:05d}-{k}")
                    for i in range(g, min(sessions, g + group))
                    for k in range(per)
                ]
            )
    t0 = time.perf_counter()
    with ns.get_queue_sender(QUEUE) as s:
        for b in batches:
            s.send_messages(bulk(s, b))
    secs = time.perf_counter() - t0
    n = sessions * per
    stored = ns.get_queue_runtime_properties(QUEUE).active_message_count
    if stored != n:
        raise SystemExit(f"setup failed: {stored} of {n} messages stored")
    return {"messages": n, "batches": len(batches), "seconds": secs, "msg_per_s": n / secs if secs else math.nan}


def worker(root: str, total: int, settle: str, done: Any, barrier: Any, out_path: str) -> None:
    """Accept the next available session, receive all its messages, complete them, close; until all are done."""
    from sparkqueue import NEXT_AVAILABLE_SESSION, Namespace
    from sparkqueue.errors import OperationTimeoutError

    accept, accept_fail, receive, complete, close, cycle = [], [], [], [], [], []
    sessions = messages = empty = 0
    last_completion = 0.0
    with Namespace(root) as ns:
        # warm up imports and the table handle outside the timed run (a peek reads the table)
        ns.get_queue_runtime_properties(QUEUE)
        barrier.wait(timeout=300)
        start = time.time()
        while done.value < total:
            t0 = time.perf_counter()
            try:
                r = ns.get_queue_receiver(QUEUE, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1.0, prefetch_count=100)
            except OperationTimeoutError:  # no free session within max_wait_time (the SDK pool loop)
                accept_fail.append(time.perf_counter() - t0)
                continue
            t1 = time.perf_counter()
            accept.append(t1 - t0)
            got: list[Any] = []
            while True:  # every message of the session: all are available, FIFO, none locked elsewhere
                batch = r.receive_messages(max_message_count=100, max_wait_time=None)
                got.extend(batch)
                if len(batch) < 100:
                    break  # fewer than asked: the session has no more for now (no wait for stragglers)
            t2 = time.perf_counter()
            receive.append(t2 - t1)
            if got:
                if settle == "batch":
                    r.complete_messages(got)
                else:
                    for m in got:
                        r.complete_message(m)
                with done.get_lock():
                    done.value += len(got)
                last_completion = time.time()
            else:
                empty += 1
            t3 = time.perf_counter()
            complete.append(t3 - t2)
            r.close()
            t4 = time.perf_counter()
            close.append(t4 - t3)
            cycle.append(t4 - t0)
            sessions += 1
            messages += len(got)
        end = time.time()
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "start": start,
                "end": end,
                "last_completion": last_completion,
                "sessions": sessions,
                "messages": messages,
                "empty_sessions": empty,
                "accept": accept,
                "accept_fail": accept_fail,
                "receive": receive,
                "complete": complete,
                "close": close,
                "cycle": cycle,
            },
            f,
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Fill, drain with competing session receivers, verify, and measure the floor around it."""
    from sparkqueue import Namespace

    scratch = Path(tempfile.mkdtemp(prefix="bench-sessions-"))
    root = str(scratch / "ns")
    try:
        print(f"filling {args.sessions} sessions x {args.per_session} messages ({args.layout}) ...", flush=True)
        send = fill(root, args.sessions, args.per_session, args.layout)
        print(f"  sent {send['messages']} messages in {send['seconds']:.1f} s ({send['msg_per_s']:,.0f} msg/s)", flush=True)
        floor_before = commit_floor(scratch, args.floor_commits)

        total = args.sessions * args.per_session
        ctx = mp.get_context("spawn")
        done, barrier = ctx.Value("i", 0), ctx.Barrier(args.processes)
        outs = [str(scratch / f"worker-{w}.json") for w in range(args.processes)]
        wargs = [(root, total, args.settle, done, barrier, outs[w]) for w in range(args.processes)]
        procs = [ctx.Process(target=worker, args=a) for a in wargs]
        print(f"draining with {args.processes} session receiver processes ...", flush=True)
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout)
        stuck = [p for p in procs if p.is_alive()]
        for p in stuck:
            p.kill()
        if stuck or any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
        floor_after = commit_floor(scratch, args.floor_commits)

        reports = [json.loads(Path(o).read_text()) for o in outs]
        completed = sum(r["messages"] for r in reports)
        left = Namespace(root).get_queue_runtime_properties(QUEUE).total_message_count
        # Until the last completion, as the competing-consumers figure of bench_core: a worker that finds no
        # free session left waits for one (up to max_wait_time) before it sees the drain is over.
        wall = max(r["last_completion"] for r in reports) - min(r["start"] for r in reports)

        def pooled(key: str) -> list[float]:
            return [x for r in reports for x in r[key]]

        floor = summary_ms(floor_before + floor_after)
        accept = summary_ms(pooled("accept"))
        return {
            "params": {
                "sessions": args.sessions,
                "messages_per_session": args.per_session,
                "processes": args.processes,
                "layout": args.layout,
                "settle": args.settle,
                "body_bytes": BODY_SIZE,
                "partitions": 16,
            },
            "send": send,
            "drain": {
                "messages_completed": completed,
                "messages_left": left,
                "wall_seconds": wall,
                "msg_per_s": completed / wall if wall > 0 else math.nan,
                "sessions_per_s": sum(r["sessions"] for r in reports) / wall if wall > 0 else math.nan,
                "session_cycles": sum(r["sessions"] for r in reports),
                "empty_session_cycles": sum(r["empty_sessions"] for r in reports),
                "failed_accepts": len(pooled("accept_fail")),
                "per_worker_sessions": [r["sessions"] for r in reports],
            },
            "latency": {
                "accept_session": accept,
                "receive_all": summary_ms(pooled("receive")),
                "complete": summary_ms(pooled("complete")),
                "close": summary_ms(pooled("close")),
                "session_cycle": summary_ms(pooled("cycle")),
            },
            "floor": {
                "delta_commit_one_row": floor,
                "before": summary_ms(floor_before),
                "after": summary_ms(floor_after),
            },
            "ratios": {
                "accept_p50_over_floor_p50": accept["p50_ms"] / floor["p50_ms"] if floor["p50_ms"] else math.nan,
                "accept_p99_over_floor_p99": accept["p99_ms"] / floor["p99_ms"] if floor["p99_ms"] else math.nan,
            },
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def report(res: dict[str, Any]) -> None:
    """Print the figures."""
    p, d, lat, fl = res["params"], res["drain"], res["latency"], res["floor"]["delta_commit_one_row"]
    print(
        f"\n== sessions: {p['sessions']} x {p['messages_per_session']}, {p['processes']} processes, "
        f"{p['layout']} layout, settle={p['settle']} " + "=" * 10
    )

    def line(label: str, value: str, note: str = "") -> None:
        print(f"  {label:<34} {value:>16}  {note}".rstrip())

    line("throughput", f"{d['msg_per_s']:,.0f} msg/s", f"{d['messages_completed']} msgs in {d['wall_seconds']:.1f} s")
    note = f"{d['session_cycles']} cycles ({d['empty_session_cycles']} empty), {d['failed_accepts']} accept timeouts"
    line("sessions", f"{d['sessions_per_s']:,.1f} sess/s", note)
    for name in ("accept_session", "receive_all", "complete", "close", "session_cycle"):
        s = lat[name]
        line(f"{name} p50 / p99", f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f} ms", f"n={s['n']}")
    line("floor: delta-rs 1-row commit p50/p99", f"{fl['p50_ms']:.1f} / {fl['p99_ms']:.1f} ms", f"n={fl['n']}")
    r = res["ratios"]
    line("accept / floor (p50, p99)", f"{r['accept_p50_over_floor_p50']:.2f}x / {r['accept_p99_over_floor_p99']:.2f}x")
    line("send (setup)", f"{res['send']['msg_per_s']:,.0f} msg/s", f"{res['send']['batches']} batches")
    if d["messages_left"] or d["messages_completed"] != p["sessions"] * p["messages_per_session"]:
        print(f"  WARNING: {d['messages_completed']} completed, {d['messages_left']} left in the queue")
    else:
        print("  check: every message completed once, queue empty")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 sessions: a smoke run of well under a minute")
    ap.add_argument("--sessions", type=int, help="number of sessions (default 1000, --quick 100)")
    ap.add_argument("--per-session", type=int, default=10, help="messages per session (default 10)")
    ap.add_argument("--processes", type=int, default=4, help="receiver processes (default 4)")
    ap.add_argument("--layout", choices=("interleaved", "grouped"), default="interleaved")
    ap.add_argument("--settle", choices=("batch", "each"), default="batch")
    ap.add_argument("--floor-commits", type=int, default=None, help="floor commits before and after (default 30, quick 15)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the workers")
    ap.add_argument("--out", type=Path, help="results file (default bench/results/sessions[-quick].json)")
    args = ap.parse_args()
    if args.sessions is None:
        args.sessions = 100 if args.quick else 1000
    if args.floor_commits is None:
        args.floor_commits = 15 if args.quick else 30
    res = run(args)
    report(res)
    out = args.out or RESULTS_DIR / ("sessions-quick.json" if args.quick else "sessions.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import deltalake

    import sparkqueue

    meta = {
        "when_utc": datetime.now(UTC).isoformat(),
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0],
        "pyarrow": pa.__version__,
        "deltalake": deltalake.__version__,
        "sparkqueue": sparkqueue.__version__,
    }
    out.write_text(json.dumps({"meta": meta, "sessions": res}, indent=2, sort_keys=True) + "\n")
    print(f"\nresults written to {out}")


if __name__ == "__main__":
    main()
