"""The Delta log engine (storage/log.py): snapshots, put-if-absent commits, rebase and conflict rules, damage.

Each test works on a real entity table created by delta-rs, written through sparkqueue's own log
code, and read back by delta-rs as the independent reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sparkqueue.errors import StorageCorruptedError, StorageError
from sparkqueue.storage.checkpoint import last_checkpoint_problem, write_checkpoint
from sparkqueue.storage.index import FileIndex
from sparkqueue.storage.log import (
    MARK_PREFIX,
    MARK_RETENTION_MS,
    CommitConflict,
    DeltaLog,
    Fence,
    Snapshot,
    TableDeletedError,
    delete_table,
)
from sparkqueue.storage.schema import ENTITY_SCHEMA, PARTITION_COLUMN
from sparkqueue.storage.store import Entry, LocalStore, resolve_root
from sparkqueue.storage.table import EntityTable


def _rows(partition: int, first_seq: int, n: int) -> pa.Table:
    """n minimal message rows of one partition (file schema)."""
    now = pa.scalar(0, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    cols = {}
    for f in ENTITY_SCHEMA:
        if f.name == PARTITION_COLUMN:
            continue
        if f.name == "sequence_number":
            cols[f.name] = pa.array(range(first_seq, first_seq + n), pa.int64())
        elif not f.nullable:
            value = {"string": "x", "int32": 0, "int64": 0}.get(str(f.type), now)
            cols[f.name] = pa.array([value] * n, f.type) if not isinstance(value, pa.Scalar) else pa.repeat(value, n)
        else:
            cols[f.name] = pa.nulls(n, f.type)
    return pa.table(cols)


@pytest.fixture
def table(tmp_path: Path) -> EntityTable:
    uri = str(tmp_path / "t")
    EntityTable.create(uri)
    return EntityTable(uri, 16)


def _one_row_commits(table: EntityTable, snap: Snapshot, partitions: int) -> None:
    """Another writer's work: one commit per partition 0..partitions-1, each a one-row file moving its fence to 1."""
    for p in range(partitions):
        table.log.commit(snap, [table.data.write(p, _rows(p, 1, 1))], [], [Fence(f"sparkqueue.seq.{p}", 1)])


def _second_handle(table: EntityTable) -> DeltaLog:
    """An independent log handle on the same table, as another process would have."""
    return DeltaLog(LocalStore(table.uri), FileIndex)


def test_commit_is_read_by_delta_rs_with_files_stats_and_fences(table: EntityTable) -> None:
    snap = table.snapshot()
    add = table.data.write(3, _rows(3, 10, 5))
    version = table.log.commit(snap, [add], [], [Fence("sparkqueue.seq.3", 14)])
    dt = DeltaTable(table.uri)
    assert dt.version() == version == snap.version
    assert dt.to_pyarrow_table().num_rows == 5
    assert dt.transaction_version("sparkqueue.seq.3") == 14
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    assert [a["partition.partition_id"] for a in actions] == [3]
    assert actions[0]["min.sequence_number"] == 10 and actions[0]["max.sequence_number"] == 14


def test_a_second_handle_replays_only_new_entries_and_sees_the_same_state(table: EntityTable) -> None:
    other = _second_handle(table)
    theirs = other.load()
    snap = table.snapshot()
    for p in range(3):
        table.log.commit(snap, [table.data.write(p, _rows(p, 1, 2))], [], [Fence(f"sparkqueue.seq.{p}", 2)])
    other.update(theirs)
    assert theirs.version == snap.version
    assert sorted(f.path for f in theirs.files) == sorted(f.path for f in snap.files)
    assert theirs.txns == snap.txns


def test_disjoint_commits_rebase_and_both_land(table: EntityTable) -> None:
    other = _second_handle(table)
    theirs = other.load()
    mine = table.snapshot()
    table.log.commit(mine, [table.data.write(1, _rows(1, 1, 2))], [], [Fence("sparkqueue.seq.1", 2)])
    # `theirs` is one version behind: its commit to another partition rebases onto ours.
    v = other.commit(theirs, [table.data.write(2, _rows(2, 1, 2))], [], [Fence("sparkqueue.seq.2", 2)])
    assert v == mine.version + 1
    dt = DeltaTable(table.uri)
    assert dt.to_pyarrow_table().num_rows == 4


def test_a_moved_fence_is_a_conflict(table: EntityTable) -> None:
    other = _second_handle(table)
    theirs = other.load()
    mine = table.snapshot()
    table.log.commit(mine, [table.data.write(1, _rows(1, 1, 2))], [], [Fence("sparkqueue.seq.1", 2)])
    with pytest.raises(CommitConflict):
        other.commit(theirs, [table.data.write(1, _rows(1, 1, 2))], [], [Fence("sparkqueue.seq.1", 2)])
    assert DeltaTable(table.uri).to_pyarrow_table().num_rows == 2


def test_removing_a_file_another_commit_removed_is_a_conflict(table: EntityTable) -> None:
    snap = table.snapshot()
    add = table.data.write(0, _rows(0, 1, 3))
    table.log.commit(snap, [add], [])
    other = _second_handle(table)
    theirs = other.load()
    (info,) = snap.files.partition(0)
    remove = [_remove(info)]
    table.log.commit(snap, [], remove)
    with pytest.raises(CommitConflict):
        other.commit(theirs, [table.data.write(0, _rows(0, 1, 3))], remove)


