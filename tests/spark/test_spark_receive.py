"""DataFrame receive and settle (docs/semantics.md §12 with §5): locked once, read many times, settled with per-row statuses."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta
from pathlib import Path

import procs
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as sf

from sparkqueue import ReceiveMode, SubQueue
from sparkqueue.errors import InvalidOperationError
from sparkqueue.model.ids import lock_tokens, sequences_of_tokens
from sparkqueue.spark import RECEIVED_SCHEMA, release
from sparkqueue.spark.settle import first_occurrences

pytestmark = pytest.mark.spark
LONG_LOCK = timedelta(minutes=5)  # the longest allowed: a busy CI machine must not expire locks mid-test


def statuses(result) -> dict[str, int]:
    """Count of each status in a settle result."""
    return {r.status: r["count"] for r in result.groupBy("status").count().collect()}


def test_a_receive_whose_spark_job_fails_after_some_tasks_locked_gives_their_messages_back(spark, ns, numbered):
    """The lock job is cancelled once a task has committed locks: the call raises, and nothing stays locked.

    Before, only a failure to read the staged result gave the locks back; messages locked by the
    tasks that had committed stayed hidden until their lock expired (and, received and deleted,
    went unreported).
    """
    ns.create_queue("q", lock_duration=timedelta(minutes=5))
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(numbered(40_000, partitions=4)) == 40_000
    staged = Path(ns.root) / "_spark_staging" / "receive"

    def cancel_once_locked() -> None:
        give_up = time.monotonic() + 120  # a bound on a hang, not a timed assertion
        while not any(staged.rglob("part-*.parquet")) and time.monotonic() < give_up:
            time.sleep(0.005)
        spark.sparkContext.cancelAllJobs()

    canceller = threading.Thread(target=cancel_once_locked)
    canceller.start()
    with ns.get_queue_receiver("q") as r, pytest.raises(Exception, match="cancel"):
        r.receive_dataframe(40_000)
    canceller.join()
    # A cancelled Python task may go on committing locks for a moment (Spark kills its worker after a
    # timeout): those the call cannot know of stay locked. Count every lock the job took once it is quiet.
    locked = -1
    while locked != (locked := sum(pq.read_metadata(f).num_rows for f in staged.rglob("part-*.parquet"))):
        time.sleep(3)
    with ns.get_queue_receiver("q") as r:
        receivable = len(procs.drain_all(r, batch=5_000))
    assert locked > 0 and receivable > 40_000 - locked  # the locks taken before the call failed were given back


def test_received_dataframe_is_locked_once_and_reads_the_same_rows_again(spark, ns, numbered):
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(300))
    with ns.get_queue_receiver("q") as r:
        got = r.receive_dataframe(200)
        assert got.schema == RECEIVED_SCHEMA
        first = got.orderBy("sequence_number").collect()
        assert len(first) == 200 and got.count() == 200
        plain = got.drop("application_properties")  # maps cannot be sorted
        assert_df_equality(plain, plain.select(*plain.columns), ignore_row_order=True)  # evaluating again: same rows
        assert got.orderBy("sequence_number").collect() == first
        assert {row.delivery_count for row in first} == {0}
        assert all(row.lock_token and row.locked_until_utc for row in first)
        assert all(row.sequence_number >> 48 == row.partition_id for row in first)
        rest = r.receive_dataframe(500)  # the first 200 stay locked: only the other 100 come
        assert rest.count() == 100
        assert not {x.sequence_number for x in rest.collect()} & {x.sequence_number for x in first}
        # The data source sees the locks the DataFrame holds.
        cols = ["sequence_number", "message_id", "body", "lock_token", "delivery_count", "partition_id"]
        shown = spark.read.format("sparkqueue").option("namespace", ns.root).load("q").where("lock_token IS NOT NULL")
        assert_df_equality(got.union(rest).select(*cols), shown.select(*cols), ignore_row_order=True, ignore_nullable=True)
        assert statuses(r.complete_dataframe(got.union(rest))) == {"ok": 300}
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    assert release(got) == 1


def test_settling_the_received_dataframe_as_returned_matches_settling_a_copy_of_it(spark, ns, numbered):
    """The returned DataFrame is settled from its staged files (no scan and shuffle of its tokens); a derived one by Spark."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(3000, partitions=6))
    with ns.get_queue_receiver("q") as r:
        got, other = r.receive_dataframe(1500), r.receive_dataframe(1500)
        tokens = {x.lock_token for x in got.select("lock_token").collect()}
        assert len(tokens) == 1500 and len({x.partition_id for x in got.select("partition_id").collect()}) > 2
        direct = {x.lock_token: x.status for x in r.complete_dataframe(got).collect()}
        assert direct == dict.fromkeys(tokens, "ok")
        assert {x.status for x in r.complete_dataframe(got).collect()} == {"lock_lost"}  # settled once only
        copy = other.select("*")
        assert statuses(r.abandon_dataframe(copy)) == {"ok": 1500}
    assert ns.get_queue_runtime_properties("q").active_message_count == 1500


