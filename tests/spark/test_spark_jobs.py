"""The producer and consumer jobs: configuration, and no duplicate output when a consumer dies mid-batch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as sf

from jobs import common, consumer, producer
from sparkqueue import Namespace
from sparkqueue.errors import InvalidOperationError

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, lock_s: int) -> Path:
    """A job configuration for a fresh namespace under tmp_path."""
    path = tmp_path / "job.toml"
    path.write_text(
        f"""
[namespace]
root = "{tmp_path / "ns"}"
[spark]
master = "local[2]"
[spark.conf]
"spark.sql.shuffle.partitions" = "4"
"spark.ui.enabled" = "false"
[queue]
name = "jobs-q"
lock_duration = {lock_s}
[producer]
generate = 2000
body_bytes = 64
id_prefix = "order"
[consumer]
batch_size = 1000
max_messages = 100000
output = "{tmp_path / "out"}"
"""
    )
    return path


def test_config_file_and_command_line_overrides(tmp_path):
    path = write_config(tmp_path, 10)
    args = consumer.parse_args(
        ["--config", str(path), "--batch-size", "7", "--set", "queue.max_delivery_count=3", "--queue", "x"]
    )
    cfg = common.load_config(args.config, common.overrides_from(args, consumer.FLAGS))
    assert cfg["consumer"]["batch_size"] == 7 and cfg["consumer"]["max_messages"] == 100000
    assert cfg["queue"]["name"] == "x" and cfg["queue"]["max_delivery_count"] == 3 and cfg["queue"]["lock_duration"] == 10
    assert cfg["namespace"]["tier"] is None  # a default the file leaves alone: the namespace's own tier
    assert common.load_config(common.DEFAULT_CONFIG)["consumer"]["transform"] == "jobs.transforms:uppercase"


def test_misspelt_settings_are_refused_and_booleans_read_as_written(tmp_path):
    """`--set queue.crate=false` was ignored (the queue was created), and `False` read as true (`bool("False")`)."""
    path = write_config(tmp_path, 10)
    for override in ("queue.crate=false", "nosection.x=1", "queue=1", "queue.name.x=1", "spark.conf=x"):
        with pytest.raises(ValueError, match=r"unknown setting|is a section|is a value"):
            common.load_config(path, common.overrides_from(producer.parse_args(["--set", override])))
    bad = tmp_path / "bad.toml"
    bad.write_text("[consumer]\nbatch_sise = 5\n")
    with pytest.raises(ValueError, match=r"unknown setting 'consumer.batch_sise'"):
        common.load_config(bad)
    for raw, expected in (("False", False), ("false", False), ("no", False), ("True", True), ("1", True)):
        cfg = common.load_config(path, common.overrides_from(producer.parse_args(["--set", f"queue.create={raw}"])))
        assert common.flag(cfg, "queue.create") is expected
    # A number where a name or path is due: the producer made a queue "5" that the consumer refused, `format = 5`
    # failed inside Spark, `checkpoint = 5` wrote to ./5. Refused as the file is read; quoted, it is a string.
    for text in ("[queue]\nname = 5\n", "[producer]\nformat = 5\n", "[stream_consumer]\ncheckpoint = 5\n"):
        bad.write_text(text)
        with pytest.raises(ValueError, match="must be a string, got 5"):
            common.load_config(bad)
    bad.write_text('[queue]\nname = "5"\n[stream_consumer]\ntrigger = 30\n')
    assert common.load_config(bad)["queue"]["name"] == "5"
    for raw in ("2024", "2024-06-01", '"2024"'):  # --set takes such a setting's text as written (quotes optional)
        args = producer.parse_args(["--set", f"producer.id_prefix={raw}"])
        assert common.load_config(path, common.overrides_from(args))["producer"]["id_prefix"] == raw.strip('"')
    cfg = common.load_config(path, common.overrides_from(producer.parse_args(["--set", "queue.create=maybe"])))
    with pytest.raises(ValueError, match=r"setting queue\.create must be true or false, got 'maybe'"):
        common.flag(cfg, "queue.create")
    args = producer.parse_args(["--set", "spark.conf.spark.sql.shuffle.partitions=4"])  # any Spark setting, dots and all
    assert common.load_config(path, common.overrides_from(args))["spark"]["conf"]["spark.sql.shuffle.partitions"] == 4


def test_maintenance_refuses_a_root_without_namespace_and_opens_either_tier(tmp_path):
    """It made a namespace at a mistyped root; the shipped configuration's tier = "standard" refused premium ones."""
    from jobs import maintenance

    missing = tmp_path / "typo"
    with pytest.raises(SystemExit) as exit_info:
        maintenance.main(["--root", str(missing), "--no-vacuum"])
    assert exit_info.value.code == 1 and not missing.exists()
    premium = tmp_path / "premium"
    Namespace(str(premium), tier="premium").close()
    assert maintenance.main(["--root", str(premium), "--no-vacuum"]) == 0


