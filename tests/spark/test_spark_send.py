"""DataFrame send (docs/semantics.md §12, §2-4): placement, duplicate detection, validation, all-or-nothing commit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as sf

from sparkqueue import Message, Namespace
from sparkqueue.constants import EntityStatus
from sparkqueue.errors import (
    InvalidArgumentTypeError,
    InvalidOperationError,
    MessageSizeExceededError,
    MessagingEntityDisabledError,
    OperationTimeoutError,
    PartitionUnavailableError,
)
from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.spark.jvm_send import FILE_ROWS
from sparkqueue.spark.send import send_dataframe
from sparkqueue.storage.table import SEQUENCE_MASK

pytestmark = pytest.mark.spark


def peek_all(ns: Namespace, queue: str, session_id: str | None = None) -> list:
    """Every live message of the queue (or of one session), browsed without locking."""
    out = []
    with ns.get_queue_receiver(queue, session_id=session_id) as r:
        while got := r.peek_messages(5000):
            out.extend(got)
    return out


def test_something_else_than_a_dataframe_is_refused_by_name(spark, ns):
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s, pytest.raises(InvalidArgumentTypeError, match="send_dataframe takes a pyspark"):
        s.send_dataframe([("x",)])
    with ns.get_queue_receiver("q") as r:
        for settle in (r.complete_dataframe, r.abandon_dataframe, r.defer_dataframe, r.dead_letter_dataframe):
            with pytest.raises(InvalidArgumentTypeError, match=r"_dataframe takes a pyspark\.sql\.DataFrame, got list"):
                settle([{"lock_token": "x"}])
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_send_counts_places_by_key_and_round_trips_fields(spark, ns):
    ns.create_queue("q")
    rows = [
        ("plain", None, None, None),
        ("keyed", "k1", None, None),
        ("keyed2", "k2", None, None),
        ("session", None, "s1", None),
        ("session+same key", "s2", "s2", None),
        ("with ttl", None, None, 30.0),
    ] * 20
    df = spark.createDataFrame(rows, "body string, partition_key string, session_id string, time_to_live double").select(
        "*",
        sf.create_map(sf.lit("n"), sf.lit(7), sf.lit("b"), sf.lit(True).cast("int")).alias("application_properties"),
        sf.lit("text/plain").alias("content_type"),
        sf.lit("c-1").alias("correlation_id"),
        sf.lit("subj").alias("subject"),
    )
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == len(rows)
    got = peek_all(ns, "q")
    assert len(got) == len(rows)
    for m in got:
        key = m.session_id or m.partition_key
        if key is not None:
            assert m.partition_id == partition_for_key(key, 16)
        assert m.sequence_number >> 48 == m.partition_id
        assert m.application_properties == {"n": 7, "b": 1}  # typed JSON, as the core stores it
        assert (m.content_type, m.correlation_id, m.subject) == ("text/plain", "c-1", "subj")
        assert m.message_id and len(m.message_id) == 36  # assigned UUIDs
        if str(m) == "with ttl":
            assert m.time_to_live == timedelta(seconds=30)
            assert m.expires_at_utc == m.enqueued_time_utc + timedelta(seconds=30)
    assert len({m.message_id for m in got}) == len(rows)


def test_unkeyed_rows_go_round_robin_in_blocks(spark, ns, numbered):
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(100, partitions=2).drop("message_id")) == 100
        small = [p.active_message_count for p in ns.get_queue_runtime_properties("q").partitions]
        assert sum(1 for d in small if d) <= 2  # a block per input partition: few commits for a small DataFrame
        large = 4 * 4 * FILE_ROWS  # 4 input partitions, each owning 4 queue partitions, fill a block in each
        assert s.send_dataframe(numbered(large, partitions=4).drop("message_id")) == large
    depth = [p.active_message_count for p in ns.get_queue_runtime_properties("q").partitions]
    assert len(depth) == 16 and min(depth) > 0 and sum(depth) == large + 100, depth


def test_duplicate_detection_counts_only_new_messages_and_places_by_message_id(spark, ns, numbered):
    ns.create_queue("q", requires_duplicate_detection=True)
    df = numbered(500)
    repeated = df.union(df.limit(100))  # 100 repeats inside one DataFrame
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(repeated) == 500
        assert s.send_dataframe(numbered(600)) == 100  # 500 already accepted in the window
    got = peek_all(ns, "q")
    assert len(got) == 600
    assert all(m.partition_id == partition_for_key(m.message_id, 16) for m in got)


def test_session_order_follows_dataframe_order(spark, ns, numbered):
    ns.create_queue("q", requires_session=True)
    df = numbered(2000, partitions=4).withColumn("session_id", sf.lit("s-1"))
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == 2000
    got = sorted(peek_all(ns, "q", "s-1"), key=lambda m: m.sequence_number)
    assert [m.message_id for m in got] == [f"m-{i}" for i in range(2000)]


def test_unkeyed_rows_keep_their_input_partition_order_without_a_sort(spark, ns, numbered):
    ns.create_queue("q", enable_partitioning=False)  # one queue partition: every row lands in it
    df = numbered(3000, partitions=3)  # input partition k holds ids [1000k, 1000k + 1000)
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == 3000
    got = sorted(peek_all(ns, "q"), key=lambda m: m.sequence_number)
    ids = [int(m.message_id[2:]) for m in got]
    for k in range(3):
        mine = [i for i in ids if i // 1000 == k]
        assert mine == sorted(mine) and len(mine) == 1000


def test_unkeyed_send_from_many_input_partitions_gives_each_queue_partition_one_writer(spark, ns, numbered):
    """40 input partitions into 16 queue partitions: coalesced so that every queue partition has a single writer."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(4000, partitions=40)) == 4000
    by_partition: dict[int, list[tuple[int, int]]] = {}
    for m in peek_all(ns, "q"):
        by_partition.setdefault(m.partition_id, []).append((m.sequence_number, int(m.message_id[2:])))
    assert sum(map(len, by_partition.values())) == 4000 and len(by_partition) == 16
    for rows in by_partition.values():
        ids = [i for _, i in sorted(rows)]
        assert ids == sorted(ids)  # one task wrote the partition, in input order


