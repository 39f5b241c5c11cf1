"""Structured Streaming: the `sparkqueue` source and sink, and the streaming consumer job, on a real local SparkSession.

"Output exactly once" is measured where a duplicate would show: the source tests write with
Spark's Parquet file sink (exactly once per batch id through its `_spark_metadata` log) or the
job's foreachBatch, which appends each batch id once (a Delta txn) and never deduplicates
messages, so a message the source emitted in two batches would appear twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.errors import PySparkException
from pyspark.sql import functions as sf

from sparkqueue import Message, Namespace, SqlRuleFilter
from sparkqueue.constants import EntityStatus
from sparkqueue.spark.streaming_source import STREAMS_DIR

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]


def send(root: str, queue: str, n: int, prefix: str = "m") -> None:
    with Namespace(root) as ns, ns.get_queue_sender(queue) as s:
        s.send_messages([Message(f"body-{i}", message_id=f"{prefix}-{i}") for i in range(n)])


def batch_dirs(root: str) -> list[str]:
    base = Path(root) / STREAMS_DIR
    return [str(b) for s in base.iterdir() for b in s.iterdir() if b.name.startswith("batch-")] if base.exists() else []


def test_source_drains_in_micro_batches_and_completes_after_commit(spark, tmp_path):
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q")
    send(root, "q", 250)
    stream = spark.readStream.format("sparkqueue").option("namespace", root).option("maxMessagesPerTrigger", 100).load("q")
    query = (
        stream.select("message_id", "body", "sequence_number", "delivery_count")
        .writeStream.format("parquet")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start(str(tmp_path / "out"))
    )
    query.awaitTermination()
    assert [p.numInputRows for p in query.recentProgress] == [100, 100, 50]
    out = spark.read.parquet(str(tmp_path / "out"))
    ids = [r.message_id for r in out.select("message_id").collect()]
    assert sorted(ids) == sorted(f"m-{i}" for i in range(250))
    assert len({r.delivery_count for r in out.select("delivery_count").collect()}) == 1  # all first deliveries
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0  # every batch completed, the last one too
    assert batch_dirs(root) == []  # completed batches leave no record behind


def test_source_reads_a_subscription_and_a_dead_letter_sub_queue(spark, tmp_path):
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "big")
        ns.delete_rule("t", "big", "$Default")
        ns.create_rule("t", "big", "big", filter=SqlRuleFilter("n >= 5"))
        with ns.get_topic_sender("t") as s:
            s.send_messages([Message(f"{i}", message_id=f"t-{i}", application_properties={"n": i}) for i in range(8)])
        ns.create_queue("dl")
        send(root, "dl", 3)
        with ns.get_queue_receiver("dl") as r:
            for m in r.receive_messages(3, max_wait_time=5):
                r.dead_letter_message(m, reason="Bad")
    sub = (
        spark.readStream.format("sparkqueue").option("namespace", root).option("topic", "t").option("subscription", "big").load()
    )
    q1 = sub.writeStream.format("memory").queryName("sub_out").option("checkpointLocation", str(tmp_path / "c1"))
    q1.trigger(availableNow=True).start().awaitTermination()
    assert sorted(r.message_id for r in spark.sql("SELECT message_id FROM sub_out").collect()) == ["t-5", "t-6", "t-7"]
    dlq = spark.readStream.format("sparkqueue").option("namespace", root).option("sub_queue", "deadletter").load("dl")
    q2 = dlq.writeStream.format("memory").queryName("dl_out").option("checkpointLocation", str(tmp_path / "c2"))
    q2.trigger(availableNow=True).start().awaitTermination()
    rows = spark.sql("SELECT message_id, dead_letter_reason FROM dl_out").collect()
    assert sorted((r.message_id, r.dead_letter_reason) for r in rows) == [("m-0", "Bad"), ("m-1", "Bad"), ("m-2", "Bad")]
    with Namespace(root) as ns:
        assert ns.get_subscription_runtime_properties("t", "big").total_message_count == 0
        assert ns.get_queue_runtime_properties("dl").dead_letter_message_count == 0


@pytest.mark.slow  # tens of seconds of Spark: CI runs it (SPARKQUEUE_SLOW=1)
def test_source_renews_the_locks_of_a_batch_that_outlasts_them(spark, tmp_path):
    """A batch processed for three lock durations keeps its messages: another receiver gets none meanwhile."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=5))
    send(root, "q", 40)
    seen: dict[str, object] = {}

    def slow(df, batch_id: int) -> None:
        seen[f"rows-{batch_id}"] = sorted(r.message_id for r in df.select("message_id").collect())
        time.sleep(16)  # > 3 lock durations
        with Namespace(root) as ns, ns.get_queue_receiver("q") as other:
            seen[f"stolen-{batch_id}"] = len(other.receive_messages(40, max_wait_time=1))

    stream = spark.readStream.format("sparkqueue").option("namespace", root).load("q")
    query = stream.writeStream.foreachBatch(slow).option("checkpointLocation", str(tmp_path / "ck"))
    query.trigger(availableNow=True).start().awaitTermination()
    assert seen == {"rows-0": sorted(f"m-{i}" for i in range(40)), "stolen-0": 0}
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_a_message_a_foreach_batch_abandons_comes_again(spark, tmp_path):
    """A foreachBatch that abandons a message it cannot process gets it again in a later batch.

    Its failed completion went to the stream's skip list, as a lapsed lock's does: the next
    batch took the message and completed it without emitting it. It was gone, never processed.
    """
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=30), enable_partitioning=False)
    send(root, "q", 20)
    seen: list[tuple[str, int]] = []

    def reject_first(df, batch_id: int) -> None:
        rows = df.select("message_id", "delivery_count").collect()
        seen.extend((r.message_id, r.delivery_count) for r in rows)
        bad = df.where("message_id = 'm-0' AND delivery_count = 0")
        if bad.count():
            with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
                assert [x.status for x in r.abandon_dataframe(bad).collect()] == ["ok"]

    stream = spark.readStream.format("sparkqueue").option("namespace", root).option("maxMessagesPerTrigger", 10).load("q")
    for _ in range(2):  # a run takes as many messages as were there when it started: m-0's second delivery took one
        query = stream.writeStream.foreachBatch(reject_first).option("checkpointLocation", str(tmp_path / "ck"))
        query.trigger(availableNow=True).start().awaitTermination()
    assert [d for m, d in seen if m == "m-0"] == [0, 1]  # abandoned once, then emitted again
    assert sorted({m for m, _ in seen}) == sorted(f"m-{i}" for i in range(20))
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


