"""time_to_live through every send path (docs/semantics.md §5): send_messages, send_dataframe and the sink agree."""

from __future__ import annotations

import contextlib
import itertools
import time
from datetime import UTC, datetime, timedelta
from functools import reduce
from pathlib import Path

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from sparkqueue import Message, Namespace
from sparkqueue.errors import SparkQueueError
from sparkqueue.model.limits import TTL_NEVER
from sparkqueue.spark.session import translate

pytestmark = pytest.mark.spark

Outcome = list[timedelta | None] | str  # each row's stored TTL, or the refusal of the whole send
_names = itertools.count()


def refusal(exc: SparkQueueError) -> str:
    """An error as compared across paths: its class and its text up to the value (each path shows the value its own way)."""
    return f"{type(exc).__name__}: {str(exc).split(', got ')[0]}"


def new_queue(ns: Namespace) -> str:
    """A fresh queue of the namespace, so each send is read back alone."""
    name = f"q{next(_names)}"
    ns.create_queue(name)
    return name


def stored(ns: Namespace, queue: str, n: int) -> list[timedelta | None]:
    """The TTL stored for messages m0 .. m<n-1> of the queue."""
    with ns.get_queue_receiver(queue) as r:
        by_id = {m.message_id: m.time_to_live for m in r.peek_messages(n + 1)}
    return [by_id[f"m{i}"] for i in range(n)]


def frame(spark: SparkSession, ttls: list[str], keyed: bool = False) -> DataFrame:
    """One row per SQL expression, as its time_to_live (rows of one call share a type: a union would widen it)."""
    key = ["'k' AS partition_key"] if keyed else []
    rows = [
        spark.range(1).selectExpr(f"'m{i}' AS message_id", "'x' AS body", f"{t} AS time_to_live", *key)
        for i, t in enumerate(ttls)
    ]
    return reduce(DataFrame.unionByName, rows)


def via_messages(ns: Namespace, ttls: list[timedelta]) -> Outcome:
    """What send_messages stores for these TTLs, or how it refuses them."""
    queue = new_queue(ns)
    try:
        with ns.get_queue_sender(queue) as s:
            s.send_messages([Message("x", message_id=f"m{i}", time_to_live=t) for i, t in enumerate(ttls)])
    except SparkQueueError as exc:
        return refusal(exc)
    return stored(ns, queue, len(ttls))


def via_dataframe(spark: SparkSession, ns: Namespace, ttls: list[str], keyed: bool) -> Outcome:
    """What send_dataframe stores (Spark's writer unkeyed, the staged path keyed), or how it refuses them."""
    queue = new_queue(ns)
    try:
        with ns.get_queue_sender(queue) as s:
            s.send_dataframe(frame(spark, ttls, keyed))
    except SparkQueueError as exc:
        return refusal(exc)
    return stored(ns, queue, len(ttls))


def via_sink(spark: SparkSession, ns: Namespace, tmp_path: Path, ttls: list[str]) -> Outcome:
    """What the streaming sink stores from a file stream of these rows, or the sparkqueue error that failed its query."""
    queue = new_queue(ns)
    src = tmp_path / "src" / queue
    frame(spark, ttls).coalesce(1).write.parquet(str(src))
    stream = spark.readStream.schema(spark.read.parquet(str(src)).schema).parquet(str(src)).writeStream.format("sparkqueue")
    stream = stream.option("namespace", ns.root).option("checkpointLocation", str(tmp_path / "ck" / queue))
    query = stream.trigger(availableNow=True).start(queue)
    with contextlib.suppress(PySparkException):
        query.awaitTermination(120)
    failure = query.exception()
    if failure is None:
        return stored(ns, queue, len(ttls))
    error = translate(failure)
    assert error is not None, f"the query failed without a sparkqueue error: {str(failure)[:800]}"
    return refusal(error)


def every_path(spark: SparkSession, ns: Namespace, tmp_path: Path, ttls: list[str]) -> dict[str, Outcome]:
    """The outcome of send_dataframe (both paths) and of the sink for the same rows."""
    return {
        "send_dataframe": via_dataframe(spark, ns, ttls, keyed=False),
        "send_dataframe keyed": via_dataframe(spark, ns, ttls, keyed=True),
        "sink": via_sink(spark, ns, tmp_path, ttls),
    }


@pytest.mark.parametrize("ttl", ["CAST(-1e20 AS DOUBLE)", "CAST(-9223372036854775808 AS BIGINT)", "CAST(-1e25 AS DECIMAL(38,0))"])
def test_hugely_negative_seconds_are_refused_as_send_messages_refuses_a_negative_ttl(spark, ns, tmp_path, ttl):
    """Too negative for microseconds in a long (or for a timedelta): refused as not positive, not as a raw overflow."""
    expected = via_messages(ns, [-timedelta(days=999_999_999)])
    assert expected == "InvalidOperationError: time_to_live must be positive"
    assert every_path(spark, ns, tmp_path, [ttl]) == dict.fromkeys(("send_dataframe", "send_dataframe keyed", "sink"), expected)