def test_bad_row_in_a_late_input_partition_stores_nothing(spark, ns, numbered):
    ns.create_queue("q")
    df = numbered(3000, partitions=30).withColumn("body", sf.when(sf.col("id") == 2999, None).otherwise(sf.col("body")))
    with ns.get_queue_sender("q") as s, pytest.raises(InvalidOperationError, match="got null"):
        s.send_dataframe(df)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_bad_rows_without_a_message_id_are_named_as_the_core_names_them(spark, ns):
    """A row without a message_id is "a message" in the error, never the id the send would have generated."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        with pytest.raises(InvalidOperationError, match=r"got null \(a message\)$"):
            s.send_dataframe(spark.createDataFrame([(None,)], "body string"))
        with pytest.raises(MessageSizeExceededError, match=r"^a message is 300000 bytes; the standard tier allows"):
            s.send_dataframe(spark.range(1).select(sf.repeat(sf.lit("x"), 300_000).alias("body")))
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_preserve_order_keeps_dataframe_order_for_unkeyed_rows(spark, ns, numbered):
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(3000, partitions=3), preserve_order=True) == 3000
    got = sorted(peek_all(ns, "q"), key=lambda m: m.sequence_number)
    assert [m.message_id for m in got] == [f"m-{i}" for i in range(3000)]


def test_oversize_message_fails_before_anything_is_stored(spark, ns, numbered):
    ns.create_queue("q")
    big = numbered(1000).withColumn(
        "body", sf.when(sf.col("id") == 777, sf.expr("unhex(repeat('ab', 300000))")).otherwise(sf.col("body"))
    )
    with ns.get_queue_sender("q") as s, pytest.raises(MessageSizeExceededError, match="m-777"):
        s.send_dataframe(big)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


@pytest.mark.parametrize(
    ("settings", "extra", "match"),
    [
        ({"requires_session": True}, {}, "requires sessions"),
        ({}, {"session_id": "a", "partition_key": "b"}, "differs from session_id"),
        ({}, {"partition_key": "k" * 129}, "at most 128"),
        ({}, {"time_to_live": -1.0}, "must be positive"),
        ({}, {"time_to_live": float("nan")}, "finite number of seconds"),
        ({}, {"time_to_live": float("inf")}, "finite number of seconds"),
        ({}, {"message_id": ""}, "message_id must not be empty"),
        ({"requires_duplicate_detection": True}, {"message_id": ""}, "message_id must not be empty"),
    ],
)
def test_invalid_rows_raise_the_core_error_and_store_nothing(spark, ns, numbered, settings, extra, match):
    ns.create_queue("q", **settings)
    df = numbered(50)
    for name, value in extra.items():
        df = df.withColumn(name, sf.when(sf.col("id") == 42, sf.lit(value)))
    if "session_id" in extra and "requires_session" not in settings:
        df = df.withColumn("session_id", sf.when(sf.col("id") == 42, sf.lit("a")))
    with ns.get_queue_sender("q") as s, pytest.raises(InvalidOperationError, match=match):
        s.send_dataframe(df)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


@pytest.mark.parametrize("status", [EntityStatus.DISABLED, EntityStatus.SEND_DISABLED])
def test_a_send_to_an_entity_whose_sends_are_disabled_is_refused(spark, ns, numbered, status):
    """As send_messages: MessagingEntityDisabledError, nothing stored, on both send paths and for topics."""
    ns.create_queue("q", status=status)
    ns.create_topic("t", status=status)
    ns.create_subscription("t", "s")
    keyed = numbered(10).withColumn("partition_key", sf.lit("k"))
    for name, df in (("q", numbered(10)), ("q", keyed), ("t", numbered(10))):
        sender = ns.get_queue_sender(name) if name == "q" else ns.get_topic_sender(name)
        with sender as s, pytest.raises(MessagingEntityDisabledError):
            s.send_dataframe(df)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    assert ns.get_subscription_runtime_properties("t", "s").total_message_count == 0


def test_wrong_column_types_fail_on_the_driver(spark, ns):
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        with pytest.raises(InvalidOperationError, match="body"):
            s.send_dataframe(spark.range(3).select(sf.col("id").alias("body")))
        with pytest.raises(InvalidOperationError, match="subject"):
            s.send_dataframe(spark.range(3).select(sf.lit("x").alias("body"), sf.col("id").alias("subject")))
        with pytest.raises(InvalidOperationError, match="body"):
            s.send_dataframe(spark.range(3))


def test_columns_naming_message_fields_in_another_case_are_those_fields(spark, ns):
    """Spark resolves `Message_ID` as `message_id`, but send_dataframe ignored such columns: two sends of "order-1" to a
    duplicate-detecting queue stored two messages under fresh ids, without their time to live. They are the fields now,
    on the JVM path and the staged one, and two columns naming one field are refused."""
    ns.create_queue("q", requires_duplicate_detection=True)
    ns.create_queue("plain")
    df = spark.createDataFrame(
        [("x", "order-1", timedelta(minutes=3))], "Body string, Message_ID string, Time_To_Live interval day to second"
    )
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == 1
        assert s.send_dataframe(df) == 0  # the repeat, by its id
    with ns.get_queue_sender("plain") as s:
        assert s.send_dataframe(df) == 1  # the JVM writer's path
    for queue in ("q", "plain"):
        (m,) = peek_all(ns, queue)
        assert (m.body, m.message_id, m.time_to_live) == (b"x", "order-1", timedelta(minutes=3))
    both = spark.createDataFrame([("x", "y")], "body string, BODY string")
    with ns.get_queue_sender("plain") as s, pytest.raises(InvalidOperationError, match="both name the message field 'body'"):
        s.send_dataframe(both)
    assert len(peek_all(ns, "plain")) == 1


def test_json_properties_interval_ttl_and_scheduled_time(spark, ns):
    ns.create_queue("q", default_message_time_to_live=timedelta(minutes=5))
    later = datetime.now(UTC) + timedelta(hours=1)
    df = spark.createDataFrame(
        [("a", '{"x": 1, "y": "z"}', timedelta(minutes=10), None), ("b", None, timedelta(minutes=1), later)],
        "body string, application_properties string, time_to_live interval day to second, scheduled_enqueue_time_utc timestamp",
    )
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == 2
    by_body = {str(m): m for m in peek_all(ns, "q")}
    assert by_body["a"].application_properties == {"x": 1, "y": "z"}
    assert by_body["a"].time_to_live == timedelta(minutes=5)  # the entity's default is smaller
    assert by_body["b"].time_to_live == timedelta(minutes=1)
    assert by_body["b"].state == "scheduled"
    assert abs(by_body["b"].scheduled_enqueue_time_utc - later) < timedelta(milliseconds=1)
    assert ns.get_queue_runtime_properties("q").scheduled_message_count == 1


@pytest.mark.parametrize("dedupe", [False, True])  # Spark's own writer, and the Python tasks
def test_non_ascii_properties_are_stored_and_sized_as_a_core_send_stores_them(spark, ns, dedupe):
    """Spark sends wrote "\u20ac" escapes: "Zürich €" sized 83 bytes against the core's 76, and a message that fits
    the core's 256 KB was refused as too large."""
    ns.create_queue("q", requires_duplicate_detection=dedupe)
    props = {"city": "Zürich €"}
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("core_", message_id="core_", application_properties=props))  # as long as "spark"
        df = spark.createDataFrame(
            [("spark", "spark", '{"city": "Zürich €"}')], "body string, message_id string, application_properties string"
        )
        assert s.send_dataframe(df) == 1
        big = {"p": "€" * 20_000}  # 60,000 bytes as UTF-8; 120,000 as escapes
        big_df = spark.createDataFrame([("x" * 190_000, json.dumps(big))], "body string, application_properties string")
        assert s.send_dataframe(big_df) == 1
    got = {str(m)[:5]: m for m in peek_all(ns, "q")}
    assert got["spark"].size_in_bytes == got["core_"].size_in_bytes
    assert got["spark"].application_properties == props


