"""Commit add/remove actions with file-precise optimistic concurrency.

delta-rs treats an explicit-action commit as having read the whole table, so any concurrent
commit that removed any file makes it fail. sparkqueue's reads depend only on the files it
removes (files are immutable) and, for appends, on the partition fences. So on a conflict we
refresh the snapshot and, when those are unchanged, commit the same actions again on the new
base; only a real overlap is reported as a conflict for the caller to recompute.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence

import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, RemoveAction

from sparkqueue.storage.schema import ENTITY_SCHEMA, PARTITION_COLUMN

log = logging.getLogger(__name__)

MAX_REBASES = 64
# delta-rs writes a checkpoint every few commits and then deletes expired log files, inside the
# commit call: when another process trimmed a file first, the call fails after the commit went
# through. sparkqueue does both itself after the commit, tolerating concurrent trimmers.
NO_LOG_CLEANUP = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
DEFAULT_LOG_RETENTION_S = 30 * 86400.0  # Delta's default logRetentionDuration
_INTERVAL = re.compile(r"^\s*interval\s+(\d+)\s+(\w+?)s?\s*$", re.IGNORECASE)
_UNIT_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
_LOG_FILE = re.compile(r"^(\d{20})\.(json|crc|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)$")


def commit(
    dt: DeltaTable,
    adds: Sequence[AddAction],
    removes: Sequence[RemoveAction],
    fences: Sequence[Transaction],
    still_valid: Callable[[DeltaTable], bool],
) -> int:
    """Commit the actions on `dt`'s version, rebasing while `still_valid(refreshed)` holds; returns the new version.

    Raises CommitFailedError when a concurrent commit invalidated what the actions were computed from.
    """
    props = CommitProperties(app_transactions=list(fences)) if fences else None
    actions = [*adds, *removes]
    for _ in range(MAX_REBASES):
        try:
            dt.create_write_transaction(
                actions,
                mode="append",
                schema=ENTITY_SCHEMA,
                partition_by=[PARTITION_COLUMN],
                commit_properties=props,
                post_commithook_properties=NO_LOG_CLEANUP,
            )
            version = dt.version()
            if version % int(dt.metadata().configuration.get("delta.checkpointInterval", "100")) == 0:
                checkpoint_quietly(dt)
            return version
        except DeltaError as exc:
            # A handle older than the log retention cannot check the commits since its version
            # (their log entries are gone): delta-rs says "Invalid table version". Refresh and
            # revalidate, as for a lost race.
            if not isinstance(exc, CommitFailedError) and "Invalid table version" not in str(exc):
                raise
            dt.update_incremental()
            if not still_valid(dt):
                if isinstance(exc, CommitFailedError):
                    raise
                raise CommitFailedError(f"the snapshot fell behind the log: {exc}") from exc
            log.debug("commit rebased onto version %d", dt.version())
    raise CommitFailedError(f"commit kept losing races after {MAX_REBASES} rebases")


def fences_unchanged(expected: dict[str, int | None]) -> Callable[[DeltaTable], bool]:
    """A validity check: every fence app id still has the version the commit was computed from."""

    def check(dt: DeltaTable) -> bool:
        return all(dt.transaction_version(app) == v for app, v in expected.items())

    return check


def checkpoint_quietly(dt: DeltaTable) -> None:
    """Checkpoint at `dt`'s version and trim the log; a failure only postpones it (the commit stands)."""
    try:
        dt.create_checkpoint()
    except (OSError, DeltaError) as exc:
        log.debug("checkpoint of %s at version %d skipped: %s", dt.table_uri, dt.version(), exc)
        return
    trim_log(dt)


def log_retention_s(dt: DeltaTable) -> float:
    """The table's delta.logRetentionDuration in seconds ("interval <n> <unit>"; Delta's default when unset)."""
    m = _INTERVAL.match(dt.metadata().configuration.get("delta.logRetentionDuration") or "")
    if m is None or m.group(2).lower() not in _UNIT_S:
        return DEFAULT_LOG_RETENTION_S
    return int(m.group(1)) * _UNIT_S[m.group(2).lower()]


def trim_log(dt: DeltaTable) -> int:
    """Delete log entries older than the log retention that precede the newest checkpoint; returns how many.

    What delta-rs's cleanup does, except that files another process deleted first are skipped
    rather than raised: every writer and every maintenance run may trim at once.
    """
    try:
        fs, root = pafs.FileSystem.from_uri(dt.table_uri)
        infos = fs.get_file_info(pafs.FileSelector(f"{root.rstrip('/')}/_delta_log"))
    except (OSError, ValueError):  # a store pyarrow cannot reach: maintenance's checkpoint leaves the log as it is
        return 0
    entries = [(int(m.group(1)), m.group(2), i) for i in infos if (m := _LOG_FILE.match(i.base_name))]
    checkpoints = [v for v, kind, _ in entries if kind.startswith("checkpoint")]
    if not checkpoints:
        return 0
    newest = max(checkpoints)
    cutoff_ns = time.time_ns() - int(log_retention_s(dt) * 1e9)
    removed = 0
    for version, _, info in entries:
        if version < newest and info.mtime_ns is not None and info.mtime_ns < cutoff_ns:
            with contextlib.suppress(OSError):  # FileNotFoundError included: another trimmer was first
                fs.delete_file(info.path)
                removed += 1
    return removed
