"""sparkqueue on a local disk and on an object store (Azurite), beside a bare obstore put on the same store.

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/bench_store.py [--quick]

For each store: round trip send -> receive -> complete (p50, p90), batched send of 1,000 x 1 KB,
and receive(1000) + complete_messages, with two floors measured in the same run on the same
store: a bare obstore put of a 1 KB object (the latency of one write) and of a 1 MB object (the
throughput of one batch's data file). Azurite is started from `.azurite/` (installed by the tests'
fixture, or here when missing). Results go to ``bench/results/store.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import common as c

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from azurite import Azurite

from sparkqueue import Message, Namespace
from sparkqueue.storage.store import open_store

BATCH = 1000


def bench_one(label: str, root: str, options: dict[str, str] | None, rounds: int, batches: int) -> dict[str, Any]:
    """Round trip, batched send and receive+complete on one store, with bare-put floors."""
    c.heading(f"{label}: {root}")
    ns = Namespace(root, storage_options=options)
    store = open_store(ns.root, options).child("_bench_floor")
    small, big = b"x" * 1024, bytes(BATCH * 1024)
    put_small = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        store.put(f"small-{uuid.uuid4().hex}", small)
        put_small.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(batches):
        store.put(f"big-{uuid.uuid4().hex}", big)
    put_big_s = (time.perf_counter() - t0) / batches

    ns.create_queue("rt")
    sender, receiver = ns.get_queue_sender("rt"), ns.get_queue_receiver("rt")
    bodies = c.random_bodies(1)
    for _ in range(5):  # warm-up
        sender.send_messages(Message(bodies[0]))
        receiver.complete_message(receiver.receive_messages(1, max_wait_time=5)[0])
    trips = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sender.send_messages(Message(bodies[0]))
        got = receiver.receive_messages(1, max_wait_time=5)
        receiver.complete_message(got[0])
        trips.append(time.perf_counter() - t0)

    ns.create_queue("bulk")
    s, r = ns.get_queue_sender("bulk"), ns.get_queue_receiver("bulk")
    payload = [Message(b) for b in c.random_bodies(BATCH)]
    t0 = time.perf_counter()
    for _ in range(batches):
        s.send_messages(c.bulk(s, payload))
    send_s = time.perf_counter() - t0
    done = 0
    t0 = time.perf_counter()
    while done < batches * BATCH:
        got = r.receive_messages(BATCH, max_wait_time=5)
        if not got:
            break
        r.complete_messages(got)
        done += len(got)
    recv_s = time.perf_counter() - t0
    ns.close()

    out = {
        "roundtrip_ms": c.latency_summary_ms(trips),
        "floor_put_1kb_ms": c.latency_summary_ms(put_small),
        "send_msg_per_s": c.rate(batches * BATCH, send_s),
        "receive_complete_msg_per_s": c.rate(done, recv_s),
        "floor_put_1mb_msg_per_s": c.rate(BATCH, put_big_s),
        "completed": done,
    }
    rt, fl = out["roundtrip_ms"], out["floor_put_1kb_ms"]
    c.row("round trip p50 / p90", f"{rt['p50_ms']:.1f} / {rt['p90_ms']:.1f} ms", f"bare 1 KB put p50 {fl['p50_ms']:.2f} ms")
    c.row("  ratio to bare put", c.fmt_ratio(c.ratio(rt["p50_ms"], fl["p50_ms"])))
    floor_rate = out["floor_put_1mb_msg_per_s"]
    c.row("batched send (1000 per call)", c.fmt_rate(out["send_msg_per_s"]), f"bare 1 MB put {c.fmt_rate(floor_rate)}")
    c.row("receive(1000) + complete", c.fmt_rate(out["receive_complete_msg_per_s"]), f"{done:,} completed")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "store.json")
    args = ap.parse_args(argv)
    rounds, batches = (30, 3) if args.quick else (200, 20)
    scratch = Path(tempfile.mkdtemp(prefix="sq-bench-store-"))
    server = Azurite(scratch / "azurite")
    results: dict[str, Any] = {}
    try:
        results["local"] = bench_one("local disk", str(scratch / "ns"), None, rounds, batches)
        container = server.create_container()
        results["azurite"] = bench_one(
            "Azurite (Azure Blob emulator)", f"az://{container}/ns", server.storage_options(), rounds, batches
        )
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    c.write_results(args.out, {"benchmark": "store", "quick": args.quick, "machine": c.machine_info()}, results)
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
