"""Streaming benchmark of sparkqueue: messages/s through `readStream.format("sparkqueue")` into a Parquet sink, local[2].

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/bench_streaming.py [--n 200000] [--quick] [--batch 50000] [--repeats 3] [--root DIR]

For each round, in one SparkSession:

- floor: the same rows streamed by Spark alone: a Parquet file source (one file per micro-batch of
  `--batch` rows) into a Parquet file sink, `trigger(availableNow=True)`: no queue at all;
- stream: the rows sent to a fresh partitioned queue (untimed, `send_dataframe`), then a query
  `readStream.format("sparkqueue")` with maxMessagesPerTrigger = `--batch` into a Parquet file
  sink with `trigger(availableNow=True)`, until the queue is drained; every batch's messages are
  completed after its commit (the last one when the query stops), so the figure includes locking,
  reading the linked files, the sink's write and completion.

Bodies are 1 KB of random alphanumerics (Spark's randstr). Figures are medians of `--repeats`
rounds; every round is in the JSON (bench/results/streaming.json, streaming-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as sf

from sparkqueue import Namespace
from sparkqueue.spark import spark_session

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SPARK_CONF = {"spark.driver.memory": "3g", "spark.sql.shuffle.partitions": "16", "spark.ui.enabled": "false"}

log = logging.getLogger("bench.streaming")


@dataclass
class Round:
    """One round's figures."""

    floor_s: float = 0.0
    stream_s: float = 0.0
    batches: int = 0
    floor_rows_per_s: float = 0.0
    stream_msg_per_s: float = 0.0
    stream_vs_floor: float = 0.0


@dataclass
class Result:
    """Median figures of the rounds, and every round."""

    n: int
    batch: int
    floor_rows_per_s: float = 0.0
    stream_msg_per_s: float = 0.0
    stream_vs_floor: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)


def source(spark: SparkSession, n: int, batch: int, body_bytes: int, where: Path) -> None:
    """n rows of random bodies and ids, in files of `batch` rows (generated once, untimed)."""
    files = max(1, -(-n // batch))
    body = sf.randstr(body_bytes, 42).cast("binary").alias("body")
    ids = sf.concat(sf.lit("m-"), sf.col("id").cast("string")).alias("message_id")
    spark.range(0, n, 1, files).select(body, ids).write.parquet(str(where))


def floor_round(spark: SparkSession, src: Path, base: Path) -> float:
    """Spark streaming the source files into a Parquet sink, one file per batch; seconds."""
    schema = spark.read.parquet(str(src)).schema
    started = time.perf_counter()
    query = (
        spark.readStream.schema(schema)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(src))
        .writeStream.format("parquet")
        .option("checkpointLocation", str(base / "floor-ck"))
        .trigger(availableNow=True)
        .start(str(base / "floor-out"))
    )
    query.awaitTermination()
    return time.perf_counter() - started


def stream_round(spark: SparkSession, src: Path, n: int, batch: int, base: Path) -> tuple[float, int]:
    """Send the source to a fresh queue (untimed), then stream it out into a Parquet sink; (seconds, batches)."""
    root = base / "ns"
    with Namespace(root) as ns:
        ns.create_queue("bench", lock_duration=timedelta(minutes=5))
        with ns.get_queue_sender("bench") as sender:
            accepted = sender.send_dataframe(spark.read.parquet(str(src)), spark)
        assert accepted == n, f"sent {accepted} of {n}"
        started = time.perf_counter()
        query = (
            spark.readStream.format("sparkqueue")
            .option("namespace", str(root))
            .option("maxMessagesPerTrigger", batch)
            .load("bench")
            .select("message_id", "sequence_number", "body")
            .writeStream.format("parquet")
            .option("checkpointLocation", str(base / "stream-ck"))
            .trigger(availableNow=True)
            .start(str(base / "stream-out"))
        )
        query.awaitTermination()
        seconds = time.perf_counter() - started
        left = ns.get_queue_runtime_properties("bench").total_message_count
    out = spark.read.parquet(str(base / "stream-out")).count()
    assert out == n and left == 0, f"streamed {out} of {n}, {left} left in the queue"
    return seconds, len(query.recentProgress)


def run_round(spark: SparkSession, src: Path, n: int, batch: int, base: Path) -> Round:
    """Floor and stream of n messages under `base` (a new directory)."""
    r = Round()
    r.floor_s = floor_round(spark, src, base)
    r.stream_s, r.batches = stream_round(spark, src, n, batch, base)
    r.floor_rows_per_s = round(n / r.floor_s)
    r.stream_msg_per_s = round(n / r.stream_s)
    r.stream_vs_floor = round(r.stream_msg_per_s / r.floor_rows_per_s, 2)
    shutil.rmtree(base, ignore_errors=True)
    log.info("round: %s", asdict(r))
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="messages (default 200,000)")
    p.add_argument("--quick", action="store_true", help="20,000 messages, one round")
    p.add_argument("--batch", type=int, default=50_000, help="maxMessagesPerTrigger (and floor rows per batch)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; figures are the medians (default 3)")
    p.add_argument("--body-bytes", dest="body_bytes", type=int, default=1024, help="body size (default 1 KB)")
    p.add_argument("--root", help="working directory (default: a temporary directory, removed afterwards)")
    p.add_argument("--out", help="JSON output path (default bench/results/streaming.json or streaming-quick.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print the figures, write the JSON."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    n, batch, repeats = (20_000, 5_000, 1) if args.quick else (args.n, args.batch, args.repeats)
    base = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="sparkqueue-bench-streaming-"))
    base.mkdir(parents=True, exist_ok=True)
    spark = spark_session("local[2]", "sparkqueue-bench-streaming", SPARK_CONF)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        src = base / "source"
        source(spark, n, batch, args.body_bytes, src)
        rounds = [run_round(spark, src, n, batch, base / f"round-{i}") for i in range(repeats)]
    finally:
        spark.stop()
        if not args.root:
            shutil.rmtree(base, ignore_errors=True)
    res = Result(n, batch)
    res.floor_rows_per_s = statistics.median(r.floor_rows_per_s for r in rounds)
    res.stream_msg_per_s = statistics.median(r.stream_msg_per_s for r in rounds)
    res.stream_vs_floor = statistics.median(r.stream_vs_floor for r in rounds)
    res.rounds = [asdict(r) for r in rounds]
    sys.stdout.write(
        f"streaming {n:,} x {args.body_bytes} B, maxMessagesPerTrigger {batch:,}, local[2], median of {repeats}:\n"
        f"  readStream(sparkqueue) -> Parquet sink  {res.stream_msg_per_s:>10,.0f} msg/s\n"
        f"  floor: Parquet source -> Parquet sink   {res.floor_rows_per_s:>10,.0f} rows/s\n"
        f"  ratio                                   {res.stream_vs_floor:>10.2f}x\n"
    )
    payload = {
        "benchmark": "streaming",
        "when": datetime.now(UTC).isoformat(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "params": {"n": n, "batch": batch, "repeats": repeats, "body_bytes": args.body_bytes, "conf": SPARK_CONF},
        "result": asdict(res),
    }
    out = Path(args.out) if args.out else RESULTS_DIR / ("streaming-quick.json" if args.quick else "streaming.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
