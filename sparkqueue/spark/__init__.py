"""Spark integration (docs/semantics.md §12): send, receive and settle messages as DataFrames, and read entities as DataFrames.

Entry points are methods of the core objects (this package is imported lazily, so pyspark stays
optional for the core library):

- `sender.send_dataframe(df)` -> number of messages accepted
- `receiver.receive_dataframe(max_message_count)` -> DataFrame of locked messages
- `receiver.complete_dataframe(df)`, `abandon_dataframe(df)`, `defer_dataframe(df)`,
  `dead_letter_dataframe(df, reason=None, error_description=None)` -> DataFrame (lock_token, status)
- `spark.read.format("sparkqueue").option("namespace", root).load(entity)` (Spark discovers the data source)
- `spark.readStream.format("sparkqueue")...load(entity)`: peek-locked micro-batches, completed after the
  sink commits them; `df.writeStream.format("sparkqueue")...start(entity)`: each micro-batch sent once
  (streaming_source.py, streaming_sink.py, docs/spark-streaming.md)

and the helpers below: `spark_session()` builds a local session configured for sparkqueue,
`table_path()` / `row_filter()` locate an entity's Delta table for other Delta readers, and
`release()` / `cleanup_staging()` remove the staging files behind returned DataFrames.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pyspark
from pyspark.sql import DataFrame

from sparkqueue.errors import InvalidOperationError
from sparkqueue.spark.schema import RECEIVED_SCHEMA, STATUS_LOCK_LOST, STATUS_OK
from sparkqueue.spark.staging import STAGING_ATTRIBUTE, STAGING_DIR, STAGING_RETENTION, cleanup_staging, local_uri, remove_dirs

MIN_PYSPARK = (4, 2)  # streaming data source and Arrow UDF APIs (pyproject.toml's floor)


def _pyspark_version() -> tuple[int, int]:
    """PySpark's (major, minor), as its version string starts ("4.1rc1" is 4.1, "4.10.0" is 4.10)."""
    found = re.match(r"(\d+)\.(\d+)", pyspark.__version__)
    return (int(found[1]), int(found[2])) if found else (0, 0)


if _pyspark_version() < MIN_PYSPARK:
    raise ImportError(
        f"sparkqueue's Spark features need PySpark {'.'.join(map(str, MIN_PYSPARK))} or later (Databricks Runtime with "
        f"Apache Spark 4.2+); this is PySpark {pyspark.__version__}. The rest of sparkqueue works without Spark.",
        name="pyspark",
    )


# Spark's entry points, imported on first use: they sit above the public API (README "Architecture"), which
# imports this package's DataFrame operations.
_ENTRY_POINTS = {
    "DEFAULT_CONF": "sparkqueue.spark.builder",
    "spark_session": "sparkqueue.spark.builder",
    "SparkQueueDataSource": "sparkqueue.spark.datasource",
    "register": "sparkqueue.spark.datasource",
    "row_filter": "sparkqueue.spark.datasource",
    "table_path": "sparkqueue.spark.datasource",
    "QueueStreamReader": "sparkqueue.spark.streaming_source",
    "STREAMS_DIR": "sparkqueue.spark.streaming_source",
    "QueueStreamWriter": "sparkqueue.spark.streaming_sink",
}


if TYPE_CHECKING:  # the entry points' real types, for type checkers (users' code and jobs/), without importing them
    from sparkqueue.spark.builder import DEFAULT_CONF, spark_session
    from sparkqueue.spark.datasource import SparkQueueDataSource, register, row_filter, table_path
    from sparkqueue.spark.streaming_sink import QueueStreamWriter
    from sparkqueue.spark.streaming_source import STREAMS_DIR, QueueStreamReader


def __getattr__(name: str) -> object:
    """An entry point, imported on first use."""
    if name in _ENTRY_POINTS:
        import importlib

        return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def release(df: DataFrame) -> int:
    """Delete the staging files a DataFrame from receive_dataframe or a *_dataframe settle reads; returns dirs removed.

    The DataFrame cannot be evaluated afterwards. One that reads other files is rejected; one that reads no file (an
    empty receive's, derived) releases nothing.
    """
    dirs = {local_uri(f).rsplit("/", 1)[0] for f in df.inputFiles()}
    staged = getattr(df, STAGING_ATTRIBUTE, None)  # set on the returned DataFrame: covers empty results too
    if staged:
        dirs.add(staged)
    if any(f"/{STAGING_DIR}/" not in d for d in dirs):
        raise InvalidOperationError(
            "release() takes a DataFrame that receive_dataframe or a *_dataframe settle returned (or one derived from "
            "those); this one reads " + ", ".join(sorted(dirs)[:3])
        )
    return remove_dirs(sorted(dirs))


__all__ = [
    "DEFAULT_CONF",
    "RECEIVED_SCHEMA",
    "STAGING_DIR",
    "STAGING_RETENTION",
    "STATUS_LOCK_LOST",
    "STATUS_OK",
    "STREAMS_DIR",
    "QueueStreamReader",
    "QueueStreamWriter",
    "SparkQueueDataSource",
    "cleanup_staging",
    "register",
    "release",
    "row_filter",
    "spark_session",
    "table_path",
]
