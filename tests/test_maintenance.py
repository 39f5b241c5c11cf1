"""Maintenance (compaction, cleanup, checkpoint, vacuum): it keeps every message and its state, never loses or
doubles work done concurrently by other processes, and keeps tables small (docs/storage.md; docs/semantics.md §4, §5, §10).

Entity tables are plain Delta tables (docs/semantics.md §12): file counts, checkpoints and orphaned rows are read with deltalake.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from procs import PARTITIONS, drain, drain_all, key_for_partition, peek_all

from sparkqueue import Message, Namespace, ReceivedMessage, SubQueue
from sparkqueue.errors import StorageError
from sparkqueue.storage import maintenance
from sparkqueue.storage.leases import LEASE_DIR, WriteLease
from sparkqueue.storage.table import EntityTable

CTX = mp.get_context("spawn")
REPO = Path(__file__).resolve().parents[1]


def _table_path(root: str, kind: str = "queue") -> str:
    """The one queue (or topic) table of a test namespace."""
    (path,) = glob.glob(f"{root}/entities/{kind}-*")
    return path


def _live_files(path: str) -> set[str]:
    return {Path(u.removeprefix("file://")).resolve().as_posix() for u in DeltaTable(path).file_uris()}


def _files_on_disk(path: str) -> set[str]:
    return {Path(p).resolve().as_posix() for p in glob.glob(f"{path}/partition_id=*/*.parquet")}


def _send_one_by_one(ns: Namespace, msgs: list[Message], queue: str = "q") -> list[int]:
    """One commit, hence one data file, per message: the small files compaction exists for."""
    with ns.get_queue_sender(queue) as s:
        return [seq for m in msgs for seq in s.send_messages(m)]


def _snapshot(msgs: list[ReceivedMessage]) -> dict[str, tuple]:
    """Everything a browse shows about each message, by id."""
    return {
        m.message_id: (
            m.sequence_number,
            m.body,
            m.state,
            m.delivery_count,
            m.locked_until_utc,
            m.dead_letter_reason,
            m.application_properties,
            m.scheduled_enqueue_time_utc,
            m.enqueued_time_utc,
        )
        for m in msgs
    }


def _browse(ns: Namespace, queue: str = "q") -> dict[str, tuple]:
    with ns.get_queue_receiver(queue) as r, ns.get_queue_receiver(queue, sub_queue=SubQueue.DEAD_LETTER) as d:
        main, dead = peek_all(r), peek_all(d)
    assert not set(_snapshot(main)) & set(_snapshot(dead))
    return {**_snapshot(main), **_snapshot(dead)}


# ---- compaction keeps messages and their state ------------------------------------------------------


def test_compaction_reduces_files_and_keeps_every_message_and_state(ns: Namespace, root: str) -> None:
    """Compaction merges small files and keeps each message with its state: active, deferred, scheduled, dead-lettered, locked."""
    ns.create_queue("q", lock_duration=timedelta(minutes=5))
    keys = [key_for_partition(p) for p in (1, 2, 3)]
    later = datetime.now(UTC) + timedelta(hours=1)
    msgs = [
        Message(f"body-{i}", message_id=f"m{i}", partition_key=keys[i % 3], application_properties={"i": i}) for i in range(30)
    ]
    _send_one_by_one(ns, msgs)
    with ns.get_queue_sender("q") as s:
        sched_seqs = [
            s.schedule_messages(Message("later", message_id=f"s{k}", partition_key=keys[k]), later)[0] for k in range(3)
        ]
    holder = ns.get_queue_receiver("q")
    got = {m.message_id: m for m in drain(holder, 30)}
    assert len(got) == 30
    deferred = [got[f"m{i}"] for i in range(0, 6)]
    dead = [got[f"m{i}"] for i in range(6, 12)]
    abandoned = [got[f"m{i}"] for i in range(12, 18)]
    locked = [got[f"m{i}"] for i in range(18, 24)]
    for m in deferred:
        holder.defer_message(m)
    for m in dead:
        holder.dead_letter_message(m, reason="bad", error_description="test")
    for m in abandoned:
        holder.abandon_message(m)
    for m in got.values():
        if m in locked or m in deferred or m in dead or m in abandoned:
            continue
        holder.complete_message(m)  # m24..m29 are gone before compaction
    path = _table_path(root)
    before_files = len(_live_files(path))
    before = _browse(ns)
    before_counts = ns.get_queue_runtime_properties("q")

    reports = ns.run_maintenance()

    after_files = len(_live_files(path))
    assert reports["queue:q"].files_before == before_files
    assert reports["queue:q"].files_after == after_files
    assert after_files < before_files
    assert after_files <= 3  # one file per partition in use
    assert _browse(ns) == before
    after_counts = ns.get_queue_runtime_properties("q")
    for f in ("active_message_count", "deferred_message_count", "scheduled_message_count", "dead_letter_message_count"):
        assert getattr(after_counts, f) == getattr(before_counts, f), f
    assert (after_counts.deferred_message_count, after_counts.scheduled_message_count) == (6, 3)
    assert after_counts.dead_letter_message_count == 6

    for m in locked:  # the tokens handed out before compaction still hold
        holder.complete_message(m)
    with ns.get_queue_receiver("q") as r:
        again = drain_all(r)
        assert sorted(m.message_id for m in again) == sorted(m.message_id for m in abandoned)
        assert all(m.delivery_count == 1 for m in again)
        back = r.receive_deferred_messages([m.sequence_number for m in deferred])
        assert sorted(m.message_id for m in back) == [f"m{i}" for i in range(6)]
        for m in [*again, *back]:
            r.complete_message(m)
    with ns.get_queue_receiver("q", sub_queue=SubQueue.DEAD_LETTER) as d:
        dl = drain_all(d)
        assert sorted(m.message_id for m in dl) == sorted(m.message_id for m in dead)
        assert {(m.dead_letter_reason, m.dead_letter_error_description) for m in dl} == {("bad", "test")}
    with ns.get_queue_sender("q") as s:
        s.cancel_scheduled_messages(sched_seqs)
    holder.close()
    assert ns.get_queue_runtime_properties("q").scheduled_message_count == 0


def test_compaction_merges_a_topics_files_per_subscription(ns: Namespace, root: str) -> None:
    """A topic's interleaved per-subscription files are compacted too, and every subscription keeps its copies."""
    ns.create_topic("t")
    for sub in ("a", "b", "c"):
        ns.create_subscription("t", sub)
    with ns.get_topic_sender("t") as s:
        for i in range(20):
            s.send_messages(Message(f"m{i}", message_id=f"m{i}", partition_key="one-key"))
    path = _table_path(root, "topic")
    assert len(_live_files(path)) == 60
    report = ns.run_maintenance()["topic:t"]
    assert len(_live_files(path)) == 3  # one file per subscription in the key's partition
    assert report.rows_dropped == 0
    for sub in ("a", "b", "c"):
        with ns.get_subscription_receiver("t", sub) as r:
            got = drain(r, 20)
            assert [m.message_id for m in got] == [f"m{i}" for i in range(20)]  # still in sequence order


