"""Maintenance that keeps an entity table's cost flat as its history grows (ENGINE-NOTES: small files and long logs).

- Compaction rewrites runs of small, adjacent files of one partition (in sequence order, never
  mixing subscriptions or session rows with messages) into bounded files. It commits only while
  every input file is still live (commit.py), so a concurrent send (new files) is never touched
  and a concurrent settlement (which rewrites an input) makes the compaction, not the settle, retry.
- While rewriting it drops rows nobody can reach any more: duplicate-detection tombstones whose
  window has passed, and copies of deleted subscriptions.
- Checkpoints bound the log replay; vacuum deletes unreferenced files (including files of
  commits that never happened, e.g. a writer killed mid-operation) after a safe retention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import CommitFailedError

from sparkqueue.storage.commit import commit
from sparkqueue.storage.files import remove_action
from sparkqueue.storage.schema import STATE_COMPLETED, TIMESTAMP
from sparkqueue.storage.table import EntityTable, FileInfo

log = logging.getLogger(__name__)

TARGET_ROWS = 20_000  # rows per compacted file: a lock or settle rewrites at most one such file
TARGET_BYTES = 64 * 1024 * 1024
SMALL_FRACTION = 0.25  # a file under a quarter of the target is "small"
DEFAULT_VACUUM_RETENTION = timedelta(hours=1)


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


def compact(
    table: EntityTable,
    *,
    drop_before: datetime | None = None,
    live_subscriptions: set[str] | None = None,
    report: MaintenanceReport | None = None,
) -> MaintenanceReport:
    """Compact every partition; optionally drop tombstones enqueued before `drop_before` and orphaned subscription rows."""
    report = report or MaintenanceReport()
    dt = table.snapshot()
    for p in range(table.partition_count):
        if not table.available(p):
            continue
        report.files_before += len(table.files(dt, p))
        for group in _groups(table.files(dt, p)):
            try:
                dropped = _rewrite(table, p, group, _droppable(drop_before, live_subscriptions))
            except CommitFailedError:
                report.compactions_skipped += 1  # a settlement changed an input first; next run picks it up
                continue
            report.files_compacted += len(group)
            report.rows_dropped += dropped
    dt = table.snapshot()
    for p in range(table.partition_count):
        if table.available(p):
            n = len(table.files(dt, p))
            report.per_partition_files[p] = n
            report.files_after += n
    return report


def _groups(files: list[FileInfo]) -> Iterator[list[FileInfo]]:
    """Runs of adjacent small files of one kind and subscription, each run within the target size."""
    run: list[FileInfo] = []
    rows = size = 0
    for f in files:
        small = f.num_records < TARGET_ROWS * SMALL_FRACTION and f.size_bytes < TARGET_BYTES * SMALL_FRACTION
        same = bool(run) and _klass(run[0]) == _klass(f)
        if run and (not small or not same or rows + f.num_records > TARGET_ROWS or size + f.size_bytes > TARGET_BYTES):
            if len(run) > 1:
                yield run
            run, rows, size = [], 0, 0
        if small and _klass(f) is not None:
            run.append(f)
            rows += f.num_records
            size += f.size_bytes
    if len(run) > 1:
        yield run


def _klass(f: FileInfo) -> tuple[str, str | None] | None:
    """What a file holds, when its statistics pin it to one kind and one subscription (else None: leave it alone)."""
    if f.min_kind is None or f.min_kind != f.max_kind or f.min_subscription != f.max_subscription:
        return None
    if f.min_subscription is None and f.null_subscriptions not in (None, f.num_records):
        return None
    return f.min_kind, f.min_subscription


def _droppable(drop_before: datetime | None, live: set[str] | None) -> Callable[[pa.Table], pa.Array] | None:
    """A mask of rows compaction may drop: expired tombstones and rows of subscriptions that no longer exist."""
    if drop_before is None and live is None:
        return None

    def mask(rows: pa.Table) -> pa.Array:
        out = pa.array([False] * rows.num_rows)
        if drop_before is not None:
            old = pc.less(rows.column("enqueued_time_utc"), pa.scalar(drop_before, TIMESTAMP))
            out = pc.or_(out, pc.and_(pc.equal(rows.column("state"), STATE_COMPLETED), old))
        if live is not None:
            sub = rows.column("subscription")
            orphan = pc.and_(pc.is_valid(sub), pc.invert(pc.fill_null(pc.is_in(sub, value_set=pa.array(sorted(live))), False)))
            out = pc.or_(out, orphan)
        return out

    return mask


def _rewrite(table: EntityTable, p: int, group: list[FileInfo], droppable: Callable[[pa.Table], pa.Array] | None) -> int:
    """Replace a run of files by one file of the same rows in sequence order; returns the rows dropped."""
    dt = table.snapshot()
    live = {f.path for f in table.files(dt, p)}
    if any(f.path not in live for f in group):
        raise CommitFailedError("an input file changed before compaction started")
    rows = pa.concat_tables([table.data.read(f.path) for f in group]).sort_by("sequence_number")
    before = rows.num_rows
    if droppable is not None:
        rows = rows.filter(pc.invert(droppable(rows)))
    adds = [table.data.write(p, rows)] if rows.num_rows else []
    removes = [remove_action(f.path, f.partition, f.size_bytes) for f in group]
    try:
        commit(dt, adds, removes, [], lambda d: all(f.path in {g.path for g in table.files(d, p)} for f in group))
    except BaseException:
        table.data.delete([a.path for a in adds])
        raise
    return before - rows.num_rows


def checkpoint(table: EntityTable, report: MaintenanceReport | None = None) -> MaintenanceReport:
    """Write a checkpoint at the current version and delete log files past the log retention."""
    report = report or MaintenanceReport()
    dt = table.snapshot()
    dt.create_checkpoint()
    dt.cleanup_metadata()
    report.checkpointed_version = dt.version()
    return report


def vacuum(
    table: EntityTable, retention: timedelta = DEFAULT_VACUUM_RETENTION, report: MaintenanceReport | None = None
) -> MaintenanceReport:
    """Delete data files no version newer than `retention` references (and never-committed files that old)."""
    report = report or MaintenanceReport()
    hours = max(0, int(retention.total_seconds() // 3600))
    removed = table.snapshot().vacuum(retention_hours=hours, dry_run=False, enforce_retention_duration=False)
    report.vacuumed_files = len(removed)
    return report