def test_only_the_locks_of_a_live_peek_lock_receive_are_settled_from_its_staged_files(spark, ns, numbered):
    """A released receive, or one of RECEIVE_AND_DELETE, goes through Spark's path and reports as it always did."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(40))
    with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as d:
        removed = d.receive_dataframe(20)
        assert removed.count() == 20
    with ns.get_queue_receiver("q") as r:
        assert statuses(r.complete_dataframe(removed)) == {"lock_lost": 20}  # no lock to settle: one status each
        got = r.receive_dataframe(20)
        assert got.count() == 20
        assert release(got) == 1
        with pytest.raises(InvalidOperationError, match="staged messages that are gone"):
            r.complete_dataframe(got)
    assert ns.get_queue_runtime_properties("q").total_message_count == 20  # the released receive settled nothing


def test_received_dataframe_outlives_a_vacuum_of_the_table_until_released(spark, ns, numbered):
    """Locked messages are staged as links to the lock commit's file: settling and vacuuming leave the DataFrame whole."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    props = sf.create_map(sf.lit("qty"), sf.col("id").cast("string"), sf.lit("tag"), sf.lit("t")).alias("application_properties")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(500).select("body", "message_id", props))
    with ns.get_queue_receiver("q") as r:
        got = r.receive_dataframe(500)
        before = sorted((x.sequence_number, x.message_id, x.body, x.lock_token) for x in got.collect())
        assert len(before) == 500
        assert statuses(r.complete_dataframe(got)) == {"ok": 500}
    reports = ns.run_maintenance(vacuum_retention=timedelta(0))
    assert sum(rep.vacuumed_files for rep in reports.values()) > 0  # the files that held the messages are gone
    after = sorted((x.sequence_number, x.message_id, x.body, x.lock_token) for x in got.collect())
    assert after == before
    assert {x.message_id: x.application_properties for x in got.collect()}["m-7"] == {"qty": "7", "tag": "t"}
    assert release(got) == 1
    with pytest.raises(Exception, match=r"(?i)not exist|PATH_NOT_FOUND|FileNotFound"):
        got.collect()