def test_consumers_refuse_a_root_without_namespace_before_spark_starts(tmp_path):
    """The consumer made a new, empty namespace at a mistyped root and reported 0 messages consumed; both consumers
    now fail in one line before any Spark session starts (a session started here would be the tests' shared one)."""
    from jobs import stream_consumer

    missing = tmp_path / "typo"
    path = write_config(tmp_path, 10)
    for job in (consumer, stream_consumer):
        with pytest.raises(SystemExit) as exit_info:
            job.main(["--config", str(path), "--root", str(missing), "--no-progress"])
        assert exit_info.value.code == 1 and not missing.exists()


def test_consumers_and_the_demo_refuse_an_object_store_root_before_changing_anything(tmp_path, capsys):
    """A Spark receive cannot work on an object-store namespace yet. The consumers made their output table and the demo
    sent its messages before finding out (every rerun added 500 more); all three now fail in one line first."""
    from jobs import demo, stream_consumer

    path = write_config(tmp_path, 10)
    for job, args in (
        (consumer, ["--config", str(path), "--no-progress"]),
        (stream_consumer, ["--config", str(path), "--output", str(tmp_path / "out")]),
        (demo, []),
    ):
        with pytest.raises(SystemExit) as exit_info:
            job.main([*args, "--root", "az://nowhere/ns"])
        assert exit_info.value.code == 1
        assert "not supported yet on an object-store namespace" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_consumers_refuse_a_queue_that_does_not_exist_before_spark_starts(tmp_path):
    """With the shipped `queue.create = true`, a consumer given a mistyped queue created it, consumed nothing and exited 0.
    Consumers never make the queue they read: both fail in one line, before Spark starts, and create nothing."""
    from jobs import stream_consumer

    root = tmp_path / "ns"
    Namespace(str(root)).close()
    path = write_config(tmp_path, 10)
    for job in (consumer, stream_consumer):
        with pytest.raises(SystemExit) as exit_info:
            job.main(
                ["--config", str(path), "--root", str(root), "--queue", "ordres", "--set", "queue.create=true", "--no-progress"]
            )
        assert exit_info.value.code == 1
    with Namespace(str(root)) as ns:
        assert ns.list_queues() == []


def test_bad_settings_and_transforms_are_named_before_spark_starts(tmp_path):
    """A bad number or transform is a one-line error naming the setting (expected_failures), raised before any Spark work."""
    path = write_config(tmp_path, 10)
    for override, message in (
        ("queue.lock_duration=abc", "setting queue.lock_duration must be a number, got 'abc'"),
        ("producer.generate=-5", "setting producer.generate must be at least 0, got -5"),
        ("consumer.batch_size=0", "setting consumer.batch_size must be at least 1, got 0"),
        ("consumer.batch_size=1.5", "setting consumer.batch_size must be an integer, got 1.5"),  # was cut to 1
    ):
        cfg = common.load_config(path, common.overrides_from(producer.parse_args(["--set", override])))
        section, key = override.split("=")[0].split(".")
        kind, minimum = (float, 0) if key == "lock_duration" else (int, 1 if key == "batch_size" else 0)
        with pytest.raises(ValueError, match=message):
            common.number(cfg, f"{section}.{key}", kind, minimum)
    for spec, message in (("nosuch:fn", "module 'nosuch' cannot be imported"), ("jobs.transforms:nope", "is not a function")):
        with pytest.raises(InvalidOperationError, match=message):
            consumer.load_transform(spec)
    with pytest.raises(SystemExit) as exit_info:  # the job's one-line failure (expected_failures), exit status 1
        consumer.main(["--config", str(path), "--transform", "nosuch:fn", "--no-progress"])
    assert exit_info.value.code == 1
    from jobs import maintenance

    Namespace(str(tmp_path / "ns")).close()
    for job, args in (  # numbers the jobs checked only once Spark had started (about ten seconds in)
        (consumer.main, ["--batch-size", "0", "--no-progress"]),
        (consumer.main, ["--max-wait-time", "-3", "--no-progress"]),
        (producer.main, ["--generate", "-5"]),
        (producer.main, ["--set", "queue.lock_duration=999", "--queue", "new"]),  # checked when made, after Spark had started
        (maintenance.main, ["--runs", "2"]),  # ran once, silently
        (maintenance.main, ["--interval", "-1"]),
    ):
        with pytest.raises(SystemExit) as exit_info:
            job(["--config", str(path), *args])
        assert exit_info.value.code == 1


