"""Reading entities as DataFrames: the `sparkqueue` data source, partition pruning, and the table helpers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as sf

from sparkqueue import Message, Namespace
from sparkqueue.errors import EntityNotFoundError, InvalidOperationError
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
    assert df.where("lock_token IS NOT NULL").count() == len(got) - 2  # shown, not taken
    assert ns.get_queue_runtime_properties("q").active_message_count == 38  # locked ones included
    rows = df.where("partition_key IS NOT NULL").collect()
    assert all(row.partition_id == partition_for_key(row.partition_key, 16) for row in rows)


@pytest.mark.parametrize("pushdown", ["true", "false"])
def test_a_filtered_query_never_narrows_the_next_one_on_the_same_dataframe(spark, ns, numbered, pushdown):
    """Spark keeps one reader per loaded DataFrame: a filter of one query must not cut the rows of the next, pushdown or not."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(320).withColumn("partition_key", sf.concat(sf.lit("k"), (sf.col("id") % 64).cast("string"))))
    per = {p.partition_id: p.active_message_count for p in ns.get_queue_runtime_properties("q").partitions}
    before = spark.conf.get("spark.sql.python.filterPushdown.enabled", "false")
    spark.conf.set("spark.sql.python.filterPushdown.enabled", pushdown)
    try:
        df = read(spark, ns, "q")
        holding = sum(1 for n in per.values() if n)
        assert holding > 10 and df.rdd.getNumPartitions() == holding  # one reader partition per Delta partition with files
        assert df.where(sf.col("partition_id") == 3).count() == per[3] > 0
        assert df.count() == 320
        assert df.where(sf.col("partition_id") == 5).count() == per[5]
        assert df.where("partition_id = 3 OR state = 'deferred'").count() == per[3]
        two = df.where(sf.col("partition_id").isin(1, 2)).select("partition_id")
        assert {row.partition_id for row in two.collect()} == {1, 2}
        assert len(df.collect()) == 320
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", before)


def test_a_mistyped_namespace_root_is_an_error_and_creates_nothing(spark, tmp_path):
    """Readers and streams never create a namespace: a root without one is refused, and nothing appears there."""
    missing = tmp_path / "nosuch"
    with pytest.raises(Exception, match="no sparkqueue namespace"):
        spark.read.format("sparkqueue").option("namespace", str(missing)).load("q").count()
    with pytest.raises(Exception, match="no sparkqueue namespace"):
        stream = spark.readStream.format("sparkqueue").option("namespace", str(missing)).option("entity", "q").load()
        q = stream.writeStream.format("memory").queryName("nosuch").option("checkpointLocation", str(tmp_path / "c"))
        q.trigger(availableNow=True).start().awaitTermination(120)
    assert not missing.exists()


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
    assert read(spark, ns, "t/Subscriptions/s1", entity_type="SUBSCRIPTION").count() == 15  # any case, as sub_queue
    assert read(spark, ns, "t/s1").count() == 15  # the short form, as the CLI reads it
    ns.create_queue("t/s1")  # queue names may hold '/': such a queue comes first
    assert read(spark, ns, "t/s1").count() == 0
    with pytest.raises(Exception, match="topic"):
        read(spark, ns, "t").count()