def test_the_sink_takes_seconds_past_ttl_never_as_never_and_refuses_nan_as_send_dataframe(spark, ns, tmp_path):
    """1e14 seconds (past what a timedelta holds) never expires, as a TTL of TTL_NEVER or more in send_messages."""
    never = TTL_NEVER.total_seconds()
    seconds = ["CAST(1e14 AS DOUBLE)", f"CAST({never} AS DOUBLE)", f"CAST({never - 1} AS DOUBLE)", "CAST(90.5 AS DOUBLE)"]
    expected = via_messages(ns, [timedelta.max, TTL_NEVER, TTL_NEVER - timedelta(seconds=1), timedelta(seconds=90.5)])
    assert expected == [None, None, TTL_NEVER - timedelta(seconds=1), timedelta(seconds=90.5)]
    assert every_path(spark, ns, tmp_path, seconds) == dict.fromkeys(("send_dataframe", "send_dataframe keyed", "sink"), expected)
    # NaN has no timedelta for send_messages: the sink refuses it as send_dataframe does
    nan = "InvalidOperationError: time_to_live must be a finite number of seconds"
    assert via_sink(spark, ns, tmp_path, ["double('NaN')"]) == via_dataframe(spark, ns, ["double('NaN')"], keyed=False) == nan


def test_an_interval_of_ttl_never_or_more_never_expires_on_every_path(spark, ns, tmp_path):
    """A day-time interval follows the TTL_NEVER rule of numbers and timedeltas: stored as no TTL, not as 20,000,000 days."""
    days = [20_000_000, TTL_NEVER.days, TTL_NEVER.days - 1, 2]
    expected = via_messages(ns, [timedelta(days=d) for d in days])
    assert expected == [None, None, timedelta(days=TTL_NEVER.days - 1), timedelta(days=2)]
    intervals = [f"INTERVAL '{d}' DAY" for d in days]
    assert every_path(spark, ns, tmp_path, intervals) == dict.fromkeys(
        ("send_dataframe", "send_dataframe keyed", "sink"), expected
    )
    negative = via_messages(ns, [-timedelta(days=1)])
    assert negative == "InvalidOperationError: time_to_live must be positive"
    assert via_dataframe(spark, ns, ["INTERVAL '-1' DAY"], keyed=False) == negative


@pytest.mark.parametrize("ttl", ["CAST(0.0005 AS DOUBLE)", "INTERVAL '0.000999' SECOND", "CAST(1e-9 AS DECIMAL(20,10))"])
def test_a_ttl_under_a_millisecond_is_refused_on_every_path_and_nothing_is_sent(spark, ns, tmp_path, ttl):
    """Kept in whole milliseconds, such a TTL would be stored as 0: expired on arrival, counted as sent, never delivered."""
    expected = via_messages(ns, [timedelta(microseconds=500)])
    assert expected == "InvalidOperationError: time_to_live must be at least 1 millisecond (it is kept in whole milliseconds)"
    assert every_path(spark, ns, tmp_path, [ttl]) == dict.fromkeys(("send_dataframe", "send_dataframe keyed", "sink"), expected)
    assert {q.total_message_count for q in ns.list_queues_runtime_properties()} == {0}


def test_one_millisecond_is_the_shortest_ttl_every_path_stores(spark, ns, tmp_path):
    """The boundary of the rule above: 1 ms (as seconds or as an interval) is stored as 1 ms, as send_messages stores it."""
    expected = via_messages(ns, [timedelta(milliseconds=1)])
    assert expected == [timedelta(milliseconds=1)]
    for ttl in ("CAST(0.001 AS DOUBLE)", "INTERVAL '0.001' SECOND"):
        assert every_path(spark, ns, tmp_path, [ttl]) == dict.fromkeys(
            ("send_dataframe", "send_dataframe keyed", "sink"), expected
        )


@pytest.mark.parametrize("keyed", [False, True], ids=["spark-writer", "python-tasks"])
def test_a_dataframe_slower_to_compute_than_its_ttl_arrives_unexpired(spark: SparkSession, ns: Namespace, keyed: bool) -> None:
    """Rows were stamped (enqueued, expiry) when the Spark job started: a DataFrame taking 3 s to compute with a 1 s
    TTL was stored expired, counted as sent, and never delivered. Such files are stamped again at the commit.

    Here a 2.5 s TTL and a job of 3.2 s or more: the receive after the send keeps seconds of slack on a loaded machine."""
    queue = new_queue(ns)
    slow = sf.udf(lambda b: (time.sleep(0.8), b)[1], "binary")  # 8 rows on 2 cores: about 3.2 s or more
    df = spark.range(0, 8, 1, 2).select(
        slow(sf.col("id").cast("string").cast("binary")).alias("body"),
        sf.lit(2.5).alias("time_to_live"),
        *([sf.concat(sf.lit("k"), sf.col("id").cast("string")).alias("partition_key")] if keyed else []),
    )
    started = datetime.now(UTC)
    with ns.get_queue_sender(queue) as s:
        assert s.send_dataframe(df) == 8
    assert (datetime.now(UTC) - started).total_seconds() > 3.0  # the job did outlast the TTL
    with ns.get_queue_receiver(queue) as r:
        got = r.receive_messages(max_message_count=20, max_wait_time=0.5)
    assert len(got) == 8
    for m in got:
        assert m.time_to_live == timedelta(seconds=2.5)
        assert m.expires_at_utc == m.enqueued_time_utc + timedelta(seconds=2.5)
        assert (m.enqueued_time_utc - started).total_seconds() > 2.5