def test_sequence_numbers_keep_increasing_after_maintenance(ns: Namespace, root: str) -> None:
    """After compaction, checkpoint and vacuum (even of an emptied partition) new sequence numbers still increase."""
    ns.create_queue("q")
    key = key_for_partition(4)
    first = _send_one_by_one(ns, [Message(f"a{i}", partition_key=key) for i in range(12)])
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 12):
            r.complete_message(m)
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert DeltaTable(_table_path(root)).file_uris() == []  # nothing left in the table but its log
    with Namespace(root) as fresh:  # a new client reads the counters from the table, not from memory
        second = _send_one_by_one(fresh, [Message(f"b{i}", partition_key=key) for i in range(5)])
        fresh.run_maintenance(vacuum_retention=timedelta(0))
        third = _send_one_by_one(fresh, [Message(f"c{i}", partition_key=key) for i in range(3)])
    seqs = first + second + third
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert {s >> 48 for s in seqs} == {4}


# ---- duplicate detection and tombstones ---------------------------------------------------------------


def test_duplicate_detection_holds_after_compaction(ns: Namespace, root: str) -> None:
    """Within the window, ids of completed and pending messages are still detected after compaction (tombstones kept)."""
    ns.create_queue("q", requires_duplicate_detection=True)
    ids = [f"id-{i}" for i in range(40)]
    _send_one_by_one(ns, [Message(i, message_id=i) for i in ids])
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 20):
            r.complete_message(m)
    path = _table_path(root)
    before = len(_live_files(path))
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert len(_live_files(path)) < before
    with ns.get_queue_sender("q") as s:
        assert s.send_messages([Message("again", message_id=i) for i in ids]) == []
        assert len(s.send_messages(Message("new", message_id="id-new"))) == 1
    rp = ns.get_queue_runtime_properties("q")
    assert rp.active_message_count == 21


def test_topic_duplicate_detection_holds_after_maintenance(ns: Namespace) -> None:
    """A duplicate-detecting topic still drops repeats after maintenance, with and without subscriptions."""
    ns.create_topic("t", requires_duplicate_detection=True)
    with ns.get_topic_sender("t") as s:
        for i in range(10):
            s.send_messages(Message("x", message_id=f"early-{i}"))
    ns.run_maintenance(vacuum_retention=timedelta(0))  # a topic without subscriptions: only its id records
    ns.create_subscription("t", "a")
    time.sleep(1.1)  # senders re-read the subscriptions after at most a second
    with ns.get_topic_sender("t") as s:
        for i in range(10):
            s.send_messages(Message("x", message_id=f"late-{i}"))
    ns.run_maintenance(vacuum_retention=timedelta(0))
    with ns.get_topic_sender("t") as s:
        repeats = [Message("x", message_id=f"{w}-{i}") for w in ("early", "late") for i in range(10)]
        assert s.send_messages(repeats) == []
    with ns.get_subscription_receiver("t", "a") as r:
        assert sorted(m.message_id for m in drain_all(r)) == sorted(f"late-{i}" for i in range(10))


def test_compaction_drops_tombstones_older_than_the_cutoff(ns: Namespace, root: str) -> None:
    """Compaction drops completed-message tombstones enqueued before its cutoff and keeps the younger ones."""
    ns.create_queue("q", requires_duplicate_detection=True)
    old = [f"old-{i}" for i in range(10)]
    young = [f"young-{i}" for i in range(10)]
    _send_one_by_one(ns, [Message(i, message_id=i, partition_key="k") for i in old])
    time.sleep(0.05)
    cutoff = datetime.now(UTC)
    time.sleep(0.05)
    _send_one_by_one(ns, [Message(i, message_id=i, partition_key="k") for i in young])
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 20):
            r.complete_message(m)
    path = _table_path(root)
    report = maintenance.compact(EntityTable(path, PARTITIONS), drop_before=cutoff)
    assert report.rows_dropped == 10
    rows = DeltaTable(path).to_pyarrow_table(columns=["message_id", "state"])
    assert sorted(rows.column("message_id").to_pylist()) == sorted(young)
    assert set(rows.column("state").to_pylist()) == {"completed"}
    again = maintenance.compact(EntityTable(path, PARTITIONS), drop_before=cutoff)  # a lone file: nothing to do
    assert (again.rows_dropped, again.files_compacted) == (0, 0)


@pytest.mark.slow
def test_run_maintenance_drops_expired_tombstones(ns: Namespace, root: str) -> None:
    """run_maintenance drops tombstones once the 20 s duplicate-detection window has passed, and not before."""
    ns.create_queue("q", requires_duplicate_detection=True, duplicate_detection_history_time_window=timedelta(seconds=20))
    ids = [f"id-{i}" for i in range(20)]
    _send_one_by_one(ns, [Message(i, message_id=i) for i in ids])
    with ns.get_queue_receiver("q") as r:
        for m in drain(r, 20):
            r.complete_message(m)
    path = _table_path(root)
    ns.run_maintenance()
    assert DeltaTable(path).to_pyarrow_table(columns=["message_id"]).num_rows == 20
    with ns.get_queue_sender("q") as s:
        assert s.send_messages([Message("x", message_id=i) for i in ids]) == []
    time.sleep(21)
    reports = ns.run_maintenance()
    assert reports["queue:q"].rows_dropped == 20
    assert DeltaTable(path).to_pyarrow_table(columns=["message_id"]).num_rows == 0
    with ns.get_queue_sender("q") as s:
        assert len(s.send_messages([Message("x", message_id=i) for i in ids])) == 20


