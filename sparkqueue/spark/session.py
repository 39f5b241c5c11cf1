"""SparkSession helpers for the DataFrame operations: the session to use, task layout, and error translation.

Errors raised inside Spark tasks reach the driver as Spark exceptions. Tasks mark sparkqueue
errors as ``[sparkqueue:<ErrorClass>] <message>`` (raise_error in SQL, or a re-raise in Python);
`spark_errors()` turns such a failure back into the sparkqueue error on the driver.
"""

from __future__ import annotations

import logging
import re
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import mmh3
from py4j.protocol import Py4JJavaError
from pyspark import SparkContext
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as sf

from sparkqueue import errors
from sparkqueue.errors import InvalidArgumentTypeError, InvalidOperationError, SparkQueueError

log = logging.getLogger(__name__)

MARKER = re.compile(r"\[sparkqueue:(\w+)\] (.*?)(?: SQLSTATE: \w+)?$", re.MULTILINE)
# A Python worker that cannot import what sparkqueue's tasks need runs another interpreter than the driver.
MISSING_MODULE = re.compile(r"No module named '((?:sparkqueue|pyspark_sparkqueue|pyarrow|deltalake|mmh3|numpy)\b[\w.]*)'")
# A DataFrame over a staging directory that release() or the retention sweep removed (staging.py).
STAGING_GONE = re.compile(r"FAILED_READ_FILE\.FILE_NOT_EXIST\].*?(\S*/_spark_staging/\S*?)\. File does not exist")


def active_session(spark: SparkSession | None = None) -> SparkSession:
    """The given session, else the active one (or the process's running one, from other threads); raises if none."""
    if spark is not None:
        if not isinstance(spark, SparkSession):
            raise InvalidArgumentTypeError(f"spark must be a SparkSession, got {type(spark).__name__}")
        return spark
    active = SparkSession.getActiveSession()  # thread-local: other threads see none ...
    if active is None and SparkContext._active_spark_context is not None:
        active = SparkSession.builder.getOrCreate()  # ... but the process's running session is meant
    if active is None:
        raise InvalidOperationError("no active SparkSession: pass spark=... or create one (sparkqueue.spark.spark_session())")
    return active


def check_dataframe(df: object, call: str) -> DataFrame:
    """`df` when it is a Spark DataFrame; InvalidArgumentTypeError naming the call otherwise (a list, a pandas frame)."""
    if not isinstance(df, DataFrame):
        raise InvalidArgumentTypeError(f"{call} takes a pyspark.sql.DataFrame, got {type(df).__name__}")
    return df


def marked(exc: SparkQueueError) -> str:
    """The text a task raises so the driver can rebuild the sparkqueue error."""
    return f"[sparkqueue:{type(exc).__name__}] {exc}"


def failing(error: type[SparkQueueError], *parts: Column | str) -> Column:
    """A column that fails the task with a sparkqueue error built from `parts` (see spark_errors)."""
    pieces = [sf.lit(f"[sparkqueue:{error.__name__}] ")] + [sf.lit(p) if isinstance(p, str) else p for p in parts]
    return sf.raise_error(sf.concat(*pieces))


def task_error(exc: SparkQueueError) -> RuntimeError:
    """A task-side exception carrying a sparkqueue error across the Spark boundary."""
    return RuntimeError(marked(exc))


def worker_python_error(module: str) -> InvalidOperationError:
    """The error for Spark Python workers that lack a module sparkqueue's tasks import, naming the fix."""
    return InvalidOperationError(
        f"Spark's Python workers cannot import {module!r}: they run another Python than this driver ({sys.executable}). "
        "Set PYSPARK_PYTHON (or the Spark setting spark.pyspark.python) to a Python with sparkqueue installed "
        "before the session starts, or build the session with sparkqueue.spark.spark_session()"
    )


def translate(exc: BaseException) -> SparkQueueError | None:
    """The sparkqueue error a failed Spark job carries, if any (or the worker-interpreter error when workers lack sparkqueue)."""
    text = str(exc)
    found = MARKER.search(text)
    if found is None:
        missing = MISSING_MODULE.search(text)
        if missing:
            return worker_python_error(missing.group(1))
        gone = STAGING_GONE.search(text)
        if gone:
            return InvalidOperationError(
                f"the DataFrame reads staged messages that are gone ({gone.group(1)}): it was released "
                "(sparkqueue.spark.release) or outlived the staging retention; receive the messages again"
            )
        return None
    cls = getattr(errors, found.group(1), None)
    if not (isinstance(cls, type) and issubclass(cls, SparkQueueError)):
        cls = SparkQueueError
    return cls(found.group(2).strip())


@contextmanager
def spark_errors() -> Iterator[None]:
    """Re-raise a Spark job failure that carries a sparkqueue error as that error."""
    try:
        yield
    except (PySparkException, Py4JJavaError) as exc:  # a job's failure reaches collect() as a bare Py4JJavaError
        err = translate(exc)
        if err is None:
            raise
        raise err from exc


@cache
def shuffle_keys(partitions: int) -> tuple[int, ...]:
    """Per queue partition p, a long whose Spark hash lands in shuffle partition p of `partitions`.

    Spark's HashPartitioning is pmod(murmur3_x86_32(long as 8 little-endian bytes, seed 42), n), so
    repartition(n, key) with these keys sends each queue partition to its own task, one to one.
    """
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < partitions:
        bucket = mmh3.hash(struct.pack("<q", candidate), 42) % partitions
        keys.setdefault(bucket, candidate)
        candidate += 1
    return tuple(keys[p] for p in range(partitions))


def input_partitions(df: DataFrame) -> int | None:
    """How many partitions a DataFrame has (planning only, no job); None when it cannot tell (no RDD API)."""
    try:
        return max(1, df.rdd.getNumPartitions())
    except Exception:  # callers fall back to plans that do not depend on it
        return None


def task_count(spark: SparkSession, queue_partitions: int) -> int:
    """Spark tasks for work spread over queue partitions: one per partition, up to what the cluster runs at once.

    Beyond the session's default parallelism (its cores) extra tasks only queue behind the first
    wave and add Python-worker overhead, so a task then handles several queue partitions in turn
    (their commits still never conflict). The count is the smallest that keeps the waves even:
    16 partitions on 3 cores give 3 tasks of 6, 5 and 5, never a fourth task that runs alone.
    """
    cores = max(1, spark.sparkContext.defaultParallelism)
    per_task = -(-max(1, queue_partitions) // cores)
    return max(1, -(-max(1, queue_partitions) // per_task))


def bucket_key(queue_partition: Column, tasks: int) -> Column:
    """A shuffle key that sends queue partition q to Spark partition q % tasks of `repartition(tasks, key)`."""
    keys = sf.array(*[sf.lit(k) for k in shuffle_keys(tasks)])
    return sf.element_at(keys, sf.pmod(queue_partition, sf.lit(tasks)) + 1)