@pytest.mark.slow  # 300,000 messages through Spark: CI runs it (SPARKQUEUE_SLOW=1)
def test_a_large_trigger_under_a_short_lock_is_taken_in_batches_each_completed(spark, tmp_path):
    """maxMessagesPerTrigger far above what can be locked, emitted, renewed and completed within one lock duration.

    Before, the source locked all 300,000 as one batch (its renewal starts once the batch is
    recorded): the first locks lapsed before it was emitted, and the run ended with every message
    still in the queue. Locking now stops after a sixth of the lock duration, so the batch is what
    its renewal and completion can keep: each message is emitted once and the queue ends empty.
    """
    n = 300_000
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=5), enable_partitioning=False)
    with Namespace(root) as ns, ns.get_queue_sender("q") as s:
        sent = spark.range(0, n, 1, 2).selectExpr("concat('b', id) AS body", "concat('m', id) AS message_id")
        assert s.send_dataframe(sent) == n
    out = str(tmp_path / "out")

    def write(df, batch_id: int) -> None:
        df.select("message_id").write.mode("overwrite").parquet(f"{out}/batch={batch_id}")

    stream = spark.readStream.format("sparkqueue").option("namespace", root).option("maxMessagesPerTrigger", n).load("q")
    query = stream.writeStream.foreachBatch(write).option("checkpointLocation", str(tmp_path / "ck"))
    query.trigger(availableNow=True).start().awaitTermination()
    emitted = spark.read.parquet(out)
    assert emitted.count() == n and emitted.select("message_id").distinct().count() == n
    assert emitted.select("batch").distinct().count() > 1
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_source_streams_a_session_queue_in_session_order(spark, tmp_path):
    """A session queue streams whole sessions under their locks: each message once, a session's messages in order
    (within a batch and across batches), and every batch completed."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("sq", requires_session=True)
        with ns.get_queue_sender("sq") as s:
            for k in range(6):  # rounds: a data file holds one message of every session
                s.send_messages([Message(f"{k}", session_id=f"s{i:02d}", message_id=f"s{i:02d}-{k}") for i in range(25)])
    seen: list[tuple[int, str, str, int]] = []

    def collect(df, batch_id):
        seen.extend((batch_id, r.session_id, r.message_id, r.sequence_number) for r in df.collect())

    stream = spark.readStream.format("sparkqueue").option("namespace", root).option("maxMessagesPerTrigger", 40).load("sq")
    query = stream.writeStream.foreachBatch(collect).option("checkpointLocation", str(tmp_path / "ck"))
    query.trigger(availableNow=True).start().awaitTermination()
    assert sorted(m for _, _, m, _ in seen) == sorted(f"s{i:02d}-{k}" for i in range(25) for k in range(6))
    for sid in {s for _, s, _, _ in seen}:
        mine = sorted((b, seq, m) for b, s, m, seq in seen if s == sid)
        assert [m for _, _, m in mine] == [f"{sid}-{k}" for k in range(6)], sid  # batch then sequence order = sent order
    assert max(b for b, _, _, _ in seen) >= 3  # 150 messages in batches of at most 40 (plus a session's remainder)
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("sq").total_message_count == 0
        assert all(s.locked_until_utc is None for s in ns.list_queue_sessions("sq"))
    assert batch_dirs(root) == []


def test_source_refuses_bad_options(spark, tmp_path):
    """A bad option, namespace or entity fails `load()` itself: no query starts and nothing is received."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q")
    send(root, "q", 1)

    def load(name: str | None = None, **options: str) -> None:
        reader = spark.readStream.format("sparkqueue")
        for k, v in options.items():
            reader = reader.option(k, v)
        reader.load(name) if name else reader.load()

    with pytest.raises(PySparkException, match="maxMessagesPerTrigger must be a positive integer"):
        load(namespace=root, entity="q", maxMessagesPerTrigger="0")
    with pytest.raises(PySparkException, match="set the namespace root"):
        load(entity="q")
    with pytest.raises(PySparkException, match="has no option 'subqueue'") as refused:
        load(namespace=root, entity="q", subQueue="deadletter")  # sub_queue, misspelt: refused, not ignored
    assert "UnboundLocalError" not in str(refused.value)  # the refusal itself, not pyspark's runner failing on it
    with pytest.raises(PySparkException, match="has no option 'subqueue'"):
        load("q", namespace=root, subQueue="deadletter")  # named by load(name): the same refusal
    with pytest.raises(PySparkException, match="no queue, topic or subscription named 'nope'"):
        load("nope", namespace=root)
    with pytest.raises(PySparkException, match="no sparkqueue namespace"):
        load("q", namespace=str(tmp_path / "nosuch"))
    assert not (tmp_path / "nosuch").exists()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").active_message_count == 1  # nothing was received


def test_source_refuses_an_entity_that_takes_no_receives(spark, tmp_path):
    """As a receiver: a ReceiveDisabled queue, and an auto-forwarding one, refuse the stream; nothing is received.

    The refusal comes when the started query first asks for an offset: `load()` cannot tell a stream
    from a batch read (which browses such a queue), however the entity is named.
    """
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("off", status=EntityStatus.RECEIVE_DISABLED)
        ns.create_queue("dst")
        ns.create_queue("fwd")
    send(root, "off", 2)
    send(root, "fwd", 2)
    with Namespace(root) as ns:
        props = ns.get_queue("fwd")
        props.forward_to = "dst"  # set after the messages arrived: the update forwards them
        ns.update_queue(props)
    for name, match in (("off", "ReceiveDisabled"), ("fwd", "forwards its messages")):
        by_option = spark.readStream.format("sparkqueue").option("namespace", root).option("entity", name).load()
        for form, reader in (
            ("option", by_option),
            ("load", spark.readStream.format("sparkqueue").option("namespace", root).load(name)),
        ):
            checkpoint = str(tmp_path / f"c-{name}-{form}")
            q = reader.writeStream.format("memory").queryName(f"never_{name}_{form}").option("checkpointLocation", checkpoint)
            with pytest.raises(PySparkException, match=match):
                q.trigger(availableNow=True).start().awaitTermination()
        browsed = spark.read.format("sparkqueue").option("namespace", root).option("entity", name).load()
        assert browsed.count() == (2 if name == "off" else 0)  # a batch read by the same options browses it
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("off").active_message_count == 2
        assert ns.get_queue_runtime_properties("dst").active_message_count == 2


