"""Soak benchmark: does a long run of send -> receive -> complete cycles stay as fast at the end as at the start?

10,000 cycles (one small message each) on a partitioned queue while a background process runs
`run_maintenance()` every few seconds with vacuum retention 0. Reports p50/p99 latency of the first
and last 500 cycles, their end/start ratio (PASS within 1.5x; the run never fails on it), the table's
Delta version (commit count) and live file count at the end, and a same-run floor: a bare delta-rs
append of one small row.

Run: python bench/bench_soak.py [--cycles N | --quick] [--maintenance-interval S] [--root DIR]
Writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from sparkqueue import Message, Namespace
from sparkqueue.storage.table import LOG_RETENTION

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
WINDOW = 500
FLOOR_EVERY = 10  # one floor append per this many cycles (timed apart from the cycles)
RATIO_LIMIT = 1.5
QUEUE = "soak"


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values, in the values' unit."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def maintenance_loop(root: str, interval_s: float, stop: mp.synchronize.Event, out: mp.Queue) -> None:
    """Background process: run_maintenance() every interval with vacuum retention 0; report run times and errors."""
    runs: list[float] = []
    errors: list[str] = []
    compacted = vacuumed = 0
    with Namespace(root) as ns:
        while not stop.wait(interval_s):
            t0 = time.perf_counter()
            try:
                reports = ns.run_maintenance(vacuum_retention=timedelta(0))
            except Exception as exc:  # reported, not fatal: the soak measures the foreground
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            runs.append(time.perf_counter() - t0)
            for r in reports.values():
                compacted += r.files_compacted
                vacuumed += r.vacuumed_files
    out.put(
        {
            "runs": len(runs),
            "run_s_p50": statistics.median(runs) if runs else None,
            "files_compacted": compacted,
            "files_vacuumed": vacuumed,
            "errors": errors,
        }
    )


class Floor:
    """A bare delta-rs append of one small row: the cost of one commit on this machine, sampled during the run."""

    SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("body", pa.binary())])

    def __init__(self, path: str) -> None:
        self.path = path
        # The log settings of sparkqueue's entity tables, so the floor's own log stays as short as theirs.
        config = {"delta.checkpointInterval": "50", "delta.logRetentionDuration": LOG_RETENTION}
        DeltaTable.create(path, schema=self.SCHEMA, configuration=config)
        self.samples: list[tuple[int, float]] = []  # (cycle, seconds)

    def sample(self, cycle: int) -> None:
        t = pa.table({"id": [cycle], "body": [b"soak"]}, schema=self.SCHEMA)
        t0 = time.perf_counter()
        write_deltalake(self.path, t, mode="append")
        self.samples.append((cycle, time.perf_counter() - t0))

    def between(self, lo: int, hi: int) -> list[float]:
        return [s for c, s in self.samples if lo <= c < hi]


def run(cycles: int, interval_s: float, root: str) -> dict:
    with Namespace(root) as ns:
        ns.create_queue(QUEUE)
        (table_path,) = Path(root, "entities").glob("queue-*")
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        maint = ctx.Process(target=maintenance_loop, args=(root, interval_s, stop, out), daemon=True)
        maint.start()
        lat: list[float] = []
        lost = 0
        floor = Floor(str(Path(root) / "floor"))
        with ns.get_queue_sender(QUEUE) as sender, ns.get_queue_receiver(QUEUE) as receiver:
            t_start = time.perf_counter()
            for i in range(cycles):
                t0 = time.perf_counter()
                sender.send_messages(Message(b"soak-%d" % i, message_id=f"m{i}"))
                got = receiver.receive_messages(max_message_count=1, max_wait_time=5)
                for m in got:
                    receiver.complete_message(m)
                lat.append(time.perf_counter() - t0)
                lost += 1 - len(got)
                if i % FLOOR_EVERY == 0:
                    floor.sample(i)
                if (i + 1) % 1000 == 0:
                    p50, p99 = pct(lat[-1000:], 50) * 1e3, pct(lat[-1000:], 99) * 1e3
                    print(f"  {i + 1:>6} cycles  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms", flush=True)
            elapsed = time.perf_counter() - t_start
        stop.set()
        maint.join(timeout=600)
        maint_stats = out.get(timeout=5) if not out.empty() else {}
        # drain whatever a receive missed (a receive that came back empty leaves its message behind)
        with ns.get_queue_receiver(QUEUE) as receiver:
            while got := receiver.receive_messages(max_message_count=100, max_wait_time=1):
                receiver.complete_messages(got)
        remaining = ns.get_queue_runtime_properties(QUEUE).total_message_count
    dt = DeltaTable(str(table_path))
    version, live_files = dt.version(), len(dt.file_uris())
    w = min(WINDOW, cycles // 2)
    first, last = lat[:w], lat[-w:]
    p50_ratio = pct(last, 50) / pct(first, 50)
    p99_ratio = pct(last, 99) / pct(first, 99)
    floor_all = [s for _, s in floor.samples]
    floor_first, floor_last = floor.between(0, w), floor.between(cycles - w, cycles)
    floor_ratio = pct(floor_last, 50) / pct(floor_first, 50)
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "cycles": cycles,
        "window": w,
        "maintenance_interval_s": interval_s,
        "elapsed_s": round(elapsed, 2),
        "cycles_per_s": round(cycles / elapsed, 1),
        "first": {"p50_ms": round(pct(first, 50) * 1e3, 2), "p99_ms": round(pct(first, 99) * 1e3, 2)},
        "last": {"p50_ms": round(pct(last, 50) * 1e3, 2), "p99_ms": round(pct(last, 99) * 1e3, 2)},
        "all": {"p50_ms": round(pct(lat, 50) * 1e3, 2), "p99_ms": round(pct(lat, 99) * 1e3, 2)},
        "end_start_ratio_p50": round(p50_ratio, 3),
        "end_start_ratio_p99": round(p99_ratio, 3),
        "ratio_limit": RATIO_LIMIT,
        "pass": p50_ratio <= RATIO_LIMIT,
        "empty_receives": lost,
        "left_in_queue": remaining,
        "table_version": version,
        "live_files": live_files,
        "floor_append_p50_ms": round(pct(floor_all, 50) * 1e3, 2),
        "floor_append_p99_ms": round(pct(floor_all, 99) * 1e3, 2),
        "floor_first_p50_ms": round(pct(floor_first, 50) * 1e3, 2),
        "floor_last_p50_ms": round(pct(floor_last, 50) * 1e3, 2),
        "floor_end_start_ratio_p50": round(floor_ratio, 3),
        "end_start_ratio_p50_vs_floor": round(p50_ratio / floor_ratio, 3),
        "floor_samples": len(floor_all),
        "maintenance": maint_stats,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=10_000, help="send -> receive -> complete cycles (default 10000)")
    p.add_argument("--quick", action="store_true", help="1000 cycles")
    p.add_argument("--maintenance-interval", type=float, default=3.0, help="seconds between maintenance runs")
    p.add_argument("--root", default=None, help="namespace directory (default: a fresh temporary one, removed after)")
    args = p.parse_args(argv)
    cycles = 1000 if args.quick else args.cycles
    if cycles < 2:
        p.error("--cycles must be at least 2")
    root = args.root or tempfile.mkdtemp(prefix="sparkqueue-soak-")
    print(f"soak: {cycles} cycles on a 16-partition queue, maintenance every {args.maintenance_interval:g} s, root {root}")
    try:
        r = run(cycles, args.maintenance_interval, root)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    verdict = "PASS" if r["pass"] else "FAIL"
    print(f"first {r['window']}: p50 {r['first']['p50_ms']:.1f} ms  p99 {r['first']['p99_ms']:.1f} ms")
    print(f"last  {r['window']}: p50 {r['last']['p50_ms']:.1f} ms  p99 {r['last']['p99_ms']:.1f} ms")
    ratios = f"{r['end_start_ratio_p50']:.2f} (p99 {r['end_start_ratio_p99']:.2f})"
    print(f"end/start p50 ratio {ratios}, limit {RATIO_LIMIT}: {verdict}")
    print(f"{r['cycles_per_s']} cycles/s; empty receives {r['empty_receives']}; left in queue {r['left_in_queue']}")
    print(f"table version (commits) {r['table_version']}, live files {r['live_files']}")
    print(
        f"floor: bare delta-rs one-row append p50 {r['floor_append_p50_ms']:.1f} ms (p99 {r['floor_append_p99_ms']:.1f} ms); "
        f"first/last window p50 {r['floor_first_p50_ms']:.1f}/{r['floor_last_p50_ms']:.1f} ms; "
        f"cycle ratio relative to the floor's own drift {r['end_start_ratio_p50_vs_floor']:.2f}"
    )
    print(f"maintenance: {r['maintenance']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    sys.exit(main())
