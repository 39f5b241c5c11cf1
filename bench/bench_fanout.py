"""Topic fan-out benchmark: messages sent to a topic with 10 SQL-filtered subscriptions of mixed selectivity.

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/bench_fanout.py [--quick] [--messages N] [--batch B] [--root DIR] [--no-verify]

Default: 100,000 messages in batches of 1,000, 1 KB random bodies, to a partitioned topic whose 10
subscriptions each have one SQL rule (selectivity from ~1% to 100%, about 3.2 copies per message).
``--quick``: 10,000 messages (well under a minute). Reported:

- msg/s sent: messages / time spent in ``send_messages`` (fan-out, filter evaluation, Parquet
  writes and the Delta commit, all included);
- copies stored/s: subscription copies written / the same time;
- filter evaluations/s: messages x rules / the same time, and the same for the fan-out step alone
  (rules evaluated in memory over the same batches, no I/O) to show what filtering itself costs;
- a same-run floor: pyarrow writing the same number of copy rows (entity-shaped, 1 KB bodies) as
  one snappy Parquet file per batch, interleaved batch by batch with the sends, and the ratio.

After the run every subscription's message count is checked against the count computed from the
generated properties (``--no-verify`` skips it). Results go to ``bench/results/fanout.json`` under
the key ``fanout`` (``fanout-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import common as c
import pyarrow.parquet as pq

from sparkqueue import Message, Namespace, SqlRuleFilter
from sparkqueue.message import to_rows
from sparkqueue.model.topics import fan_out
from sparkqueue.sender import send_settings

TOPIC = "fanout"
REGIONS = ["eu-west", "eu-north", "us-east", "us-west", "ap-south", "ap-east", "sa-east", "af-south", "me-central", "ca-central"]
KINDS = ["order", "refund", "invoice", "ping"]

# name -> (SQL filter, the same predicate in Python over (subject, properties) for verification)
Predicate = Callable[[str, dict[str, Any]], bool]
SUBSCRIPTIONS: dict[str, tuple[str, Predicate]] = {
    "all": ("priority >= 0", lambda s, p: True),
    "eu-west": ("region = 'eu-west'", lambda s, p: p["region"] == "eu-west"),
    "low-priority": ("priority < 50", lambda s, p: p["priority"] < 50),
    "money": ("kind IN ('order', 'refund')", lambda s, p: p["kind"] in ("order", "refund")),
    "big-amount": ("amount * 1.2 > 900", lambda s, p: p["amount"] * 1.2 > 900),
    "orders-by-label": ("sys.Label LIKE 'orders/%'", lambda s, p: s.startswith("orders/")),
    "vip-urgent": ("vip = TRUE AND priority > 90", lambda s, p: p["vip"] and p["priority"] > 90),
    "americas-or-tenth": (
        "region IN ('us-east', 'us-west') OR priority % 10 = 0",
        lambda s, p: p["region"] in ("us-east", "us-west") or p["priority"] % 10 == 0,
    ),
    "coupons": ("EXISTS(coupon)", lambda s, p: "coupon" in p),
    "pings": ("kind = 'ping' AND region IS NOT NULL", lambda s, p: p["kind"] == "ping"),
}


def make_properties(rnd: random.Random, n: int) -> list[tuple[str, dict[str, Any]]]:
    """(subject, application properties) of n messages, drawn from a seeded generator."""
    out = []
    for _ in range(n):
        kind = rnd.choice(KINDS)
        region = rnd.choice(REGIONS)
        props: dict[str, Any] = {
            "region": region,
            "priority": rnd.randrange(100),
            "amount": round(rnd.uniform(0, 1000), 2),
            "kind": kind,
            "vip": rnd.random() < 0.1,
        }
        if rnd.random() < 0.05:
            props["coupon"] = f"C{rnd.randrange(10_000)}"
        out.append((f"{kind}s/{region}", props))
    return out


def build_topic(ns: Namespace) -> None:
    """The topic and its 10 subscriptions, each with exactly one SQL rule."""
    ns.create_topic(TOPIC)
    for name, (sql, _) in SUBSCRIPTIONS.items():
        ns.create_subscription(TOPIC, name)
        ns.create_rule(TOPIC, name, "only", filter=SqlRuleFilter(sql))
        ns.delete_rule(TOPIC, name, "$Default")


def run(messages: int, batch: int, root: str, verify: bool, seed: int) -> dict[str, Any]:
    """Send `messages` in batches of `batch`; time sends, an interleaved Parquet floor, and in-memory fan-out."""
    rnd = random.Random(seed)
    n_batches = (messages + batch - 1) // batch
    bodies = c.random_bodies(batch)
    scratch = Path(root) / "floor"
    scratch.mkdir(parents=True, exist_ok=True)
    expected = dict.fromkeys(SUBSCRIPTIONS, 0)
    send_s: list[float] = []
    fanout_s: list[float] = []
    floor_s: list[float] = []
    copies = 0
    floor_rows = c.message_rows(c.random_bodies(max(1, 4 * batch)))  # sliced to each batch's copy count
    with Namespace(f"{root}/ns") as ns:
        build_topic(ns)
        sender = ns.get_topic_sender(TOPIC)
        sender.send_messages([Message(b"warm-up", application_properties={"priority": "n/a"})])  # caches; matches no rule
        subscribers = ns.broker.subscribers(TOPIC)  # the same rules the sender uses, for the in-memory fan-out timing
        for b in range(n_batches):
            n = min(batch, messages - b * batch)
            meta = make_properties(rnd, n)
            for subject, props in meta:
                for name, (_, pred) in SUBSCRIPTIONS.items():
                    expected[name] += pred(subject, props)
            msgs = [
                Message(bodies[i], message_id=f"b{b}-{i}", subject=subject, application_properties=props)
                for i, (subject, props) in enumerate(meta)
            ]
            t0 = time.perf_counter()
            seqs = sender.send_messages(c.bulk(sender, msgs))
            send_s.append(time.perf_counter() - t0)
            copies += len(seqs)
            # the fan-out step alone: rules over the same rows, in memory
            rows, _ = to_rows(msgs, send_settings(ns.tier, ns.get_topic(TOPIC)), datetime.now(UTC))
            t0 = time.perf_counter()
            out = fan_out(rows, subscribers, record_ids=False)
            fanout_s.append(time.perf_counter() - t0)
            assert out.num_rows == len(seqs), (out.num_rows, len(seqs))
            # floor: write as many entity-shaped copy rows as this batch stored, as one Parquet file
            k = len(seqs)
            part = floor_rows if k <= floor_rows.num_rows else c.message_rows(c.random_bodies(k))
            t0 = time.perf_counter()
            pq.write_table(part.slice(0, k), scratch / f"copies-{b:05d}.parquet", compression="snappy")
            floor_s.append(time.perf_counter() - t0)
            if (b + 1) % max(1, n_batches // 10) == 0:
                done = (b + 1) * batch
                print(
                    f"  {min(done, messages):>8,} messages sent, {copies:>9,} copies, {c.rate(done, sum(send_s)):,.0f} msg/s",
                    flush=True,
                )
        verified: dict[str, Any] = {}
        if verify:
            t0 = time.perf_counter()
            stored = {name: ns.get_subscription_runtime_properties(TOPIC, name).active_message_count for name in SUBSCRIPTIONS}
            verified = {"ok": stored == expected, "stored": stored, "seconds": time.perf_counter() - t0}
            if stored != expected:
                print(f"  VERIFY FAILED: stored {stored} expected {expected}", file=sys.stderr)
    rules = sum(len(s.rules) for s in subscribers)
    total = sum(send_s)
    return {
        "messages": messages,
        "batch": batch,
        "subscriptions": len(SUBSCRIPTIONS),
        "rules": rules,
        "copies": copies,
        "copies_per_message": copies / messages,
        "expected_per_subscription": expected,
        "selectivity": {k: v / messages for k, v in expected.items()},
        "send_seconds": total,
        "msg_per_s": c.rate(messages, total),
        "copies_per_s": c.rate(copies, total),
        "filter_evals_per_s": c.rate(messages * rules, total),
        "batch_latency_ms": c.latency_summary_ms(send_s),
        "fanout_only": {
            "seconds": sum(fanout_s),
            "msg_per_s": c.rate(messages, sum(fanout_s)),
            "filter_evals_per_s": c.rate(messages * rules, sum(fanout_s)),
            "share_of_send": sum(fanout_s) / total if total else float("nan"),
        },
        "floor_parquet_write": {
            "seconds": sum(floor_s),
            "copies_per_s": c.rate(copies, sum(floor_s)),
        },
        "copies_vs_floor": c.ratio(c.rate(copies, total), c.rate(copies, sum(floor_s))),
        "verify": verified,
    }


def report(r: dict[str, Any]) -> None:
    """Print the figures."""
    c.heading(f"fan-out: {r['messages']:,} messages x {r['subscriptions']} filtered subscriptions (batches of {r['batch']:,})")
    c.row("copies stored", f"{r['copies']:,}", f"{r['copies_per_message']:.2f} per message")
    c.row("sent", c.fmt_rate(r["msg_per_s"]), f"{r['send_seconds']:.1f} s in send_messages")
    c.row("copies stored/s", f"{r['copies_per_s']:,.0f} copies/s")
    c.row("filter evaluations/s", f"{r['filter_evals_per_s']:,.0f} evals/s", f"{r['rules']} rules x messages / send time")
    lat = r["batch_latency_ms"]
    c.row("send latency per batch", f"p50 {lat['p50_ms']:,.0f} ms", f"p99 {lat['p99_ms']:,.0f} ms")
    fo = r["fanout_only"]
    c.row(
        "fan-out step alone (in memory)",
        f"{fo['filter_evals_per_s']:,.0f} evals/s",
        f"{fo['msg_per_s']:,.0f} msg/s, {100 * fo['share_of_send']:.0f}% of send time",
    )
    fl = r["floor_parquet_write"]
    c.row("floor: Parquet write of the copies", f"{fl['copies_per_s']:,.0f} copies/s", f"{fl['seconds']:.1f} s")
    c.row("copies/s vs floor", c.fmt_ratio(r["copies_vs_floor"]))
    if r["verify"]:
        c.row("per-subscription counts", "OK" if r["verify"]["ok"] else "MISMATCH")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print and save."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10,000 messages (under a minute)")
    ap.add_argument("--messages", type=int, default=None, help="messages to send (default 100,000; --quick 10,000)")
    ap.add_argument("--batch", type=int, default=1000, help="messages per send_messages call")
    ap.add_argument("--root", default=None, help="directory for the namespace (default: a temporary directory)")
    ap.add_argument("--no-verify", action="store_true", help="skip the per-subscription count check")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    messages = args.messages or (10_000 if args.quick else 100_000)
    root = args.root or tempfile.mkdtemp(prefix="sq-fanout-")
    started = datetime.now(UTC)
    try:
        result = run(messages, args.batch, root, not args.no_verify, args.seed)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    report(result)
    key = "fanout-quick" if args.quick else "fanout"
    meta = {**c.machine_info(), "started_utc": started, "argv": sys.argv[1:]}
    c.write_results(c.RESULTS_DIR / "fanout.json", meta, {key: result})
    print(f"\n  results written to {c.RESULTS_DIR / 'fanout.json'} [{key}]")
    return 0 if not result["verify"] or result["verify"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