@pytest.mark.parametrize("retention", ["1h", 3600, float("nan"), timedelta(days=-1), None])
def test_a_bad_vacuum_retention_changes_nothing(ns: Namespace, root: str, retention: object) -> None:
    """run_maintenance checks vacuum_retention before it touches a table: a clear error, and not one file changed."""
    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        for i in range(5):
            s.send_messages(Message(f"m{i}"))
    before = sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())
    with pytest.raises(ValueError, match="vacuum_retention"):
        ns.run_maintenance(vacuum_retention=retention)  # type: ignore[arg-type]
    assert sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file()) == before


def test_a_subscription_created_after_the_catalog_read_is_no_orphan(ns: Namespace, root: str) -> None:
    """Compaction drops rows of subscriptions its catalog read missed only if they are older than the read (less CLOCK_MARGIN)."""
    ns.create_topic("t", enable_partitioning=False)
    ns.create_subscription("t", "old")
    stale = maintenance.LiveSubscriptions(frozenset({"old.x"}), datetime.now(UTC))  # read before "new" was created
    ns.create_subscription("t", "new")
    with ns.get_topic_sender("t") as s:
        for i in range(5):
            s.send_messages(Message(f"m{i}"))
    report = maintenance.compact(EntityTable(_table_path(root, "topic"), 1), live_subscriptions=stale)
    assert report.rows_dropped == 0
    assert len(peek_all(ns.get_subscription_receiver("t", "new"))) == 5


def _maintain_without_margin(root: str, running: Any, stop: Any, runs: Any) -> None:
    """Run maintenance in a loop with no clock margin (one machine), so only the order of read and clock protects."""
    maintenance.CLOCK_MARGIN = timedelta(0)
    ns = Namespace(root)
    while not stop.is_set():
        ns.run_maintenance(vacuum=False)
        runs.value += 1
        running.set()


def _create_and_send(root: str, count: int) -> None:
    """Create subscriptions one by one, sending three messages to the topic after each."""
    ns = Namespace(root)
    for i in range(count):
        ns.create_subscription("t", f"s{i:02d}")
        with ns.get_topic_sender("t") as s:
            s.send_messages([Message(f"{i}-{k}") for k in range(3)])
        time.sleep(0.1)  # let maintenance runs fall between creations, sends and the next creation


def test_maintenance_racing_subscription_creation_loses_nothing(root: str) -> None:
    """A maintenance process running throughout never drops a copy of a subscription created while it runs."""
    ns = Namespace(root)
    for q in range(4):  # entities maintained before the topic widen the window between catalog read and compaction
        ns.create_queue(f"a{q}", enable_partitioning=False)
        ns.get_queue_sender(f"a{q}").send_messages([Message("x") for _ in range(20)])
    ns.create_topic("t", enable_partitioning=False)
    running, stop, runs = CTX.Event(), CTX.Event(), CTX.Value("i", 0)
    maint = CTX.Process(target=_maintain_without_margin, args=(root, running, stop, runs))
    maint.start()
    try:
        assert running.wait(60)
        before = runs.value
        _create_and_send(root, 15)
        assert runs.value - before >= 5  # maintenance ran throughout
    finally:
        stop.set()
        maint.join(60)
    assert maint.exitcode == 0
    counts = {i: len(peek_all(ns.get_subscription_receiver("t", f"s{i:02d}"), batch=200)) for i in range(15)}
    assert counts == {i: 3 * (15 - i) for i in range(15)}