def test_a_batch_read_takes_the_stream_sources_naming_options(spark, ns, numbered):
    """`option("topic", t).option("subscription", s).load()` passed load() (the stream source's check) and then failed
    the first action: the reader took no such option. It reads the subscription now; `entity` names an entity as
    load(name) does, and names that disagree fail load() itself."""
    ns.create_topic("t")
    ns.create_subscription("t", "s1")
    ns.create_queue("q")
    with ns.get_topic_sender("t") as s:
        s.send_dataframe(numbered(20))
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(3))

    def base():  # a DataFrameReader keeps the options set on it: a fresh one per read
        return spark.read.format("sparkqueue").option("namespace", ns.root)

    assert base().option("topic", "t").option("subscription", "s1").load().count() == 20
    assert base().option("topic", "t").option("subscription", "s1").option("sub_queue", "deadletter").load().count() == 0
    assert base().option("entity", "t/Subscriptions/s1").load().count() == 20
    assert base().option("entity", "q").load().count() == 3
    assert base().option("entity", "q").load("q").count() == 3  # the same entity named twice
    with pytest.raises(Exception, match="name different entities"):
        base().option("entity", "q").load("t/s1")
    with pytest.raises(Exception, match='option "subscription" needs option "topic"'):
        base().option("subscription", "s1").load()
    with pytest.raises(Exception, match="subscription 't/Subscriptions/nope' does not exist"):
        base().option("topic", "t").option("subscription", "nope").load()


def test_entity_type_reads_the_short_subscription_form_and_the_stream_source_takes_it_too(spark, ns, numbered):
    """entity_type=subscription refused "t/s1", the short form that works without it; readStream with entity_type
    passed load() and start(), then failed at its first offset (the source took no such option)."""
    from sparkqueue.spark.streaming_source import source_config

    ns.create_topic("t")
    ns.create_subscription("t", "s1")
    with ns.get_topic_sender("t") as s:
        s.send_dataframe(numbered(4))
    assert read(spark, ns, "t/s1", entity_type="subscription").count() == 4
    ns.create_queue("t/s1")  # a queue of that name comes first, unless the read asks for a subscription
    assert read(spark, ns, "t/s1").count() == 0
    assert read(spark, ns, "t/s1", entity_type="subscription").count() == 4
    assert read(spark, ns, "t/s1", entity_type="queue").count() == 0
    with pytest.raises(EntityNotFoundError, match="subscription 't/Subscriptions/nope' does not exist"):
        table_path(ns, "t/nope", entity_type="subscription")
    with pytest.raises(InvalidOperationError, match="entity_type must be 'queue' or 'subscription'"):
        table_path(ns, "t/s1", entity_type="topic")
    base = {"namespace": ns.root, "path": "t/s1"}
    assert source_config({**base, "entity_type": "subscription"}).address.display == "t/Subscriptions/s1"
    assert source_config({**base, "entity_type": "QUEUE"}).address.display == "t/s1"
    assert source_config(base).address.display == "t/s1"