def test_source_fails_on_a_damaged_queue_instead_of_streaming_nothing(spark, tmp_path):
    """The queue's only data file damaged: receive_dataframe raised, while the stream ended with no error and no row
    (`availableNow`), or emitted empty batches forever: damaged storage read as empty. Its query fails naming the
    partition, and a batch directory is not left behind."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
    send(root, "q", 20)
    for f in Path(root, "entities").rglob("*.parquet"):
        f.write_bytes(f.read_bytes()[:10])
    reader = spark.readStream.format("sparkqueue").option("namespace", root).load("q")
    query = reader.writeStream.format("memory").queryName("damaged_q").option("checkpointLocation", str(tmp_path / "ck"))
    with pytest.raises(PySparkException, match=r"partition\(s\) 0 of 'q'"):
        query.trigger(availableNow=True).start().awaitTermination(120)
    assert batch_dirs(root) == []


def test_sink_refuses_an_entity_whose_sends_are_disabled(spark, tmp_path):
    """As a sender: a SendDisabled queue fails the query, and nothing is stored."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out", status=EntityStatus.SEND_DISABLED)
    src = sink_source(spark, tmp_path)
    stream = spark.readStream.schema("body string, partition_key string").parquet(str(src / "f0"))
    w = stream.writeStream.format("sparkqueue").option("namespace", root).option("checkpointLocation", str(tmp_path / "c"))
    with pytest.raises(PySparkException, match="SendDisabled"):
        w.trigger(availableNow=True).start("out").awaitTermination(120)
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").total_message_count == 0


def sink_source(spark, tmp_path: Path, properties: bool = False) -> Path:
    """Three Parquet files of 40 rows each ("file<f>-<i>", keyed k0..k3): a file stream's batches 0, 1 and 2."""
    src = tmp_path / "src"
    for f in range(3):
        if properties:
            rows = [(f"file{f}-{i}", f"k{i % 4}", {"file": str(f)}) for i in range(40)]
            ddl = "body string, partition_key string, application_properties map<string,string>"
        else:
            rows, ddl = [(f"file{f}-{i}", f"k{i % 4}") for i in range(40)], "body string, partition_key string"
        spark.createDataFrame(rows, ddl).coalesce(1).write.parquet(str(src / f"f{f}"))
    return src


def test_sink_sends_each_micro_batch_once_when_spark_replays_it(spark, tmp_path):
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out", requires_duplicate_detection=False)
    src = sink_source(spark, tmp_path, properties=True)
    schema = spark.read.parquet(str(src / "f0")).schema

    def run() -> list[int]:
        stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(src / "*"))
        query = (
            stream.writeStream.format("sparkqueue")
            .option("namespace", root)
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start("out")
        )
        query.awaitTermination()
        return [p.batchId for p in query.recentProgress]

    assert run() == [0, 1, 2]
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").active_message_count == 120
    # The sink committed batch 2 but the process "died" before Spark recorded it: Spark replays it.
    for name in ("2", ".2.crc"):
        (tmp_path / "ck" / "commits" / name).unlink(missing_ok=True)
    assert run() == [2]
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").active_message_count == 120  # the replay sent nothing
    got = spark.read.format("sparkqueue").option("namespace", root).load("out").collect()
    assert sorted(r.body.decode() for r in got) == sorted(f"file{f}-{i}" for f in range(3) for i in range(40))
    assert {r.application_properties["file"] for r in got} == {"0", "1", "2"}
    assert {r.partition_key for r in got} == {"k0", "k1", "k2", "k3"}


def test_sink_fails_a_batch_whose_staged_rows_a_cleanup_removed_and_sends_it_whole_on_restart(spark, tmp_path):
    """A staging cleanup (another call's, once a task's directory is an hour old) removed rows of a running batch.

    The commit counts the staged rows against what the tasks reported: the batch fails with
    StorageError and sends nothing (it sent the rows left, and Spark recorded the batch as written).
    The query restarted from its checkpoint writes the batch again, whole.
    """
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out")
    src = sink_source(spark, tmp_path)
    schema = spark.read.parquet(str(src / "f0")).schema
    staged_dir, cleaned = Path(root) / "_spark_staging" / "stream-send", str(tmp_path / "cleaned")

    def other_tasks_staged() -> bool:  # a finished file (written under a temporary name, then renamed)
        return staged_dir.is_dir() and any(staged_dir.rglob("part-*.parquet"))

    def body(b):  # a plain Python UDF, run in a Spark worker: one task of batch 1 waits, then cleans up
        if b == "file1-39" and not os.path.exists(cleaned):
            give_up = time.monotonic() + 60
            while not other_tasks_staged() and time.monotonic() < give_up:
                time.sleep(0.05)
            from sparkqueue.spark.staging import cleanup_staging

            cleanup_staging(root, timedelta(0))
            Path(cleaned).touch()
        return b

    def run() -> None:
        stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(src / "*"))
        query = (
            stream.repartition(2)
            .select(sf.udf(body, "string").asNondeterministic()("body").alias("body"), "partition_key")
            .writeStream.format("sparkqueue")
            .option("namespace", root)
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start("out")
        )
        query.awaitTermination()

    with pytest.raises(Exception, match="staged 40 rows but"):
        run()
    assert os.path.exists(cleaned)
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").active_message_count == 40  # batch 0 only
    run()
    got = spark.read.format("sparkqueue").option("namespace", root).load("out").collect()
    assert sorted(r.body.decode() for r in got) == sorted(f"file{f}-{i}" for f in range(3) for i in range(40))


SINK_CHILD = """
import os, sys, time
from pathlib import Path
from pyspark.sql import functions as sf
from sparkqueue.spark import spark_session

root, src, checkpoint, hang = sys.argv[1:5]
spark = spark_session("local[2]", conf={"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"})


@sf.udf("string")
def passing(body):
    if hang != "-" and body.startswith("file1-"):  # batch 1 hangs in its write tasks until the test kills us
        Path(hang).touch()
        time.sleep(3600)
    return body


schema = spark.read.parquet(f"{src}/f0").schema
stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(f"{src}/*")
query = (
    stream.select(passing("body").alias("body"), "partition_key")
    .writeStream.format("sparkqueue")
    .option("namespace", root)
    .option("checkpointLocation", checkpoint)
    .trigger(availableNow=True)
    .start("out")
)
query.awaitTermination()
"""


