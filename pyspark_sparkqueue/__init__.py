"""Spark's discovery hook for the `sparkqueue` data source: `spark.read.format("sparkqueue")` on any SparkSession.

Spark 4 registers, on first use of a Python data source, the `DefaultSource` of every installed
top-level module named `pyspark_*` (pyspark/sql/worker/lookup_data_sources.py), found by Spark's
Python workers. This module is that hook for sparkqueue; the reader itself lives in
`sparkqueue.spark.datasource` (see docs there).

It imports only pyspark: Spark imports every `pyspark_*` module in one lookup, so a failure here
would break every Python data source of the session. The implementation is imported when a read
is planned, and a worker Python without sparkqueue's dependencies then fails with an error that
names the fix (PYSPARK_PYTHON / spark.pyspark.python).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

__all__ = ["DefaultSource"]

T = TypeVar("T")


def _plain(make: Callable[[], T]) -> T:
    """make(), with a sparkqueue error (a bad option, an unknown entity) raised afresh from here.

    Spark puts the Python traceback of a failed planning call into its error; without the frames
    inside sparkqueue, what the user reads is this call and the error's own one-line message.
    """
    try:
        return make()
    except Exception as exc:
        if type(exc).__module__ != "sparkqueue.errors":
            raise
        raise exc.with_traceback(None) from None


def _implementation() -> Any:
    """sparkqueue.spark.datasource, or an error naming the interpreter Spark's workers run and how to change it."""
    try:
        from sparkqueue.spark import datasource
    except ImportError as exc:
        if exc.name == "pyspark":  # too old a PySpark: its own message says so
            raise RuntimeError(f"[sparkqueue:InvalidOperationError] {exc}") from None
        raise RuntimeError(
            f"[sparkqueue:InvalidOperationError] Spark's Python workers run {sys.executable}, which cannot import "
            f"sparkqueue ({exc}). Run the workers on the Python that has sparkqueue installed: set the environment "
            "variable PYSPARK_PYTHON (or the Spark setting spark.pyspark.python) to it before the session starts, "
            "or build the session with sparkqueue.spark.spark_session()."
        ) from exc
    return datasource


class DefaultSource(DataSource):
    """`spark.read.format("sparkqueue").option("namespace", root).load(entity)`: an entity's messages, unlocked."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "sparkqueue"

    def schema(self) -> StructType:
        """The received-message layout, once the options and the entity pass the checks `load()` makes."""
        implementation = _implementation()
        _plain(lambda: implementation.check_load(dict(self.options)))
        layout: StructType = implementation.RECEIVED_SCHEMA
        return layout

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader pinned to the table's current version."""
        reader: DataSourceReader = _plain(lambda: _implementation().make_reader(dict(self.options), schema))
        return reader

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """Refused: DataFrames are sent with sender.send_dataframe (or a streaming query)."""
        writer: DataSourceWriter = _plain(
            lambda: _implementation().SparkQueueDataSource(dict(self.options)).writer(schema, overwrite)
        )
        return writer

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802 - pyspark's name
        """`spark.readStream.format("sparkqueue")`: peek-locked micro-batches."""
        reader: DataSourceStreamReader = _plain(
            lambda: _implementation().SparkQueueDataSource(dict(self.options)).streamReader(schema)
        )
        return reader

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802 - pyspark's name
        """`df.writeStream.format("sparkqueue")`: each micro-batch sent once."""
        source = _implementation().SparkQueueDataSource
        writer: DataSourceStreamWriter = _plain(lambda: source(dict(self.options)).streamWriter(schema, overwrite))
        return writer