def test_run_maintenance_drops_rows_of_deleted_subscriptions(ns: Namespace, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies held for a deleted subscription are removed from the topic's table; the others stay receivable."""
    monkeypatch.setattr(maintenance, "CLOCK_MARGIN", timedelta(0))  # one machine: its rows are orphans at once
    ns.create_topic("t")
    ns.create_subscription("t", "keep")
    ns.create_subscription("t", "gone")
    with ns.get_topic_sender("t") as s:
        for i in range(30):
            s.send_messages(Message(f"m{i}", message_id=f"m{i}", partition_key=f"k{i % 4}"))
    path = _table_path(root, "topic")
    subs = DeltaTable(path).to_pyarrow_table(columns=["subscription"]).column("subscription")
    assert len(pc.unique(subs)) == 2
    ns.delete_subscription("t", "gone")
    reports = ns.run_maintenance(vacuum_retention=timedelta(0))
    assert reports["topic:t"].rows_dropped == 30
    left = DeltaTable(path).to_pyarrow_table(columns=["subscription", "message_id"])
    assert left.num_rows == 30
    assert len(pc.unique(left.column("subscription"))) == 1
    assert reports["topic:t"].files_after < reports["topic:t"].files_before
    with ns.get_subscription_receiver("t", "keep") as r:
        assert sorted(m.message_id for m in drain(r, 30)) == sorted(f"m{i}" for i in range(30))


def test_maintenance_leaves_an_unavailable_partition_alone(ns: Namespace, root: str) -> None:
    """With a partition down, maintenance compacts the others and does not touch it; its messages survive."""
    ns.create_queue("q")
    down, up = key_for_partition(5), key_for_partition(9)
    _send_one_by_one(ns, [Message(f"{k}-{i}", message_id=f"{k}-{i}", partition_key=k) for k in (down, up) for i in range(6)])
    ns.fault_injector("q").fail(5, ("read", "write"))
    report = ns.run_maintenance(vacuum_retention=timedelta(0))["queue:q"]
    assert 5 not in report.per_partition_files
    assert report.per_partition_files[9] == 1
    ns.fault_injector("q").heal()
    assert len([f for f in _live_files(_table_path(root)) if "/partition_id=5/" in f]) == 6
    with ns.get_queue_receiver("q") as r:
        assert len(drain(r, 12)) == 12


def test_maintenance_compacts_checkpoints_and_vacuums_around_a_damaged_partition(root: str) -> None:
    """One damaged file in partition 3 stopped the whole table's maintenance ("partition 3 is unavailable"): no other
    partition compacted, no checkpoint, no vacuum, at every run. The damaged partition is now left alone and reported,
    the rest is maintained, and vacuum keeps every live file of it, the damaged one included."""
    down, up = key_for_partition(3), key_for_partition(9)
    with Namespace(root) as ns:
        ns.create_queue("q")
        _send_one_by_one(ns, [Message(f"{k}-{i}", message_id=f"{k}-{i}", partition_key=k) for k in (down, up) for i in range(6)])
    path = _table_path(root)
    partition_3 = sorted(glob.glob(f"{path}/partition_id=3/*.parquet"))
    assert len(partition_3) == 6
    victim = Path(partition_3[2])
    victim.write_bytes(b"\0" * victim.stat().st_size)  # a zeroed file: its damage is found by compaction's read
    for run in range(2):
        with Namespace(root) as ns:  # a fresh process: nothing marked before the run
            report = ns.run_maintenance(vacuum_retention=timedelta(0))["queue:q"]
        assert report.error is None, report.error
        assert list(report.unavailable_partitions) == [3] and victim.name in report.unavailable_partitions[3]
        assert report.checkpointed_version is not None
        assert report.per_partition_files == {p: 1 if p == 9 else 0 for p in range(PARTITIONS) if p != 3}
        assert report.vacuumed_files == (6 if run == 0 else 0)  # partition 9's replaced files
        assert sorted(glob.glob(f"{path}/partition_id=3/*.parquet")) == partition_3  # all kept, live as they are
        assert {f for f in _live_files(path) if "/partition_id=3/" in f} == {Path(f).resolve().as_posix() for f in partition_3}
    assert os.path.exists(f"{path}/_delta_log/{report.checkpointed_version:020d}.checkpoint.parquet")
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        assert sorted(m.message_id for m in drain(r, 6)) == sorted(f"{up}-{i}" for i in range(6))


def test_the_maintenance_job_reports_a_partition_it_left_alone(root: str) -> None:
    """`python -m jobs.maintenance` exits 0 with a damaged partition, and says which partition it left alone and why."""
    with Namespace(root) as ns:
        ns.create_queue("q")
        _send_one_by_one(ns, [Message(f"m{i}", partition_key=key_for_partition(3)) for i in range(3)])
    victim = Path(sorted(glob.glob(f"{_table_path(root)}/partition_id=3/*.parquet"))[0])
    victim.write_bytes(b"\0" * victim.stat().st_size)
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.maintenance", "--root", root, "--no-vacuum"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "queue:q: partition 3 left alone: partition 3 is unavailable" in proc.stdout and victim.name in proc.stdout


@pytest.mark.parametrize("pointer", ["future version", "one past the newest entry"])
def test_a_checkpoint_corrects_a_last_checkpoint_that_names_no_checkpoint(ns: Namespace, root: str, pointer: str) -> None:
    """`_last_checkpoint` never moves back, so one naming a version with no checkpoint stayed for good, and delta-rs
    could not open the table. A checkpoint rewrites a pointer that names no existing checkpoint."""
    ns.create_queue("q", enable_partitioning=False)
    ns.get_queue_sender("q").send_messages([Message(f"m{i}") for i in range(3)])  # one file: nothing to compact
    path = _table_path(root)
    newest = max(int(Path(f).name[:20]) for f in glob.glob(f"{path}/_delta_log/*.json"))
    version = 999_999 if pointer == "future version" else newest + 1
    Path(path, "_delta_log", "_last_checkpoint").write_text(f'{{"version": {version}, "size": 3}}')
    with pytest.raises(Exception, match="_last_checkpoint"):
        DeltaTable(path)
    checkpointed = ns.run_maintenance(vacuum=False)["queue:q"].checkpointed_version
    assert checkpointed == newest
    assert json.loads(Path(path, "_delta_log", "_last_checkpoint").read_text())["version"] == checkpointed
    assert DeltaTable(path).to_pyarrow_table().num_rows == 3


# ---- checkpoint and vacuum -------------------------------------------------------------------------


def test_run_maintenance_writes_a_checkpoint(ns: Namespace, root: str) -> None:
    """run_maintenance writes a Delta checkpoint at the table's version; a new client reads the table from it."""
    ns.create_queue("q")
    _send_one_by_one(ns, [Message(f"m{i}", message_id=f"m{i}") for i in range(8)])
    reports = ns.run_maintenance()
    path = _table_path(root)
    version = reports["queue:q"].checkpointed_version
    assert version is not None
    assert os.path.exists(f"{path}/_delta_log/{version:020d}.checkpoint.parquet")
    assert glob.glob(f"{path}/_delta_log/*.checkpoint.parquet")
    with Namespace(root) as fresh, fresh.get_queue_receiver("q") as r:
        assert sorted(m.message_id for m in drain(r, 8)) == sorted(f"m{i}" for i in range(8))


def test_maintenance_trims_the_delta_log(ns: Namespace, root: str) -> None:
    """Log entries older than the log retention that precede the newest checkpoint are deleted; the table stays whole."""
    ns.create_queue("q")
    _send_one_by_one(ns, [Message(f"m{i}", message_id=f"m{i}", partition_key="k") for i in range(30)])
    log_dir = f"{_table_path(root)}/_delta_log"
    commits = sorted(glob.glob(f"{log_dir}/*.json"))
    assert len(commits) > 30
    an_hour_ago = time.time() - 3600
    for f in commits:  # age the history past the retention
        os.utime(f, (an_hour_ago, an_hour_ago))
    version = ns.run_maintenance()["queue:q"].checkpointed_version
    assert version is not None
    left = sorted(int(Path(f).name[:20]) for f in glob.glob(f"{log_dir}/*.json"))
    assert left and min(left) >= version - 1  # only the newest entries remain (the vacuum's own commits among them)
    assert len(left) < 10
    with Namespace(root) as fresh, fresh.get_queue_receiver("q") as r:
        assert sorted(m.message_id for m in drain(r, 30)) == sorted(f"m{i}" for i in range(30))
    with ns.get_queue_sender("q") as s:  # the open client's handles still work on the trimmed log
        assert len(s.send_messages(Message("after", message_id="after"))) == 1


def test_an_old_file_removed_minutes_ago_is_kept_for_the_retention_after_the_log_forgot_its_removal(
    ns: Namespace, root: str
) -> None:
    """The log keeps minutes of entries, vacuum's retention is an hour. Once the entry that removed a file was trimmed,
    vacuum judged the file by its age alone: a two-hour-old file went minutes after its removal, under any reader
    still holding an older snapshot (a long spark.read, a Delta reader), which then found a live file missing. Vacuum
    now counts from when it first found the file unreferenced."""
    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message(f"m{i}", message_id=f"m{i}") for i in range(5)])
    table = _table_path(root)
    two_hours_ago = time.time() - 7200
    sent = glob.glob(f"{table}/partition_id=*/*.parquet")
    for f in [*sent, *glob.glob(f"{table}/_delta_log/*.json")]:
        os.utime(f, (two_hours_ago, two_hours_ago))
    pinned = DeltaTable(table)  # a reader holding the version before the removal
    with ns.get_queue_receiver("q") as r:
        r.complete_messages(drain(r, 5))
    three_minutes_ago = time.time() - 180  # past the log retention: the removal's entry is trimmed
    for f in glob.glob(f"{table}/_delta_log/*.json"):
        os.utime(f, (three_minutes_ago, three_minutes_ago))
    for _ in range(2):
        ns.run_maintenance()
        assert all(os.path.exists(f) for f in sent)
    assert pinned.to_pyarrow_table().num_rows == 5
    ns.run_maintenance(vacuum_retention=timedelta(0))  # found unreferenced long enough now
    assert not any(os.path.exists(f) for f in sent)


