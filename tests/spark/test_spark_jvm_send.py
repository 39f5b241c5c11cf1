"""DataFrame sends written by Spark's own Parquet writer (spark/jvm_send.py): stored as the engine stores, one commit."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from procs import peek_all
from pyspark.sql import functions as sf

from sparkqueue import Message, Namespace
from sparkqueue.broker import core
from sparkqueue.errors import QuotaExceededError
from sparkqueue.spark import jvm_send
from sparkqueue.spark.jvm_send import FILE_ROWS, SPLIT_BYTES, WRITE_OPTIONS, split_oversized
from sparkqueue.storage.files import FILE_SCHEMA, MAX_FILE_BYTES, MAX_FILE_ROWS
from sparkqueue.storage.log import AddFile
from sparkqueue.storage.table import SEQUENCE_MASK, EntityTable, partition_of

pytestmark = pytest.mark.spark

# Columns that differ between two sends of one message by design: which sequence number, which id.
VARYING = {"sequence_number", "message_id"}  # a scheduled message's times are its schedule's: the same on both paths


def stored_rows(table_dir: str) -> list[dict]:
    return DeltaTable(table_dir).to_pyarrow_table().sort_by("sequence_number").to_pylist()


@pytest.mark.parametrize("preserve_order", [None, True], ids=["spark-writer", "python-tasks"])
def test_a_message_sent_through_spark_is_stored_as_send_messages_stores_it(spark, ns, preserve_order):
    ns.create_queue("spark", enable_partitioning=False, default_message_time_to_live=timedelta(hours=1))
    ns.create_queue("core", enable_partitioning=False, default_message_time_to_live=timedelta(hours=1))
    at = datetime.now(UTC) + timedelta(minutes=5)
    fields = {
        "correlation_id": "c1",
        "subject": "s",
        "to": "t",
        "reply_to": "r",
        "reply_to_session_id": "rs",
        "content_type": "text/plain",
        "time_to_live": timedelta(minutes=30),
        "scheduled_enqueue_time_utc": at,
    }
    props = {"a": "x", "n": 3}
    df = spark.createDataFrame(
        [(b"hello", "id-1", json.dumps(props), 1800.0, at, *[fields[k] for k in list(fields)[:6]])],
        "body binary, message_id string, application_properties string, time_to_live double, "
        "scheduled_enqueue_time_utc timestamp, correlation_id string, subject string, to string, reply_to string, "
        "reply_to_session_id string, content_type string",
    )
    with ns.get_queue_sender("spark") as s:
        assert s.send_dataframe(df, preserve_order=preserve_order) == 1
    with ns.get_queue_sender("core") as s:
        s.send_messages(Message(b"hello", message_id="id-2", application_properties=props, **fields))
    (a,) = stored_rows(ns.broker.entity("queue", "spark").table.uri)
    (b,) = stored_rows(ns.broker.entity("queue", "core").table.uri)
    assert {k: v for k, v in a.items() if k not in VARYING} == {k: v for k, v in b.items() if k not in VARYING}
    assert a["expires_at_utc"] - a["available_at_utc"] == b["expires_at_utc"] - b["available_at_utc"]
    assert a["available_at_utc"] == at.replace(microsecond=at.microsecond) == b["available_at_utc"]
    # Same file layout: the engine's columns and types, LZ4, and Delta statistics for the same columns.
    table_dir = ns.broker.entity("queue", "spark").table.uri
    (path,) = DeltaTable(table_dir).file_uris()
    assert "/partition_id=0/" in path
    meta = pq.read_metadata(path)
    assert meta.schema.to_arrow_schema().remove_metadata().names == FILE_SCHEMA.names
    assert pq.read_table(path).schema.field("enqueued_time_utc").type == FILE_SCHEMA.field("enqueued_time_utc").type
    assert meta.row_group(0).column(0).compression.upper().startswith("LZ4")
    spark_stats, core_stats = add_stats(table_dir), add_stats(ns.broker.entity("queue", "core").table.uri)
    assert spark_stats["numRecords"] == 1
    for key in ("minValues", "maxValues", "nullCount"):
        assert set(spark_stats[key]) == set(core_stats[key])
    for key in ("minValues", "maxValues"):  # the same bounds, timestamps in ms, but for what differs by design
        assert {k: v for k, v in spark_stats[key].items() if k not in VARYING} == {
            k: v for k, v in core_stats[key].items() if k not in VARYING
        }
    assert spark_stats["nullCount"] == core_stats["nullCount"]


def add_stats(table_dir: str) -> dict:
    """The Delta statistics of the table's one add action."""
    (stats,) = [
        json.loads(json.loads(line)["add"]["stats"])
        for f in sorted(Path(table_dir, "_delta_log").glob("*.json"))
        for line in f.read_text().splitlines()
        if '"add"' in line
    ]
    return stats


