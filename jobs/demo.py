"""Demo job: create a partitioned queue in a local namespace, send, receive, settle, show runtime properties.

The first half uses the Python API; the second sends and receives DataFrames with Spark in local
mode (one task per queue partition). Run: python -m jobs.demo [--root ./sparkqueue-data] [--no-spark]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

from rich.console import Console
from rich.progress import track
from rich.table import Table

from sparkqueue import Message, Namespace, SubQueue
from sparkqueue.errors import EntityAlreadyExistsError

log = logging.getLogger("jobs.demo")
QUEUE = "demo-orders"
SPARK_QUEUE = "demo-events"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="./sparkqueue-data", help="namespace root (a local directory or object-store URI)")
    p.add_argument("--messages", type=int, default=2000, help="how many messages to send")
    p.add_argument("--batch", type=int, default=500, help="messages per send and receive batch")
    p.add_argument("--spark-messages", type=int, default=10_000, help="messages for the DataFrame half")
    p.add_argument("--no-spark", action="store_true", help="skip the DataFrame half (no Java on this machine)")
    return p.parse_args(argv)


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


def main(argv: list[str] | None = None) -> None:
    """Send orders, receive them in batches, complete most, dead-letter the malformed ones, defer one."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    with Namespace(args.root) as ns:
        try:
            ns.create_queue(QUEUE, requires_duplicate_detection=True)
        except EntityAlreadyExistsError:
            log.info("queue %s exists; reusing it", QUEUE)
        started = time.perf_counter()
        with ns.get_queue_sender(QUEUE) as sender:
            for start in track(range(0, args.messages, args.batch), description="sending", console=console):
                batch = [
                    Message(
                        f'{{"order": {i}}}' if i % 97 else "not json",
                        message_id=f"order-{i}",
                        application_properties={"region": ("eu", "us", "apac")[i % 3]},
                    )
                    for i in range(start, min(start + args.batch, args.messages))
                ]
                sender.send_messages(batch)
        console.print(f"sent {args.messages} messages in {time.perf_counter() - started:.2f}s")
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
        console.print(f"completed {done}, dead-lettered {dead}")
        console.print(runtime_table(ns, QUEUE))
        with ns.get_queue_receiver(QUEUE, sub_queue=SubQueue.DEAD_LETTER) as dlq:
            for m in dlq.peek_messages(3):
                console.print(f"dead letter {m.message_id}: {m.dead_letter_reason} ({m.dead_letter_error_description})")
        if not args.no_spark:
            dataframe_round_trip(ns, args.spark_messages, console)


def dataframe_round_trip(ns: Namespace, n: int, console: Console) -> None:
    """Send n messages as a DataFrame, receive them as a DataFrame, complete them by lock token (Spark local mode)."""
    from pyspark.sql import functions as sf

    from sparkqueue.spark import spark_session

    spark = spark_session("local[2]", "sparkqueue-demo")
    with contextlib.suppress(EntityAlreadyExistsError):
        ns.create_queue(SPARK_QUEUE)
    df = spark.range(n).select(
        sf.concat(sf.lit("event-"), sf.col("id").cast("string")).alias("body"),
        (sf.col("id") % 100).cast("string").alias("partition_key"),
    )
    started = time.perf_counter()
    with console.status("sending a DataFrame"):
        sent = ns.get_queue_sender(SPARK_QUEUE).send_dataframe(df)
    console.print(f"DataFrame send: {sent} messages in {time.perf_counter() - started:.2f}s")
    receiver = ns.get_queue_receiver(SPARK_QUEUE)
    started = time.perf_counter()
    with console.status("receiving a DataFrame"):
        got = receiver.receive_dataframe(n)
        status = receiver.complete_dataframe(got.select("lock_token"))
        counts = {r["status"]: r["count"] for r in status.groupBy("status").count().collect()}
    console.print(f"DataFrame receive+complete: {counts} in {time.perf_counter() - started:.2f}s")
    console.print(runtime_table(ns, SPARK_QUEUE))


if __name__ == "__main__":
    main()