@pytest.mark.slow  # tens of seconds of Spark: CI runs it (SPARKQUEUE_SLOW=1)
def test_sink_query_killed_mid_batch_restarts_and_sends_each_batch_once(spark, tmp_path):
    """A separate process runs a sink query and is SIGKILLed inside batch 1's write; the restarted query sends it once."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out")
    src = sink_source(spark, tmp_path)
    child = tmp_path / "sink_child.py"
    child.write_text(SINK_CHILD)
    hang = tmp_path / "hanging"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    args = [sys.executable, str(child), root, str(src), str(tmp_path / "ck")]
    log = tmp_path / "child.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([*args, str(hang)], env=env, stdout=err, stderr=err, start_new_session=True)
    try:
        for _ in range(3000):  # a bound on the wait, not an assertion on time
            if hang.exists() or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert hang.exists(), log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").active_message_count == 40  # batch 0 only: batch 1 never committed
    done = subprocess.run([*args, "-"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = spark.read.format("sparkqueue").option("namespace", root).load("out").collect()
    assert sorted(r.body.decode() for r in got) == sorted(f"file{f}-{i}" for f in range(3) for i in range(40))


# Loaded by every Python process of the child's Spark (driver and workers: PYTHONPATH): the sink's commit of
# batch 1 lands, then the whole process group (driver, JVM, workers) is SIGKILLed before Spark records the batch.
DIE_AFTER_SINK_COMMIT = """
import os, signal
from pathlib import Path

marker = os.environ.get("SPARKQUEUE_TEST_DIE_AFTER_COMMIT")
# The driver loads this first: its process group (driver and JVM) is the one to kill. Spark's Python workers
# run in a group of their own, and inherit this from the JVM's environment.
os.environ.setdefault("SPARKQUEUE_TEST_KILL_GROUP", str(os.getpgid(0)))
if marker:
    from sparkqueue.spark import streaming_sink

    landed = streaming_sink.QueueStreamWriter.commit

    def commit_then_die(self, messages, batchId):
        landed(self, messages, batchId)
        if batchId == 1:
            Path(marker).touch()
            os.killpg(int(os.environ["SPARKQUEUE_TEST_KILL_GROUP"]), signal.SIGKILL)

    streaming_sink.QueueStreamWriter.commit = commit_then_die
"""


@pytest.mark.slow  # two Spark processes: CI runs it (SPARKQUEUE_SLOW=1)
def test_sink_query_killed_after_its_commit_landed_restarts_without_sending_the_batch_again(spark, tmp_path):
    """SIGKILL between the sink's commit of batch 1 and Spark's record of it: the restart replays batch 1, which sends nothing."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out", requires_duplicate_detection=False)
    src = sink_source(spark, tmp_path)
    child = tmp_path / "sink_child.py"
    child.write_text(SINK_CHILD)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(DIE_AFTER_SINK_COMMIT)
    died = tmp_path / "died"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": f"{hooks}:{REPO}"}
    args = [sys.executable, str(child), root, str(src), str(tmp_path / "ck"), "-"]
    crashed = subprocess.run(
        args, env={**env, "SPARKQUEUE_TEST_DIE_AFTER_COMMIT": str(died)}, capture_output=True, text=True, timeout=900,
        start_new_session=True,
    )  # fmt: skip
    assert crashed.returncode == -signal.SIGKILL and died.exists(), crashed.stderr[-3000:]
    assert not (tmp_path / "ck" / "commits" / "1").exists()  # Spark never recorded batch 1
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").active_message_count == 80  # batches 0 and 1 were sent
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = spark.read.format("sparkqueue").option("namespace", root).load("out").collect()
    assert sorted(r.body.decode() for r in got) == sorted(f"file{f}-{i}" for f in range(3) for i in range(40))


def test_sink_sends_to_a_topic_through_its_subscription_rules(spark, tmp_path):
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "all")
        ns.create_subscription("t", "even")
        ns.delete_rule("t", "even", "$Default")
        ns.create_rule("t", "even", "even", filter=SqlRuleFilter("parity = 'even'"))
    src = tmp_path / "src"
    spark.range(30).selectExpr(
        "CAST(id AS STRING) AS body", "to_json(named_struct('parity', IF(id % 2 = 0, 'even', 'odd'))) AS application_properties"
    ).coalesce(1).write.parquet(str(src))
    stream = spark.readStream.schema(spark.read.parquet(str(src)).schema).parquet(str(src))
    query = stream.writeStream.format("sparkqueue").option("namespace", root).option("checkpointLocation", str(tmp_path / "ck"))
    query.trigger(availableNow=True).start("t").awaitTermination()
    with Namespace(root) as ns:
        assert ns.get_subscription_runtime_properties("t", "all").active_message_count == 30
        assert ns.get_subscription_runtime_properties("t", "even").active_message_count == 15


SINK_COLUMN_REFUSALS = {
    "body int": ("body INT", "body must be binary or string, got int"),
    "properties map of arrays": (
        "body STRING, application_properties MAP<STRING, ARRAY<INT>>",
        "application_properties must map strings to strings, numbers or booleans",
    ),
    "time_to_live string": ("body STRING, time_to_live STRING", "time_to_live must be seconds .a number. or a day-time"),
    "time_to_live year-month": ("body STRING, time_to_live INTERVAL YEAR TO MONTH", "or a day-time interval, got interval"),
    "scheduled string": ("body STRING, scheduled_enqueue_time_utc STRING", "scheduled_enqueue_time_utc must be a timestamp"),
    "Subject bigint": ("body STRING, Subject BIGINT", "subject must be a string column, got bigint"),
}


@pytest.mark.parametrize("ddl, refused", SINK_COLUMN_REFUSALS.values(), ids=SINK_COLUMN_REFUSALS.keys())
def test_the_sink_refuses_at_its_start_every_column_type_send_dataframe_refuses(spark, tmp_path, ddl, refused):
    """The sink checked only its string fields when its query started; an int body, a year-month TTL (a bare KeyError),
    a string schedule ... started and failed inside the first batch's tasks. Its start (`sink_config`, which Spark runs
    before the first batch) refuses them as send_dataframe does."""
    from pyspark.sql.types import StructType

    from sparkqueue.errors import InvalidOperationError
    from sparkqueue.spark.streaming_sink import sink_config

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out")
    options = {"namespace": root, "path": "out", "checkpointlocation": str(tmp_path / "ck")}
    with pytest.raises(InvalidOperationError, match=refused):
        sink_config(options, StructType.fromDDL(ddl))
    assert sink_config(options, StructType.fromDDL("body STRING, Subject STRING, time_to_live DOUBLE")).address.name == "out"