def test_settling_a_released_dataframe_and_releasing_another_dataframe_are_clear_errors(spark, ns, numbered, tmp_path):
    """Settling a received DataFrame after release() raised a raw Py4JJavaError with a Java stack; release() of a
    DataFrame reading a user's Parquet raised a builtin ValueError, and receive_dataframe(spark="x") an
    AttributeError. Each is an InvalidOperationError now, and nothing changes."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(5).select("body"))
        with pytest.raises(InvalidOperationError, match="preserve_order must be a bool"):
            s.send_dataframe(numbered(5).select("body"), preserve_order="no")
    spark.range(3).write.parquet(str(tmp_path / "user"))
    with ns.get_queue_receiver("q") as r:
        with pytest.raises(InvalidOperationError, match="spark must be a SparkSession"):
            r.receive_dataframe(5, spark="x")  # type: ignore[arg-type]
        got = r.receive_dataframe(5)
        assert release(got) == 1
        for df in (got, got.where("delivery_count >= 0")):
            with pytest.raises(InvalidOperationError, match="staged messages that are gone"):
                r.complete_dataframe(df)
        with pytest.raises(InvalidOperationError, match="takes a DataFrame that receive_dataframe"):
            release(spark.read.parquet(str(tmp_path / "user")))
        assert release(spark.range(3)) == 0  # reads no file: nothing to release (as a derived empty receive)
        assert release(r.receive_dataframe(5).select("body")) == 0  # an empty receive, derived: no error either
    assert (tmp_path / "user").exists()
    assert ns.get_queue_runtime_properties("q").total_message_count == 5  # nothing was completed ...
    with ns.get_queue_receiver("q") as r:
        assert r.receive_messages(5, max_wait_time=0.5) == []  # ... nor given back: still locked


def test_received_properties_map_as_the_data_source_shows_them(spark, ns):
    """Typed application properties arrive as map<string,string>: strings as they are, numbers and booleans as JSON text."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    props = '{"n": 5, "f": 1.5, "b": true, "s": "x y", "z": null}'
    df = spark.createDataFrame([("a", props)], "body string, application_properties string")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(df)
    shown = spark.read.format("sparkqueue").option("namespace", ns.root).load("q").collect()[0].application_properties
    with ns.get_queue_receiver("q") as r:
        got = r.receive_dataframe(1).collect()[0].application_properties
    assert got == shown == {"n": "5", "f": "1.5", "b": "true", "s": "x y", "z": None}


def test_100k_messages_sent_then_received_and_completed_exactly_once(spark, ns):
    ns.create_queue("q", lock_duration=LONG_LOCK)
    n = 100_000
    df = spark.range(0, n, 1, 2).select(
        sf.concat(sf.lit("m-"), sf.col("id").cast("string")).alias("message_id"),
        sf.rpad(sf.col("id").cast("string"), 100, ".").alias("body"),
    )
    with ns.get_queue_sender("q") as s:
        assert s.send_dataframe(df) == n
    seen: list[int] = []
    ids: list[str] = []
    with ns.get_queue_receiver("q") as r:
        while True:
            got = r.receive_dataframe(40_000)
            rows = got.select("sequence_number", "message_id").collect()
            if not rows:
                break
            seen += [x.sequence_number for x in rows]
            ids += [x.message_id for x in rows]
            assert statuses(r.complete_dataframe(got)) == {"ok": len(rows)}
            release(got)
    assert len(seen) == n and len(set(seen)) == n
    assert sorted(ids) == sorted(f"m-{i}" for i in range(n))
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_two_concurrent_dataframe_consumers_never_share_a_message(spark, ns, numbered):
    ns.create_queue("q", lock_duration=LONG_LOCK)
    n = 6000
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(n))
    taken: dict[str, list[int]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def consume(name: str) -> None:
        try:
            with ns.get_queue_receiver("q") as r:
                while True:
                    got = r.receive_dataframe(1500)
                    seqs = [x.sequence_number for x in got.select("sequence_number").collect()]
                    if not seqs:
                        return
                    taken[name] += seqs
                    assert statuses(r.complete_dataframe(got)) == {"ok": len(seqs)}
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(name,)) for name in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not set(taken["a"]) & set(taken["b"])
    assert len(taken["a"]) + len(taken["b"]) == n
    assert taken["a"] and taken["b"]