def test_a_large_send_is_numbered_densely_in_files_of_one_partition(spark, ns, numbered):
    ns.create_queue("q")
    n = 3 * 6 * FILE_ROWS  # 3 input partitions, each owning 5 or 6 queue partitions, fill a block in each
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(n, partitions=3, body_bytes=16)) == n
    table_dir = ns.broker.entity("queue", "q").table.uri
    rows = DeltaTable(table_dir).to_pyarrow_table(columns=["partition_id", "sequence_number", "message_id"]).to_pylist()
    assert sorted(r["message_id"] for r in rows) == sorted(f"m-{i}" for i in range(n))
    by_partition: dict[int, list[tuple[int, int]]] = {}
    for r in rows:
        assert partition_of(r["sequence_number"]) == r["partition_id"]
        by_partition.setdefault(r["partition_id"], []).append((r["sequence_number"] & SEQUENCE_MASK, int(r["message_id"][2:])))
    assert len(by_partition) == 16
    for got in by_partition.values():
        got.sort()
        assert [c for c, _ in got] == list(range(1, len(got) + 1))
        ids = [i for _, i in got]
        assert ids == sorted(ids)  # one input partition owns the queue partition and keeps its order
    files = list(Path(table_dir).glob("partition_id=*/*.parquet"))
    assert all(pq.read_metadata(f).num_rows <= FILE_ROWS for f in files)
    assert not list(Path(table_dir).glob("spark-send/*"))  # staging directories are gone
    with ns.get_queue_receiver("q") as r:
        assert len(r.receive_messages(10)) > 0