def test_a_change_computed_from_a_stale_snapshot_conflicts_before_writing_any_file(
    table: EntityTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change whose file another handle removed meanwhile conflicts before it writes a data file (DeltaLog.precheck)."""
    from sparkqueue.model.lifecycle import changes
    from sparkqueue.storage.table import OP_SET

    snap = table.snapshot()
    table.log.commit(snap, [table.data.write(0, _rows(0, 1, 3))], [])
    stale = table.snapshot()
    (info,) = stale.files.partition(0)
    other = EntityTable(table.uri, 16)  # another process's handle removes the file
    other.log.commit(other.snapshot(), [], [_remove(info)])
    rows = table.data.read(info.path)

    def no_writes(pieces: object) -> None:
        raise AssertionError("a change bound to conflict wrote data files")

    monkeypatch.setattr(table.data, "write_all", no_writes)
    with pytest.raises(CommitConflict):
        table.apply(stale, 0, changes(rows, OP_SET))


class _LosesFirstRace(LocalStore):
    """A local store on which `competitor` commits (as another writer) just before this store's first log put."""

    def __init__(self, root: str, competitor: Callable[[], None]) -> None:
        super().__init__(root)
        self.competitor: Callable[[], None] | None = competitor
        self.retried_at = 0.0  # when the second put began, a while after the entry was written

    @contextlib.contextmanager
    def staged(self, data: bytes, folder: str) -> Iterator[Callable[[str], bool]]:
        with super().staged(data, folder) as put:

            def racing(path: str) -> bool:
                if self.competitor is not None:
                    self.competitor()
                    self.competitor = None
                elif not self.retried_at:
                    time.sleep(0.05)
                    self.retried_at = time.time()
                return put(path)

            yield racing


def test_a_commit_that_loses_a_put_rebases_and_lands_with_no_temporary_entry_left(table: EntityTable) -> None:
    """A commit whose version is taken between its checks and its put lands on the next one, stamped when it lands."""
    mine = table.snapshot()
    landed: list[int] = []

    def competitor() -> None:
        landed.append(table.log.commit(mine, [table.data.write(1, _rows(1, 1, 1))], [], [Fence("sparkqueue.seq.1", 1)]))

    store = _LosesFirstRace(table.uri, competitor)
    other = DeltaLog(store, FileIndex)
    theirs = other.load()
    v = other.commit(theirs, [table.data.write(9, _rows(9, 1, 1))], [], [Fence("sparkqueue.seq.9", 1)])
    assert landed and v == landed[0] + 1 == theirs.version
    dt = DeltaTable(table.uri)
    assert dt.version() == v and dt.to_pyarrow_table().num_rows == 2
    log_dir = Path(table.uri) / "_delta_log"
    assert [n for n in os.listdir(log_dir) if n.startswith(".")] == []
    assert (log_dir / f"{v:020d}.json").stat().st_mtime >= store.retried_at - 0.01  # stamped when it landed


def test_a_commit_that_landed_is_not_failed_by_its_housekeeping(table: EntityTable) -> None:
    """A checkpoint or log trim failing after the entry landed is logged; the commit returns and its files stay."""

    def broken(snap: object) -> None:
        raise StorageError("the store refused the checkpoint")

    log = DeltaLog(LocalStore(table.uri), FileIndex, after_commit=broken)
    add = table.data.write(2, _rows(2, 1, 2))
    v = log.commit(log.load(), [add], [], [Fence("sparkqueue.seq.2", 2)])
    dt = DeltaTable(table.uri)
    assert dt.version() == v and dt.to_pyarrow_table().num_rows == 2


def _remove(info: object) -> object:
    from sparkqueue.storage.files import remove_action

    return remove_action(info.path, info.partition, info.size_bytes)  # type: ignore[attr-defined]


def test_a_metadata_change_is_a_conflict(table: EntityTable) -> None:
    other = _second_handle(table)
    theirs = other.load()
    snap = table.snapshot()
    meta = dict(snap.metadata, configuration={**snap.configuration, "delta.checkpointInterval": "7"})
    body = json.dumps({"commitInfo": {"operation": "SET TBLPROPERTIES"}}) + "\n" + json.dumps({"metaData": meta}) + "\n"
    assert table.store.put_if_absent(f"_delta_log/{snap.version + 1:020d}.json", body.encode())
    with pytest.raises(CommitConflict):
        other.commit(theirs, [table.data.write(5, _rows(5, 1, 1))], [], [Fence("sparkqueue.seq.5", 1)])


def test_checkpoint_then_load_from_it_after_the_log_is_trimmed(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    EntityTable.create(uri)
    table = EntityTable(uri, 16)
    snap = table.snapshot()
    for i in range(1, 251):  # checkpoints at 100 and 200
        table.log.commit(snap, [table.data.write(i % 16, _rows(i % 16, i, 1))], [], [Fence(f"app.{i % 16}", i)])
    names = os.listdir(f"{uri}/_delta_log")
    assert "00000000000000000200.checkpoint.parquet" in names
    # Trim everything before the checkpoint, as an old log would be, then load cold.
    for n in names:
        if n.endswith(".json") and int(n[:20]) < 200:
            os.unlink(f"{uri}/_delta_log/{n}")
    fresh = DeltaLog(LocalStore(uri), FileIndex).load()
    assert fresh.version == 250
    assert fresh.txns == snap.txns
    assert sorted(f.path for f in fresh.files) == sorted(f.path for f in snap.files)
    # The statistics that receives prune on survive the checkpoint, whichever form delta-rs stores them in.
    assert {f.path: f for f in fresh.files} == {f.path: f for f in snap.files}
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 250


def test_checkpoints_drop_forwarding_marks_a_retention_old_and_keep_every_other_txn(table: EntityTable) -> None:
    """A mark not updated for MARK_RETENTION_MS leaves the next checkpoint; fences and other txns never do."""
    snap = table.snapshot()
    mark, fence, sink = f"{MARK_PREFIX}q..deadletter.0.abc", "sparkqueue.seq.0", "stream.query.1"
    add = table.data.write(0, _rows(0, 1, 1))
    table.log.commit(snap, [add], [], [Fence(fence, 1), Fence(mark, 1), Fence(sink, 3)])
    written = snap.txn_times[mark]

    def checkpoint_then_load(source: Snapshot, at_ms: int) -> Snapshot:
        assert write_checkpoint(table.store, source, at_ms)
        fresh = DeltaLog(LocalStore(table.uri), FileIndex).load()
        assert fresh.version == snap.version and sorted(f.path for f in fresh.files) == [add.path]
        return fresh

    assert checkpoint_then_load(snap, written + MARK_RETENTION_MS).txns == snap.txns
    fresh = checkpoint_then_load(snap, written + MARK_RETENTION_MS + 1)
    assert fresh.txns == {fence: 1, sink: 3}
    assert fresh.txn_times == {fence: written, sink: written}
    dt = DeltaTable(table.uri)
    assert (dt.transaction_version(mark), dt.transaction_version(fence), dt.transaction_version(sink)) == (None, 1, 3)
    # A checkpoint that gave no times (as older ones wrote): its marks count from the next checkpoint on.
    timeless = snap.copy()
    timeless.txn_times.clear()
    later = written + 10 * MARK_RETENTION_MS
    fresh = checkpoint_then_load(timeless, later)
    assert fresh.txns == snap.txns and fresh.txn_times[mark] == later
    assert checkpoint_then_load(fresh, later + MARK_RETENTION_MS + 1).txns == {fence: 1, sink: 3}


def test_a_zero_byte_newest_entry_is_reported_never_read_as_absent(table: EntityTable) -> None:
    snap = table.snapshot()
    table.log.commit(snap, [table.data.write(0, _rows(0, 1, 3))], [], [Fence("sparkqueue.seq.0", 3)])
    Path(table.uri, "_delta_log", f"{snap.version + 1:020d}.json").write_bytes(b"")
    with pytest.raises(StorageCorruptedError, match="empty"):
        _second_handle(table).load()
    with pytest.raises(StorageCorruptedError):
        table.log.update(snap)


def test_a_truncated_entry_is_reported(table: EntityTable) -> None:
    snap = table.snapshot()
    Path(table.uri, "_delta_log", f"{snap.version + 1:020d}.json").write_bytes(b'{"commitInfo":{"timest')
    with pytest.raises(StorageCorruptedError, match="truncated"):
        _second_handle(table).load()


def test_a_missing_entry_in_the_middle_is_reported(table: EntityTable) -> None:
    snap = table.snapshot()
    _one_row_commits(table, snap, 3)
    os.unlink(Path(table.uri, "_delta_log", f"{snap.version - 1:020d}.json"))
    with pytest.raises(StorageCorruptedError, match="missing"):
        _second_handle(table).load()


class _ListingRacingACommit(LocalStore):
    """A directory whose first listing of the log misses one entry, as a listing taken while it was committed can."""

    def __init__(self, root: str, hidden: str) -> None:
        super().__init__(root)
        self.hidden: str | None = hidden

    def list(self, prefix: str = "") -> list[Entry]:
        out = [e for e in super().list(prefix) if e.path.rpartition("/")[2] != self.hidden]
        self.hidden = None
        return out


def test_an_entry_a_listing_missed_while_it_was_committed_is_found_by_listing_again(table: EntityTable) -> None:
    snap = table.snapshot()
    _one_row_commits(table, snap, 3)
    store = _ListingRacingACommit(table.uri, f"{snap.version - 1:020d}.json")
    loaded = DeltaLog(store, FileIndex).load()
    assert store.hidden is None  # the first listing did miss it
    assert loaded.version == snap.version


class _ListingAlwaysMissing(LocalStore):
    """A directory whose every listing of the log misses one entry (listings during a burst of commits can, several in a row)."""

    def __init__(self, root: str, hidden: str) -> None:
        super().__init__(root)
        self.hidden = hidden

    def list(self, prefix: str = "") -> list[Entry]:
        return [e for e in super().list(prefix) if e.path.rpartition("/")[2] != self.hidden]


def test_an_entry_every_listing_misses_is_looked_up_by_name_before_it_is_called_missing(table: EntityTable) -> None:
    """Four listings in a row missed entries under three busy writers: the namespace then failed to open as damaged."""
    snap = table.snapshot()
    _one_row_commits(table, snap, 3)
    hidden = f"{snap.version - 1:020d}.json"
    assert DeltaLog(_ListingAlwaysMissing(table.uri, hidden), FileIndex).load().version == snap.version
    os.unlink(Path(table.uri, "_delta_log", hidden))  # gone for real: damage, reported
    with pytest.raises(StorageCorruptedError, match="missing"):
        DeltaLog(_ListingAlwaysMissing(table.uri, hidden), FileIndex).load()


def test_tables_with_features_sparkqueue_cannot_write_are_refused(tmp_path: Path) -> None:
    uri = str(tmp_path / "dv")
    DeltaTable.create(
        uri, schema=ENTITY_SCHEMA, partition_by=[PARTITION_COLUMN], configuration={"delta.enableChangeDataFeed": "true"}
    )
    table = EntityTable(uri, 16)
    snap = table.snapshot()
    with pytest.raises(StorageError, match="enableChangeDataFeed"):
        table.log.commit(snap, [table.data.write(0, _rows(0, 1, 1))], [])
    assert DeltaTable(uri).version() == 0


def test_a_stale_snapshot_reloads_instead_of_trusting_a_missing_next_entry(table: EntityTable) -> None:
    """Past the safe window a snapshot is reloaded from a listing, so a trimmed entry is never taken as 'no newer entry'."""
    other = _second_handle(table)
    theirs = other.load()
    snap = table.snapshot()
    table.log.commit(snap, [table.data.write(0, _rows(0, 1, 1))], [], [Fence("sparkqueue.seq.0", 1)])
    theirs.verified_at -= 10_000  # as if the process had slept far past the log retention
    with pytest.raises(CommitConflict):
        other.commit(theirs, [table.data.write(0, _rows(0, 1, 1))], [], [Fence("sparkqueue.seq.0", 1)])
    other.update(theirs)
    assert theirs.version == snap.version


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "   ",
        "/",
        None,
        3,
        "ftp://host/x",
        "s3://",
        "az://c/ns?x=1",  # obstore and delta-rs drop a query or fragment: the namespace would land on az://c/ns
        "az://c/ns#frag",
        "az://c/ns/../up",
        "az://c/ns/./x",
        "az://c//x",
        "abfss://@acct.dfs.core.windows.net/x",
        "ns\tx",
        "ns\nx",
        "file://otherhost/x",
        "file:///tmp/x?y",
    ],
)
def test_bad_roots_are_refused(bad: object) -> None:
    from sparkqueue.errors import InvalidOperationError

    with pytest.raises(InvalidOperationError):
        resolve_root(bad)  # type: ignore[arg-type]


