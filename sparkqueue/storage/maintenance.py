"""Maintenance that keeps an entity table's cost flat as its history grows (docs/storage.md: small files and long logs).

- Compaction rewrites runs of small, adjacent files of one partition (in sequence order, never
  mixing subscriptions or session rows with messages) into bounded files. It commits only while
  every input file is still live (log.py), so a concurrent send (new files) is never touched
  and a concurrent settlement (which rewrites an input) makes the compaction, not the settle, retry.
- While rewriting it drops rows nobody can reach any more: duplicate-detection tombstones whose
  window has passed, and copies of deleted subscriptions.
- Checkpoints bound the log replay; vacuum deletes unreferenced files (including files of
  commits that never happened, e.g. a writer killed mid-operation) after a safe retention.
- An unavailable partition (a fault, or a damaged file compaction's read finds) is left alone and
  reported (`MaintenanceReport.unavailable_partitions`); the others are compacted, and the table is
  still checkpointed and vacuumed (a damaged live file is live: vacuum keeps it).
- The namespace catalog gets the same checkpoint, log trim and vacuum (`maintain_catalog`): every
  catalog change writes the whole catalog to a new file, so without them its files and log grow
  with the square of the entity count.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import PartitionUnavailableError, SparkQueueError
from sparkqueue.storage.checkpoint import trim_log, write_checkpoint
from sparkqueue.storage.files import MAX_FILE_BYTES, MAX_FILE_ROWS, remove_action
from sparkqueue.storage.index import FileInfo
from sparkqueue.storage.leases import lease_of, live_leases
from sparkqueue.storage.log import LOG_DIR, TOMBSTONE, CommitConflict, Snapshot, delete_table, withdraw
from sparkqueue.storage.schema import PARTITION_COLUMN, STATE_COMPLETED, TIMESTAMP, constant
from sparkqueue.storage.store import Entry, Store
from sparkqueue.storage.table import EntityTable

log = logging.getLogger(__name__)

TARGET_ROWS = MAX_FILE_ROWS  # compaction removes small files; it never builds files a lock would be slow to rewrite
TARGET_BYTES = MAX_FILE_BYTES
SMALL_FRACTION = 0.25  # a file under a quarter of the target is "small"
DEFAULT_VACUUM_RETENTION = timedelta(hours=1)
UNREFERENCED = f"{LOG_DIR}/_sparkqueue_unreferenced"  # vacuum's record of files whose removal the log no longer dates
ORPHAN_RETENTION = timedelta(minutes=10)  # a live writer commits within seconds; files this old and not live are not its
CLOCK_MARGIN = timedelta(minutes=5)  # how far the clocks of machines sharing a namespace may disagree


@dataclass(frozen=True)
class LiveSubscriptions:
    """A topic's subscriptions as one catalog read found them, and before when a row of any other is an orphan.

    A subscription created after the read has no row enqueued before the read (its copies are made
    by sends that found it), so only rows enqueued before the read, less CLOCK_MARGIN for other
    machines' clocks, of a subscription the read did not find belong to a deleted one.
    """

    keys: frozenset[str]
    orphans_before: datetime

    @classmethod
    def read(cls, keys: Callable[[], set[str]]) -> LiveSubscriptions:
        """The subscription keys `keys()` reads now; the instant is taken before the read."""
        before = datetime.now(UTC) - CLOCK_MARGIN
        return cls(frozenset(keys()), before)


class MaintainedTable(Protocol):
    """What checkpoint and vacuum need of a table: its store and its newest snapshot (an EntityTable, the Catalog)."""

    @property
    def store(self) -> Store: ...

    def snapshot(self) -> Snapshot: ...


@dataclass
class MaintenanceReport:
    """What one maintenance run did to a table."""

    files_before: int = 0
    files_after: int = 0
    files_compacted: int = 0
    rows_dropped: int = 0
    compactions_skipped: int = 0
    vacuumed_files: int = 0
    checkpointed_version: int | None = None
    per_partition_files: dict[int, int] = field(default_factory=dict)
    # Partitions compaction left alone because they were unavailable (a fault, or damage a read found), and why;
    # the run went on with the others, its checkpoint and its vacuum. `check` tells what is damaged.
    unavailable_partitions: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # why the run could not finish this table (the others went on)


def compact(
    table: EntityTable,
    *,
    drop_before: datetime | None = None,
    live_subscriptions: LiveSubscriptions | None = None,
    report: MaintenanceReport | None = None,
) -> MaintenanceReport:
    """Compact every partition; optionally drop tombstones enqueued before `drop_before` and orphaned subscription rows.

    An unavailable partition (an injected fault, or a damaged data file, found before or by this
    compaction's own read) is left as it is and recorded in the report's `unavailable_partitions`;
    the other partitions are compacted all the same, and the caller goes on to checkpoint and vacuum.
    """
    report = report or MaintenanceReport()
    dt = table.snapshot()
    for p in range(table.partition_count):
        files: list[FileInfo] = []
        try:
            files = table.files(dt, p)  # PartitionUnavailableError while it is down
            _compact_partition(table, p, files, drop_before, live_subscriptions, report)
        except PartitionUnavailableError as exc:
            if table.available(p):  # a file replaced under this read (a concurrent compaction and vacuum): no damage
                report.compactions_skipped += 1
                report.files_before += len(files)
                continue
            log.warning("maintenance of %s skips partition %d: %s", table.uri, p, exc)
            report.unavailable_partitions[p] = str(exc)
            continue  # counted in neither files_before nor files_after
        report.files_before += len(files)
    dt = table.snapshot()
    for p in range(table.partition_count):
        if table.available(p):
            n = len(table.files(dt, p))
            report.per_partition_files[p] = n
            report.files_after += n
    return report


def _compact_partition(
    table: EntityTable,
    p: int,
    files: list[FileInfo],
    drop_before: datetime | None,
    live_subscriptions: LiveSubscriptions | None,
    report: MaintenanceReport,
) -> None:
    """Rewrite the partition's runs of small files (compact); PartitionUnavailableError when a read finds it damaged."""
    for group in _groups(files, drop_before, live_subscriptions):
        try:
            dropped = _rewrite(table, p, group, _droppable(drop_before, live_subscriptions))
        except CommitConflict:
            report.compactions_skipped += 1  # a settlement changed an input first; next run picks it up
            continue
        if dropped is None:
            continue  # a lone file with nothing to drop after all: left as it is
        report.files_compacted += len(group)
        report.rows_dropped += dropped


def _groups(
    files: list[FileInfo], drop_before: datetime | None = None, live: LiveSubscriptions | None = None
) -> Iterator[list[FileInfo]]:
    """Per kind and subscription, runs of small files (in sequence order) within the target size.

    Files of different subscriptions interleave in sequence order (a topic send writes one file per
    subscription), so runs are formed per kind and subscription, not across neighbours. A file that
    stays alone is still rewritten when its statistics show it may hold rows to drop.
    """
    by_klass: dict[tuple[str, str | None], list[FileInfo]] = {}
    for f in files:
        k = _klass(f)
        if k is not None:
            by_klass.setdefault(k, []).append(f)
    for klass, klass_files in by_klass.items():
        run: list[FileInfo] = []
        rows = size = 0
        for f in klass_files:
            small = f.num_records < TARGET_ROWS * SMALL_FRACTION and f.size_bytes < TARGET_BYTES * SMALL_FRACTION
            if run and (not small or rows + f.num_records > TARGET_ROWS or size + f.size_bytes > TARGET_BYTES):
                yield from _emit(run, klass, drop_before, live)
                run, rows, size = [], 0, 0
            if small:
                run.append(f)
                rows += f.num_records
                size += f.size_bytes
            else:
                yield from _emit([f], klass, drop_before, live)
        yield from _emit(run, klass, drop_before, live)


def _emit(
    run: list[FileInfo], klass: tuple[str, str | None], drop_before: datetime | None, live: LiveSubscriptions | None
) -> Iterator[list[FileInfo]]:
    """A run worth rewriting: several files, or one that may hold rows to drop."""
    if len(run) > 1 or (len(run) == 1 and _may_drop(run[0], klass, drop_before, live)):
        yield run


def _may_drop(f: FileInfo, klass: tuple[str, str | None], drop_before: datetime | None, live: LiveSubscriptions | None) -> bool:
    """Could the file hold a row of a deleted subscription or a tombstone enqueued before `drop_before`?"""
    if live is not None and klass[1] is not None and klass[1] not in live.keys:
        return f.min_enqueued is None or f.min_enqueued < live.orphans_before
    if drop_before is None or f.min_enqueued is None or f.min_enqueued >= drop_before:
        return False
    return f.min_state is None or f.max_state is None or f.min_state <= STATE_COMPLETED <= f.max_state


def _klass(f: FileInfo) -> tuple[str, str | None] | None:
    """What a file holds, when its statistics pin it to one kind and one subscription (else None: leave it alone)."""
    if f.min_kind is None or f.min_kind != f.max_kind or f.min_subscription != f.max_subscription:
        return None
    if f.min_subscription is None and f.null_subscriptions not in (None, f.num_records):
        return None
    return f.min_kind, f.min_subscription


def _droppable(drop_before: datetime | None, live: LiveSubscriptions | None) -> Callable[[pa.Table], pa.Array] | None:
    """A mask of rows compaction may drop: expired tombstones and rows of subscriptions that no longer exist."""
    if drop_before is None and live is None:
        return None

    def mask(rows: pa.Table) -> pa.Array:
        out = constant(False, pa.bool_(), rows.num_rows)
        if drop_before is not None:
            old = pc.less(rows.column("enqueued_time_utc"), pa.scalar(drop_before, TIMESTAMP))
            out = pc.or_(out, pc.and_(pc.equal(rows.column("state"), STATE_COMPLETED), old))
        if live is not None:
            sub = rows.column("subscription")
            kept = pc.fill_null(pc.is_in(sub, value_set=pa.array(sorted(live.keys), pa.string())), False)
            before = pc.less(rows.column("enqueued_time_utc"), pa.scalar(live.orphans_before, TIMESTAMP))
            orphan = pc.and_(pc.and_(pc.is_valid(sub), pc.invert(kept)), pc.fill_null(before, False))
            out = pc.or_(out, orphan)
        return out

    return mask


def _rewrite(table: EntityTable, p: int, group: list[FileInfo], droppable: Callable[[pa.Table], pa.Array] | None) -> int | None:
    """Replace a run of files by bounded files of the same rows in sequence order; returns the rows dropped.

    A single file from which nothing would be dropped is left alone (returns None).
    """
    dt = table.snapshot()
    live = {f.path for f in table.files(dt, p)}
    if any(f.path not in live for f in group):
        raise CommitConflict("an input file changed before compaction started")
    rows = pa.concat_tables([table.data.read(f.path) for f in group]).sort_by("sequence_number")
    before = rows.num_rows
    if droppable is not None:
        rows = rows.filter(pc.invert(droppable(rows)))
    if len(group) == 1 and rows.num_rows == before:
        return None
    adds = table.data.write_chunks(p, rows)
    removes = [remove_action(f.path, f.partition, f.size_bytes) for f in group]
    table.commit(dt, adds, removes, operation="OPTIMIZE")
    dropped: int = before - rows.num_rows
    return dropped


def checkpoint(table: MaintainedTable, report: MaintenanceReport | None = None) -> MaintenanceReport:
    """Write a checkpoint at the current version and delete log files past the log retention."""
    report = report or MaintenanceReport()
    snap = table.snapshot()
    if write_checkpoint(table.store, snap):
        trim_log(table.store, snap)
        report.checkpointed_version = snap.version
    return report


def vacuum(
    table: MaintainedTable, retention: timedelta = DEFAULT_VACUUM_RETENTION, report: MaintenanceReport | None = None
) -> MaintenanceReport:
    """Delete files the table no longer references: removed more than `retention` ago, or never committed.

    A file removed by a commit still in the log is judged by that commit's time. Past the log's
    retention (minutes) the removal time is gone: such a file, like one no commit ever referenced
    (a writer killed between writing and committing), goes once vacuum has found it unreferenced
    for `retention` (UNREFERENCED records when it first did, so a reader holding an older snapshot
    keeps its files for the retention, not the log's) and it is at least ORPHAN_RETENTION old, since
    a live writer commits its files within seconds of writing them (docs/storage.md). Left-over
    temporary files of killed writers go the same way. Files of a live write lease (a DataFrame
    send still writing, leases.py) are kept whatever their age; the leases are read before the
    snapshot, so a lease gone by then was released after its commit landed, and the snapshot
    holds that commit's files.
    """
    report = report or MaintenanceReport()
    now = time.time()
    leased = live_leases(table.store, now)
    snap = table.snapshot()
    removed_at = _removals(table)
    seen = _unreferenced(table)
    still: dict[str, float] = {}
    keep_removed_after = now - retention.total_seconds()
    keep_unknown_after = now - ORPHAN_RETENTION.total_seconds()
    deleted = 0
    for e in table.store.list():
        if e.path.startswith(f"{LOG_DIR}/") and not e.path.rsplit("/", 1)[-1].startswith(".tmp-"):
            continue
        if e.path in snap.files or lease_of(e.path) in leased:
            continue
        when = removed_at.get(e.path)
        if when is None:
            if e.mtime_s >= keep_unknown_after:  # a live writer's file, or one committed after the snapshot: not dated yet
                continue
            when = still[e.path] = seen.get(e.path, now)
        if when <= keep_removed_after:
            table.store.delete(e.path)
            still.pop(e.path, None)
            deleted += 1
    if still != seen and not table.store.exists(TOMBSTONE):
        table.store.put(UNREFERENCED, json.dumps(still).encode())
        if table.store.exists(TOMBSTONE):  # deleted meanwhile: the record must not outlive the table
            withdraw(table.store, [UNREFERENCED])
    report.vacuumed_files += deleted
    return report


def _unreferenced(table: MaintainedTable) -> dict[str, float]:
    """When vacuum first found each file it could not date by a removal in the log unreferenced (UNREFERENCED).

    Written by every vacuum, the last one winning: a time lost to a concurrent run is taken again
    later, which only keeps a file longer.
    """
    try:
        raw = json.loads(table.store.get(UNREFERENCED))
    except (FileNotFoundError, ValueError):
        return {}
    return {str(k): float(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _removals(table: MaintainedTable) -> dict[str, float]:
    """When each file removed by a commit still in the log was removed (seconds since the epoch)."""
    out: dict[str, float] = {}
    for e in table.store.list(f"{LOG_DIR}/"):
        if not e.path.endswith(".json") or e.path.rpartition("/")[0] != LOG_DIR:
            continue
        try:
            text = table.store.get(e.path).decode("utf-8")
        except (FileNotFoundError, UnicodeDecodeError):  # trimmed meanwhile, or damaged: judged by age instead
            continue
        for line in text.splitlines():
            if '"remove"' not in line:
                continue
            try:
                remove = json.loads(line)["remove"]
            except (ValueError, KeyError, TypeError):
                continue
            out[unquote(remove["path"])] = float(remove.get("deletionTimestamp") or e.mtime_s * 1000) / 1000
    return out


def remove_orphan_tables(root: Store, folder: str, live: Callable[[], set[str]], retention: timedelta) -> MaintenanceReport:
    """Delete entity tables under `folder` that no catalog entry names, once all their files are old.

    A process killed between making an entity's table and recording it in the catalog (or while
    deleting the table) leaves such a table. The folders are listed before `live` reads the
    catalog, so a table recorded meanwhile counts as live; one being made now is newer than
    ORPHAN_RETENTION (a create records its table within seconds) and stays, as does a folder with
    no file yet (a create's first directories). A table holding data files is deleted only under
    its delete's tombstone: otherwise its entry may be what is missing (a damaged catalog), and
    its messages stay, reported by `unnamed_tables` (Namespace.check).
    """
    report = MaintenanceReport()
    for table, files in _old_unnamed(root, folder, live, retention):
        if _holds_messages(table, files):
            log.warning("left table %s alone: no catalog entry names it, but it holds messages (Namespace.check)", table)
            continue
        removed = delete_table(root.child(table), keep_tombstone=False)
        report.vacuumed_files += removed
        log.info("removed table %s: no catalog entry names it (%d files)", table, removed)
    return report


def unnamed_tables(root: Store, folder: str, live: Callable[[], set[str]]) -> dict[str, int]:
    """Tables under `folder` that no catalog entry names and that hold data files, with how many (what maintenance keeps).

    As maintenance, it counts only tables whose files are all older than ORPHAN_RETENTION, and reads the catalog
    again after listing them: a create or delete running meanwhile is not reported as a lost entry.
    """
    out = {table: n for table, files in _old_unnamed(root, folder, live, timedelta(0)) if (n := _holds_messages(table, files))}
    if out:
        named = live()
        out = {t: n for t, n in out.items() if t not in named}
    return out


def _old_unnamed(
    root: Store, folder: str, live: Callable[[], set[str]], retention: timedelta
) -> Iterator[tuple[str, list[Entry]]]:
    """Tables under `folder` that no catalog entry names and whose files are all older than `retention` (at least
    ORPHAN_RETENTION), with their listings. The folders are listed before `live` reads the catalog, so a table recorded
    meanwhile counts as named; a folder with no file yet (a create's first directories) is left out: nothing tells its age.
    """
    candidates = root.folders(folder.rstrip("/") + "/")
    named = live()
    keep_after = time.time() - max(retention, ORPHAN_RETENTION).total_seconds()
    for table in candidates:
        if table in named:
            continue
        files = root.list(table + "/")
        if files and not any(e.mtime_s >= keep_after for e in files):
            yield table, files


def _holds_messages(table: str, files: list[Entry]) -> int:
    """How many data files an unnamed table's listing holds (those of its partitions, not its log, leases, staging or
    temporary files), 0 under its delete's tombstone: what maintenance must not remove, since its entry may be what is
    missing (a damaged catalog)."""
    if any(e.path == f"{table}/{TOMBSTONE}" for e in files):
        return 0
    data = f"{table}/{PARTITION_COLUMN}="
    return sum(1 for e in files if e.path.startswith(data) and not e.path.rsplit("/", 1)[-1].startswith(".tmp-"))


def maintain_catalog(catalog: MaintainedTable, vacuum_retention: timedelta | None) -> MaintenanceReport:
    """Checkpoint the namespace catalog, trim its log behind the checkpoint and (with a retention) vacuum it.

    Every catalog change replaces the catalog's one file, so this is all it needs: nothing to
    compact. Vacuum goes first, while the log still holds the removals the trim may delete (and a
    retention vacuum cannot use fails before anything changed). A failure is logged and returned
    in the report's `error`, as for an entity table.
    """
    report = MaintenanceReport()
    try:
        if vacuum_retention is not None:
            vacuum(catalog, vacuum_retention, report)
        checkpoint(catalog, report)
        report.files_before = report.files_after = len(catalog.snapshot().files)
    except SparkQueueError as exc:
        log.error("maintenance of the namespace catalog %s skipped: %s", catalog.store.uri, exc)
        report.error = str(exc)
    return report