def test_a_producer_rerun_says_its_messages_were_dropped_as_duplicates(spark, tmp_path, caplog):
    """A second run with the same id prefix logged only "sent 0 messages", leaving the user to guess why."""
    path = write_config(tmp_path, 10)
    args = ["--set", "producer.generate=20", "--set", "queue.requires_duplicate_detection=true"]
    cfg = common.load_config(path, common.overrides_from(producer.parse_args(args)))
    assert producer.run(cfg, spark) == 20
    with caplog.at_level(logging.INFO, logger="jobs"):
        assert producer.run(cfg, spark) == 0
    assert "20 of the 20 generated messages were dropped by duplicate detection" in caplog.text


def test_the_producer_names_settings_an_existing_queue_does_not_have(tmp_path, caplog):
    """The producer reused an existing queue with other settings than the config's [queue] without a word."""
    cfg = common.load_config(write_config(tmp_path, 60))
    with common.namespace(cfg) as ns:
        ns.create_queue("jobs-q", lock_duration=timedelta(seconds=30), max_delivery_count=10)
        with caplog.at_level(logging.WARNING, logger="jobs"):
            assert common.ensure_queue(ns, cfg) == "jobs-q"
        assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
            "lock_duration is 30, not 60; the queue's settings apply (Namespace.update_queue changes those that can change)"
        ]
        caplog.clear()
        ns.update_queue(ns.get_queue("jobs-q"), lock_duration=timedelta(seconds=60))
        with caplog.at_level(logging.WARNING, logger="jobs"):
            assert common.ensure_queue(ns, cfg) == "jobs-q"
        assert caplog.records == []
        assert ns.get_queue("jobs-q").lock_duration == timedelta(seconds=60)


def test_an_interrupted_job_reports_in_one_line_and_exits_130(caplog):
    """Ctrl-C in a job printed three chained tracebacks (pyspark's signal handler, py4j): one line says what stays done."""
    with caplog.at_level(logging.ERROR, logger="jobs"), pytest.raises(SystemExit) as exit_info, common.expected_failures(False):
        raise KeyboardInterrupt
    assert exit_info.value.code == 130
    assert len(caplog.records) == 1 and "interrupted" in caplog.records[0].getMessage()


def test_a_consumer_refuses_an_output_table_of_other_columns_before_receiving(spark, tmp_path):
    """An output table made by another transform: the merge dropped the columns it lacked (the bodies), completed the
    messages and reported success. The consumers now refuse before receiving, and nothing is locked or completed;
    an output path that is a file is refused as well. By default the output follows the namespace root."""
    from jobs import stream_consumer

    path = write_config(tmp_path, 60)  # no lock may lapse between receive and complete, even on a loaded machine
    cfg = common.load_config(path, common.overrides_from(producer.parse_args(["--set", "producer.generate=20"])))
    assert producer.run(cfg, spark) == 20
    cfg["consumer"]["max_messages"] = 5
    assert consumer.run(cfg, spark, progress=False).completed == 5  # the default transform (uppercase) made the table
    other = dict(cfg, consumer={**cfg["consumer"], "transform": "jobs.transforms:identity"})
    with pytest.raises(InvalidOperationError, match=r"has columns .*body_upper.*, but this transform makes .*body"):
        consumer.run(other, spark, progress=False)
    with pytest.raises(InvalidOperationError, match=r"has columns .*body_upper.*, but this transform makes .*body"):
        stream_consumer.run(other, spark)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(InvalidOperationError, match=r"is a file, not a Delta table directory"):
        consumer.run(dict(cfg, consumer={**cfg["consumer"], "output": str(a_file)}), spark, progress=False)
    with Namespace(str(tmp_path / "ns")) as ns:
        props = ns.get_queue_runtime_properties("jobs-q")
        assert (props.active_message_count, props.total_message_count) == (15, 15)  # none locked, none completed
        with ns.get_queue_receiver("jobs-q") as r:
            assert len(r.receive_messages(15, max_wait_time=5)) == 15
    default = dict(cfg, consumer={**cfg["consumer"], "output": ""})
    assert consumer.output_path(default) == f"{tmp_path / 'ns'}/_output/jobs-q"