def test_sink_rejects_rows_without_body_and_a_query_without_checkpoint(spark, tmp_path):
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("out")
    rate = spark.readStream.format("rate").option("rowsPerSecond", 1).load()
    with pytest.raises(PySparkException, match="needs a `body` column"):
        w = rate.writeStream.format("sparkqueue").option("namespace", root).option("checkpointLocation", str(tmp_path / "c1"))
        w.start("out").awaitTermination(60)
    with pytest.raises(PySparkException, match=r"partition_key must be a string column, got bigint"):
        # refused before the first batch, as send_dataframe refuses it: the query started and failed inside that batch
        q = rate.selectExpr("CAST(value AS STRING) AS body", "value AS partition_key").writeStream.format("sparkqueue")
        q = q.option("namespace", root).option("checkpointLocation", str(tmp_path / "c0"))
        q.start("out").awaitTermination(60)
    with pytest.raises(PySparkException, match="checkpointLocation"):
        q = rate.selectExpr("CAST(value AS STRING) AS body").writeStream.format("sparkqueue").option("namespace", root)
        q.start("out").awaitTermination(60)
    with pytest.raises(PySparkException, match="streaming sink has no option 'maxmessagespertrigger'"):
        q = rate.selectExpr("CAST(value AS STRING) AS body").writeStream.format("sparkqueue").option("namespace", root)
        q = q.option("checkpointLocation", str(tmp_path / "c2")).option("maxMessagesPerTrigger", 10)  # a source option
        q.start("out").awaitTermination(60)
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("out").active_message_count == 0