def test_unavailable_key_partition_fails_and_unkeyed_rows_avoid_it(spark, ns, numbered):
    ns.create_queue("q")
    down = partition_for_key("k", 16)
    ns.fault_injector("q").fail(down)  # the driver plans placement: its view of availability is what counts
    with ns.get_queue_sender("q") as s:
        with pytest.raises(PartitionUnavailableError):
            s.send_dataframe(numbered(10).withColumn("partition_key", sf.lit("k")))
        assert s.send_dataframe(numbered(320).drop("message_id")) == 320
    ns.fault_injector("q").heal()
    depth = [p.active_message_count for p in ns.get_queue_runtime_properties("q").partitions]
    assert depth[down] == 0 and sum(depth) == 320


def test_topic_send_copies_to_every_subscription(spark, ns, numbered):
    ns.create_topic("t")
    ns.create_subscription("t", "a")
    ns.create_subscription("t", "b")
    with ns.get_topic_sender("t") as s:
        assert s.send_dataframe(numbered(300)) == 300
    for sub in ("a", "b"):
        assert ns.get_subscription_runtime_properties("t", sub).active_message_count == 300
    counts = Counter()
    with ns.get_subscription_receiver("t", "a") as r:
        while got := r.receive_messages(300, max_wait_time=None):
            counts.update(m.message_id for m in got)
            r.complete_messages(got)
    assert len(counts) == 300 and set(counts.values()) == {1}