def test_relative_roots_resolve_to_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_root("data/ns") == str(tmp_path / "data" / "ns")
    assert resolve_root("file://" + str(tmp_path / "x")) == str(tmp_path / "x")
    assert resolve_root("file:" + str(tmp_path / "x")) == str(tmp_path / "x")  # the form Spark and Hadoop print
    assert resolve_root("file://localhost" + str(tmp_path / "x")) == str(tmp_path / "x")
    assert resolve_root("file://" + str(tmp_path / "a%20b")) == str(tmp_path / "a b")
    assert resolve_root("az://container/path/") == "az://container/path"


def test_sync_flushes_files_written_around_the_store_and_reports_one_that_vanished(tmp_path: Path) -> None:
    """What a DataFrame send uses on Spark's files (they are written without fsync) before it commits them."""
    store = LocalStore(str(tmp_path))
    (tmp_path / "partition_id=3").mkdir()
    for name in ("a.parquet", "b.parquet"):
        (tmp_path / "partition_id=3" / name).write_bytes(b"x" * 4096)
    store.sync(["partition_id=3/a.parquet", "partition_id=3/b.parquet"])
    assert store.get("partition_id=3/a.parquet") == b"x" * 4096
    with pytest.raises(StorageError, match="vanished before it was made durable"):
        store.sync(["partition_id=3/a.parquet", "partition_id=3/gone.parquet"])


