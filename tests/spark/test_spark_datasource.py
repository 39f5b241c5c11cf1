"""Reading entities as DataFrames: the `sparkqueue` data source, partition pruning, and the table helpers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as sf

from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.spark import RECEIVED_SCHEMA, row_filter, table_path

pytestmark = pytest.mark.spark


def read(spark, ns, name: str, **options: str):
    """spark.read.format("sparkqueue") on the test namespace."""
    reader = spark.read.format("sparkqueue").option("namespace", ns.root)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load(name)


def test_reads_live_messages_with_state_without_locking(spark, ns, numbered):
    ns.create_queue("q")
    later = datetime.now(UTC) + timedelta(hours=1)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(40).withColumn("partition_key", sf.concat(sf.lit("k"), (sf.col("id") % 5).cast("string"))))
        s.send_dataframe(numbered(5).withColumn("scheduled_enqueue_time_utc", sf.lit(later)))
    with ns.get_queue_receiver("q") as r:
        got = r.receive_messages(10)
        r.defer_message(got[0])
        r.complete_message(got[1])
    df = read(spark, ns, "q")
    assert df.schema == RECEIVED_SCHEMA
    states = {row.state: row["count"] for row in df.groupBy("state").count().collect()}
    assert states == {"active": 38, "deferred": 1, "scheduled": 5}  # 45 sent, 1 completed
    assert df.where("lock_token IS NOT NULL").count() == 8  # shown, not taken
    assert ns.get_queue_runtime_properties("q").active_message_count == 38  # locked ones included
    rows = df.where("partition_key IS NOT NULL").collect()
    assert all(row.partition_id == partition_for_key(row.partition_key, 16) for row in rows)


def test_partition_filter_prunes_reader_partitions(spark, ns, numbered):
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(320).withColumn("partition_key", sf.concat(sf.lit("k"), (sf.col("id") % 64).cast("string"))))
    df = read(spark, ns, "q")
    holding = sum(1 for p in ns.get_queue_runtime_properties("q").partitions if p.total_message_count)
    assert holding > 10 and df.rdd.getNumPartitions() == holding  # one reader partition per Delta partition with files
    one = df.where(sf.col("partition_id") == 3)
    assert one.rdd.getNumPartitions() == 1
    assert one.count() == ns.get_queue_runtime_properties("q").partitions[3].active_message_count > 0
    two = df.where(sf.col("partition_id").isin(1, 2))
    assert two.rdd.getNumPartitions() == 2
    assert {row.partition_id for row in two.select("partition_id").distinct().collect()} == {1, 2}


def test_dead_letters_and_subscriptions(spark, ns, numbered):
    ns.create_topic("t")
    ns.create_subscription("t", "s1")
    ns.create_subscription("t", "s2")
    with ns.get_topic_sender("t") as s:
        s.send_dataframe(numbered(20))
    with ns.get_subscription_receiver("t", "s1") as r:
        for m in r.receive_messages(5):
            r.dead_letter_message(m, reason="Bad", error_description="test")
    assert read(spark, ns, "t/Subscriptions/s1").count() == 15
    assert read(spark, ns, "t/Subscriptions/s2").count() == 20
    dlq = read(spark, ns, "t/Subscriptions/s1", sub_queue="deadletter").collect()
    assert len(dlq) == 5 and {row.dead_letter_reason for row in dlq} == {"Bad"}
    assert read(spark, ns, "t/Subscriptions/s1", entity_type="subscription").count() == 15
    with pytest.raises(Exception, match="topic"):
        read(spark, ns, "t").count()


def test_table_path_and_row_filter_select_the_same_rows_for_other_readers(spark, ns, numbered):
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(100))
    path = table_path(ns, "q")
    dt = DeltaTable(path)  # a plain Delta table: format("delta") reads it where the Delta jars are installed
    raw = spark.read.option("basePath", path).parquet(*dt.file_uris())  # what a Delta reader does at this version
    assert raw.where(row_filter(ns, "q")).count() == 100
    assert raw.where(row_filter(ns.root, "q", sub_queue="deadletter")).count() == 0