# ---- all or nothing ----------------------------------------------------------------------------


def _waiting(check, what):
    """A function that polls check() until true, for UDFs (defined here so cloudpickle ships it by value to workers)."""

    def wait(limit_s=120.0):  # a bound on a hang, not a timed assertion
        give_up = time.monotonic() + limit_s
        while not check():
            if time.monotonic() > give_up:
                raise RuntimeError(f"gave up waiting for {what}")
            time.sleep(0.05)

    return wait


def test_a_task_failing_after_others_wrote_their_files_sends_nothing(spark, ns, numbered, tmp_path):
    """The last input partition's task raises (in the write pass) once other tasks have written files: nothing is sent."""
    ns.create_queue("q")
    table_dir = ns.broker.entity("queue", "q").table.uri
    fail_id = 3999  # in the last of 16 input partitions: local[2] runs it after most of the others
    # Inlined (not data_files): the UDF runs in Spark's workers, which cannot import this test module. os.walk skips
    # what vanishes meanwhile (Path.rglob raised FileNotFoundError for another task's renamed attempt directory).
    files_written = _waiting(
        lambda: any(f.endswith(".parquet") and "_delta_log" not in d for d, _, fs in os.walk(table_dir) for f in fs),
        "another task's files",
    )

    def body(i, b):  # a plain Python UDF (no type hints: pyspark would read them as an Arrow UDF's)
        if i != fail_id:
            return b
        files_written()
        raise RuntimeError("injected failure after other tasks wrote their files")

    df = numbered(4000, partitions=16).withColumn(
        "body", sf.udf(body, "binary").asNondeterministic()(sf.col("id"), sf.col("body"))
    )
    with ns.get_queue_sender("q") as s, pytest.raises(Exception, match="injected failure"):
        s.send_dataframe(df)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    assert DeltaTable(table_dir).to_pyarrow_table().num_rows == 0
    assert peek_all(ns, "q") == []
    # The files of the tasks that had finished are deleted; only the one task local[2] ran beside the failing
    # one may have been stopped mid-way (its file is not in the log; vacuum removes it).
    assert len(data_files(table_dir)) <= 1
    with ns.get_queue_sender("q") as s:  # the queue takes a send afterwards, numbered from 1
        assert s.send_dataframe(numbered(100)) == 100
    counters = sorted(m.sequence_number & SEQUENCE_MASK for m in peek_all(ns, "q"))
    assert counters[0] == 1