@pytest.mark.slow  # ~20 s on the Spark worker, which bounds the default run's time; CI runs it (SPARKQUEUE_SLOW=1)
def test_dataframe_receives_and_core_receiver_processes_never_share_a_message(spark, ns, root, numbered):
    """Spark lock tasks racing 2 core receiver processes over the same queue: each message is taken by one side, once."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    n = 4000
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(n))
    ctx = mp.get_context("spawn")
    barrier, results, done = ctx.Barrier(3), ctx.Queue(), ctx.Value("i", 0)
    children = [
        ctx.Process(target=procs.receive_and_complete, args=(root, "q", barrier, done, n, results, i), daemon=True)
        for i in range(2)
    ]
    for c in children:
        c.start()
    spark_ids: list[str] = []
    try:
        barrier.wait(timeout=120)
        with ns.get_queue_receiver("q") as r:
            give_up = time.monotonic() + 180
            while done.value < n and time.monotonic() < give_up:
                got = r.receive_dataframe(400)
                ids = [x.message_id for x in got.select("message_id").collect()]
                if ids:
                    assert statuses(r.complete_dataframe(got)) == {"ok": len(ids)}
                    spark_ids += ids
                    with done.get_lock():
                        done.value += len(ids)
                release(got)
        reports = [results.get(timeout=120) for _ in children]
    finally:
        for c in children:
            c.join(timeout=30)
            if c.is_alive():
                c.kill()
    assert [c.exitcode for c in children] == [0, 0]
    core_ids = [mid for _, delivered, _, _ in reports for mid, _ in delivered]
    assert sum(lost for *_, lost in reports) == 0
    with ns.get_queue_receiver("q") as r:
        assert r.peek_messages(10, sequence_number=0) == []
    assert len(core_ids) == len(set(core_ids)), "a core receiver got a message twice"
    assert len(spark_ids) == len(set(spark_ids)), "Spark received a message twice"
    assert not set(core_ids) & set(spark_ids), "a message was taken by both sides"
    assert sorted(core_ids + spark_ids) == sorted(f"m-{i}" for i in range(n))
    assert spark_ids and core_ids, "both sides must have taken messages"


def test_stale_and_foreign_tokens_are_reported_per_row(spark, ns, numbered):
    ns.create_queue("q", enable_partitioning=False, lock_duration=timedelta(seconds=2))  # one partition: one lock task
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(40))
    with ns.get_queue_receiver("q") as r:
        old = r.receive_dataframe(40)
        assert old.count() == 40
        props = ns.get_queue("q")
        props.lock_duration = LONG_LOCK  # later deliveries keep their locks however slow the machine is
        ns.update_queue(props)
        time.sleep(2.5)  # the first locks lapse (and every process's cached settings are renewed) ...
        new = r.receive_dataframe(40)  # ... and a later delivery supersedes them
        assert {x.delivery_count for x in new.collect()} == {1}
        stale = r.complete_dataframe(old)
        assert stale.count() == 40 and statuses(stale) == {"lock_lost": 40}
        junk = spark.createDataFrame([("not-a-token",), (None,), ("00000000-0000-0001-0000-000000000000",)], "lock_token string")
        result = {row.lock_token: row.status for row in r.complete_dataframe(junk.union(new.select("lock_token"))).collect()}
        assert len(result) == 43
        assert result["not-a-token"] == result[None] == result["00000000-0000-0001-0000-000000000000"] == "lock_lost"
        assert sum(v == "ok" for v in result.values()) == 40
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_abandon_defer_and_dead_letter_by_dataframe(spark, ns, numbered):
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(30).withColumn("partition_key", sf.lit("one")))  # one partition: sequence order = id order
    with ns.get_queue_receiver("q") as r:
        got = r.receive_dataframe(30).withColumn("i", sf.expr("cast(substring(message_id, 3) as int)"))
        assert statuses(r.abandon_dataframe(got.where("i < 10"))) == {"ok": 10}
        assert statuses(r.defer_dataframe(got.where("i >= 10 AND i < 20"))) == {"ok": 10}
        dead = got.where("i >= 20").withColumn(
            "dead_letter_reason", sf.when(sf.col("i") % 2 == 0, sf.concat(sf.lit("even-"), sf.col("i").cast("string")))
        )
        assert statuses(r.dead_letter_dataframe(dead, reason="Fallback", error_description="by test")) == {"ok": 10}
        again = r.receive_dataframe(30).collect()
        assert sorted(x.message_id for x in again) == sorted(f"m-{i}" for i in range(10))
        assert {x.delivery_count for x in again} == {1}
        deferred = sorted(x.sequence_number for x in got.where("i >= 10 AND i < 20").collect())
        assert len(r.receive_deferred_messages(deferred)) == 10
    rp = ns.get_queue_runtime_properties("q")
    assert (rp.deferred_message_count, rp.dead_letter_message_count) == (10, 10)
    dlq = spark.read.format("sparkqueue").option("namespace", ns.root).option("sub_queue", "deadletter").load("q")
    reasons = {x.message_id: (x.dead_letter_reason, x.dead_letter_error_description) for x in dlq.collect()}
    assert reasons["m-20"] == ("even-20", "by test") and reasons["m-21"] == ("Fallback", "by test")
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as d:
        assert statuses(d.complete_dataframe(d.receive_dataframe(10))) == {"ok": 10}


def test_dead_letter_texts_past_4096_characters_are_refused_as_dead_letter_message_refuses_them(spark, ns, numbered):
    """By argument or by a row's column: InvalidOperationError before anything is settled; 4,096 characters are kept."""
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(20))  # spread over the queue's partitions: a settle task per partition
    with ns.get_queue_receiver("q") as r:
        got = r.receive_dataframe(20).cache()
        assert got.count() == 20
        with pytest.raises(InvalidOperationError, match="reason is 4097 characters long; at most 4096 are allowed"):
            r.dead_letter_dataframe(got, reason="r" * 4097)
        with pytest.raises(InvalidOperationError, match="error_description is 5000 characters long"):
            r.dead_letter_dataframe(got, error_description="d" * 5000)
        one_long = sf.when(sf.col("message_id") == "m-7", sf.repeat(sf.lit("d"), 5000)).otherwise(sf.lit("short"))
        with pytest.raises(InvalidOperationError, match="dead_letter_error_description is 5000 characters long"):
            r.dead_letter_dataframe(got.withColumn("dead_letter_error_description", one_long), reason="why")
        with pytest.raises(InvalidOperationError, match="dead_letter_reason is 4097 characters long"):
            r.dead_letter_dataframe(got.withColumn("dead_letter_reason", sf.repeat(sf.lit("r"), 4097)))
        assert ns.get_queue_runtime_properties("q").dead_letter_message_count == 0  # nothing was settled ...
        at_limit = got.withColumn("dead_letter_reason", sf.repeat(sf.lit("r"), 4096))
        assert statuses(r.dead_letter_dataframe(at_limit, error_description="d" * 4096)) == {"ok": 20}  # ... every lock held
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as d:
        stored = {(len(m.dead_letter_reason or ""), len(m.dead_letter_error_description or "")) for m in d.peek_messages(30)}
    assert stored == {(4096, 4096)}