# ---- a gap after a live handle's version ---------------------------------------------------------


def test_a_live_handle_reports_an_entry_missing_after_its_version_and_never_commits_into_the_gap(table: EntityTable) -> None:
    """Entry v gone while v+1 exists: update raises the fresh load's error, so no commit takes version v."""
    live = EntityTable(table.uri, 16)  # a handle opened before the damage, as a running process has
    stale = live.snapshot()
    snap = table.snapshot()
    _one_row_commits(table, snap, 3)
    gone = Path(table.uri, "_delta_log", f"{stale.version + 1:020d}.json")
    gone.unlink()
    with pytest.raises(StorageCorruptedError, match=f"log entries {stale.version + 1} are missing") as fresh_error:
        _second_handle(table).load()
    with pytest.raises(StorageCorruptedError) as live_error:
        live.snapshot()
    assert str(live_error.value) == str(fresh_error.value)
    with pytest.raises(StorageCorruptedError, match="missing"):
        live.log.precheck(stale, [], {})  # what a change does before writing its files
    with pytest.raises(StorageCorruptedError, match="missing"):
        live.snapshot()  # and again on the next operation: the handle's snapshot did not move past the gap
    assert not gone.exists()  # no fork: the hole is still a hole


def test_a_commit_rebasing_over_a_gap_reports_it_instead_of_filling_it(table: EntityTable) -> None:
    """A commit that loses its put replays the winners; an entry missing among them is damage, not the log's end."""
    other = _second_handle(table)
    theirs = other.load()
    snap = table.snapshot()
    _one_row_commits(table, snap, 3)
    gone = Path(table.uri, "_delta_log", f"{theirs.version + 2:020d}.json")
    gone.unlink()
    with pytest.raises(StorageCorruptedError, match=f"log entries {theirs.version + 2} are missing"):
        other.commit(theirs, [table.data.write(9, _rows(9, 1, 1))], [], [Fence("sparkqueue.seq.9", 1)])
    assert not gone.exists()


class _EntryLandsAfterItsRead(LocalStore):
    """A store whose first read of one entry misses it, as a read just before a writer commits it does."""

    def __init__(self, root: str, late: str, misses: int = 1) -> None:
        super().__init__(root)
        self.late: str | None = late
        self.misses = misses
        self.listings = 0

    def get(self, path: str) -> bytes:
        if path == self.late:
            self.misses -= 1
            if self.misses == 0:
                self.late = None
            raise FileNotFoundError(path)
        return super().get(path)

    def list(self, prefix: str = "") -> list[Entry]:
        self.listings += 1
        return super().list(prefix)


def test_entries_landing_between_the_two_reads_of_an_update_are_not_a_gap(table: EntityTable) -> None:
    """v read as absent, then v and v+1 land: v is read again and the update reaches the newest version, raising nothing.

    No reload from a listing: with several writers this race is common, and a reload costs the checkpoint.
    """
    store = _EntryLandsAfterItsRead(table.uri, "")
    other = DeltaLog(store, FileIndex)
    theirs = other.load()
    snap = table.snapshot()
    _one_row_commits(table, snap, 2)
    store.late = f"_delta_log/{theirs.version + 1:020d}.json"
    listings = store.listings
    other.update(theirs)
    assert store.late is None  # the first read did miss it
    assert theirs.version == snap.version and theirs.txns == snap.txns
    assert store.listings == listings