def test_a_given_schema_a_batch_write_and_a_list_of_names_get_errors_that_say_what_to_do(spark, ns, numbered):
    """`.schema(...)` skipped the source's schema and failed with Spark's column-count mismatch; `df.write` said "writer
    is not implemented"; load([...]) named an option 'paths' the user never set."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(3))
    reader = spark.read.format("sparkqueue").option("namespace", ns.root)
    with pytest.raises(Exception, match=r"fixed schema .* load without .schema"):
        reader.schema("message_id string").load("q").collect()
    from sparkqueue.spark import RECEIVED_SCHEMA

    assert spark.read.format("sparkqueue").option("namespace", ns.root).schema(RECEIVED_SCHEMA).load("q").count() == 3
    with pytest.raises(Exception, match=r"reads one entity: load.name., not a list"):
        spark.read.format("sparkqueue").option("namespace", ns.root).load(["q", "q"]).count()
    with pytest.raises(Exception, match=r"is not supported: send a DataFrame with sender.send_dataframe"):
        numbered(2).write.format("sparkqueue").option("namespace", ns.root).mode("append").save("q")
    assert ns.get_queue_runtime_properties("q").active_message_count == 3


def test_a_dead_letter_whose_scheduled_time_is_ahead_reads_as_active_in_spark_too(spark, ns):
    """Forwarding to a missing queue dead-letters a scheduled message at once; Spark called it scheduled."""
    from datetime import UTC, datetime, timedelta

    from sparkqueue import Message, SubQueue

    ns.create_queue("nowhere")
    ns.create_queue("src", forward_to="nowhere")
    ns.delete_queue("nowhere")  # deleted since: the source dead-letters what it cannot forward
    with ns.get_queue_sender("src") as s:
        s.schedule_messages(Message("x"), datetime.now(UTC) + timedelta(hours=1))
    assert [r.state for r in read(spark, ns, "src", sub_queue="deadletter").collect()] == ["active"]
    with ns.get_queue_receiver("src", sub_queue=SubQueue.DEAD_LETTER) as r:
        assert [row.state for row in r.receive_dataframe(5).collect()] == ["active"]


def test_table_path_and_row_filter_select_the_same_rows_for_other_readers(spark, ns, numbered):
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(100))
    path = table_path(ns, "q")
    dt = DeltaTable(path)  # a plain Delta table: format("delta") reads it where the Delta jars are installed
    raw = spark.read.option("basePath", path).parquet(*dt.file_uris())  # what a Delta reader does at this version
    assert raw.where(row_filter(ns, "q")).count() == 100
    assert raw.where(row_filter(ns.root, "q", sub_queue="deadletter")).count() == 0


def test_names_that_are_no_queue_or_subscription_get_a_clear_error(ns):
    ns.create_topic("t")
    with pytest.raises(EntityNotFoundError, match="no queue, topic or subscription named 'nope'"):
        table_path(ns, "nope")
    with pytest.raises(InvalidOperationError, match="'t' is a topic; read one of its subscriptions"):
        table_path(ns, "t")
    with pytest.raises(EntityNotFoundError, match="subscription 't/Subscriptions/s' does not exist"):
        table_path(ns, "t/Subscriptions/s")


def test_reader_errors_are_one_line_and_unknown_options_are_refused(spark, ns, numbered):
    """A planning error shows sparkqueue's message without its internal frames; a misspelt option fails, not ignored."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_dataframe(numbered(10))
    with pytest.raises(Exception, match="no queue, topic or subscription named 'nope'") as err:
        read(spark, ns, "nope").count()
    assert "datasource.py" not in str(err.value) and "resolve(" not in str(err.value)  # no frames inside sparkqueue
    options = "entity, entity_type, namespace, path, storage_option"
    with pytest.raises(Exception, match=f"has no option 'subqueue'; its options: {options}") as err:
        read(spark, ns, "q", subQueue="deadletter").count()
    assert "datasource.py" not in str(err.value)
    assert read(spark, ns, "q", SUB_QUEUE="deadletter").count() == 0
    assert read(spark, ns, "q", Entity_Type="queue").count() == 10  # option names are case-insensitive


def test_relative_root_namespace_opens_from_another_directory_and_in_spark_tasks(spark, tmp_path, monkeypatch, numbered):
    """A namespace created with a relative root works from any directory, and in Spark tasks (which run elsewhere)."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(home)
    with Namespace("rel-ns") as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"m{i}", message_id=f"id-{i}") for i in range(30)])
    monkeypatch.chdir(elsewhere)
    with Namespace(str(home / "rel-ns")) as ns:  # by absolute path, from another directory
        assert ns.get_queue_runtime_properties("q").active_message_count == 30
        with ns.get_queue_receiver("q") as r:
            assert sorted(m.message_id for m in r.peek_messages(30)) == sorted(f"id-{i}" for i in range(30))
    with Namespace("../home/rel-ns") as ns:  # relative again, from the other directory: Spark tasks use it too
        receiver = ns.get_queue_receiver("q")
        got = receiver.receive_dataframe(100)
        assert sorted(r.message_id for r in got.select("message_id").collect()) == sorted(f"id-{i}" for i in range(30))
        status = receiver.complete_dataframe(got.select("lock_token"))
        assert {r.status for r in status.collect()} == {"ok"}
        assert ns.get_queue_sender("q").send_dataframe(numbered(10)) == 10
        assert read(spark, ns, "q").count() == 10
        # Spark resolves a relative `namespace` option in its own working directory (os.chdir does not move the
        # JVM's), so a Spark read takes the resolved root, as ns.root gives it.
        assert ns.root == str(home / "rel-ns")
        assert spark.read.format("sparkqueue").option("namespace", ns.root).load("q").count() == 10
        assert ns.get_queue_runtime_properties("q").active_message_count == 10


REPO = Path(__file__).resolve().parents[2]
PLAIN_SESSION = r"""
import json, sys
from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()  # nothing else: no register(), no sparkqueue settings
spark.sparkContext.setLogLevel("ERROR")
root, out = sys.argv[1], {}
if sys.argv[2] == "read":
    out["pushdown"] = spark.conf.get("spark.sql.python.filterPushdown.enabled", "false")
    df = spark.read.format("sparkqueue").option("namespace", root).load("q")
    out["ids"] = sorted(r.message_id for r in df.select("message_id").collect())
    out["p3"] = df.where("partition_id = 3").count()
