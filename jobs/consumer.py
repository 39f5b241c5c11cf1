"""Consumer job: drain up to a limit of messages in batches, transform them, merge the results into a Delta table
(via deltalake), then complete the messages. Meant to run on a schedule; each run stops when the queue is empty
or the limit is reached.

    python -m jobs.consumer [--config conf/sparkqueue.toml] [--batch-size N] [--max-messages N] [--transform mod:fn]
    spark-submit jobs/consumer.py --config conf/sparkqueue.toml

No duplicate output after a crash: the output table is written with a deltalake MERGE that
inserts only rows whose key (queue, sequence_number) is not there yet. A run that dies after
writing a batch but before completing it leaves the messages locked; when the locks lapse the
next run receives them again (same sequence numbers), and the MERGE skips the rows it already
holds. `--crash-after-write` exits right after the write of the first batch, for crash drills.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (spark-submit jobs/consumer.py): make `jobs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql.pandas.types import to_arrow_schema
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jobs import common
from sparkqueue.errors import InvalidOperationError
from sparkqueue.spark import RECEIVED_SCHEMA, STATUS_OK, release
from sparkqueue.storage.retry import Deadline, retry_commit

log = logging.getLogger("jobs.consumer")

CRASH_EXIT_CODE = 75
MERGE_TIMEOUT_S = 300.0
NUMBERS: common.Numbers = (
    ("consumer.max_messages", int, 0),
    ("consumer.batch_size", int, 1),
    ("consumer.max_wait_time", float, 0),
)
FLAGS = {
    "batch_size": "consumer.batch_size",
    "max_messages": "consumer.max_messages",
    "transform": "consumer.transform",
    "output": "consumer.output",
    "max_wait_time": "consumer.max_wait_time",
}


@dataclass
class ConsumerResult:
    """What one run did."""

    batches: int = 0
    received: int = 0
    written: int = 0
    completed: int = 0
    lock_lost: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (each overrides the configuration file)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--batch-size", dest="batch_size", type=int, help="messages per receive (consumer.batch_size)")
    p.add_argument("--max-messages", dest="max_messages", type=int, help="stop after this many (consumer.max_messages)")
    p.add_argument("--max-wait-time", dest="max_wait_time", type=float, help="seconds to wait for a batch's first message")
    p.add_argument("--transform", help="module:function applied to each batch (consumer.transform)")
    p.add_argument("--output", help="output Delta table path (consumer.output)")
    p.add_argument("--crash-after-write", action="store_true", help="exit after writing the first batch (crash drill)")
    return p.parse_args(argv)


def load_transform(spec: str) -> Callable[[DataFrame], DataFrame]:
    """The function a 'module:function' string names."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise InvalidOperationError(f"transform must be 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ImportError as exc:
        raise InvalidOperationError(f"transform {spec!r}: module {module!r} cannot be imported ({exc})") from None
    if not callable(fn):
        raise InvalidOperationError(f"{spec!r} is not a function")
    transform: Callable[[DataFrame], DataFrame] = fn
    return transform


def output_rows(received: DataFrame, transform: Callable[[DataFrame], DataFrame], queue: str) -> DataFrame:
    """The transform's rows, keyed by queue and sequence number."""
    out = transform(received)
    if "sequence_number" not in out.columns:
        raise InvalidOperationError("the transform must keep the sequence_number column: it keys the output table")
    return out.withColumn("queue", sf.lit(queue)).withColumn("processed_at_utc", sf.current_timestamp())


def output_path(cfg: dict[str, Any]) -> str:
    """consumer.output, or by default `<namespace root>/_output/<queue>` (next to the stream consumer's checkpoints)."""
    path = str(cfg["consumer"]["output"])
    return path or f"{str(cfg['namespace']['root']).rstrip('/')}/_output/{cfg['queue']['name']}"