def test_a_reload_that_finds_the_metadata_unchanged_does_not_fail_a_commit_as_a_metadata_change(table: EntityTable) -> None:
    """A snapshot reloaded from a checkpoint keeps the version of its last metadata change when the metadata is the same.

    A checkpoint cannot tell when the metadata last changed; taking its version refused every
    commit computed before the reload with "the table's metadata or protocol changed".
    """
    store = _EntryLandsAfterItsRead(table.uri, "")
    other = DeltaLog(store, FileIndex)
    theirs = other.load()
    snap = table.snapshot()
    _one_row_commits(table, snap, 3)
    assert write_checkpoint(table.store, snap)
    seen = {"sparkqueue.seq.9": theirs.txns.get("sparkqueue.seq.9")}
    # v is missed twice while v+1 exists: the update reloads from the listing (and the checkpoint) to tell a gap.
    store.late, store.misses = f"_delta_log/{theirs.version + 1:020d}.json", 2
    listings = store.listings
    other.precheck(theirs, [], seen)  # what a change does before it writes its files; no CommitConflict
    assert store.listings > listings and theirs.version == snap.version
    version = other.commit(theirs, [table.data.write(9, _rows(9, 1, 1))], [], [Fence("sparkqueue.seq.9", 1)], seen=seen)
    assert version == snap.version + 1


def test_a_load_a_trim_keeps_racing_raises_a_storage_error(table: EntityTable) -> None:
    """Every listing names an entry that is gone when read (a trimmer at work): after a few tries, a clear StorageError."""
    snap = table.snapshot()
    table.log.commit(snap, [table.data.write(0, _rows(0, 1, 1))], [], [Fence("sparkqueue.seq.0", 1)])
    store = _EntryLandsAfterItsRead(table.uri, f"_delta_log/{snap.version:020d}.json", misses=1000)
    with pytest.raises(StorageError, match="a log trim raced"):
        DeltaLog(store, FileIndex).load()


class _PutHeldUp(LocalStore):
    """A store whose next log put is held up while `meanwhile` runs, as a paused process or a stalled object-store put is."""

    def __init__(self, root: str, *, reply_only: bool = False) -> None:
        """`reply_only`: the put lands at once and only its reply is held up (a slow link)."""
        super().__init__(root)
        self.meanwhile: Callable[[], None] | None = None
        self.reply_only = reply_only

    @contextlib.contextmanager
    def staged(self, data: bytes, folder: str) -> Iterator[Callable[[str], bool]]:
        with super().staged(data, folder) as put:

            def held_up(path: str) -> bool:
                landed = put(path) if self.reply_only else None
                if self.meanwhile is not None:
                    run, self.meanwhile = self.meanwhile, None
                    run()
                return put(path) if landed is None else landed

            yield held_up


def test_a_put_held_up_until_its_version_was_trimmed_has_an_unknown_outcome(table: EntityTable) -> None:
    """A commit checked the safe window, then its put came after other writers committed, checkpointed and trimmed past it.

    Its version was free only because the trim deleted it: no reader reads the entry behind the
    checkpoint, so the commit must not count as landed. Nor may it count as failed: a late reply
    to a put that landed in turn looks the same once the entries around it were trimmed too, and
    there a repeat stores the commit twice. StorageError; the entry and the data file stay (unread).
    """
    store = _PutHeldUp(table.uri)
    mine = DeltaLog(store, FileIndex)
    snap = mine.load()
    version = snap.version + 1

    def others_commit_checkpoint_and_trim() -> None:
        theirs = table.snapshot()
        _one_row_commits(table, theirs, 3)
        assert write_checkpoint(table.store, theirs)
        for v in range(theirs.version):  # what trim_log does once they are older than the retention
            Path(table.uri, "_delta_log", f"{v:020d}.json").unlink()
        snap.verified_at -= 3600  # the put came an hour after the window was checked

    store.meanwhile = others_commit_checkpoint_and_trim
    add = table.data.write(9, _rows(9, 1, 1))
    with pytest.raises(StorageError, match=f"outcome of version {version} is unknown"):
        mine.commit(snap, [add], [], [Fence("sparkqueue.seq.9", 1)])  # not CommitConflict: EntityTable.commit keeps the file
    assert Path(table.uri, add.path).exists()
    assert _second_handle(table).load().txns.get("sparkqueue.seq.9") is None  # readers start at the checkpoint: unread


@pytest.mark.parametrize("trimmed_before", [False, True])
def test_a_put_that_landed_on_time_stands_though_its_reply_came_after_others_checkpointed_past_it(
    table: EntityTable, trimmed_before: bool
) -> None:
    """Only the reply was late: others committed on the entry and checkpointed it, so it stands and its files stay.

    `trimmed_before`: the entries before it were trimmed meanwhile too (a reply later than the log
    retention); its files, live in a fresh load, still tell that others read it.
    """
    store = _PutHeldUp(table.uri, reply_only=True)
    mine = DeltaLog(store, FileIndex)
    snap = mine.load()
    version = snap.version + 1

    def others_commit_on_it_and_checkpoint() -> None:
        theirs = table.snapshot()
        assert theirs.version == version  # they read the entry
        _one_row_commits(table, theirs, 3)
        assert write_checkpoint(table.store, theirs)
        if trimmed_before:
            for v in range(version):
                Path(table.uri, "_delta_log", f"{v:020d}.json").unlink()
        snap.verified_at -= 3600  # the reply came an hour after the window was checked

    store.meanwhile = others_commit_on_it_and_checkpoint
    add = table.data.write(9, _rows(9, 1, 1))
    assert mine.commit(snap, [add], [], [Fence("sparkqueue.seq.9", 1)]) == version
    assert Path(table.uri, "_delta_log", f"{version:020d}.json").exists() and Path(table.uri, add.path).exists()
    fresh = _second_handle(table).load()
    assert fresh.txns.get("sparkqueue.seq.9") == 1 and add.path in {f.path for f in fresh.files}
    assert DeltaTable(table.uri).to_pyarrow_table().num_rows == 4


