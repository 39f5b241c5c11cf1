"""Checkpoints and log trimming, so that loading a table stays cheap however many commits it has seen.

A checkpoint (written by delta-rs, the reference writer) folds the log up to a version into one
Parquet file; entries before the newest checkpoint and older than the table's log retention are
then deleted. Every writer may trim at once: a file another trimmer deleted first is skipped.
Both are best effort: a failure only postpones them, the commit that triggered them stands.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping

from sparkqueue.storage.log import LOG_DIR, Snapshot, log_retention_s
from sparkqueue.storage.store import Store

log = logging.getLogger(__name__)

_LOG_FILE = re.compile(r"^(\d{20})\.(json|crc|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)$")


def write_checkpoint(table_uri: str, version: int, storage_options: Mapping[str, str] | None) -> bool:
    """Write a checkpoint at `version` with delta-rs; False (logged) when it could not."""
    from deltalake import DeltaTable

    try:
        DeltaTable(table_uri, version=version, storage_options=dict(storage_options or {}) or None).create_checkpoint()
    except Exception as exc:
        log.debug("checkpoint of %s at version %d skipped: %s", table_uri, version, exc)
        return False
    return True


def trim_log(store: Store, snap: Snapshot) -> int:
    """Delete log entries older than the log retention that precede the newest checkpoint; returns how many."""
    entries = []
    for e in store.list(f"{LOG_DIR}/"):
        m = _LOG_FILE.match(e.path.rsplit("/", 1)[-1])
        if m is not None:
            entries.append((int(m.group(1)), m.group(2), e))
    checkpoints = [v for v, kind, _ in entries if kind.startswith("checkpoint")]
    if not checkpoints:
        return 0
    newest = max(checkpoints)
    cutoff = time.time() - log_retention_s(snap.configuration)
    removed = 0
    for version, _, e in entries:
        if version < newest and e.mtime_s < cutoff:
            store.delete(e.path)
            removed += 1
    return removed