def test_run_maintenance_vacuums_the_catalog_and_trims_its_log(ns: Namespace, root: str) -> None:
    """Every catalog change writes the whole catalog to a new file: maintenance deletes the replaced files once past
    the vacuum retention and the log entries behind its checkpoint once past the log retention; nothing else changes."""
    for i in range(30):
        ns.create_queue(f"q{i:02d}")
    catalog = f"{root}/_catalog"

    def files() -> list[str]:
        return glob.glob(f"{catalog}/*.parquet")

    assert len(files()) >= 30
    report = ns.run_maintenance()["catalog"]  # default retention: files replaced just now stay for old readers
    assert report.error is None and report.vacuumed_files == 0 and len(files()) >= 30
    forty_days_ago = time.time() - 40 * 86400  # past the catalog's log retention (Delta's default, 30 days)
    for f in glob.glob(f"{catalog}/**", recursive=True):
        os.utime(f, (forty_days_ago, forty_days_ago))
    assert ns.run_maintenance(vacuum=False)["catalog"].vacuumed_files == 0
    assert len(files()) >= 30
    report = ns.run_maintenance(vacuum_retention=timedelta(0))["catalog"]
    assert report.error is None and report.vacuumed_files >= 29 and report.checkpointed_version is not None
    (live,) = files()
    assert report.files_after == 1
    entries = [int(Path(f).name[:20]) for f in glob.glob(f"{catalog}/_delta_log/*.json")]
    assert entries and min(entries) >= report.checkpointed_version
    assert DeltaTable(catalog).to_pyarrow_table().num_rows == 30  # an independent reader sees the whole catalog
    with Namespace(root) as fresh:
        assert [q.name for q in fresh.list_queues()] == [f"q{i:02d}" for i in range(30)]
        fresh.create_queue("after")
    assert len(ns.list_queues()) == 31
    assert os.path.exists(live)  # the default retention keeps the file "after" replaced
    assert ns.run_maintenance()["catalog"].vacuumed_files == 0


def test_vacuum_removes_unreferenced_files(ns: Namespace, root: str) -> None:
    """With retention 0, vacuum deletes every data file the table no longer references; the default retention keeps them."""
    ns.create_queue("q")
    _send_one_by_one(ns, [Message(f"m{i}", message_id=f"m{i}", partition_key=f"k{i % 3}") for i in range(15)])
    path = _table_path(root)
    ns.run_maintenance()  # compaction with the default retention: replaced files stay on disk for old readers
    assert len(_files_on_disk(path)) > len(_live_files(path))
    reports = ns.run_maintenance(vacuum_retention=timedelta(0))
    assert reports["queue:q"].vacuumed_files > 0
    assert _files_on_disk(path) == _live_files(path)
    with ns.get_queue_receiver("q") as r:
        assert len(drain(r, 15)) == 15


def test_vacuum_removes_old_never_committed_files_but_keeps_fresh_ones(ns: Namespace, root: str) -> None:
    """Files a killed writer left uncommitted are vacuumed once old; a fresh one (a live writer's) is kept."""
    ns.create_queue("q")
    _send_one_by_one(ns, [Message("m", partition_key="k")])
    path = _table_path(root)
    (live,) = _live_files(path)
    stale = f"{os.path.dirname(live)}/part-killed-writer.snappy.parquet"
    fresh = f"{os.path.dirname(live)}/part-live-writer.snappy.parquet"
    shutil.copy(live, stale)
    shutil.copy(live, fresh)
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert not os.path.exists(stale)
    assert os.path.exists(fresh)
    assert os.path.exists(live)
    with ns.get_queue_receiver("q") as r:
        assert len(drain_all(r)) == 1


def test_vacuum_keeps_old_uncommitted_files_of_a_live_write_lease_only(ns: Namespace, root: str) -> None:
    """A long write (a DataFrame send) holds a lease: its old uncommitted files stay; a stale lease's files go, and the lease."""
    ns.create_queue("q")
    _send_one_by_one(ns, [Message("m", partition_key="k")])
    path = _table_path(root)
    (live,) = _live_files(path)
    folder = os.path.dirname(live)
    table = EntityTable(path, PARTITIONS)
    two_hours_ago = time.time() - 7200
    with WriteLease(table.store) as lease, WriteLease(table.store) as stalled:
        kept = f"{folder}/part-{lease.tag}-1.lz4.parquet"
        staged = f"{path}/spark-send/{lease.tag}-0/_temporary/0/part-00000.lz4.parquet"  # Spark's writer, mid-job
        dropped = f"{folder}/part-{stalled.tag}-1.lz4.parquet"
        os.makedirs(os.path.dirname(staged))
        for copy in (kept, staged, dropped):
            shutil.copy(live, copy)
            os.utime(copy, (two_hours_ago, two_hours_ago))
        stalled_file = f"{path}/{LEASE_DIR}/{stalled.id}"
        os.utime(stalled_file, (two_hours_ago, two_hours_ago))  # its holder stopped refreshing it (killed)
        ns.run_maintenance(vacuum_retention=timedelta(0))
        assert os.path.exists(kept) and os.path.exists(staged)
        assert not os.path.exists(dropped) and not os.path.exists(stalled_file)
        assert os.path.exists(f"{path}/{LEASE_DIR}/{lease.id}")
    assert not os.path.exists(f"{path}/{LEASE_DIR}/{lease.id}")  # released
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert not os.path.exists(kept) and not os.path.exists(staged)  # never committed: judged by age once released
    assert os.path.exists(live)
    with ns.get_queue_receiver("q") as r:
        assert len(drain_all(r)) == 1


