"""Demo job: create a partitioned queue in a local namespace, send, receive, settle, show runtime properties.

The first half uses the Python API; the second sends and receives DataFrames with Spark in local
mode (one task per queue partition). Each step says what it did, and why, in a line or two.

    python -m jobs.demo [--root ./sparkqueue-data] [--config conf/sparkqueue.toml] [--no-spark] [--verbose]

Run it twice: the queue keeps duplicate detection on, so the second run's messages (same ids,
within the 10-minute window) are dropped, and the demo says so.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `jobs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.progress import track
from rich.table import Table

from jobs import common
from sparkqueue import Message, Namespace, SubQueue
from sparkqueue.cli.render import console as make_console
from sparkqueue.errors import EntityAlreadyExistsError

log = logging.getLogger("jobs.demo")
QUEUE = "demo-orders"
SPARK_QUEUE = "demo-events"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_arg(p)
    p.add_argument("--root", help="namespace root, a local directory or object-store URI (default: namespace.root)")
    p.add_argument("--messages", type=int, default=2000, help="how many messages to send")
    p.add_argument("--batch", type=int, default=500, help="messages per send and receive batch")
    p.add_argument("--spark-messages", type=int, default=10_000, help="messages for the DataFrame half")
    p.add_argument("--no-spark", action="store_true", help="skip the DataFrame half (no Java on this machine)")
    p.add_argument("-v", "--verbose", action="store_true", help="the library's and Spark's INFO log, full stack traces")
    args = p.parse_args(argv)
    if args.messages < 0 or args.batch < 1 or args.spark_messages < 0:
        p.error("--messages and --spark-messages must be >= 0, --batch >= 1")
    return args


def runtime_table(ns: Namespace, queue: str) -> Table:
    """Runtime properties of the queue as a rich table, one row per partition plus the total."""
    rp = ns.get_queue_runtime_properties(queue)
    t = Table(title=f"{queue}: {rp.availability_status}")
    for col in ("partition", "active", "dead-letter", "scheduled", "deferred", "total", "bytes"):
        t.add_column(col, justify="right")
    for p in rp.partitions:
        t.add_row(
            str(p.partition_id),
            str(p.active_message_count),
            str(p.dead_letter_message_count),
            str(p.scheduled_message_count),
            str(p.deferred_message_count),
            str(p.total_message_count),
            str(p.size_in_bytes),
        )
    t.add_row(
        "all",
        str(rp.active_message_count),
        str(rp.dead_letter_message_count),
        str(rp.scheduled_message_count),
        str(rp.deferred_message_count),
        str(rp.total_message_count),
        str(rp.size_in_bytes),
        style="bold",
    )
    return t


def main(argv: list[str] | None = None) -> int:
    """Send orders, receive them in batches, complete most, dead-letter the malformed ones; then the DataFrame half."""
    args = parse_args(argv)
    common.setup_logging(args.verbose)
    console = make_console()
    with common.expected_failures(args.verbose):
        cfg = common.load_config(args.config, {"namespace.root": args.root} if args.root else {})
        if not args.no_spark:  # refused before anything is sent, not after the core half
            from sparkqueue.spark.staging import require_local_root

            require_local_root(str(cfg["namespace"]["root"]), "the demo's DataFrame half (pass --no-spark)")
        with common.namespace(cfg) as ns:
            console.print(f"[bold]sparkqueue demo[/bold] in namespace {ns.root} (one Delta table per queue)")
            dropped = core_round_trip(ns, args, console)
            if not args.no_spark:
                dataframe_round_trip(ns, args.spark_messages, console, verbose=args.verbose)
    again = "" if dropped else " Run it again to see duplicate detection drop the repeated orders."
    console.print(f"[green]Demo finished.[/green]{again}")
    return 0


def core_round_trip(ns: Namespace, args: argparse.Namespace, console: Console) -> int:
    """The Python API: send orders with ids, receive and settle them, show the dead letters; returns how many were dropped."""
    try:
        ns.create_queue(QUEUE, requires_duplicate_detection=True)
        console.print(f"created queue {QUEUE!r}: 16 partitions, duplicate detection on (10-minute window)")
    except EntityAlreadyExistsError:
        console.print(f"queue {QUEUE!r} exists (an earlier run); reusing it")
    dead_before = ns.get_queue_runtime_properties(QUEUE).dead_letter_message_count
    started = time.perf_counter()
    stored = 0
    with ns.get_queue_sender(QUEUE) as sender:
        for start in track(range(0, args.messages, args.batch), description="sending", console=console, transient=True):
            batch = [
                Message(
                    f'{{"order": {i}}}' if i % 97 else "not json",
                    message_id=f"order-{i}",
                    application_properties={"region": ("eu", "us", "apac")[i % 3]},
                )
                for i in range(start, min(start + args.batch, args.messages))
            ]
            stored += len(sender.send_messages(batch))  # sequence numbers of the messages stored
    elapsed = time.perf_counter() - started
    dropped = int(args.messages) - stored
    ids = f"ids order-0 ... order-{max(args.messages - 1, 0)}"
    console.print(f"sent {args.messages} messages ({ids}) in {elapsed:.2f}s: {stored} stored")
    if dropped:
        console.print(
            f"[yellow]{dropped} dropped by duplicate detection[/yellow]: their message ids were already sent to "
            f"{QUEUE!r} within its detection window (an earlier run); nothing new to receive for them"
        )
    done = dead = 0
    with ns.get_queue_receiver(QUEUE, max_wait_time=1) as receiver:
        while batch_in := receiver.receive_messages(max_message_count=args.batch):
            good = [m for m in batch_in if str(m).startswith("{")]
            for m in batch_in:
                if not str(m).startswith("{"):
                    receiver.dead_letter_message(m, reason="ParseError", error_description="body is not JSON")
                    dead += 1
            receiver.complete_messages(good)
            done += len(good)
    console.print(f"received {done + dead}: completed {done} (removed), dead-lettered {dead} whose body is not JSON")
    console.print(runtime_table(ns, QUEUE))
    dead_now = ns.get_queue_runtime_properties(QUEUE).dead_letter_message_count
    if dead_before:
        console.print(f"the dead-letter queue held {dead_before} from earlier runs; it holds {dead_now} now")
    with ns.get_queue_receiver(QUEUE, sub_queue=SubQueue.DEAD_LETTER) as dlq:
        for m in dlq.peek_messages(3):
            console.print(f"dead letter {m.message_id}: {m.dead_letter_reason} ({m.dead_letter_error_description})", markup=False)
    if dead_now:  # not before the detection window has passed: the ids are still recorded as sent
        window = ns.get_queue(QUEUE).duplicate_detection_history_time_window
        console.print(f"move them back, once duplicate detection's {window} window has passed (a resubmitted copy keeps its id):")
        console.print(f"  sparkqueue --root {ns.root} resubmit {QUEUE}", soft_wrap=True, markup=False)  # one line to copy
    return dropped


def dataframe_round_trip(ns: Namespace, n: int, console: Console, *, verbose: bool = False) -> None:
    """Send n messages as a DataFrame, receive them as a DataFrame, complete them by lock token (Spark local mode)."""
    from pyspark.sql import functions as sf

    from sparkqueue.spark import release, spark_session

    with console.status("starting Spark (local[2])"):
        spark = spark_session("local[2]", "sparkqueue-demo", conf=common.quiet_spark_log({"spark.ui.enabled": "false"}, verbose))
        spark.sparkContext.setLogLevel("INFO" if verbose else "WARN")
    with contextlib.suppress(EntityAlreadyExistsError):
        ns.create_queue(SPARK_QUEUE)
    df = spark.range(n).select(
        sf.concat(sf.lit("event-"), sf.col("id").cast("string")).alias("body"),
        (sf.col("id") % 100).cast("string").alias("partition_key"),
    )
    started = time.perf_counter()
    with console.status("sending a DataFrame"):
        sent = ns.get_queue_sender(SPARK_QUEUE).send_dataframe(df)
    took = time.perf_counter() - started
    console.print(f"DataFrame send to {SPARK_QUEUE!r}: {sent} messages in {took:.2f}s (a task per partition)")
    receiver = ns.get_queue_receiver(SPARK_QUEUE)
    started = time.perf_counter()
    with console.status("receiving a DataFrame"):
        got = receiver.receive_dataframe(n)
        status = receiver.complete_dataframe(got.select("lock_token"))
        counts = {r["status"]: r["count"] for r in status.groupBy("status").count().collect()}
        release(got)
        release(status)
    shown = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "nothing to receive"
    console.print(f"DataFrame receive + complete: {shown} in {time.perf_counter() - started:.2f}s")
    peeked = spark.read.format("sparkqueue").option("namespace", ns.root).load(SPARK_QUEUE).count()
    console.print(f'spark.read.format("sparkqueue") sees {peeked} messages left in {SPARK_QUEUE!r}')
    console.print(runtime_table(ns, SPARK_QUEUE))
    spark.stop()


if __name__ == "__main__":
    sys.exit(main())
