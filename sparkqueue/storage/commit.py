"""Commit add/remove actions with file-precise optimistic concurrency.

delta-rs treats an explicit-action commit as having read the whole table, so any concurrent
commit that removed any file makes it fail. sparkqueue's reads depend only on the files it
removes (files are immutable) and, for appends, on the partition fences. So on a conflict we
refresh the snapshot and, when those are unchanged, commit the same actions again on the new
base; only a real overlap is reported as a conflict for the caller to recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, RemoveAction

from sparkqueue.storage.schema import ENTITY_SCHEMA, PARTITION_COLUMN

log = logging.getLogger(__name__)

MAX_REBASES = 64


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
                actions, mode="append", schema=ENTITY_SCHEMA, partition_by=[PARTITION_COLUMN], commit_properties=props
            )
            return dt.version()
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