def test_a_put_held_up_while_vacuum_took_its_data_file_is_an_error_not_an_acknowledgement(table: EntityTable) -> None:
    """A commit's put came an hour after its window check; meanwhile vacuum deleted its data file as an old orphan.

    The entry has landed (other writers may build on it), but the commit is not acknowledged:
    StorageCorruptedError names the lost file, so a sender knows its message was not stored.
    """
    from sparkqueue.storage.maintenance import vacuum

    store = _PutHeldUp(table.uri)
    mine = DeltaLog(store, FileIndex)
    snap = mine.load()
    add = table.data.write(9, _rows(9, 1, 1))

    def vacuum_takes_the_file() -> None:
        two_hours_ago = time.time() - 7200
        os.utime(Path(table.uri, add.path), (two_hours_ago, two_hours_ago))
        assert vacuum(table, timedelta(0)).vacuumed_files == 1
        snap.verified_at -= 3600

    store.meanwhile = vacuum_takes_the_file
    with pytest.raises(StorageCorruptedError, match=f"vacuumed meanwhile \\({add.path}\\)"):
        mine.commit(snap, [add], [], [Fence("sparkqueue.seq.9", 1)])
    assert Path(table.uri, "_delta_log", f"{snap.version + 1:020d}.json").exists()


# ---- reader protocol: what sparkqueue cannot read correctly is refused, never read as usual -------------


def _append_entry(uri: str, actions: list[dict[str, object]]) -> int:
    """Write the next log entry as another Delta writer would; returns its version."""
    log_dir = Path(uri, "_delta_log")
    version = max(int(n[:20]) for n in os.listdir(log_dir) if n.endswith(".json")) + 1
    body = "".join(json.dumps(a) + "\n" for a in [{"commitInfo": {"timestamp": 0, "operation": "X"}}, *actions])
    (log_dir / f"{version:020d}.json").write_text(body)
    return version


_DV = {"storageType": "i", "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f", "offset": 1, "sizeInBytes": 36, "cardinality": 1}
_DV_PROTOCOL = {
    "minReaderVersion": 3,
    "minWriterVersion": 7,
    "readerFeatures": ["deletionVectors"],
    "writerFeatures": ["deletionVectors"],
}


def test_a_table_whose_rows_are_deleted_by_deletion_vectors_is_refused_on_load_and_on_update(table: EntityTable) -> None:
    snap = table.snapshot()
    table.log.commit(snap, [table.data.write(0, _rows(0, 1, 3))], [], [Fence("sparkqueue.seq.0", 3)])
    other = _second_handle(table)
    theirs = other.load()
    (add,) = [dict(a) for a in snap.files.actions()]
    remove = {k: add[k] for k in ("path", "partitionValues", "size")}
    _append_entry(
        table.uri,
        [
            {"protocol": _DV_PROTOCOL},
            {"remove": {**remove, "deletionTimestamp": 0, "dataChange": True}},
            {"add": {**add, "deletionVector": _DV}},
        ],
    )
    with pytest.raises(StorageError, match=r"deletionVectors.*deletion vector") as exc:
        _second_handle(table).load()
    assert table.uri in str(exc.value) and not isinstance(exc.value, StorageCorruptedError)
    before = theirs.version
    for _ in range(2):  # the snapshot is not moved onto the entry, so every later update refuses too
        with pytest.raises(StorageError, match="deletionVectors"):
            other.update(theirs)
        assert theirs.version == before
    with pytest.raises(StorageError, match="deletionVectors"):
        table.snapshot()


def test_an_added_file_with_a_deletion_vector_is_refused_whatever_the_protocol_says(table: EntityTable) -> None:
    snap = table.snapshot()
    add = table.data.write(0, _rows(0, 1, 3)).action(0)
    _append_entry(table.uri, [{"add": {**add, "deletionVector": _DV}}])
    with pytest.raises(StorageError, match="1 file\\(s\\) with a deletion vector"):
        table.log.update(snap)
    with pytest.raises(StorageError, match="deletion vector"):
        _second_handle(table).load()


@pytest.mark.parametrize(
    ("protocol", "refused"),
    [
        (
            {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["someFutureFeature"]},
            "reader feature someFutureFeature",
        ),
        (
            {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["timestampNtz", "v2Checkpoint"]},
            "reader feature v2Checkpoint",
        ),
        ({"minReaderVersion": 4, "minWriterVersion": 7}, "reader version 4"),
    ],
)
def test_reader_features_and_versions_sparkqueue_does_not_read_are_refused_on_load_and_on_update(
    table: EntityTable, protocol: dict[str, object], refused: str
) -> None:
    snap = table.snapshot()
    _append_entry(table.uri, [{"protocol": protocol}])
    with pytest.raises(StorageError, match=refused):
        table.log.update(snap)
    with pytest.raises(StorageError, match=refused):
        _second_handle(table).load()


