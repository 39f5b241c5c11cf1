"""Spark benchmark of sparkqueue: DataFrame send and receive+complete of N 1 KB messages in local[2].

Run from the repository root with the project's interpreter::

    .venv/bin/python bench/bench_spark.py [--n 1000000] [--quick] [--batch 250000] [--repeats 3] [--root DIR]

Sizes: 100k and N (default 1M); `--quick` runs 100k only. For each size, in one SparkSession,
`--repeats` rounds (default 3; the table and the top-level figures are the medians, every round
is in the JSON):

- floor: Spark writing the same DataFrame to Parquet: no queue at all;
- send: `sender.send_dataframe(df)` into a fresh partitioned queue (all or nothing: one commit from the driver);
- read: counting the queue through the `sparkqueue` data source;
- receive+complete: `receive_dataframe(batch)` then `complete_dataframe` until the queue is empty.

Bodies are 1 KB of random alphanumerics (Spark's randstr), which Snappy or LZ4 cannot shrink much; they are
generated once per size into a Parquet source (untimed) that the floor and the send both read.
Peak resident memory is sampled every 50 ms for the Python driver, the JVM, and the Python
workers. Results print as a table and go to bench/results/spark.json (spark-quick.json with --quick).
Targets: send >= 100k msg/s, receive+complete >= 50k msg/s.
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
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from sparkqueue import Namespace
from sparkqueue.spark import release, spark_session

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGETS = {"send_msg_per_s": 100_000, "receive_complete_msg_per_s": 50_000}
SPARK_CONF = {
    "spark.driver.memory": "3g",
    "spark.sql.shuffle.partitions": "16",
    "spark.ui.enabled": "false",
}

log = logging.getLogger("bench.spark")


@dataclass
class Peaks:
    """Peak RSS (MB) seen while sampling: Python driver, JVM, Python workers (summed)."""

    driver_mb: float = 0.0
    jvm_mb: float = 0.0
    workers_mb: float = 0.0


@dataclass
class SizeResult:
    """Figures for one message count."""

    n: int
    floor_parquet_s: float = 0.0
    send_s: float = 0.0
    read_s: float = 0.0
    receive_complete_s: float = 0.0
    receive_batches: int = 0
    floor_msg_per_s: float = 0.0
    send_msg_per_s: float = 0.0
    read_msg_per_s: float = 0.0
    receive_complete_msg_per_s: float = 0.0
    send_vs_floor: float = 0.0
    peaks: Peaks = field(default_factory=Peaks)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # every round's figures (the median is above)


MEDIAN_FIELDS = (
    "floor_parquet_s",
    "send_s",
    "read_s",
    "receive_complete_s",
    "floor_msg_per_s",
    "send_msg_per_s",
    "read_msg_per_s",
    "receive_complete_msg_per_s",
)


class RssSampler:
    """Samples the RSS of this process and its children (JVM, Python workers) in a background thread."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._me = psutil.Process(os.getpid())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def _sample(self) -> None:
        mb = 1 / 2**20
        self.peaks.driver_mb = max(self.peaks.driver_mb, self._me.memory_info().rss * mb)
        jvm = workers = 0
        for child in self._me.children(recursive=True):
            try:
                rss = child.memory_info().rss
                name = child.name()
            except psutil.Error:
                continue
            if "java" in name:
                jvm += rss
            else:
                workers += rss
        self.peaks.jvm_mb = max(self.peaks.jvm_mb, jvm * mb)
        self.peaks.workers_mb = max(self.peaks.workers_mb, workers * mb)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def timed(out: dict[str, float], key: str) -> Iterator[None]:
    """Store the block's wall time in out[key]."""
    started = time.perf_counter()
    yield
    out[key] = time.perf_counter() - started


def messages(spark: SparkSession, n: int, body_bytes: int, where: Path) -> DataFrame:
    """n messages with random alphanumeric bodies of body_bytes, unkeyed: generated once to Parquet (untimed), read back."""
    spark.range(0, n, 1, 2).select(sf.randstr(body_bytes, 42).cast("binary").alias("body")).write.parquet(str(where))
    return spark.read.parquet(str(where))


def drain(ns: Namespace, queue: str, spark: SparkSession, batch: int) -> tuple[int, int]:
    """Receive and complete until the queue is empty; returns (messages completed, batches)."""
    done = batches = 0
    with ns.get_queue_receiver(queue) as receiver:
        while True:
            got = receiver.receive_dataframe(batch, spark)
            result = receiver.complete_dataframe(got)
            ok = result.where("status = 'ok'").count()
            release(got)
            release(result)
            if ok == 0:
                return done, batches
            done += ok
            batches += 1


def run_size(spark: SparkSession, n: int, args: argparse.Namespace, base: Path) -> SizeResult:
    """`args.repeats` rounds of floor, send, read and receive+complete of n messages; the median round's figures.

    The source is generated once; each round uses a fresh namespace and measures its own floor,
    so a load spike hits the floor and the queue alike. The result holds every round in `rounds`.
    """
    df = messages(spark, n, args.body_bytes, base / f"source-{n}")
    rounds = [run_round(spark, df, n, args, base / f"round-{i}") for i in range(args.repeats)]
    shutil.rmtree(base / f"source-{n}", ignore_errors=True)
    res = SizeResult(n)
    for name in MEDIAN_FIELDS:
        setattr(res, name, statistics.median(getattr(r, name) for r in rounds))
    res.receive_batches = rounds[0].receive_batches
    res.send_vs_floor = round(res.send_s / res.floor_parquet_s, 2) if res.floor_parquet_s else 0.0
    res.peaks = Peaks(*(max(getattr(r.peaks, f) for r in rounds) for f in ("driver_mb", "jvm_mb", "workers_mb")))
    res.rounds = [{k: v for k, v in asdict(r).items() if k != "rounds"} for r in rounds]
    return res