def test_files_of_a_send_hold_up_to_4000_rows_and_the_first_lock_splits_one(spark, ns, numbered):
    """Spark's writer starts a file per 4,000 rows; a lock in one rewrites it as files of at most 1,000 rows."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(5000, partitions=1, body_bytes=16)) == 5000
    table_dir = ns.broker.entity("queue", "q").table.uri

    def sizes() -> list[int]:
        return sorted(a["num_records"] for a in pa.table(DeltaTable(table_dir).get_add_actions(flatten=True)).to_pylist())

    assert FILE_ROWS == 4000 and sizes() == [1000, 4000]
    with ns.get_queue_receiver("q") as r:
        got = r.receive_messages(10)
        assert [m.message_id for m in got] == [f"m-{i}" for i in range(10)]
        assert max(sizes()) <= MAX_FILE_ROWS and sum(sizes()) == 5000
        r.complete_messages(got)


def test_a_send_of_large_bodies_commits_files_of_about_8_mb(spark, ns):
    """Spark's writer rolls files by rows only; a file of large bodies past SPLIT_BYTES is cut to the engine's bound."""
    ns.create_queue("q", enable_partitioning=False)
    n, size = 200, 200 * 1024  # one block: about 40 MB of incompressible bodies
    df = spark.range(0, n, 1, 1).select(sf.randstr(size, 7).cast("binary").alias("body"), sf.col("id"))
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == n
    table_dir = ns.broker.entity("queue", "q").table.uri
    adds = pa.table(DeltaTable(table_dir).get_add_actions(flatten=True)).to_pylist()
    assert len(adds) > 1 and max(a["size_bytes"] for a in adds) <= 2 * MAX_FILE_BYTES
    rows = DeltaTable(table_dir).to_pyarrow_table(columns=["sequence_number", "size_in_bytes"]).sort_by("sequence_number")
    assert [s & SEQUENCE_MASK for s in rows.column("sequence_number").to_pylist()] == list(range(1, n + 1))
    assert not list(Path(table_dir).glob("spark-send/*"))
    assert sum(1 for _ in Path(table_dir).glob("partition_id=*/*.parquet")) == len(adds)  # the oversized file is gone


def test_the_send_options_make_spark_close_row_groups_of_about_8_mb(spark, tmp_path):
    """What lets split_oversized read a file of large bodies one row group at a time (a wrong option key would do nothing)."""
    df = spark.range(0, 120, 1, 1).select(sf.randstr(200 * 1024, 3).cast("binary").alias("body"))
    df.write.options(**WRITE_OPTIONS).parquet(str(tmp_path / "out"))
    (f,) = (tmp_path / "out").glob("*.parquet")
    meta = pq.read_metadata(f)
    assert meta.num_row_groups >= 2
    assert all(meta.row_group(g).total_byte_size <= MAX_FILE_BYTES + 10 * 200 * 1024 for g in range(meta.num_row_groups))
    small = spark.range(0, 4000, 1, 1).select(sf.randstr(1024, 3).cast("binary").alias("body"))
    small.write.options(**WRITE_OPTIONS).parquet(str(tmp_path / "small"))
    (f,) = (tmp_path / "small").glob("*.parquet")
    assert pq.read_metadata(f).num_row_groups == 1  # 4,000 rows of 1 KB: one row group, as before


def test_an_oversized_file_is_split_row_group_by_row_group_keeping_rows_and_order(spark, ns, numbered):
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(2500, partitions=1, body_bytes=16)) == 2500
    table = ns.broker.entity("queue", "q").table
    rows = DeltaTable(table.uri).to_pyarrow_table(columns=FILE_SCHEMA.names).sort_by("sequence_number")
    staged = Path(table.uri) / "partition_id=0" / "oversized.parquet"
    pq.write_table(rows, staged, row_group_size=700)  # 4 row groups, as Spark's writer leaves a file of large bodies
    out = split_oversized(table, [AddFile("partition_id=0/oversized.parquet", {"partition_id": "0"}, SPLIT_BYTES + 1, "{}")])
    assert not staged.exists()
    pieces = [pq.read_table(Path(table.uri) / a.path) for a in out]
    assert all(t.num_rows <= MAX_FILE_ROWS for t in pieces)
    got = pa.concat_tables(pieces).select(["sequence_number", "message_id"]).to_pylist()
    assert got == rows.select(["sequence_number", "message_id"]).to_pylist()


def test_input_partitions_without_rows_add_no_files(spark, ns):
    """Spark writes an empty file for a task without rows; the send commits only the files that hold rows."""
    ns.create_queue("q")
    df = spark.range(0, 40, 1, 4).where("id < 3").selectExpr("cast(id as string) as body")
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == 3
    table_dir = ns.broker.entity("queue", "q").table.uri
    adds = pa.table(DeltaTable(table_dir).get_add_actions(flatten=True)).to_pylist()
    assert sum(a["num_records"] for a in adds) == 3 and all(a["num_records"] > 0 for a in adds)
    assert sorted(r["body"] for r in stored_rows(table_dir)) == [b"0", b"1", b"2"]
    assert not list(Path(table_dir).glob("spark-send/*"))


def small_quota(ns, monkeypatch: pytest.MonkeyPatch) -> EntityTable:
    """Queue "q" with a 1 MiB quota per partition (the smallest setting, 1 GB, is too much for a test): its table.

    The quota is set on the cached entity, which then must not be refreshed from the catalog.
    """
    ns.create_queue("q", enable_partitioning=False)
    monkeypatch.setattr(core, "PROPERTIES_TTL_S", 3600.0)
    table = ns.broker.entity("queue", "q").table
    table.max_partition_bytes = 1 << 20
    return table


def test_a_send_past_the_quota_fails_and_stores_nothing(spark, ns, numbered, monkeypatch):
    small_quota(ns, monkeypatch)
    with ns.get_queue_sender("q") as s, pytest.raises(QuotaExceededError, match="nothing was stored"):
        s.send_dataframe(numbered(2000, body_bytes=1024))
    table_dir = ns.broker.entity("queue", "q").table.uri
    assert DeltaTable(table_dir).to_pyarrow_table().num_rows == 0
    assert not [p for p in Path(table_dir).rglob("*.parquet") if "_delta_log" not in p.parts]


def test_the_quota_is_checked_exactly_where_the_footers_bound_is_not_enough(spark, ns, monkeypatch):
    """Message bytes come from the files' footers as a bound; a partition the bound puts over its quota is summed exactly."""
    table = small_quota(ns, monkeypatch)
    # 1,000 bodies of 1,010 bytes: 1,010,000 message bytes fit 1 MiB; with each value's length prefix and the
    # generated message ids, the footers' bound (about 1,054,000) does not. (The quota counts stored bytes, and
    # these bodies compress to little: the stored first send leaves room for the second's exact sum to decide.)
    body = sf.repeat(sf.lit("x"), 1010).alias("body")
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(spark.range(0, 1000, 1, 2).select(body)) == 1000
        used = table.partition_bytes(table.snapshot(), 0)
        with pytest.raises(QuotaExceededError, match=f"holds {used} bytes; adding 1050400 would pass"):
            s.send_dataframe(spark.range(0, 1040, 1, 2).select(body))  # refused on the exact sum
    assert ns.get_queue_runtime_properties("q").total_message_count == 1000