@pytest.mark.parametrize(
    ("configuration", "refused"),
    [
        ({"delta.enableDeletionVectors": "true"}, "reader feature deletionVectors"),
        ({"delta.columnMapping.mode": "name"}, "columnMapping"),
    ],
)
def test_tables_delta_rs_creates_with_features_sparkqueue_cannot_read_are_refused(
    tmp_path: Path, configuration: dict[str, str], refused: str
) -> None:
    uri = str(tmp_path / "t")
    DeltaTable.create(uri, schema=ENTITY_SCHEMA, partition_by=[PARTITION_COLUMN], configuration=configuration)
    with pytest.raises(StorageError, match=refused):
        DeltaLog(LocalStore(uri), FileIndex).load()


def test_a_checkpoint_with_an_unreadable_protocol_is_refused(tmp_path: Path) -> None:
    from deltalake import write_deltalake

    uri = str(tmp_path / "t")
    DeltaTable.create(
        uri, schema=ENTITY_SCHEMA, partition_by=[PARTITION_COLUMN], configuration={"delta.enableDeletionVectors": "true"}
    )
    write_deltalake(uri, _rows(0, 1, 2).append_column(PARTITION_COLUMN, pa.array([0, 0], pa.int32())), mode="append")
    DeltaTable(uri).create_checkpoint()
    for n in os.listdir(f"{uri}/_delta_log"):
        if n.endswith(".json"):
            os.unlink(f"{uri}/_delta_log/{n}")  # only the checkpoint tells the protocol
    with pytest.raises(StorageError, match="deletionVectors"):
        DeltaLog(LocalStore(uri), FileIndex).load()


class _AnyFiles:
    """The live files of any table (a FileSet for log.py): path to add action."""

    def __init__(self) -> None:
        self.adds: dict[str, object] = {}

    def add(self, action: dict[str, object]) -> None:
        self.adds[str(action["path"])] = action

    def remove(self, path: str) -> None:
        self.adds.pop(path, None)

    def actions(self) -> list[object]:
        return list(self.adds.values())

    def __contains__(self, path: object) -> bool:
        return path in self.adds

    def __len__(self) -> int:
        return len(self.adds)

    def copy(self) -> _AnyFiles:
        other = _AnyFiles()
        other.adds = dict(self.adds)
        return other


def test_tables_delta_rs_writes_with_timestamp_ntz_and_its_checkpoints_still_open(tmp_path: Path) -> None:
    """delta-rs marks a timestamp-without-zone column as reader feature timestampNtz (protocol 3/7): sparkqueue reads it."""
    from deltalake import write_deltalake

    uri = str(tmp_path / "t")
    schema = pa.schema([("a", pa.int64()), ("t", pa.timestamp("us"))])
    DeltaTable.create(uri, schema=schema)
    rows = pa.table({"a": [1, 2], "t": pa.array([0, 1], pa.timestamp("us"))}, schema=schema)
    write_deltalake(uri, rows, mode="append")
    DeltaTable(uri).create_checkpoint()
    log = DeltaLog(LocalStore(uri), _AnyFiles)
    snap = log.load()
    assert snap.protocol["readerFeatures"] == ["timestampNtz"] and snap.version == 1 and len(snap.files) == 1
    write_deltalake(uri, rows, mode="append")
    log.update(snap)
    assert snap.version == 2 and len(snap.files) == 2
    for n in os.listdir(f"{uri}/_delta_log"):
        if n.endswith(".json") and int(n[:20]) <= 1:
            os.unlink(f"{uri}/_delta_log/{n}")
    assert len(DeltaLog(LocalStore(uri), _AnyFiles).load().files) == 2  # from the checkpoint delta-rs wrote