def test_a_dataframe_send_whose_write_lease_lapsed_commits_nothing(ns: Namespace, root: str) -> None:
    """The lease's refreshes failed (or the driver was paused) long enough that vacuum may have taken its files.

    The send's commit refuses (StorageError) and deletes its files instead of committing files
    that may be gone: before, such a commit made a partition unreadable.
    """
    from sparkqueue.spark.commit import Written, commit_renumbering

    ns.create_queue("q")
    _send_one_by_one(ns, [Message("m", partition_key="k")])
    table = ns.broker.entity("queue", "q").table
    (live,) = table.snapshot().files
    p = live.partition
    base = table.snapshot().transaction_version(f"sparkqueue.seq.{p}")
    with WriteLease(table.store) as lease:
        (adds,) = table.data.write_all([(p, table.data.read(live.path), 1000)], lease.tag)
        stale = time.time() - 400  # no refresh for almost 7 minutes
        os.utime(f"{table.uri}/{LEASE_DIR}/{lease.id}", (stale, stale))
        written = Written(adds, {p: 1}, {p: (base or 0) + 1}, {p: None})
        with pytest.raises(StorageError, match="was not refreshed"):
            commit_renumbering(table, adds, written, {p: base}, ns.broker.deadline())
    assert not any(os.path.exists(f"{table.uri}/{a.path}") for a in adds)
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in drain_all(r)] == ["m"]