def test_source_streams_the_readable_partitions_of_a_partly_damaged_queue(spark, tmp_path):
    """One partition damaged, another holding messages and a scheduled one: the stream failed as soon as a batch locked
    nothing, though core receives skip a damaged partition while others may hold messages. It streams what it can read."""
    from procs import key_for_partition

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q")
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"bad-{i}", partition_key=key_for_partition(10)) for i in range(5)])
            later = datetime.now(UTC) + timedelta(hours=1)
            s.send_messages(Message("later", partition_key=key_for_partition(6), scheduled_enqueue_time_utc=later))
            s.send_messages([Message(f"ok-{i}", partition_key=key_for_partition(6)) for i in range(5)])
    for f in Path(root, "entities").rglob("partition_id=10/*.parquet"):
        f.write_bytes(b"not parquet")
    reader = spark.readStream.format("sparkqueue").option("namespace", root).load("q")
    query = (
        reader.selectExpr("CAST(body AS STRING) AS body")
        .writeStream.format("memory")
        .queryName("partly_damaged")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="0.5 seconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 60
        while spark.table("partly_damaged").count() < 5 and query.isActive and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # several triggers after the first batch: each locks nothing and must not fail the query
        assert query.isActive and query.exception() is None, query.exception()
        assert sorted(r.body for r in spark.table("partly_damaged").collect()) == [f"ok-{i}" for i in range(5)]
    finally:
        query.stop()


def test_options_naming_different_entities_are_refused(spark, tmp_path):
    """`.option("entity", "t/s").load("q")` drained and completed t/s, `.option("topic", ...)` with a subscription lost
    to `load(name)`, and the sink's `.option("entity", "orders").start("audit")` sent to orders: which name won depended
    on the option. Two names of different entities are refused, nothing received or sent; two names of one entity
    (any case) are one name, and the sink's option "topic" must name a topic."""
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q")
        ns.create_queue("orders")
        ns.create_topic("t")
        ns.create_subscription("t", "s")
        ns.get_topic_sender("t").send_messages(Message("for-s"))
    send(root, "q", 1)

    def source(name: str | None, **options: str):  # type: ignore[no-untyped-def]
        reader = spark.readStream.format("sparkqueue").option("namespace", root)
        for k, v in options.items():
            reader = reader.option(k, v)
        return reader.load(name) if name else reader.load()

    with pytest.raises(PySparkException, match="name different entities"):
        source("q", entity="t/s")
    with pytest.raises(PySparkException, match="name different entities"):
        source("q", topic="t", subscription="s")
    with pytest.raises(PySparkException, match='needs option "subscription"'):
        source(None, topic="t")
    assert source("Q", entity="q").isStreaming  # one entity, named twice
    assert source("t/s", topic="T").isStreaming  # the topic alone beside one of its subscriptions: the same entity
    with pytest.raises(PySparkException, match="is not one of its subscriptions"):
        source("q", topic="t")
    rate = spark.readStream.format("rate").option("rowsPerSecond", 1).load().selectExpr("CAST(value AS STRING) AS body")
    for i, (name, options, match) in enumerate(
        [("q", {"entity": "orders"}, "name different entities"), (None, {"topic": "q"}, "not a topic")]
    ):
        w = rate.writeStream.format("sparkqueue").option("namespace", root).option("checkpointLocation", str(tmp_path / f"c{i}"))
        for k, v in options.items():
            w = w.option(k, v)
        with pytest.raises(PySparkException, match=match):
            (w.start(name) if name else w.start()).awaitTermination(60)
    with Namespace(root) as ns:
        assert [ns.get_queue_runtime_properties(q).active_message_count for q in ("q", "orders")] == [1, 0]
        assert ns.get_subscription_runtime_properties("t", "s").active_message_count == 1


def write_config(tmp_path: Path, lock_s: int) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(
        f"""
[namespace]
root = "{tmp_path / "ns"}"
[spark]
master = "local[2]"
[spark.conf]
"spark.sql.shuffle.partitions" = "2"
"spark.ui.enabled" = "false"
[queue]
name = "sq"
lock_duration = {lock_s}
[consumer]
output = "{tmp_path / "out"}"
[stream_consumer]
checkpoint = "{tmp_path / "ck"}"
max_messages_per_trigger = 100
"""
    )
    return path


def run_job(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The streaming consumer in a process of its own (own session: killing it kills its JVM too)."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.stream_consumer", "--config", str(path), "--no-progress", *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the JVM this job started, if it outlived its driver
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow  # tens of seconds of Spark: CI runs it (SPARKQUEUE_SLOW=1)
@pytest.mark.parametrize("sessions", [False, True])
def test_stream_consumer_killed_mid_batch_restarts_with_each_output_once(tmp_path, sessions):
    """SIGKILL after batch 1's output is written, before Spark commits it; locks lapse while the job is down (5 s).

    With sessions, batches hold whole sessions (10 of 10 messages each) under session locks that lapse the same way.
    """
    path = write_config(tmp_path, lock_s=5)
    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("sq", lock_duration=timedelta(seconds=5), requires_session=sessions)
        with ns.get_queue_sender("sq") as s:
            s.send_messages(
                [Message(f"body-{i}", message_id=f"m-{i}", session_id=f"s{i % 30}" if sessions else None) for i in range(300)]
            )
    crashed = run_job(path, "--crash-after-write", "1")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    out = DeltaTable(str(tmp_path / "out")).to_pyarrow_table(columns=["sequence_number", "message_id"])
    assert out.num_rows == 200  # batches 0 and 1 written; batch 1 never committed by Spark
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("sq").total_message_count == 200  # batch 0 completed, batch 1 not

    done = run_job(path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = DeltaTable(str(tmp_path / "out")).to_pyarrow_table(columns=["sequence_number", "message_id", "body_upper"])
    ids = out.column("message_id").to_pylist()
    assert len(ids) == 300 and sorted(ids) == sorted(f"m-{i}" for i in range(300))
    assert len(set(out.column("sequence_number").to_pylist())) == 300
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("sq").total_message_count == 0
    assert batch_dirs(root) == []


def test_options_and_row_conversion_without_a_session():
    """Storage options (JSON and per key), Message fields from Arrow columns, and batch reads balanced over tasks."""
    from sparkqueue.errors import InvalidOperationError
    from sparkqueue.spark.streaming import storage_options_of
    from sparkqueue.spark.streaming_sink import messages_from_arrow
    from sparkqueue.spark.streaming_source import ROWS_PER_TASK, group_partitions

    opts = {"storage_options": '{"account_name": "a", "use_emulator": true}', "storage_option.account_key": "k"}
    assert storage_options_of(opts) == {"account_name": "a", "use_emulator": "true", "account_key": "k"}
    with pytest.raises(InvalidOperationError, match="JSON object"):
        storage_options_of({"storage_options": "[1]"})

    batch = pa.RecordBatch.from_pydict(
        {
            "body": pa.array(["a", "b", ""]),
            "partition_key": pa.array(["k", None, None]),
            "application_properties": pa.array([[("x", "1")], None, []], pa.map_(pa.string(), pa.string())),
            "time_to_live": pa.array([30, None, 1.5]),
            "ignored": pa.array([1, 2, 3]),
        }
    )
    msgs = messages_from_arrow(batch)
    assert [m.body for m in msgs] == [b"a", b"b", b""]
    with pytest.raises(InvalidOperationError, match=r"body must be bytes or str, got null \(a message\)"):
        messages_from_arrow(pa.RecordBatch.from_pydict({"body": pa.array(["a", None])}))  # as send_dataframe refuses it
    as_struct = pa.array([{"a": "x", "b": None}], pa.struct([("a", pa.string()), ("b", pa.int64())]))
    struct_batch = pa.RecordBatch.from_pydict({"body": pa.array([b"x"]), "application_properties": as_struct})
    assert messages_from_arrow(struct_batch)[0].application_properties == {"a": "x", "b": None}  # nulls kept, as sent
    assert [m.partition_key for m in msgs] == ["k", None, None]
    assert [m.application_properties for m in msgs] == [{"x": "1"}, None, None]
    assert [m.time_to_live for m in msgs] == [timedelta(seconds=30), None, timedelta(seconds=1.5)]
    as_json = pa.RecordBatch.from_pydict({"body": pa.array([b"x"]), "application_properties": pa.array(['{"n": 2}'])})
    assert messages_from_arrow(as_json)[0].application_properties == {"n": 2}
    with pytest.raises(InvalidOperationError, match="JSON object"):
        messages_from_arrow(pa.RecordBatch.from_pydict({"body": pa.array([b"x"]), "application_properties": pa.array(["[]"])}))

    (cased,) = messages_from_arrow(pa.RecordBatch.from_pydict({"Body": pa.array(["b"]), "Message_ID": pa.array(["m-1"])}))
    assert (cased.body, cased.message_id) == (b"b", "m-1")  # field names in any case, as Spark resolves them

    parts = [([f"f{p}"], [f"t{p}-{i}" for i in range(n)]) for p, n in enumerate([ROWS_PER_TASK, 10, ROWS_PER_TASK // 2, 5])]
    tasks = group_partitions(7, parts)
    assert len(tasks) == 2 and sorted(f for t in tasks for f in t.files) == ["f0", "f1", "f2", "f3"]
    assert sum(len(t.tokens) for t in tasks) == sum(len(t) for _, t in parts)
    assert group_partitions(7, parts[1:2])[0].files == ["f1"]


def test_a_batch_whose_completion_fails_keeps_its_locks_renewed_until_it_completes(tmp_path, monkeypatch):
    """The source keeps renewing a committed batch whose completion failed, so no other receiver takes its messages."""
    from sparkqueue.errors import PartitionUnavailableError
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
    send(root, "q", 5)
    state = StreamState(source_config({"namespace": root, "path": "q"}), "stream-1", available_now=False)
    try:
        assert state.receive(0, 10) == 5

        def unavailable(items, op):
            raise PartitionUnavailableError("partition 0 is unavailable (test)")

        monkeypatch.setattr(state, "_settle", unavailable)
        state.complete_through(0)  # fails: the record stays for the next call, and the locks stay renewed
        assert 0 in state.inflight and state.batches() == [0]
        monkeypatch.undo()
        state.complete_through(0)
        assert 0 not in state.inflight and state.batches() == []
    finally:
        state.stop()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_a_batch_spark_never_logged_gives_its_messages_back_without_counting_a_delivery(tmp_path):
    """A driver that died after the source recorded a batch but before Spark logged it: no query saw those messages.

    The restart discarded the record and abandoned its locks, which counted a delivery: a query
    crashing in that window again and again dead-lettered messages it never processed.
    """
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False)
    send(root, "q", 3)
    config = source_config({"namespace": root, "path": "q"})
    crashed = StreamState(config, "stream-1", available_now=False)
    assert crashed.receive(0, 10) == 3
    crashed.stop()
    restarted = StreamState(config, "stream-1", available_now=False)
    try:
        restarted.discard_after(-1)  # Spark's checkpoint logged no batch
        assert restarted.batches() == []
    finally:
        restarted.stop()
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        got = r.receive_messages(10, max_wait_time=5)
        assert sorted((m.message_id, m.delivery_count) for m in got) == [("m-0", 0), ("m-1", 0), ("m-2", 0)]


def test_skipped_messages_of_a_deleted_entity_do_not_hide_those_of_the_one_made_again(tmp_path):
    """A restarted stream completes a batch whose locks lapsed: its messages go to the skip list. The queue is then
    deleted and made again under the same name; its new messages reuse those sequence numbers and were completed
    unseen. They are emitted now."""
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False, lock_duration=timedelta(seconds=5))
    send(root, "q", 3, prefix="old")
    config = source_config({"namespace": root, "path": "q"})
    first = StreamState(config, "stream-1", available_now=False)
    assert first.receive(0, 10) == 3
    first.stop()  # the query goes down: nothing renews the batch's locks
    time.sleep(6)
    again = StreamState(config, "stream-1", available_now=False)  # restarted from its checkpoint
    try:
        again.complete_through(0)  # Spark had committed batch 0: its lapsed messages are skipped if they come again
        assert len(again.skip) == 3
        with Namespace(root) as ns:
            ns.delete_queue("q")
            ns.create_queue("q", enable_partitioning=False)
        send(root, "q", 3, prefix="new")
        time.sleep(1.5)  # the stream's cached settings name the new table
        assert again.receive(1, 10) == 3
        again.complete_through(1)
    finally:
        again.stop()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_available_now_counts_each_message_once_when_a_lapsed_lock_brings_it_back(tmp_path):
    """Trigger.AvailableNow takes as many messages as the queue held. A batch whose locks lapsed before completion
    sends its messages back; the stream completes them unseen (their output was committed).

    Before, those completions counted against the run's budget a second time: the run ended early
    with that many messages never emitted (CI saw 81,920 of 300,000 left in the queue).
    """
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False, lock_duration=timedelta(seconds=1))
    send(root, "q", 10)
    state = StreamState(source_config({"namespace": root, "path": "q"}), "stream-1", available_now=True)
    try:
        assert state.receive(0, 4) == 4
        with state.lock:  # the renewer waits for this lock: nothing renews batch 0, and its locks lapse
            time.sleep(2.5)
        state.complete_through(0)  # the sink had committed batch 0: its messages are skipped when they come again
        assert len(state.skip) == 4
        emitted = 0
        for n in range(1, 10):
            got = state.receive(n, 100)
            if not got:
                break
            emitted += got
            state.complete_through(n)
        assert emitted == 6 and not state.skip
    finally:
        state.stop()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_a_batch_whose_renewal_fails_does_not_stop_the_renewal_of_later_batches(tmp_path, monkeypatch):
    """Batch 0's partition fails its settles, so its completion fails and it stays in flight; batch 1 holds messages of
    a healthy partition. Before, every renewal round stopped at batch 0: batch 1's locks lapsed while Spark processed
    it, and another receiver took its messages."""
    from procs import key_for_partition

    from sparkqueue.errors import PartitionUnavailableError
    from sparkqueue.model import lifecycle
    from sparkqueue.spark.streaming_source import StreamState, source_config
    from sparkqueue.storage.table import partition_of

    root = str(tmp_path / "ns")
    failing, healthy = 3, 9
    with Namespace(root) as ns:
        ns.create_queue("q", lock_duration=timedelta(seconds=3))
        with ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"a{i}", partition_key=key_for_partition(failing)) for i in range(5)])
    state = StreamState(source_config({"namespace": root, "path": "q"}), "stream-1", available_now=False)
    settle_on = state._settle_on

    def partition_fails(ns, items, op):
        if op in (lifecycle.RENEW, lifecycle.COMPLETE) and any(partition_of(s) == failing for s, _ in items):
            raise PartitionUnavailableError(f"partition {failing} is unavailable (test)")
        return settle_on(ns, items, op)

    monkeypatch.setattr(state, "_settle_on", partition_fails)
    try:
        assert state.receive(0, 10) == 5
        state.complete_through(0)  # fails: batch 0 stays in flight, its renewal failing too
        assert 0 in state.inflight
        with Namespace(root) as ns, ns.get_queue_sender("q") as s:
            s.send_messages([Message(f"b{i}", partition_key=key_for_partition(healthy)) for i in range(5)])
        assert state.receive(1, 10) == 5
        time.sleep(4.5)  # Spark processes batch 1 for longer than a lock duration
        with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
            taken = [m.body.decode() for m in r.receive_messages(10, max_wait_time=1)]
        assert [b for b in taken if b.startswith("b")] == []
    finally:
        state.stop()


