"""Streaming consumer job: the scheduled consumer as a Structured Streaming query over the `sparkqueue` source.

    python -m jobs.stream_consumer [--config conf/sparkqueue.toml] [--checkpoint PATH] [--trigger available_now|SECONDS]
    spark-submit jobs/stream_consumer.py --config conf/sparkqueue.toml

By default the query runs with `trigger(availableNow=True)`: it drains what the queue holds when
it starts, in micro-batches of `max_messages_per_trigger`, then stops, which is what a scheduled
run (Databricks job, cron) wants; `--trigger 30` keeps it running with a batch every 30 seconds.

Each micro-batch is transformed (consumer.transform) and appended to a Delta table
(consumer.output) in one commit carrying the Delta txn (query id, batch id), so a batch Spark
replays after a crash is not appended twice. The source completes a batch's messages only after
Spark committed the batch, and replays a batch with exactly the messages it had (see
docs/spark-streaming.md): each message's output row is written once, even when the job is
killed mid-batch and restarted from its checkpoint.

Settings ([stream_consumer] in the configuration file, or the flags): `checkpoint` (default
"<namespace root>/_checkpoints/<queue>"), `max_messages_per_trigger` (default 50000), `trigger`
("available_now" or seconds). The queue, output and transform are the consumer's.
`--crash-after-write N` SIGKILLs the process after writing batch N's output (crash drills).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (spark-submit jobs/stream_consumer.py): make `jobs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from pyspark.sql import DataFrame, SparkSession

from jobs import common
from jobs.consumer import load_transform, output_path, output_rows, prepare_output
from sparkqueue.errors import InvalidOperationError
from sparkqueue.spark.streaming_sink import query_id

log = logging.getLogger("jobs.stream_consumer")

AVAILABLE_NOW = "available_now"  # the default trigger (common.DEFAULTS["stream_consumer"])
FLAGS = {
    "checkpoint": "stream_consumer.checkpoint",
    "max_messages_per_trigger": "stream_consumer.max_messages_per_trigger",
    "trigger": "stream_consumer.trigger",
    "transform": "consumer.transform",
    "output": "consumer.output",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (each overrides the configuration file)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--checkpoint", help="checkpoint location of the query (stream_consumer.checkpoint)")
    p.add_argument("--max-messages-per-trigger", dest="max_messages_per_trigger", type=int, help="messages per micro-batch")
    p.add_argument("--trigger", help="'available_now' (drain and stop) or seconds between micro-batches")
    p.add_argument("--transform", help="module:function applied to each micro-batch (consumer.transform)")
    p.add_argument("--output", help="output Delta table path (consumer.output)")
    p.add_argument("--crash-after-write", dest="crash_after_write", type=int, help="SIGKILL after writing batch N (drill)")
    return p.parse_args(argv)


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The [stream_consumer] settings, checked (before Spark starts), with the default checkpoint filled in."""
    s = dict(cfg["stream_consumer"])
    common.number(cfg, "stream_consumer.max_messages_per_trigger", int, 1)
    if not s["checkpoint"]:
        s["checkpoint"] = f"{str(cfg['namespace']['root']).rstrip('/')}/_checkpoints/{cfg['queue']['name']}"
    trigger = str(s["trigger"])
    if trigger != AVAILABLE_NOW:
        try:
            if not 0 < float(trigger) < math.inf:  # NaN and inf passed this check, then failed inside Spark
                raise ValueError
        except ValueError:
            raise InvalidOperationError(
                f"trigger must be 'available_now' or a positive number of seconds, got {trigger!r}"
            ) from None
    return s