@pytest.mark.parametrize("entity", ["queue", "topic"])  # Spark's own writer; Python tasks staging in place
def test_a_vacuum_while_a_long_dataframe_send_writes_keeps_its_files(spark, ns, numbered, tmp_path, entity):
    """Files a send's tasks wrote long before its commit survive a vacuum with no retention (the send's write lease).

    The last input partition's task waits for another task's files, makes every file not in the
    log look two hours old (what a long job's first files are at its end), and runs the
    namespace's maintenance with `vacuum_retention=timedelta(0)` from its worker process. Before
    write leases that vacuum deleted the files, and the send failed or committed files that were gone.
    """
    if entity == "queue":
        ns.create_queue("q")
    else:
        ns.create_topic("q")
        ns.create_subscription("q", "s")
    table_dir = ns.broker.entity(entity, "q").table.uri
    root, gate_id, seen = ns.root, 3999, str(tmp_path / "seen.json")

    def _files_under(top: str, suffix: str = "") -> list[Path]:  # defined here: cloudpickle ships it to the workers
        """Files under a directory Spark's tasks are writing: os.walk skips what vanishes meanwhile (Path.rglob raised
        FileNotFoundError for another task's `_temporary` attempt directory, renamed as that task committed)."""
        return [Path(d, f) for d, _, files in os.walk(top) for f in files if f.endswith(suffix)]

    files_written = _waiting(
        lambda: any("_delta_log" not in p.parts for p in _files_under(table_dir, ".parquet")), "another task's files"
    )

    def body(i, b):  # a plain Python UDF, run in a Spark worker process
        if i != gate_id or os.path.exists(seen):
            return b
        try:
            files_written(10.0)
        except RuntimeError:  # the topic send's validation pass, which writes nothing: wait in the write pass
            return b
        old = time.time() - 7200
        uncommitted = [p for p in _files_under(table_dir, ".parquet") if "_delta_log" not in p.parts]
        for p in _files_under(table_dir):
            if "_delta_log" not in p.parts and "_sparkqueue_leases" not in p.parts:
                with contextlib.suppress(FileNotFoundError):  # another task's attempt directory, renamed meanwhile
                    os.utime(p, (old, old))
        from sparkqueue import Namespace as Ns

        with Ns(root) as other:
            reports = other.run_maintenance(vacuum_retention=timedelta(0))
        vacuumed = reports[f"{entity}:q"].vacuumed_files
        Path(seen).write_text(json.dumps({"uncommitted": len(uncommitted), "vacuumed": vacuumed}))
        return b

    df = numbered(4000, partitions=16).withColumn(
        "body", sf.udf(body, "binary").asNondeterministic()(sf.col("id"), sf.col("body"))
    )
    sender = ns.get_queue_sender("q") if entity == "queue" else ns.get_topic_sender("q")
    with sender as s:
        assert s.send_dataframe(df) == 4000
    vacuumed = json.loads(Path(seen).read_text())
    assert vacuumed["uncommitted"] > 0 and vacuumed["vacuumed"] == 0
    assert ns.check() == []
    if entity == "queue":
        assert sorted(m.message_id for m in peek_all(ns, "q")) == sorted(f"m-{i}" for i in range(4000))
    else:
        assert ns.get_subscription_runtime_properties("q", "s").active_message_count == 4000
        assert DeltaTable(table_dir).to_pyarrow_table().num_rows == 4000
    ns.run_maintenance(vacuum_retention=timedelta(0))  # the lease ended with the send: nothing is left of it
    assert not list(Path(table_dir).glob("_sparkqueue_leases/*"))


def data_files(table_dir: str) -> list[Path]:
    """Every Parquet file under the table but its log: committed, staged, or being written by a Spark task."""
    return [p for p in Path(table_dir).rglob("*.parquet") if "_delta_log" not in p.parts]


CONCURRENT_SENDER = """
import os, sys, time
from sparkqueue import Message, Namespace
root, started, done, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
while not os.path.exists(started):
    time.sleep(0.02)
with Namespace(root) as ns, ns.get_queue_sender("q") as s:
    for i in range(count):
        s.send_messages(Message(f"core-{i}", message_id=f"c-{i}"))
    for extra in sys.argv[5:]:  # "<message id>:<partition key>" of messages the DataFrame sends too
        mid, key = extra.split(":")
        s.send_messages(Message("core", message_id=mid, partition_key=key))
open(done, "w").close()
"""