else:  # the workers run a Python without sparkqueue's dependencies (PYSPARK_PYTHON): the errors name the fix
    try:
        spark.read.format("sparkqueue").option("namespace", root).load("q").count()
    except Exception as exc:
        out["read_error"] = str(exc)
    from sparkqueue import Namespace
    from sparkqueue.errors import InvalidOperationError
    with Namespace(root) as ns:
        # Spark's own writer stores a DataFrame send, so it needs no Python worker; a DataFrame receive does.
        out["sent"] = ns.get_queue_sender("q").send_dataframe(spark.createDataFrame([("x",)], "body string"))
        try:
            ns.get_queue_receiver("q").receive_dataframe(10, spark).count()
        except InvalidOperationError as exc:
            out["receive_error"] = str(exc)
spark.stop()
print("RESULT " + json.dumps(out))
"""


def run_plain_session(tmp_path: Path, root: str, mode: str, **env_vars: str) -> dict:
    """Run PLAIN_SESSION in a fresh process, as a user would: an activated venv, outside the clone, no PYTHONPATH; its RESULT.

    Spark finds the data source only as installed (scripts/test.sh), never through this tree on a path.
    """
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SESSION)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_", "PYTHONPATH"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", **env_vars)
    done = subprocess.run(
        [sys.executable, str(script), root, mode], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.mark.slow  # tens of seconds of Spark: CI runs it (SPARKQUEUE_SLOW=1)
def test_format_sparkqueue_on_a_plain_session(ns, tmp_path):
    """A session built with SparkSession.builder.getOrCreate() alone reads format("sparkqueue") (pyspark_sparkqueue)."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", message_id=f"id-{i}", partition_key=f"k{i}") for i in range(40)])
    out = run_plain_session(tmp_path, ns.root, "read")
    assert out["pushdown"] != "true"  # works with Spark's default: filter pushdown off
    assert out["ids"] == sorted(f"id-{i}" for i in range(40))
    assert out["p3"] == ns.get_queue_runtime_properties("q").partitions[3].active_message_count


@pytest.mark.slow  # a second fresh JVM and worker pool: ~40 s on 2 cores
def test_workers_on_a_python_without_sparkqueue_get_an_error_naming_the_fix(ns, tmp_path):
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import pyarrow"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without pyarrow")
    ns.create_queue("q")
    # The workers' Python sees sparkqueue's code (this tree on its path) but has none of its dependencies. A worker
    # Python without sparkqueue at all makes Spark itself report the `sparkqueue` source as not found.
    out = run_plain_session(tmp_path, ns.root, "errors", PYSPARK_PYTHON=bare, PYTHONPATH=str(REPO))
    for key in ("read_error", "receive_error"):
        assert key in out and "PYSPARK_PYTHON" in out[key] and "spark.pyspark.python" in out[key], out
    assert out["sent"] == 1
    props = ns.get_queue_runtime_properties("q")  # the failed receive locked nothing
    assert (props.total_message_count, props.active_message_count) == (1, 1)