def test_gathers_across_partitions_and_never_takes_more_than_asked(spark, ns, numbered):
    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(12).withColumn("partition_key", sf.lit("a")))
        s.send_dataframe(numbered(3).withColumn("partition_key", sf.lit("b")))
    with ns.get_queue_receiver("q") as r:
        assert r.receive_dataframe(10).count() == 10  # a share of 10/16 per partition, then rounds on the full ones
        assert r.receive_dataframe(10).count() == 5
        assert r.receive_dataframe(10).count() == 0


def test_receive_and_delete_mode_and_receiver_checks(spark, ns, numbered):
    ns.create_queue("q", lock_duration=LONG_LOCK)
    ns.create_queue("s", requires_session=True, lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(20))
    with ns.get_queue_receiver("q", receive_mode=ReceiveMode.RECEIVE_AND_DELETE) as r:
        got = r.receive_dataframe(50)
        assert got.count() == 20 and got.where("lock_token IS NOT NULL").count() == 0
        with pytest.raises(InvalidOperationError, match="RECEIVE_AND_DELETE"):
            r.complete_dataframe(got)
    assert ns.get_queue_runtime_properties("q").total_message_count == 0
    with ns.get_queue_receiver("q") as r:
        with pytest.raises(InvalidOperationError, match="lock_token"):
            r.complete_dataframe(spark.range(3))
        with ns.transaction(), pytest.raises(InvalidOperationError, match="transaction"):
            r.receive_dataframe(1)
    with ns.get_queue_sender("s") as s:
        s.send_dataframe(numbered(2).withColumn("session_id", sf.lit("x")))
    with ns.get_queue_receiver("s", session_id="x") as r, pytest.raises(InvalidOperationError, match="session"):
        r.receive_dataframe(1)


