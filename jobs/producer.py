"""Producer job: send a DataFrame (read from a source, or generated rows) to a queue with send_dataframe.

    python -m jobs.producer [--config conf/sparkqueue.toml] [--source data.parquet --format parquet] [--generate N]
    spark-submit jobs/producer.py --config conf/sparkqueue.toml --generate 100000

A source without a `body` column is sent as one JSON body per row (its other message-field
columns, e.g. partition_key, are used as such).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (spark-submit jobs/producer.py): make `jobs` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from jobs import common
from sparkqueue.spark.send import MESSAGE_FIELDS

log = logging.getLogger("jobs.producer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (each overrides the configuration file)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p)
    p.add_argument("--source", help="input data path (producer.source); omit to generate rows")
    p.add_argument("--format", help="spark.read format of the source (producer.format)")
    p.add_argument("--generate", type=int, help="rows to generate (producer.generate)")
    p.add_argument("--body-bytes", dest="body_bytes", type=int, help="body size of generated rows (producer.body_bytes)")
    p.add_argument("--id-prefix", dest="id_prefix", help="message id prefix of generated rows (producer.id_prefix)")
    return p.parse_args(argv)


NUMBERS: common.Numbers = (("producer.generate", int, 0), ("producer.body_bytes", int, 0))
FLAGS = {
    "source": "producer.source",
    "format": "producer.format",
    "generate": "producer.generate",
    "body_bytes": "producer.body_bytes",
    "id_prefix": "producer.id_prefix",
}


def build_frame(spark: SparkSession, cfg: dict[str, Any]) -> DataFrame:
    """The messages to send: the source's rows, or generated ones."""
    p = cfg["producer"]
    if p["source"]:
        reader = spark.read.format(p["format"])
        if str(p["format"]).lower() == "csv":  # a CSV source names its columns in its first line
            reader = reader.option("header", True)
        df = reader.load(p["source"])
        if "body" in df.columns:
            return df
        fields = [c for c in df.columns if c in MESSAGE_FIELDS]
        return df.select(sf.to_json(sf.struct(*df.columns)).alias("body"), *fields)
    n, size = common.numbers(cfg, NUMBERS)
    body = sf.rpad(sf.concat(sf.lit('{"n": '), sf.col("id").cast("string"), sf.lit("}")), size, " ")
    cols = [body.cast("binary").alias("body")]
    if p["id_prefix"]:
        cols.append(sf.concat(sf.lit(f"{p['id_prefix']}-"), sf.col("id").cast("string")).alias("message_id"))
    return spark.range(n).select(*cols)


def run(cfg: dict[str, Any], spark: SparkSession) -> int:
    """Send the configured DataFrame; returns how many messages the queue accepted."""
    with common.namespace(cfg) as ns:
        queue = common.ensure_queue(ns, cfg)
        started = time.perf_counter()
        with ns.get_queue_sender(queue) as sender:
            accepted = sender.send_dataframe(build_frame(spark, cfg))
        elapsed = time.perf_counter() - started
        log.info("sent %d messages to %s in %.1fs (%.0f msg/s)", accepted, queue, elapsed, accepted / max(elapsed, 1e-9))
        generated = None if cfg["producer"]["source"] else common.numbers(cfg, NUMBERS)[0]
        if generated is not None and accepted < generated:  # a re-run with the same id prefix: said, not left to guess
            log.info(
                "%d of the %d generated messages were dropped by duplicate detection: %s already holds their ids "
                "(an earlier run); use another --id-prefix to send new ones",
                generated - accepted,
                generated,
                queue,
            )
        return accepted


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m jobs.producer` and `spark-submit jobs/producer.py`."""
    args = parse_args(argv)
    common.setup_logging(args.verbose)
    with common.expected_failures(args.verbose):
        cfg = common.load_config(args.config, common.overrides_from(args, FLAGS))
        common.numbers(cfg, NUMBERS)
        with common.namespace(cfg) as ns:  # the queue (made with its settings, or checked) before Spark starts
            common.ensure_queue(ns, cfg)
        spark = common.session(cfg, verbose=args.verbose)
        try:
            run(cfg, spark)
        finally:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