def prepare_output(spark: SparkSession, transform: Callable[[DataFrame], DataFrame], queue: str, path: str) -> pa.Schema:
    """The output table's schema, checked before any message is received: the table is made when missing, and an
    existing one must have the columns and types this transform produces (else a merge would drop what it lacks)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidOperationError(f"output {path!r} is a file, not a Delta table directory")
    empty = spark.createDataFrame([], RECEIVED_SCHEMA)
    schema = pa.schema(
        [f.with_nullable(True) for f in to_arrow_schema(output_rows(empty, transform, queue).schema, timezone="UTC")]
    )
    DeltaTable.create(path, schema=schema, partition_by=["queue"], mode="ignore")
    have = pa.schema(DeltaTable(path).schema().to_arrow())  # deltalake gives an arro3 schema
    if _columns(have) != _columns(schema):
        raise InvalidOperationError(
            f"output table {path!r} has columns {_shown(have)}, but this transform makes {_shown(schema)}: "
            "write to another --output, or use the transform that made the table"
        )
    return schema


def _columns(schema: Any) -> list[tuple[str, str]]:
    """(name, type) per column, with types compared as Delta stores them (no large/view variants, no nullability)."""
    plain = {"large_string": "string", "string_view": "string", "large_binary": "binary", "binary_view": "binary"}
    return [(f.name, plain.get(str(f.type), str(f.type))) for f in schema]


def _shown(schema: Any) -> str:
    return ", ".join(name for name, _ in _columns(schema))


def write_output(out: DataFrame, path: str, queue: str, schema: pa.Schema) -> int:
    """Merge the rows into the output table (see prepare_output) in one Spark task; returns rows inserted."""
    counts = out.coalesce(1).mapInArrow(partial(merge_task, path, queue, schema), "inserted long").collect()
    return sum(r.inserted for r in counts)


def merge_task(path: str, queue: str, schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Insert the rows whose (queue, sequence_number) the table does not hold yet; retries lost commit races."""
    rows = [b for b in batches if b.num_rows]
    inserted = 0
    if rows:
        source = pa.Table.from_batches(rows).cast(schema)

        def attempt() -> int:
            merged = (
                DeltaTable(path)
                .merge(
                    source,
                    f"t.queue = '{queue}' AND t.queue = s.queue AND t.sequence_number = s.sequence_number",
                    source_alias="s",
                    target_alias="t",
                )
                .when_not_matched_insert_all()
                .execute()
            )
            return int(merged.get("num_target_rows_inserted", 0))

        inserted = retry_commit(attempt, Deadline(MERGE_TIMEOUT_S), f"merge into {path}")
    yield pa.RecordBatch.from_pydict({"inserted": pa.array([inserted], pa.int64())})


@contextmanager
def progress_bar(enabled: bool, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (or nothing); yields its advance function."""
    if not enabled:
        yield lambda n: None
        return
    columns = (TextColumn("consuming"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("consume", total=total or None)
        yield lambda n: bar.advance(task, n)


def run(cfg: dict[str, Any], spark: SparkSession, *, crash_after_write: bool = False, progress: bool = True) -> ConsumerResult:
    """Drain up to consumer.max_messages messages: receive, transform, merge, complete, batch by batch."""
    transform = load_transform(str(cfg["consumer"]["transform"]))
    limit, batch, wait = common.numbers(cfg, NUMBERS)
    result = ConsumerResult()
    with common.namespace(cfg, create=False) as ns:  # a mistyped root is an error: consumers never make a namespace
        queue = common.require_queue(ns, cfg)  # and never make the queue
        path = output_path(cfg)
        schema = prepare_output(spark, transform, queue, path)
        backlog = ns.get_queue_runtime_properties(queue).active_message_count
        with (
            ns.get_queue_receiver(queue, max_wait_time=wait or None) as receiver,  # 0: do not wait
            progress_bar(progress, min(limit, backlog)) as advance,
        ):
            while result.received < limit:
                received = receiver.receive_dataframe(min(batch, limit - result.received), spark)
                n = received.count()
                if n == 0:
                    break
                try:
                    written = write_output(output_rows(received, transform, queue), path, queue, schema)
                except BaseException:  # nothing of the batch is completed: give its messages back at once
                    with contextlib.suppress(Exception):
                        receiver.abandon_dataframe(received).count()
                    raise
                if crash_after_write:
                    log.warning("crash drill: exiting after writing %d rows, before completing %d messages", written, n)
                    logging.shutdown()
                    os._exit(CRASH_EXIT_CODE)
                settled = receiver.complete_dataframe(received)
                ok = settled.where(sf.col("status") == STATUS_OK).count()
                release(received)
                release(settled)
                result.batches += 1
                result.received += n
                result.written += written
                result.completed += ok
                result.lock_lost += n - ok
                if ok < n:
                    log.warning("%d messages lost their lock before completion; they come again and the merge skips them", n - ok)
                advance(n)
    log.info(
        "consumed %d messages from %s in %d batches: %d rows written to %s, %d completed, %d lock lost",
        result.received,
        queue,
        result.batches,
        result.written,
        path,
        result.completed,
        result.lock_lost,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m jobs.consumer` and `spark-submit jobs/consumer.py`."""
    args = parse_args(argv)
    common.setup_logging(args.verbose)
    with common.expected_failures(args.verbose):
        cfg = common.load_config(args.config, common.overrides_from(args, FLAGS))
        load_transform(str(cfg["consumer"]["transform"]))  # a bad transform fails before Spark starts
        common.numbers(cfg, NUMBERS)
        common.check_source(cfg, "a Spark receive (jobs.consumer)")  # so do a mistyped root or queue
        spark = common.session(cfg, verbose=args.verbose)
        started = time.perf_counter()
        try:
            result = run(cfg, spark, crash_after_write=args.crash_after_write, progress=not args.no_progress)
        finally:
            spark.stop()
    log.info("done in %.1fs: %s", time.perf_counter() - started, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