def test_a_commit_whose_liveness_check_fails_after_it_landed_is_reported_landed(
    table: EntityTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs after the put: failing it (a store hiccup) must not report a landed commit as failed."""
    from sparkqueue.storage.log import TOMBSTONE

    real = LocalStore.exists

    def hiccup(self: LocalStore, path: str) -> bool:
        if path == TOMBSTONE:
            raise StorageError("the store did not answer")
        return real(self, path)

    snap = table.snapshot()
    monkeypatch.setattr(LocalStore, "exists", hiccup)
    version = table.log.commit(snap, [table.data.write(0, _rows(0, 1, 1))], [], [Fence("sparkqueue.seq.0", 1)])
    monkeypatch.undo()
    assert _second_handle(table).load().version == version


def test_writers_whose_handles_predate_a_delete_leave_nothing_in_the_deleted_table(table: EntityTable) -> None:
    """Maintenance read the table, another process deleted it, then the checkpoint's put made the table's folder again;
    a sender whose handle predated the delete committed on, counted that checkpoint as a live log, and its send was
    acknowledged into a deleted table: lost (and stray files of two such writers could each pass for the other's live
    table). The delete's tombstone now stays until maintenance removes the folder: every such writer finds it."""
    snap = table.snapshot()
    _one_row_commits(table, snap, 2)
    first, second = _second_handle(table), _second_handle(table)
    older = first.load()
    _one_row_commits(table, table.snapshot(), 1)
    newer = second.load()
    delete_table(table.store)
    assert not write_checkpoint(table.store, snap)
    for log, read in ((first, older), (second, newer)):
        with pytest.raises(TableDeletedError):
            log.commit(read, [table.data.write(9, _rows(9, 1, 1))], [], [Fence("sparkqueue.seq.9", 1)])
    assert [e.path for e in table.store.list()] == ["_sparkqueue_deleting"]
    assert delete_table(table.store, keep_tombstone=False) == 0  # what maintenance does once the tombstone is old
    assert not Path(table.uri).exists()


def test_a_checkpoint_written_after_check_listed_the_log_is_not_reported_missing(table: EntityTable) -> None:
    """`check` lists the log, then reads `_last_checkpoint`: a checkpoint written in between (any writer's, every 100th
    version, or maintenance) was reported as "names version N, which has no checkpoint", damage that was not there."""
    snap = table.snapshot()
    _one_row_commits(table, snap, 2)
    listed = [e.path for e in table.store.list("_delta_log/")]
    assert write_checkpoint(table.store, snap)
    assert last_checkpoint_problem(table.store, listed) is None
    table.store.delete(f"_delta_log/{snap.version:020d}.checkpoint.parquet")  # really missing: still reported
    assert "which has no checkpoint" in str(last_checkpoint_problem(table.store, listed))


def _entity_rows(partition: int, n: int) -> pa.Table:
    """n message rows of one partition as an append takes them (partition id set, numbered by the append)."""
    rows = _rows(partition, 0, n)
    return rows.append_column(
        ENTITY_SCHEMA.field(PARTITION_COLUMN), pa.array([partition] * n, ENTITY_SCHEMA.field(PARTITION_COLUMN).type)
    )


def _use_store(table: EntityTable, store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `table` write its data files and log entries through `store` (a LocalStore at its root)."""
    monkeypatch.setattr(table.data, "store", store)
    monkeypatch.setattr(table.log, "store", store)


class _SlowDataStore(LocalStore):
    """A local store whose data files take a while to store; notes when each is stored and when log entries are staged and put."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.events: list[str] = []

    def put_new(self, path: str, data: bytes | memoryview) -> None:
        super().put_new(path, data)
        time.sleep(0.3)
        self.events.append("data stored")

    @contextlib.contextmanager
    def staged(self, data: bytes, folder: str) -> Iterator[Callable[[str], bool]]:
        with super().staged(data, folder) as put:
            self.events.append("entry staged")

            def noting(path: str) -> bool:
                landed = put(path)
                self.events.append("entry put")
                return landed

            yield noting


def test_a_commit_stages_its_entry_while_its_data_file_is_stored_and_puts_it_only_after(
    table: EntityTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry's write overlaps the data file's; the entry lands only once the file is durable (never naming a missing file)."""
    store = _SlowDataStore(table.uri)
    _use_store(table, store, monkeypatch)
    table.append(_entity_rows(3, 2), None)
    assert store.events == ["entry staged", "data stored", "entry put"]
    assert DeltaTable(table.uri).to_pyarrow_table().num_rows == 2


class _FailsAfterWriting(LocalStore):
    """A local store that writes a data file and then fails (as a disk filling up at the fsync)."""

    def put_new(self, path: str, data: bytes | memoryview) -> None:
        super().put_new(path, data)
        raise StorageError("the disk is full")


@pytest.mark.parametrize("files", [1, 3])
def test_a_commit_whose_data_file_fails_to_store_lands_nothing_and_leaves_no_file(
    table: EntityTable, monkeypatch: pytest.MonkeyPatch, files: int
) -> None:
    """The write's error is raised; no log entry names the files, and neither they nor a staged entry remain."""
    before = table.snapshot().version
    monkeypatch.setattr(table.data, "store", _FailsAfterWriting(table.uri))
    rows = pa.concat_tables([_entity_rows(p, 2) for p in range(files)])
    with pytest.raises(StorageError, match="disk is full"):
        table.append(rows, None)
    assert DeltaLog(LocalStore(table.uri), FileIndex).load().version == before
    assert list(Path(table.uri).rglob("*.parquet")) == []
    assert [n for n in os.listdir(Path(table.uri) / "_delta_log") if n.startswith(".")] == []


class _Interrupted(BaseException):
    """What a signal handler raises in the committing thread (as Ctrl-C raises KeyboardInterrupt)."""


class _FirstFileLate(LocalStore):
    """A local store that starts writing partition 0's data file late (0.6 s), the others a little (0.1 s)."""

    def put_new(self, path: str, data: bytes | memoryview) -> None:
        time.sleep(0.6 if path.startswith("partition_id=0/") else 0.1)
        super().put_new(path, data)


def test_a_commit_interrupted_while_its_files_are_stored_lands_nothing_and_leaves_no_file(
    table: EntityTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write ends before the interrupt goes up, and the batch's files are deleted: none appears afterwards."""
    import signal

    store = _FirstFileLate(table.uri)
    _use_store(table, store, monkeypatch)
    before = table.snapshot().version

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted()

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # while the commit waits for partition 0's file
        with pytest.raises(_Interrupted):
            table.append(pa.concat_tables([_entity_rows(p, 2) for p in range(3)]), None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    time.sleep(1.0)  # longer than any write of the batch takes
    assert list(Path(table.uri).rglob("*.parquet")) == []
    assert DeltaLog(LocalStore(table.uri), FileIndex).load().version == before


class _LosesItsStagedEntry(LocalStore):
    """A local store on which the staged log entry is removed while the data file is stored (as a table deletion does)."""

    def put_new(self, path: str, data: bytes | memoryview) -> None:
        super().put_new(path, data)
        for name in os.listdir(Path(self.root) / "_delta_log"):
            if name.startswith(".tmp-"):
                os.unlink(Path(self.root) / "_delta_log" / name)


def test_a_commit_whose_staged_entry_vanished_stages_it_again_and_lands(
    table: EntityTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry is staged before the data file is stored; if it goes meanwhile, the put writes it again, as a first try would."""
    store = _LosesItsStagedEntry(table.uri)
    _use_store(table, store, monkeypatch)
    table.append(_entity_rows(4, 2), None)
    assert DeltaTable(table.uri).to_pyarrow_table().num_rows == 2
    assert [n for n in os.listdir(Path(table.uri) / "_delta_log") if n.startswith(".")] == []
