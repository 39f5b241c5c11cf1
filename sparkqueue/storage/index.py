"""The file index of an entity table: per-partition file statistics at one version, kept current from the log.

Every operation needs the live files of a partition with their statistics. Rebuilding that from
`DeltaTable.get_add_actions` costs time in proportion to the whole table's files, and the table
version moves with every send and settle. So the index is built once and then moved forward by
reading only the new commits' JSON (their add and remove actions carry the statistics); it is
rebuilt only on first use, after a long gap, or when the log entries it needs are gone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import DeltaTable

from sparkqueue.storage.schema import ANY_SUBSCRIPTION, PARTITION_COLUMN

log = logging.getLogger(__name__)

MAX_INCREMENT = 500  # versions to replay from the log before a full rebuild is cheaper


@dataclass(frozen=True)
class FileInfo:
    """Statistics of one data file, enough to decide whether a read must open it."""

    path: str
    partition: int
    size_bytes: int
    num_records: int
    min_seq: int
    max_seq: int
    min_available_at: datetime | None
    max_enqueued: datetime | None
    min_sub_queue: str | None
    max_sub_queue: str | None
    min_kind: str | None = None
    max_kind: str | None = None
    min_subscription: str | None = None
    max_subscription: str | None = None
    null_subscriptions: int | None = None
    min_session: str | None = None
    max_session: str | None = None
    min_enqueued: datetime | None = None
    min_state: str | None = None
    max_state: str | None = None

    def may_hold(self, kind: str, sub_queue: str | None, subscription: str | None, session_id: str | None = None) -> bool:
        """False when the statistics prove the file holds no row of this kind, sub-queue, subscription and session."""
        if not _in_range(kind, self.min_kind, self.max_kind):
            return False
        if sub_queue is not None and not _in_range(sub_queue, self.min_sub_queue, self.max_sub_queue):
            return False
        if session_id is not None and not _in_range(session_id, self.min_session, self.max_session):
            return False
        if subscription == ANY_SUBSCRIPTION:
            return True
        if subscription is None:
            return self.null_subscriptions != 0
        return _in_range(subscription, self.min_subscription, self.max_subscription)


def _in_range(value: str, lo: str | None, hi: str | None) -> bool:
    """Could a file whose string stats are [lo, hi] hold `value`? Missing stats: assume yes.

    sparkqueue writes its own, untruncated string statistics (files.py), so a plain range check is exact.
    """
    return lo is None or hi is None or lo <= value <= hi


class FileIndex:
    """Live files of one table at `version`, by partition, each partition's list ordered by lowest sequence number."""

    def __init__(self, uri: str, fs: pafs.FileSystem, root: str) -> None:
        self.uri = uri
        self._fs = fs
        self._log = f"{root}/_delta_log"
        self.version = -1
        self._files: dict[str, FileInfo] = {}
        self._sorted: dict[int, list[FileInfo]] = {}

    def at(self, dt: DeltaTable) -> FileIndex:
        """Bring the index to `dt`'s version: replay new commits from the log, or rebuild when that is not possible."""
        target = dt.version()
        if target == self.version:
            return self
        if self.version < 0 or target < self.version or target - self.version > MAX_INCREMENT:
            self._rebuild(dt)
        else:
            try:
                for v in range(self.version + 1, target + 1):
                    self._replay(v)
            except (OSError, ValueError, KeyError) as exc:
                log.debug("log replay of %s to version %d failed (%s); rebuilding the file index", self.uri, target, exc)
                self._rebuild(dt)
        self.version = target
        return self

    def partition(self, p: int) -> list[FileInfo]:
        """The partition's live files, ordered by lowest sequence number."""
        files = self._sorted.get(p)
        if files is None:
            files = sorted((f for f in self._files.values() if f.partition == p), key=lambda f: f.min_seq)
            self._sorted[p] = files
        return files

    def __contains__(self, path: str) -> bool:
        return path in self._files

    def _replay(self, version: int) -> None:
        """Apply one commit's add and remove actions."""
        with self._fs.open_input_stream(f"{self._log}/{version:020d}.json") as f:
            text = f.read().decode("utf-8")
        for line in text.splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            if "add" in action:
                info = _from_add(action["add"])
                self._files[info.path] = info
                self._sorted.pop(info.partition, None)
            elif "remove" in action:
                gone = self._files.pop(unquote(action["remove"]["path"]), None)
                if gone is not None:
                    self._sorted.pop(gone.partition, None)

    def _rebuild(self, dt: DeltaTable) -> None:
        """Build the index from the snapshot's add actions."""
        self._files = {f.path: f for f in _from_snapshot(dt)}
        self._sorted = {}


def _from_add(add: dict) -> FileInfo:
    """A FileInfo from a log `add` action and its JSON statistics."""
    stats = json.loads(add.get("stats") or "{}")
    lo, hi, nulls = stats.get("minValues", {}), stats.get("maxValues", {}), stats.get("nullCount", {})
    return FileInfo(
        path=unquote(add["path"]),
        partition=int(add["partitionValues"][PARTITION_COLUMN]),
        size_bytes=int(add["size"]),
        num_records=int(stats.get("numRecords", 0)),
        min_seq=int(lo.get("sequence_number", 0)),
        max_seq=int(hi.get("sequence_number", 0)),
        min_available_at=_ts(lo.get("available_at_utc")),
        max_enqueued=_ts(hi.get("enqueued_time_utc")),
        min_sub_queue=lo.get("sub_queue"),
        max_sub_queue=hi.get("sub_queue"),
        min_kind=lo.get("kind"),
        max_kind=hi.get("kind"),
        min_subscription=lo.get("subscription"),
        max_subscription=hi.get("subscription"),
        null_subscriptions=nulls.get("subscription"),
        min_session=lo.get("session_id"),
        max_session=hi.get("session_id"),
        min_enqueued=_ts(lo.get("enqueued_time_utc")),
        min_state=lo.get("state"),
        max_state=hi.get("state"),
    )


def _ts(value: str | None) -> datetime | None:
    """A Delta statistics timestamp (ISO 8601, 'Z') as an aware datetime."""
    return datetime.fromisoformat(value) if value else None


def _from_snapshot(dt: DeltaTable) -> list[FileInfo]:
    """Every live file of a snapshot, from its flattened add actions."""
    a = pa.table(dt.get_add_actions(flatten=True))

    def col(name: str) -> list:
        return a.column(name).to_pylist() if name in a.column_names else [None] * a.num_rows

    rows = zip(
        col("path"),
        col(f"partition.{PARTITION_COLUMN}"),
        col("size_bytes"),
        col("num_records"),
        col("min.sequence_number"),
        col("max.sequence_number"),
        col("min.available_at_utc"),
        col("max.enqueued_time_utc"),
        col("min.sub_queue"),
        col("max.sub_queue"),
        col("min.kind"),
        col("max.kind"),
        col("min.subscription"),
        col("max.subscription"),
        col("null_count.subscription"),
        col("min.session_id"),
        col("max.session_id"),
        col("min.enqueued_time_utc"),
        col("min.state"),
        col("max.state"),
        strict=True,
    )
    return [
        FileInfo(unquote(path), int(part), size, n or 0, lo or 0, hi or 0, *rest) for path, part, size, n, lo, hi, *rest in rows
    ]