def run_round(spark: SparkSession, df: DataFrame, n: int, args: argparse.Namespace, base: Path) -> SizeResult:
    """Floor, send, read and receive+complete of n messages in a fresh namespace under `base` (a new directory)."""
    res = SizeResult(n)
    times: dict[str, float] = {}
    root = base / f"ns-{n}"  # never a deleted namespace's path: Spark workers keep their handles on a namespace
    with RssSampler() as sampler:
        with timed(times, "floor"):
            df.write.mode("overwrite").parquet(str(base / f"floor-{n}"))
        with Namespace(root) as ns:
            ns.create_queue("bench", lock_duration=timedelta(minutes=5))
            with ns.get_queue_sender("bench") as sender, timed(times, "send"):
                accepted = sender.send_dataframe(df, spark)
            assert accepted == n, f"sent {accepted} of {n}"
            with timed(times, "read"):
                shown = spark.read.format("sparkqueue").option("namespace", str(root)).load("bench").count()
            assert shown == n, f"read {shown} of {n}"
            with timed(times, "receive"):
                done, res.receive_batches = drain(ns, "bench", spark, args.batch)
            assert done == n, f"completed {done} of {n}"
            assert ns.get_queue_runtime_properties("bench").total_message_count == 0
    res.peaks = sampler.peaks
    res.floor_parquet_s, res.send_s, res.read_s, res.receive_complete_s = (
        times["floor"],
        times["send"],
        times["read"],
        times["receive"],
    )
    rate: Callable[[float], float] = lambda s: round(n / s) if s else 0.0
    res.floor_msg_per_s, res.send_msg_per_s = rate(res.floor_parquet_s), rate(res.send_s)
    res.read_msg_per_s, res.receive_complete_msg_per_s = rate(res.read_s), rate(res.receive_complete_s)
    res.send_vs_floor = round(res.send_s / res.floor_parquet_s, 2) if res.floor_parquet_s else 0.0
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(base / f"floor-{n}", ignore_errors=True)
    log.info("round of %d: %s", n, {k: v for k, v in asdict(res).items() if k.endswith("per_s")})
    return res


def warm_up(spark: SparkSession, base: Path) -> None:
    """One small untimed round of every path, so the timed runs see started JVM code paths and Python workers."""
    with Namespace(base / "warm-up") as ns:
        ns.create_queue("warm")
        with ns.get_queue_sender("warm") as sender:
            sender.send_dataframe(spark.range(2000).select(sf.col("id").cast("string").alias("body")), spark)
        spark.read.format("sparkqueue").option("namespace", ns.root).load("warm").count()
        drain(ns, "warm", spark, 1000)
        spark.range(2000).write.mode("overwrite").parquet(str(base / "warm-up" / "floor"))
    shutil.rmtree(base / "warm-up", ignore_errors=True)


def report(results: list[SizeResult]) -> str:
    """A plain-text table of the figures."""
    names = ("n", "floor/s", "send/s", "send:floor", "read/s", "recv+cmpl/s", "drv MB", "jvm MB", "wrk MB")
    head = " ".join(f"{h:>11}" for h in names)
    lines = [head]
    for r in results:
        values = (
            r.n,
            r.floor_msg_per_s,
            r.send_msg_per_s,
            r.send_vs_floor,
            r.read_msg_per_s,
            r.receive_complete_msg_per_s,
            r.peaks.driver_mb,
            r.peaks.jvm_mb,
            r.peaks.workers_mb,
        )
        lines.append(" ".join(f"{v:>11.2f}" if isinstance(v, float) and v < 100 else f"{v:>11.0f}" for v in values))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="largest message count (default 1,000,000)")
    p.add_argument("--quick", action="store_true", help="100k messages only")
    p.add_argument("--batch", type=int, default=250_000, help="messages per receive_dataframe call")
    p.add_argument("--repeats", type=int, default=3, help="rounds per size; figures are the medians (default 3)")
    p.add_argument("--body-bytes", dest="body_bytes", type=int, default=1024, help="body size (default 1 KB)")
    p.add_argument("--root", help="working directory (default: a temporary directory, removed afterwards)")
    p.add_argument("--out", help="JSON output path (default bench/results/spark.json or spark-quick.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the sizes, print the table, write the JSON."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    sizes = [100_000] if args.quick else sorted({100_000, args.n})
    base = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="sparkqueue-bench-spark-"))
    base.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    spark = spark_session("local[2]", "sparkqueue-bench", SPARK_CONF)
    spark.sparkContext.setLogLevel("ERROR")
    session_s = time.perf_counter() - started
    try:
        warm_up(spark, base)
        results = []
        for n in sizes:
            log.info("running %d messages", n)
            results.append(run_size(spark, n, args, base))
            log.info("%s", asdict(results[-1]))
    finally:
        spark.stop()
        if not args.root:
            shutil.rmtree(base, ignore_errors=True)
    table = report(results)
    sys.stdout.write(table + "\n")
    payload: dict[str, Any] = {
        "benchmark": "spark",
        "when": datetime.now(UTC).isoformat(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "session_start_s": round(session_s, 2),
        "targets": TARGETS,
        "params": {
            "batch": args.batch,
            "repeats": args.repeats,
            "body_bytes": args.body_bytes,
            "master": "local[2]",
            "conf": SPARK_CONF,
        },
        "results": [asdict(r) for r in results],
        "targets_met": {str(r.n): {k: getattr(r, k) >= v for k, v in TARGETS.items()} for r in results},
    }
    out = Path(args.out) if args.out else RESULTS_DIR / ("spark-quick.json" if args.quick else "spark.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