@pytest.mark.slow  # ~30 s: the job's first run is killed and rerun; CI runs it with the slow tests
def test_consumer_killed_after_writing_leaves_no_duplicate_output(spark, tmp_path):
    path = write_config(tmp_path, 10)
    cfg = common.load_config(path)
    assert producer.run(cfg, spark) == 2000
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    crashed = subprocess.run(
        [sys.executable, "-m", "jobs.consumer", "--config", str(path), "--crash-after-write", "--no-progress"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert crashed.returncode == consumer.CRASH_EXIT_CODE, crashed.stderr[-3000:]
    # Spark's JVM logs at WARN (conf/log4j2.properties), without its start-up chatter, so the job's own lines show.
    spark_lines = [line for line in crashed.stderr.splitlines() if " INFO " in line or "log4j profile" in line]
    assert not spark_lines, spark_lines[:5]
    out = tmp_path / "out"
    assert DeltaTable(str(out)).to_pyarrow_table().num_rows == 1000  # written, never completed
    with Namespace(cfg["namespace"]["root"]) as ns:
        assert ns.get_queue_runtime_properties("jobs-q").total_message_count == 2000
        locked = spark.read.format("sparkqueue").option("namespace", ns.root).load("jobs-q").where("lock_token IS NOT NULL")
        until_us = locked.agg(sf.max(sf.unix_micros("locked_until_utc"))).first()[0]
    assert until_us is not None
    time.sleep(max(0.0, until_us / 1e6 - time.time()) + 0.5)  # the crashed run's locks lapse
    result = consumer.run(cfg, spark, progress=False)
    assert result.received >= 2000 and result.completed >= 2000
    rows = DeltaTable(str(out)).to_pyarrow_table(columns=["queue", "sequence_number", "message_id", "body_upper"])
    seqs = rows.column("sequence_number").to_pylist()
    assert len(seqs) == 2000 and len(set(seqs)) == 2000
    assert rows.column("body_upper")[0].as_py().startswith('{"N": ')
    with Namespace(cfg["namespace"]["root"]) as ns:
        assert ns.get_queue_runtime_properties("jobs-q").total_message_count == 0


def test_an_older_pyspark_is_refused_at_import_with_a_clear_message():
    """On PySpark 4.0 (Databricks 17.3 LTS) the send failed with `cannot import name 'arrow_udf'`, and the worker
    daemon took receives and reads down with it; 4.1 lacks the streaming source's API."""
    code = (
        "import pyspark; pyspark.__version__ = '4.1.4'\n"
        "from sparkqueue import Namespace  # the core library works without the Spark features\n"
        "try:\n"
        "    import sparkqueue.spark\n"
        "except ImportError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pyspark | sparkqueue's Spark features need PySpark 4.2 or later")
    assert "this is PySpark 4.1.4" in out.stdout


def test_a_csv_source_is_read_with_its_header(spark, tmp_path):
    """`--format csv` sent the header line as a message, with columns _c0, _c1, ... and no partition key."""
    source = tmp_path / "in.csv"
    source.write_text("id,partition_key,qty\n1,k1,5\n2,k2,7\n")
    cfg = common.load_config(write_config(tmp_path, 10))
    cfg["producer"].update(source=str(source), format="csv")
    rows = sorted(producer.build_frame(spark, cfg).collect(), key=lambda r: r.partition_key)
    assert [(r.partition_key, r.body) for r in rows] == [
        ("k1", '{"id":"1","partition_key":"k1","qty":"5"}'),
        ("k2", '{"id":"2","partition_key":"k2","qty":"7"}'),
    ]