def test_the_renewer_outlives_an_unexpected_error(tmp_path, monkeypatch):
    """An error other than sparkqueue's (here an OSError) in a renewal ended the renewal thread: the batch in flight
    lost its locks and another receiver took its messages. It is logged and the renewal tried again."""
    from sparkqueue.model import lifecycle
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_queue("q", enable_partitioning=False, lock_duration=timedelta(seconds=3))
    send(root, "q", 5)
    state = StreamState(source_config({"namespace": root, "path": "q"}), "stream-1", available_now=False)
    settle_on = state._settle_on
    raised: list[str] = []

    def first_renewal_fails(ns, items, op):
        if op == lifecycle.RENEW and not raised:
            raised.append(op)
            raise OSError("a transient I/O error (test)")
        return settle_on(ns, items, op)

    monkeypatch.setattr(state, "_settle_on", first_renewal_fails)
    try:
        assert state.receive(0, 10) == 5
        time.sleep(4.5)
        assert raised
        with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
            assert r.receive_messages(10, max_wait_time=1) == []
        state.complete_through(0)
    finally:
        state.stop()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("q").total_message_count == 0


def test_renewal_takes_a_batch_in_the_order_its_locks_were_taken():
    """Partitions lock in parallel, so a batch's oldest locks are each partition's first: renewal takes those first."""
    from sparkqueue.spark.streaming_source import in_lock_order
    from sparkqueue.storage.table import sequence_number

    a = [(sequence_number(0, i), f"a{i}") for i in range(3)]
    b = [(sequence_number(5, i), f"b{i}") for i in range(2)]
    assert [t for _, t in in_lock_order(a + b)] == ["a0", "b0", "a1", "b1", "a2"]