def _racing_core_sender(root: str, tmp_path: Path, count: int, *extra_ids: str):
    """A core sender in another process that sends `count` single messages to queue "q" while a DataFrame send runs.

    Returns the process and a function that gates a DataFrame on it: the first evaluation of row 0
    (in the send's first attempt, after the driver read the fences) starts the sender and waits
    until it has sent everything; later evaluations pass straight through.
    """
    started, done = str(tmp_path / "started"), str(tmp_path / "done")
    child = subprocess.Popen(
        [sys.executable, "-c", CONCURRENT_SENDER, root, started, done, str(count), *extra_ids],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    core_sent = _waiting(lambda: os.path.exists(done), "the core sender")

    def body(i, b):
        if i == 0 and not os.path.exists(done):
            Path(started).touch()
            core_sent()
        return b

    gated = sf.udf(body, "binary").asNondeterministic()
    return child, lambda df: df.withColumn("body", gated(sf.col("id"), sf.col("body")))


@pytest.mark.parametrize("mode", ["in-place", "shuffled", "deduplicated"])
def test_a_concurrent_core_sender_moves_the_fences_and_the_dataframe_send_lands_whole_after_it(
    spark, ns, numbered, tmp_path, mode, caplog
):
    """A core sender in another process sends to every partition while the DataFrame send runs.

    The DataFrame's first attempt numbered its rows from fences that then moved, so its commit
    conflicts. The files of the moved partitions are renumbered after the core messages and the
    commit lands (no second Spark job, which a steady sender would make conflict again); on a
    duplicate-detecting queue the renumbering also drops the message id the core sender sent
    meanwhile. Every partition ends numbered 1..N with no gap or repeat, the core messages in their
    send order and the DataFrame's after them.
    """
    dedupe = mode == "deduplicated"
    ns.create_queue("q", requires_duplicate_detection=dedupe)
    caplog.set_level(logging.INFO, logger="sparkqueue.spark.commit")
    core = 48  # single unkeyed sends go round-robin: every one of the 16 partitions gets some
    repeated = ("m-7",) if dedupe else ()  # one of the DataFrame's messages (same id and key), sent by the core sender first
    child, gate = _racing_core_sender(ns.root, tmp_path, core, *[f"{m}:k{int(m[2:]) % 64}" for m in repeated])
    n = 4000
    df = gate(numbered(n, partitions=4))
    keyed = mode != "in-place"
    if keyed:
        df = df.withColumn("partition_key", sf.concat(sf.lit("k"), (sf.col("id") % 64).cast("string")))
    try:
        with ns.get_queue_sender("q") as s:
            assert s.send_dataframe(df) == n - len(repeated)
    finally:
        assert child.wait(timeout=120) == 0
    got = peek_all(ns, "q")
    assert len(got) == n + core
    by_partition: dict[int, list] = {}
    for m in got:
        by_partition.setdefault(m.partition_id, []).append(m)
    for p, msgs in by_partition.items():
        msgs.sort(key=lambda m: m.sequence_number)
        assert [m.sequence_number & SEQUENCE_MASK for m in msgs] == list(range(1, len(msgs) + 1)), p
        ids = [m.message_id for m in msgs]
        core_ids = [i for i in ids if i.startswith("c-")]
        assert core_ids == sorted(core_ids, key=lambda i: int(i[2:]))  # the core sender's order
        assert ids[: len(core_ids)] == core_ids  # the DataFrame's rows were numbered after them
        frame_ids = [int(i[2:]) for i in ids[len(core_ids) :]]
        if keyed:  # a key's rows keep the DataFrame's order
            for k in range(64):
                mine = [i for i in frame_ids if i % 64 == k]
                assert mine == sorted(mine)
        else:
            assert frame_ids == sorted(frame_ids)  # one input partition owns the queue partition
    assert sum(1 for msgs in by_partition.values() if any(m.message_id.startswith("c-") for m in msgs)) == 16
    assert [str(m) for m in got if m.message_id in repeated] == ["core"] * len(repeated)  # the first sent is kept
    table_dir = ns.broker.entity("queue", "q").table.uri
    on_disk = {f.name for f in Path(table_dir).glob("partition_id=*/*.parquet")}
    live = {u.rsplit("/", 1)[-1] for u in DeltaTable(table_dir).file_uris()}
    assert on_disk == live  # the conflicting attempt's files were deleted
    # Spark wrote the rows once and only the moved partitions' files were renumbered
    assert "renumbering their files only" in caplog.text


STEADY_SENDER = """
import os, sys, time
from sparkqueue import Message, Namespace
root, stop, sent = sys.argv[1], sys.argv[2], sys.argv[3]
topic = sys.argv[4:] == ["topic"]  # send to topic "t" instead of queue "q"
n = 0
with Namespace(root) as ns, (ns.get_topic_sender("t") if topic else ns.get_queue_sender("q")) as s:
    while not os.path.exists(stop) and n < 5000:
        s.send_messages(Message(f"core-{n}", message_id=f"c-{n}"))
        n += 1
        time.sleep(0.01)
with open(sent, "w") as f:
    f.write(str(n))
"""


def test_conflicts_past_the_operation_timeout_raise_and_send_nothing(spark, root, numbered, tmp_path):
    """A core sender keeps moving every partition's fence while each attempt of the DataFrame send runs (each lasts
    more than the 1 s timeout): the send gives up with OperationTimeoutError and stores none of its rows."""
    stop, sent = tmp_path / "stop", tmp_path / "sent"
    with Namespace(root, operation_timeout=1.0) as ns:
        ns.create_queue("q")
        child = subprocess.Popen(
            [sys.executable, "-c", STEADY_SENDER, ns.root, str(stop), str(sent)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            _waiting(lambda: ns.get_queue_runtime_properties("q").total_message_count > 0, "the core sender")()
            slow = sf.udf(lambda b: time.sleep(0.002) or b, "binary")  # 1,000 rows: each attempt outlasts the timeout
            with ns.get_queue_sender("q") as s, pytest.raises(OperationTimeoutError, match="operation timeout"):
                s.send_dataframe(numbered(1000).withColumn("body", slow(sf.col("body"))))
        finally:
            stop.touch()
            assert child.wait(timeout=120) == 0
        core = int(sent.read_text())
        assert DeltaTable(ns.broker.entity("queue", "q").table.uri).to_pyarrow_table().num_rows == core
        assert {m.message_id for m in peek_all(ns, "q")} == {f"c-{i}" for i in range(core)}


def test_a_steady_sender_of_the_same_ids_does_not_starve_a_deduplicating_dataframe_send(spark, ns, numbered, tmp_path):
    """A core sender keeps sending to every partition of a duplicate-detecting queue, some of the DataFrame's ids among
    its messages, while the DataFrame send runs. Before, each moved fence ran the whole Spark job again, which the
    steady sender made conflict again until the operation timeout. Now the moved partitions are renumbered without
    the repeated ids: the send lands, and every id is stored once, by whichever sender sent it first."""
    stop, sent = tmp_path / "stop", tmp_path / "sent"
    ns.create_queue("q", requires_duplicate_detection=True)
    entity = ns.broker.entity("queue", "q")
    child = subprocess.Popen(
        [sys.executable, "-c", STEADY_SENDER, ns.root, str(stop), str(sent)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    n = 2000
    try:
        _waiting(lambda: ns.get_queue_runtime_properties("q").total_message_count > 0, "the core sender")()
        slow = sf.udf(lambda b: time.sleep(0.001) or b, "binary")  # the job outlasts many of the core sender's commits
        df = numbered(n).withColumn("message_id", sf.concat(sf.lit("c-"), sf.col("id").cast("string")))
        with ns.get_queue_sender("q") as s:
            accepted = s.send_dataframe(df.withColumn("body", slow(sf.col("body"))))
    finally:
        stop.touch()
        assert child.wait(timeout=120) == 0
    core = int(sent.read_text())
    got = peek_all(ns, "q")
    assert Counter(m.message_id for m in got) == Counter(f"c-{i}" for i in range(max(n, core)))  # each id once
    from_frame = [m for m in got if not str(m).startswith("core-")]
    assert len(from_frame) == accepted and 0 < accepted < n  # the core sender sent some of the DataFrame's ids first
    rows = DeltaTable(entity.table.uri).to_pyarrow_table(columns=["partition_id", "sequence_number"]).to_pylist()
    by_partition: dict[int, set[int]] = {}
    for row in rows:
        by_partition.setdefault(row["partition_id"], set()).add(row["sequence_number"] & SEQUENCE_MASK)
    for p, counters in by_partition.items():
        assert sorted(counters) == list(range(1, len(counters) + 1)), p  # dense numbering


TOPIC_SENDER = """
import sys
from pathlib import Path
from sparkqueue import Message, Namespace
root, done = sys.argv[1], sys.argv[2]
with Namespace(root) as ns, ns.get_topic_sender("t") as s:
    s.send_messages(Message("core-X", message_id="X"))
Path(done).touch()
"""


def test_a_deduplicating_topic_send_whose_fence_moved_drops_only_the_repeated_message(spark, ns, tmp_path):
    """A core sender sends X to a duplicate-detecting topic while a DataFrame send of X, Z and A runs; subscription s2's
    rule action sets every copy's id to 'Z'. Renumbering the files dropped rows by their own id: Z and A's s2 copies
    (id 'Z', which the core sender's s2 copy carries too) went, and 1 was returned. The send now runs again and drops
    X only: every subscription gets Z and A, and 2 is returned."""
    from sparkqueue import SqlRuleAction, SqlRuleFilter

    ns.create_topic("t", requires_duplicate_detection=True, enable_partitioning=False)
    ns.create_subscription("t", "s1")
    ns.create_subscription("t", "s2")
    ns.delete_rule("t", "s2", "$Default")
    ns.create_rule("t", "s2", "z", filter=SqlRuleFilter("1 = 1"), action=SqlRuleAction("SET sys.MessageId = 'Z'"))
    done = tmp_path / "done"

    def body(i, b):  # the first evaluation of row 0 (after the driver read the fences) has the core sender send X
        if i == 0 and not done.exists():
            subprocess.run([sys.executable, "-c", TOPIC_SENDER, ns.root, str(done)], check=True, timeout=120)
        return b

    gated = sf.udf(body, "binary").asNondeterministic()
    rows = [(0, b"df-X", "X"), (1, b"df-Z", "Z"), (2, b"df-A", "A")]
    df = spark.createDataFrame(rows, "id long, body binary, message_id string").coalesce(1)
    with ns.get_topic_sender("t") as s:
        assert s.send_dataframe(df.withColumn("body", gated(sf.col("id"), sf.col("body")))) == 2
    for sub, ids in (("s1", {"core-X": "X", "df-Z": "Z", "df-A": "A"}), ("s2", {"core-X": "Z", "df-Z": "Z", "df-A": "Z"})):
        with ns.get_subscription_receiver("t", sub) as r:
            got = r.peek_messages(10, sequence_number=0)
        assert {str(m): m.message_id for m in got} == ids, sub


def test_small_stages_keep_duplicate_detection_and_dense_numbering(spark, ns, numbered):
    """A task stages its rows in many chunks: a repeat in a later chunk is still a duplicate, numbers stay dense."""
    ns.create_queue("q", requires_duplicate_detection=True)
    df = numbered(500)
    assert send_dataframe(ns.broker, "queue", "q", df.union(df.limit(100)), stage_rows=8) == 500
    assert send_dataframe(ns.broker, "queue", "q", numbered(600), stage_rows=8) == 100
    got = peek_all(ns, "q")
    assert sorted(m.message_id for m in got) == sorted(f"m-{i}" for i in range(600))
    by_partition = Counter(m.partition_id for m in got)
    for p, count in by_partition.items():
        counters = sorted(m.sequence_number & SEQUENCE_MASK for m in got if m.partition_id == p)
        assert counters == list(range(1, count + 1))


def test_a_forwarding_queue_forwards_what_a_dataframe_send_stored(spark, ns, numbered):
    ns.create_queue("dest")
    ns.create_queue("q", forward_to="dest")
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(200)) == 200
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    assert sorted(m.message_id for m in peek_all(ns, "dest")) == sorted(f"m-{i}" for i in range(200))


def test_on_an_object_store_a_dataframe_send_lands_and_staging_calls_are_refused_before_they_lock(spark, azurite, numbered):
    """Sends go through the Python tasks (obstore); calls whose files Spark must read back are refused up front.

    Before, each raised a raw ArrowInvalid ("Unrecognized filesystem type in URI: az://"), a receive after
    it had locked its messages.
    """
    from sparkqueue.errors import InvalidOperationError

    root = f"az://{azurite.create_container()}/ns"
    with Namespace(root, storage_options=azurite.storage_options()) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            assert s.send_dataframe(numbered(40)) == 40
        with ns.get_queue_receiver("q") as r:
            with pytest.raises(InvalidOperationError, match="not supported yet on an object-store namespace"):
                r.receive_dataframe(10)
            got = r.receive_messages(40, max_wait_time=2)
        assert len(got) == 40 and {m.delivery_count for m in got} == {0}  # nothing was locked by the refused call


def test_a_send_committing_into_a_deleted_queue_marks_its_table_deleted(ns):
    """Staged files committed after another process deleted and re-made the queue: TableDeletedError, and the table
    handle is marked deleted (the broker then looks the entity up again), as a core commit marks it. No Spark job."""
    import pyarrow as pa
    from pyspark.sql import Row

    from sparkqueue.message import send_settings
    from sparkqueue.spark.commit import Repeats
    from sparkqueue.spark.send import WRITE_COLUMNS, PartitionStager, SendPlan, commit_send, fence_bases
    from sparkqueue.spark.worker import EntityRef
    from sparkqueue.storage.log import TableDeletedError

    ns.create_queue("q")
    entity = ns.broker.entity("queue", "q")
    bases = fence_bases(entity.table, entity.partition_count)
    plan = SendPlan(
        EntityRef.of(ns.broker, "queue", "q"),
        send_settings(ns.broker.tier, entity.props),
        entity.partition_count,
        tuple(range(entity.partition_count)),
        bases=bases,
    )
    columns = {c: pa.nulls(2, pa.string()) for c in WRITE_COLUMNS}
    columns |= {
        "body": pa.array([b"x", b"y"]),
        "message_id": pa.array(["a", "b"]),
        "time_to_live_ms": pa.nulls(2, pa.int64()),
        "scheduled_enqueue_time_utc": pa.nulls(2, pa.timestamp("us", tz="UTC")),
        "size_in_bytes": pa.array([2, 2], pa.int32()),
        "_qp": pa.array([0, 0], pa.int32()),
    }
    stager = PartitionStager(plan)
    stager.add(pa.table(columns))
    stager.finish()
    results = [Row(**r) for r in stager.summary().to_pylist()]
    with Namespace(ns.root) as other:
        other.delete_queue("q")
        other.create_queue("q")
    with pytest.raises(TableDeletedError):
        commit_send(entity.table, results, bases, entity.deadline(), repeats=Repeats.NONE)
    assert entity.table.deleted