def test_a_write_lease_that_went_unrefreshed_too_long_is_not_refreshed_back_to_life(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused driver resumes: its refresh thread must not revive a lease vacuum may have judged stale meanwhile."""
    from sparkqueue.storage import leases

    monkeypatch.setattr(leases, "LEASE_REFRESH_S", 0.05)
    ns.create_queue("q")
    table = ns.broker.entity("queue", "q").table
    with WriteLease(table.store) as lease:
        path = f"{table.uri}/{LEASE_DIR}/{lease.id}"
        lease._written -= leases.LEASE_LIVE_S  # as after a pause of ten minutes (monotonic time counts it)
        give_up = time.monotonic() + 30  # a bound on a hang, not a timed assertion
        while os.path.exists(path) and time.monotonic() < give_up:
            time.sleep(0.05)
        assert not os.path.exists(path)
        with pytest.raises(StorageError, match="was not refreshed"):
            leases.require_live(table.store, [f"partition_id=0/part-{lease.tag}-x.lz4.parquet"])


def test_maintenance_job_runs_in_a_subprocess(ns: Namespace, root: str) -> None:
    """`python -m jobs.maintenance --root <root>` exits 0 and compacts the namespace's tables."""
    ns.create_queue("q")
    _send_one_by_one(ns, [Message(f"m{i}", partition_key="k") for i in range(10)])
    path = _table_path(root)
    assert len(_live_files(path)) == 10
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.maintenance", "--root", root, "--vacuum-retention-hours", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(_live_files(path)) == 1
    assert _files_on_disk(path) == _live_files(path)


# ---- maintenance beside live senders and receivers in other processes ------------------------------------


def _sender(root: str, total: int, out: str) -> None:
    """Send `total` messages in batches of 10, alternately keyed and unkeyed; record the ids of each acknowledged batch."""
    with Namespace(root) as ns, ns.get_queue_sender("q") as s:
        for b in range(total // 10):
            ids = [f"b{b}-{k}" for k in range(10)]
            key = f"key-{b % 7}" if b % 2 else None
            s.send_messages([Message(i, message_id=i, partition_key=key) for i in ids])
            with open(out, "a", encoding="utf-8") as f:
                f.write("".join(f"{i}\n" for i in ids))


def _receiver(root: str, total: int, out: str, deadline_s: float) -> None:
    """Receive and complete until `total` completions succeeded; record each successful completion."""
    done = 0
    give_up = time.monotonic() + deadline_s
    with Namespace(root) as ns, ns.get_queue_receiver("q") as r:
        while done < total and time.monotonic() < give_up:
            for m in r.receive_messages(max_message_count=20, max_wait_time=0.5):
                r.complete_message(m)
                done += 1
                with open(out, "a", encoding="utf-8") as f:
                    f.write(f"{m.message_id}\n")


def _lines(path: str) -> list[str]:
    return Path(path).read_text(encoding="utf-8").split() if os.path.exists(path) else []


def test_compaction_beside_sender_and_receiver_processes_loses_and_doubles_nothing(
    ns: Namespace, root: str, tmp_path: Path
) -> None:
    """Maintenance running beside a sender and a receiver process loses no message and completes none twice."""
    total = 400
    ns.create_queue("q", lock_duration=timedelta(seconds=30))
    sent, completed = str(tmp_path / "sent"), str(tmp_path / "completed")
    children = [
        CTX.Process(target=_sender, args=(root, total, sent), daemon=True),
        CTX.Process(target=_receiver, args=(root, total, completed, 150.0), daemon=True),
    ]
    for c in children:
        c.start()
    compacted = runs = 0
    while any(c.is_alive() for c in children):
        report = ns.run_maintenance(vacuum_retention=timedelta(0))["queue:q"]
        compacted += report.files_compacted
        runs += 1
        time.sleep(0.2)
    for c in children:
        c.join()
        assert c.exitcode == 0
    assert runs >= 2
    assert compacted > 0
    sent_ids, done_ids = _lines(sent), _lines(completed)
    assert len(sent_ids) == total
    assert len(done_ids) == len(set(done_ids))  # no message was completed twice
    assert set(done_ids) == set(sent_ids)  # and none was lost
    assert ns.get_queue_runtime_properties("q").total_message_count == 0


def _orphan_table(ns: Namespace) -> str:
    """A table with no catalog entry, as a process killed between making a queue's table and recording it leaves one."""
    path = "entities/queue-orphan"
    EntityTable.create(f"{ns.root}/{path}", ns.storage_options)
    return path


@pytest.mark.parametrize("kind", ["queue", "topic"])
def test_a_create_held_up_until_maintenance_removed_its_table_fails_and_leaves_no_entry(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A create paused between making its table and recording it, longer than the orphan retention, finds its table gone.

    Before, the create returned and the catalog named a table that no longer existed: every send
    failed for good. Now the create raises StorageError, leaves no entry, and the name can be created again.
    """
    real = EntityTable.create

    def held_up(uri: str, storage_options: dict[str, str] | None = None) -> None:
        real(uri, storage_options)
        two_hours_ago = time.time() - 7200
        for f in glob.glob(f"{uri}/**/*", recursive=True):  # the pause lasted two hours
            os.utime(f, (two_hours_ago, two_hours_ago))
        code = f"from sparkqueue import Namespace; Namespace({ns.root!r}).run_maintenance()"  # another process's maintenance
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        assert not os.path.exists(f"{uri}/_delta_log")  # removed as an orphan

    monkeypatch.setattr(EntityTable, "create", staticmethod(held_up))
    create = ns.create_queue if kind == "queue" else ns.create_topic
    with pytest.raises(StorageError, match="maintenance removed its new table"):
        create("e")
    monkeypatch.undo()
    assert (ns.list_queues() if kind == "queue" else ns.list_topics()) == []
    create("e")  # the name is free
    sender = ns.get_queue_sender("e") if kind == "queue" else ns.get_topic_sender("e")
    with sender as s:
        s.send_messages(Message("after"))


def test_maintenance_removes_a_table_no_catalog_entry_names_and_nothing_else(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, such a table stayed for good: neither check() nor vacuum looked outside the catalog's tables."""
    monkeypatch.setattr(maintenance, "ORPHAN_RETENTION", timedelta(0))  # the orphan need not be old here
    with store.open() as ns:
        ns.create_queue("q")
        ns.create_topic("t")
        ns.create_subscription("t", "s")
        with ns.get_queue_sender("q") as s:
            s.send_messages(Message("kept"))
        with ns.get_topic_sender("t") as s:
            s.send_messages(Message("kept too"))
        orphan = _orphan_table(ns)
        assert ns.store.list(orphan + "/")
        reports = ns.run_maintenance(vacuum_retention=timedelta(0))
        assert reports["orphan tables"].vacuumed_files >= 1
        assert ns.store.list(orphan + "/") == []
        with ns.get_queue_receiver("q") as r:
            assert [str(m) for m in drain(r, 1)] == ["kept"]
        with ns.get_subscription_receiver("t", "s") as r:
            assert [str(m) for m in drain(r, 1)] == ["kept too"]


def test_an_unnamed_table_holding_messages_is_reported_and_kept_not_removed(ns: Namespace, root: str) -> None:
    """The catalog's newest entry (the create of "orders") deleted: the queue vanished without a report, and maintenance
    then removed its table, messages and all, as an orphan. check() reports such a table and maintenance keeps it; a
    table that carries a delete's tombstone, or holds no data file, still goes."""
    ns.create_queue("a")
    ns.create_queue("orders")  # the catalog's newest entry
    with ns.get_queue_sender("orders") as s:
        s.send_messages([Message(f"order {i}") for i in range(5)])
    table = ns.broker.entity("queue", "orders").table.uri
    ns.close()
    os.remove(sorted(glob.glob(f"{root}/_catalog/_delta_log/*.json"))[-1])
    deleting = _orphan_table(Namespace(root))  # a delete killed after its tombstone: data files and the mark
    os.makedirs(f"{root}/{deleting}/partition_id=0")
    Path(f"{root}/{deleting}/partition_id=0/part-x.parquet").write_bytes(b"x")
    Path(f"{root}/{deleting}/_sparkqueue_deleting").write_bytes(b"")
    leased = "entities/queue-leased"  # deleted, then a Spark send's lease refresher wrote its lease again: no data
    EntityTable.create(f"{root}/{leased}")
    os.makedirs(f"{root}/{leased}/{LEASE_DIR}")
    Path(f"{root}/{leased}/{LEASE_DIR}/lease-1").write_bytes(b"{}")
    Path(f"{root}/{leased}/.tmp-1").write_bytes(b"x")
    old = time.time() - 3 * 3600
    for folder, _, names in os.walk(f"{root}/entities"):  # dot files too
        for name in names:
            os.utime(f"{folder}/{name}", (old, old))
    with Namespace(root, create=False) as again:
        assert [q.name for q in again.list_queues()] == ["a"]
        (found,) = again.check()
        assert found.table == f"table entities/{os.path.basename(table)}" and "no catalog entry names" in found.problem
        assert not found.repaired
        again.run_maintenance()
        assert len(glob.glob(f"{table}/**/*.parquet", recursive=True)) == 1  # the five messages' file stayed
        assert not os.path.exists(f"{root}/{deleting}")
        assert not os.path.exists(f"{root}/{leased}")
        assert [f.table for f in again.check(repair=True)] == [found.table]  # repair leaves it too
        again.create_queue("fresh")  # a table made since the orphan retention is no finding: its create may be running
        with again.get_queue_sender("fresh") as s:
            s.send_messages(Message("new"))
        assert [f.table for f in again.check()] == [found.table]
    assert DeltaTable(table).to_pyarrow_table(columns=["body"]).num_rows == 5  # readable as it was


def test_a_recent_table_without_catalog_entry_is_left_for_its_create_to_record(ns: Namespace) -> None:
    orphan = _orphan_table(ns)
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert ns.store.list(orphan + "/") != []  # younger than ORPHAN_RETENTION: a create may be about to record it
    old = time.time() - maintenance.ORPHAN_RETENTION.total_seconds() - 60
    for e in ns.store.list(orphan + "/"):
        os.utime(f"{ns.root}/{e.path}", (old, old))
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert ns.store.list(orphan + "/") == []


def test_a_table_folder_without_files_yet_is_left_for_its_create(ns: Namespace) -> None:
    """A create's first step makes `_delta_log/` before any file: maintenance at any retention deleted it at once
    (no file said how old it was), and the create then failed with delta-rs's raw TableNotFoundError."""
    folder = f"{ns.root}/entities/queue-being-made/_delta_log"
    os.makedirs(folder)
    ns.run_maintenance(vacuum_retention=timedelta(0))
    assert os.path.isdir(folder)


@pytest.mark.parametrize("spelling", ["root", "another"])
def test_a_table_recorded_by_its_absolute_path_is_not_an_orphan(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """Namespaces made before table paths were relative record absolute ones: such a live table was swept.

    `another`: recorded under another spelling of the root (a symlink, a mount point), still this namespace's table.
    """
    import dataclasses

    ns.create_queue("q")
    with ns.get_queue_sender("q") as s:
        s.send_messages(Message("kept"))
    real = ns.broker.catalog.entries
    recorded_root = ns.root if spelling == "root" else "/mnt/elsewhere/ns"

    def absolute(*args: Any, **kwargs: Any) -> Any:
        return [
            dataclasses.replace(e, table_path=f"{recorded_root}/{e.table_path}") if e.table_path else e
            for e in real(*args, **kwargs)
        ]

    monkeypatch.setattr(ns.broker.catalog, "entries", absolute)
    monkeypatch.setattr(maintenance, "ORPHAN_RETENTION", timedelta(0))
    maintenance.remove_orphan_tables(ns.store, "entities", ns._table_paths, timedelta(0))
    monkeypatch.undo()
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in drain(r, 1)] == ["kept"]


def _check_deleting_b_midway(ns: Namespace, monkeypatch: pytest.MonkeyPatch, child: list[str]) -> list[str]:
    """Queues a, b and c with a message each; check() then runs `python <child>` (a process deleting b) right before
    it checks queue b. Returns the list of tables check() reaches (the caller may clear it between checks)."""
    import sparkqueue.management as management

    for q in ("a", "b", "c"):
        ns.create_queue(q)
        with ns.get_queue_sender(q) as s:
            s.send_messages(Message("m"))
    real = management.check_table
    seen: list[str] = []

    def deleting_b_first(table: EntityTable, *, repair: bool = False) -> Any:
        seen.append(table.uri)
        if len(seen) == 2:  # queue b
            subprocess.run([sys.executable, *child], check=True, timeout=120)
        return real(table, repair=repair)

    monkeypatch.setattr(management, "check_table", deleting_b_first)
    return seen


def test_check_skips_a_queue_another_process_deletes_while_it_runs(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """check() read the catalog, then another process deleted a queue before check reached it: the queue is skipped.

    Before, a raw FileNotFoundError for the vanished log stopped the check of every later table.
    """
    code = f"from sparkqueue import Namespace; Namespace({ns.root!r}).delete_queue('b')"
    seen = _check_deleting_b_midway(ns, monkeypatch, ["-c", code])  # just before check reads b's log
    for repair in (False, True):
        seen.clear()
        if repair:
            ns.create_queue("b")
        assert ns.check(repair=repair) == []
        assert len(seen) == 3  # queue c was checked too


# Another process's delete_queue('b'), caught half-way: tombstone written, data files gone, log not yet.
HALF_DELETE = r"""
import sys
import sparkqueue.management as management
from sparkqueue import Namespace
from sparkqueue.storage.log import LOG_DIR, TOMBSTONE

def half(store, **_):
    store.put(TOMBSTONE, b"")
    for e in store.list():
        if e.path != TOMBSTONE and not e.path.startswith(f"{LOG_DIR}/"):
            store.delete(e.path)
    return 0

management.delete_table = half
Namespace(sys.argv[1]).delete_queue("b")
"""


def test_check_skips_a_queue_caught_half_way_through_another_process_s_delete(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check() read the catalog, then reached queue b while another process was deleting it (data gone, log not yet).

    Before, the missing data files were reported as damage of a queue that no longer exists.
    """
    seen = _check_deleting_b_midway(ns, monkeypatch, ["-c", HALF_DELETE, ns.root])
    assert ns.check() == []
    assert len(seen) == 3


def test_check_reports_a_table_whose_log_is_gone_while_the_catalog_names_it(ns: Namespace, root: str) -> None:
    """A queue whose `_delta_log` directory vanished (the catalog still names it) is a finding, never a crash."""
    ns.create_queue("q")
    shutil.rmtree(f"{_table_path(root)}/_delta_log")
    ns.create_queue("r")  # checked after it
    (finding,) = ns.check()
    assert "queue q" in finding.table and "log is missing" in finding.problem


def test_check_beside_a_vacuum_at_retention_zero_reports_no_live_file_missing(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit and a vacuum landing between check's log load and its listing removed a file check still took as live.

    Before, check reported it missing (and repair would have committed its removal again).
    """
    from sparkqueue.storage.store import LocalStore

    ns.create_queue("q", enable_partitioning=False)
    with ns.get_queue_sender("q") as s:
        s.send_messages([Message("done"), Message("kept")])
    real = LocalStore.list
    raced: list[bool] = []

    def list_after_a_race(self: LocalStore, prefix: str = "") -> Any:
        if not raced and prefix == "" and "/entities/" in self.uri:  # check's listing of the queue's table
            raced.append(True)
            with Namespace(ns.root) as other, other.get_queue_receiver("q") as r:
                r.complete_message(drain(r, 1)[0])  # rewrites the file holding both messages
                other.run_maintenance(vacuum_retention=timedelta(0))  # and deletes the old one at once
        return real(self, prefix)

    monkeypatch.setattr(LocalStore, "list", list_after_a_race)
    assert ns.check() == []
    assert raced
    monkeypatch.undo()
    with ns.get_queue_receiver("q") as r:
        assert [str(m) for m in peek_all(r)] == ["kept"]


def test_a_read_whose_snapshot_a_compaction_and_vacuum_overtook_marks_no_damage(ns: Namespace, root: str) -> None:
    """A receive pass reads all partitions from one snapshot; files a compaction replaced and a vacuum at retention 0
    deleted meanwhile were taken as damage: the partition read "Limited" for 30 s and refused keyed sends."""
    ns.create_queue("q")
    key = key_for_partition(3, "k")
    with ns.get_queue_sender("q") as s:
        for i in range(6):
            s.send_messages([Message(f"m{i}", partition_key=key)])
    with Namespace(root) as reader:
        entity = reader.broker.entity("queue", "q")
        stale = entity.table.snapshot()  # as a receive pass holds it
        with Namespace(root) as other:
            other.run_maintenance(vacuum_retention=timedelta(0))  # six files compacted into one, the six deleted
        assert entity.receive_partition(stale, 3, "main", 5, False).num_rows == 0  # skipped this once
        assert reader.get_queue_runtime_properties("q").availability_status == "Available"
        with reader.get_queue_sender("q") as s:
            s.send_messages(Message("keyed", partition_key=key))
        with reader.get_queue_receiver("q") as r:
            assert len(drain(r, 7)) == 7