def append_task(
    path: str, app_id: str, batch_id: int, schema: pa.Schema, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """Append the batch's rows in one Delta commit carrying txn (app_id, batch_id), unless that batch is recorded already."""
    rows = [b for b in batches if b.num_rows]
    done = DeltaTable(path).transaction_version(app_id)
    written = 0
    if done is not None and done >= batch_id:
        log.info("batch %d is in %s already (a replay after a restart); not appended again", batch_id, path)
    elif rows:
        table = pa.Table.from_batches(rows).cast(schema)
        txn = CommitProperties(app_transactions=[Transaction(app_id, batch_id)])
        write_deltalake(path, table, mode="append", commit_properties=txn)
        written = table.num_rows
    yield pa.RecordBatch.from_pydict({"written": pa.array([written], pa.int64())})


def batch_writer(
    cfg: dict[str, Any], checkpoint: str, schema: pa.Schema, crash_after_write: int | None = None
) -> Callable[[DataFrame, int], None]:
    """The foreachBatch function: transform, then append once per (query id, batch id) to the table prepare_output made."""
    transform = load_transform(str(cfg["consumer"]["transform"]))
    queue, path = cfg["queue"]["name"], output_path(cfg)

    def write(received: DataFrame, batch_id: int) -> None:
        out = output_rows(received, transform, queue)
        app_id = f"sparkqueue.stream-consumer.{query_id(checkpoint)}"
        task = partial(append_task, path, app_id, batch_id, schema)
        written = sum(r.written for r in out.coalesce(1).mapInArrow(task, "written long").collect())
        log.info("batch %d: %d rows written to %s", batch_id, written, path)
        if crash_after_write is not None and batch_id == crash_after_write:
            log.warning("crash drill: SIGKILL after writing batch %d, before Spark commits it", batch_id)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    return write


def run(cfg: dict[str, Any], spark: SparkSession, *, crash_after_write: int | None = None) -> dict[str, Any]:
    """Run the streaming query (until drained with available_now); returns its last progress figures."""
    s = settings(cfg)
    with common.namespace(cfg, create=False) as ns:  # a mistyped root is an error: consumers never make a namespace
        queue = common.require_queue(ns, cfg)  # and never make the queue
        root = ns.root
    schema = prepare_output(spark, load_transform(str(cfg["consumer"]["transform"])), queue, output_path(cfg))
    stream = (
        spark.readStream.format("sparkqueue")
        .option("namespace", root)
        .option("maxMessagesPerTrigger", int(s["max_messages_per_trigger"]))
        .load(queue)
    )
    writer = stream.writeStream.foreachBatch(batch_writer(cfg, str(s["checkpoint"]), schema, crash_after_write))
    writer = writer.option("checkpointLocation", str(s["checkpoint"])).queryName(f"sparkqueue-{queue}")
    if str(s["trigger"]) == AVAILABLE_NOW:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{float(s['trigger'])} seconds")
    query = writer.start()
    log.info("streaming query %s consuming %s into %s (checkpoint %s)", query.id, queue, output_path(cfg), s["checkpoint"])
    query.awaitTermination()
    progress = query.recentProgress
    rows = sum(int(_figure(p, "numInputRows")) for p in progress)
    return {"query_id": str(query.id), "batches": len(progress), "input_rows": rows}


def _figure(progress: Any, name: str) -> Any:
    """A figure of a query progress report (an object in PySpark 4, a dict before)."""
    return progress[name] if isinstance(progress, dict) else getattr(progress, name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m jobs.stream_consumer` and `spark-submit jobs/stream_consumer.py`."""
    args = parse_args(argv)
    common.setup_logging(args.verbose)
    with common.expected_failures(args.verbose):
        cfg = common.load_config(args.config, common.overrides_from(args, FLAGS))
        settings(cfg)  # bad settings fail before Spark starts
        load_transform(str(cfg["consumer"]["transform"]))
        common.check_source(cfg, "the streaming source (jobs.stream_consumer)")  # a mistyped root or queue too
        spark = common.session(cfg, verbose=args.verbose)
        started = time.perf_counter()
        try:
            result = run(cfg, spark, crash_after_write=args.crash_after_write)
        finally:
            spark.stop()
    log.info("done in %.1fs: %s", time.perf_counter() - started, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