def test_a_send_renumbered_after_a_concurrent_send_checks_the_quota_again(spark, ns, monkeypatch):
    """Another sender fills the partition between the send's quota check and its commit: the renumbered send is refused."""
    small_quota(ns, monkeypatch)
    place = jvm_send.place

    def place_after_a_concurrent_send(*args, **kwargs):
        with Namespace(ns.root) as other, other.get_queue_sender("q") as s:  # another handle: its commit moves the fence
            s.send_messages([Message(os.urandom(2000), message_id=f"c-{i}") for i in range(48)])  # over 96 KB stored
        monkeypatch.setattr(jvm_send, "place", place)
        return place(*args, **kwargs)

    monkeypatch.setattr(jvm_send, "place", place_after_a_concurrent_send)
    # 980 bodies of 1,010 bytes (989,800): the footers' bound (about 1,036,000) fits an empty 1 MiB partition,
    # but not once the 48 files of the other sender are in it.
    df = spark.range(0, 980, 1, 2).select(sf.repeat(sf.lit("x"), 1010).alias("body"))
    with ns.get_queue_sender("q") as s, pytest.raises(QuotaExceededError, match="adding 989800 would pass"):
        s.send_dataframe(df)
    with ns.get_queue_receiver("q") as r:
        assert sorted(m.message_id for m in peek_all(r)) == sorted(f"c-{i}" for i in range(48))
    table_dir = ns.broker.entity("queue", "q").table.uri
    live = {u.rsplit("/", 1)[-1] for u in DeltaTable(table_dir).file_uris()}
    assert {f.name for f in Path(table_dir).glob("partition_id=*/*.parquet")} == live  # the send's files are gone


@pytest.mark.parametrize("preserve_order", [None, True], ids=["spark-writer", "python-tasks"])
def test_a_time_to_live_past_the_latest_instant_never_expires_on_every_path(spark, ns, preserve_order):
    """A TTL whose expiry would lie past year 9999 is stored as no expiry, by Spark as by send_messages."""
    ns.create_queue("q", enable_partitioning=False)
    ttl = timedelta(days=3_000_000)  # about 8,200 years
    df = spark.createDataFrame([(b"x", ttl.total_seconds())], "body binary, time_to_live double")
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df, preserve_order=preserve_order) == 1
        s.send_messages(Message(b"y", time_to_live=ttl))
    rows = stored_rows(ns.broker.entity("queue", "q").table.uri)
    assert [(r["body"], r["expires_at_utc"], r["time_to_live_ms"]) for r in rows] == [
        (b"x", None, ttl // timedelta(milliseconds=1)),
        (b"y", None, ttl // timedelta(milliseconds=1)),
    ]


TIMESTAMP_TYPE = "spark.sql.parquet.outputTimestampType"


@pytest.fixture
def int96_session(spark):
    """The shared session with a user's own Parquet timestamp type (INT96), put back as it was afterwards."""
    before = spark.conf.get(TIMESTAMP_TYPE, None)
    spark.conf.set(TIMESTAMP_TYPE, "INT96")
    yield spark
    if before is None:
        spark.conf.unset(TIMESTAMP_TYPE)
    else:
        spark.conf.set(TIMESTAMP_TYPE, before)


def test_overlapping_writes_of_one_session_give_the_user_back_their_timestamp_type(int96_session):
    """Where Spark takes the type from the session (before 4.3): the first write sets it, the last one restores the user's."""
    spark = int96_session
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[str | None] = []

    def first() -> None:
        with jvm_send._conf(spark, jvm_send.WRITE_CONF):
            first_in.set()
            second_in.wait(30)
        first_out.set()

    def second() -> None:
        first_in.wait(30)
        with jvm_send._conf(spark, jvm_send.WRITE_CONF):
            second_in.set()
            first_out.wait(30)
            seen.append(spark.conf.get(TIMESTAMP_TYPE, None))  # the first ended: this write still needs the setting

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen == ["TIMESTAMP_MICROS"]
    assert spark.conf.get(TIMESTAMP_TYPE, None) == "INT96"


def test_concurrent_sends_write_micros_timestamps_and_leave_the_sessions_type_alone(int96_session, ns):
    """Two threads of one session sending at once: engine files (INT64 UTC microseconds), the user's setting kept."""
    spark = int96_session
    ns.create_queue("q")
    errors: list[BaseException] = []

    def sends(t: int) -> None:
        try:
            with ns.get_queue_sender("q") as s:
                for i in range(4):
                    s.send_dataframe(spark.range(0, 50, 1, 2).select(sf.lit(f"t{t}-{i}").alias("body")))
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=sends, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    seen = set()
    while any(t.is_alive() for t in threads):
        seen.add(spark.conf.get(TIMESTAMP_TYPE, None))
    assert not errors
    assert spark.conf.get(TIMESTAMP_TYPE, None) == "INT96"
    if jvm_send.options_win(spark):  # the type is the write's own: the session never changes, even during the sends
        assert seen == {"INT96"}
    assert ns.get_queue_runtime_properties("q").total_message_count == 400
    table = ns.broker.entity("queue", "q").table.uri.removeprefix("file://")
    files = list(Path(table).glob("partition_id=*/*.parquet"))
    assert files
    for f in files:
        schema = pq.ParquetFile(f).schema_arrow
        assert schema.field("enqueued_time_utc").type == pa.timestamp("us", tz="UTC"), f