def _session_queue(root: str, sessions: int, per: int, lock: timedelta | None = None) -> None:
    """A session queue holding `per` messages of each of `sessions` sessions, sent round by round."""
    with Namespace(root) as ns:
        ns.create_queue("sq", requires_session=True, **({"lock_duration": lock} if lock else {}))
        with ns.get_queue_sender("sq") as s:
            for k in range(per):
                s.send_messages([Message(f"{k}", session_id=f"s{i:03d}") for i in range(sessions)])


def test_a_session_batch_completes_each_session_under_its_own_lock(tmp_path):
    """Sessions sharing a queue partition in one batch: every message completes, none is reported lost (no skip entry)."""
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    _session_queue(root, 20, 3)
    state = StreamState(source_config({"namespace": root, "path": "sq"}), "stream-1", available_now=False)
    try:
        assert state.receive(0, 30) == 30
        held = state.held[0]
        assert len({lock.session_id for lock, _ in held}) == 10
        assert len({lock.partition for lock, _ in held}) < 10  # some partitions hold several of the batch's sessions
        state.complete_through(0)
        assert state.skip == {} and state.batches() == []
    finally:
        state.stop()
    with Namespace(root) as ns:
        assert ns.get_queue_runtime_properties("sq").total_message_count == 30
        assert all(s.locked_until_utc is None for s in ns.list_queue_sessions("sq"))


def test_a_session_batch_never_takes_a_session_twice_when_its_locks_lapse(tmp_path, monkeypatch):
    """A batch that takes longer than the lock duration to fill stops taking sessions, and never re-takes its own."""
    from sparkqueue.model import sessions as session_model
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    _session_queue(root, 40, 1, lock=timedelta(seconds=1))
    accept = session_model.Sessions.accept

    def slow_accept(self, *args, **kwargs):
        time.sleep(0.15)  # 40 accepts would take 6 s: locks of 1 s lapse on the way
        return accept(self, *args, **kwargs)

    monkeypatch.setattr(session_model.Sessions, "accept", slow_accept)
    state = StreamState(source_config({"namespace": root, "path": "sq"}), "stream-1", available_now=False)
    try:
        emitted = state.receive(0, 1000)
        seqs = [s for s, _ in state.inflight[0]]
        assert 0 < emitted < 40 and len(seqs) == len(set(seqs)) == emitted
        assert len({lock.session_id for lock, _ in state.held[0]}) == len(state.held[0])
    finally:
        state.stop()


def test_a_session_batch_that_fails_while_taking_releases_its_sessions(tmp_path, monkeypatch):
    """An error while a batch takes sessions releases those it took at once (another receiver need not wait for expiry)."""
    from sparkqueue.errors import OperationTimeoutError
    from sparkqueue.model import sessions as session_model
    from sparkqueue.spark.streaming_source import StreamState, source_config

    root = str(tmp_path / "ns")
    _session_queue(root, 4, 3)
    receive, calls = session_model.Sessions.receive, []

    def failing_receive(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OperationTimeoutError("a commit deadline passed (test)")
        return receive(self, *args, **kwargs)

    monkeypatch.setattr(session_model.Sessions, "receive", failing_receive)
    state = StreamState(source_config({"namespace": root, "path": "sq"}), "stream-1", available_now=False)
    try:
        with pytest.raises(OperationTimeoutError):
            state.receive(0, 100)
    finally:
        state.stop()
    with Namespace(root) as ns:
        assert [s.locked_until_utc for s in ns.list_queue_sessions("sq")] == [None] * 4


def test_stream_consumer_settings():
    from jobs import common, stream_consumer
    from sparkqueue.errors import InvalidOperationError

    cfg = common.load_config(None, {"namespace.root": "/data/sq", "queue.name": "orders"})
    s = stream_consumer.settings(cfg)
    expected = ("/data/sq/_checkpoints/orders", "available_now", 50_000)
    assert (s["checkpoint"], s["trigger"], s["max_messages_per_trigger"]) == expected
    args = stream_consumer.parse_args(["--trigger", "30", "--checkpoint", "/ck", "--max-messages-per-trigger", "7"])
    s = stream_consumer.settings(common.load_config(None, common.overrides_from(args, stream_consumer.FLAGS)))
    assert (s["checkpoint"], s["trigger"], s["max_messages_per_trigger"]) == ("/ck", "30", 7)
    for trigger in ("soon", "nan", "inf", "-1", 0):  # nan and inf passed, then failed once Spark had started
        with pytest.raises(InvalidOperationError, match="trigger must be"):
            stream_consumer.settings(common.load_config(None, {"stream_consumer.trigger": trigger}))


def test_the_stream_names_a_subscription_in_the_short_form_too(tmp_path):
    """A stream names subscription s of topic t as 't/s' too, as the CLI does; a queue of that name comes first."""
    from sparkqueue.errors import EntityNotFoundError, InvalidOperationError
    from sparkqueue.spark.streaming import address_of

    root = str(tmp_path / "ns")
    with Namespace(root) as ns:
        ns.create_topic("t")
        ns.create_subscription("t", "s")
    source = address_of({"namespace": root, "entity": "t/s"}, sink=False)
    assert (source.entity_type, source.display) == ("subscription", "t/Subscriptions/s")
    with pytest.raises(EntityNotFoundError, match="no queue, topic or subscription named 't/nope'"):
        address_of({"namespace": root, "entity": "t/nope"}, sink=False)
    with pytest.raises(EntityNotFoundError, match="no queue or topic named 'nope'"):  # it said "topic 'nope' does not exist"
        address_of({"namespace": root, "entity": "nope"}, sink=True)
    with pytest.raises(EntityNotFoundError):  # the sink sends to queues and topics only
        address_of({"namespace": root, "entity": "t/s"}, sink=True)
    with Namespace(root) as ns:
        ns.create_topic("t/s")  # a topic of that name comes first too, as in the CLI
    with pytest.raises(InvalidOperationError, match="'t/s' is a topic"):
        address_of({"namespace": root, "entity": "t/s"}, sink=False)
    assert address_of({"namespace": root, "entity": "t/s"}, sink=True).entity_type == "topic"
    with Namespace(root) as ns:
        ns.delete_topic("t/s")
        ns.create_queue("t/s")
    assert address_of({"namespace": root, "entity": "t/s"}, sink=False).entity_type == "queue"
    with pytest.raises(InvalidOperationError, match="is a topic"):
        address_of({"namespace": root, "entity": "t"}, sink=False)
