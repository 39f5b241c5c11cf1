"""Transforms for jobs/consumer.py: each takes the received-message DataFrame and returns the rows to store.

A transform must keep `sequence_number` (the output table's key, with the queue name) and may
drop rows (those messages are completed without output). Name one with --transform module:function.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as sf

KEY_COLUMNS = ("sequence_number", "message_id", "partition_id", "enqueued_time_utc")


def uppercase(df: DataFrame) -> DataFrame:
    """Demo: the body decoded as UTF-8 and upper-cased."""
    return df.select(*KEY_COLUMNS, sf.upper(sf.col("body").cast("string")).alias("body_upper"))


def identity(df: DataFrame) -> DataFrame:
    """The messages as received, without the lock columns (they mean nothing once stored)."""
    return df.select(
        *KEY_COLUMNS,
        "body",
        "session_id",
        "partition_key",
        "correlation_id",
        "subject",
        "content_type",
        "application_properties",
        "delivery_count",
    )