@pytest.mark.parametrize("name", ["q?x", "brack[1]", "brace{a,b}", "star*"])
def test_a_root_whose_name_holds_glob_characters_receives_and_settles(spark, tmp_path, name):
    """Spark reads a path as a glob pattern: "brack[1]" matched nothing (PATH_NOT_FOUND) after the messages were locked."""
    from sparkqueue import Message, Namespace

    (tmp_path / "qAx").mkdir()  # a sibling "q?x" would match as a pattern
    with Namespace(tmp_path / name / "ns") as ns:
        ns.create_queue("q", lock_duration=LONG_LOCK)
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}") for i in range(6)])
        with ns.get_queue_receiver("q") as r:
            got = r.receive_dataframe(4)
            assert got.count() == 4
            assert statuses(r.complete_dataframe(got)) == {"ok": 4}
        assert ns.get_queue_runtime_properties("q").active_message_count == 2


def test_a_receive_whose_dataframe_cannot_be_made_gives_its_locks_back_at_once(spark, ns, numbered, monkeypatch):
    """Before, the messages stayed locked (and a delivery was spent) until their locks expired."""
    from sparkqueue.spark import receive

    ns.create_queue("q", lock_duration=LONG_LOCK)
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(50))

    def fail(*args, **kwargs):
        raise RuntimeError("the DataFrame could not be made")

    with ns.get_queue_receiver("q") as r:
        monkeypatch.setattr(receive, "read_staged", fail)
        with pytest.raises(RuntimeError):
            r.receive_dataframe(30)
        monkeypatch.undo()
        again = r.receive_messages(50, max_wait_time=1)
    assert len(again) == 50 and {m.delivery_count for m in again} == {0}


def test_a_receive_stops_locking_before_its_first_locks_could_lapse(spark, ns, numbered):
    """Many small lock commits under a short lock: the call returned messages whose locks had lapsed during it.

    Locking now stops after a sixth of the lock duration (1 s of 6 s): fewer messages than asked, every lock still
    held with seconds to spare. Without the stop, all 4,000 would be locked (400 commits take several seconds).
    """
    from sparkqueue.spark.receive import receive_dataframe

    ns.create_queue("q", enable_partitioning=False, lock_duration=timedelta(seconds=6))  # one partition, one lock task
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(4000))
    df = receive_dataframe(ns.broker, "queue", "q", 4000, spark, chunk=10)  # 400 commits take longer than 1 s
    returned = time.time()
    rows = df.select("sequence_number", "locked_until_utc").collect()
    assert 0 < len(rows) < 4000
    assert min(r.locked_until_utc.timestamp() for r in rows) > returned


def test_a_receive_dataframe_from_a_damaged_queue_raises_instead_of_returning_nothing(spark, ns):
    """The queue's only data file lost: the lock tasks found the damage in their processes and the driver returned an
    empty DataFrame, as if the queue were empty. It raises PartitionUnavailableError naming the partition."""
    from sparkqueue import Message
    from sparkqueue.errors import PartitionUnavailableError

    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}") for i in range(10)])
    for f in Path(ns.root, "entities").rglob("*.parquet"):
        f.unlink()
    with ns.get_queue_receiver("q") as r, pytest.raises(PartitionUnavailableError, match=r"partition\(s\) 0 of 'q'"):
        r.receive_dataframe(10)


def test_repeated_tokens_point_at_their_first_occurrence_whatever_the_sequence_numbers_show():
    """settle.first_occurrences: distinct messages take the fast path; a token given twice, a message's stale and new
    tokens, and tokens of no message are told apart as hashing every token would."""
    seqs = pa.array([3, 1, 2], pa.int64())
    tokens = lock_tokens(seqs)
    assert first_occurrences(seqs.to_numpy(), tokens).tolist() == [0, 1, 2]
    again = lock_tokens(pa.array([1], pa.int64()))  # message 1 delivered again: same sequence number, another token
    mixed = pa.concat_arrays([tokens, tokens.slice(0, 1), again, pa.array(["junk", "junk"], pa.string())])
    mixed_seqs = sequences_of_tokens(mixed).fill_null(-1).to_numpy()
    expected = pc.index_in(mixed, value_set=mixed).to_numpy(zero_copy_only=False).tolist()
    assert first_occurrences(mixed_seqs, mixed).tolist() == expected == [0, 1, 2, 0, 4, 5, 5]
