"""The file index of an entity table: per-partition file statistics, kept by the table's snapshot.

Every operation needs the live files of a partition with their statistics (what the receive path
prunes on). The snapshot (log.py) applies each commit's add and remove actions here, so the
index is always at the snapshot's version without re-reading anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import unquote

from sparkqueue.storage.schema import ANY_SUBSCRIPTION, PARTITION_COLUMN


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
        return self.may_hold_subscription(subscription)

    def may_hold_subscription(self, subscription: str | None) -> bool:
        """False when the statistics prove the file holds no row of this subscription (None: a queue's rows)."""
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
    """Live files of one entity table, by partition, each partition's list ordered by lowest sequence number.

    The `FileSet` of an entity table's snapshot (log.py): the log applies add and remove actions.
    """

    def __init__(self) -> None:
        self._files: dict[str, FileInfo] = {}
        self._actions: dict[str, Mapping[str, Any]] = {}  # what a checkpoint writes back
        self._sorted: dict[int, list[FileInfo]] = {}

    def add(self, action: Mapping[str, Any]) -> None:
        """Record a live file from its `add` action."""
        info = _from_add(action)
        self._files[info.path] = info
        self._actions[info.path] = action
        self._sorted.pop(info.partition, None)

    def remove(self, path: str) -> None:
        """Forget a removed file."""
        gone = self._files.pop(path, None)
        self._actions.pop(path, None)
        if gone is not None:
            self._sorted.pop(gone.partition, None)

    def actions(self) -> Iterable[Mapping[str, Any]]:
        """The live files' add actions."""
        return self._actions.values()

    def partition(self, p: int) -> list[FileInfo]:
        """The partition's live files, ordered by lowest sequence number."""
        files = self._sorted.get(p)
        if files is None:
            files = sorted((f for f in self._files.values() if f.partition == p), key=lambda f: f.min_seq)
            self._sorted[p] = files
        return files

    def __iter__(self) -> Iterator[FileInfo]:
        return iter(self._files.values())

    def __contains__(self, path: object) -> bool:
        return path in self._files

    def __len__(self) -> int:
        return len(self._files)

    def copy(self) -> FileIndex:
        """An independent index of the same files (FileInfo is immutable; sorted lists are rebuilt on demand)."""
        other = FileIndex()
        other._files = dict(self._files)
        other._actions = dict(self._actions)
        return other


def _from_add(add: Mapping[str, Any]) -> FileInfo:
    """A FileInfo from a log `add` action and its JSON statistics."""
    # delta-rs checkpoints may carry the statistics parsed (stats_parsed) instead of as JSON text.
    stats = json.loads(add["stats"]) if add.get("stats") else (add.get("stats_parsed") or {})
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


def _ts(value: str | datetime | None) -> datetime | None:
    """A Delta statistics timestamp (ISO 8601, 'Z'; or already parsed) as an aware datetime."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(value) if value else None
