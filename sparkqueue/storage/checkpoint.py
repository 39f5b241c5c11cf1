"""Checkpoints and log trimming, so that loading a table stays cheap however many commits it has seen.

A checkpoint folds the log up to a version into one Parquet file (Delta's classic checkpoint,
read by delta-rs and Spark); entries before the newest checkpoint and older than the table's log
retention are then deleted. Every writer may trim at once: a file another trimmer deleted first is skipped.
Both are best effort: a failure only postpones them, the commit that triggered them stands.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sparkqueue.storage.log import (
    LOG_DIR,
    MARK_PREFIX,
    MARK_RETENTION_MS,
    Snapshot,
    deleted_since,
    log_retention_s,
    withdraw,
)
from sparkqueue.storage.store import Store

log = logging.getLogger(__name__)

LAST_CHECKPOINT = f"{LOG_DIR}/_last_checkpoint"
_LOG_FILE = re.compile(r"^(\d{20})\.(json|crc|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)$")


def write_checkpoint(store: Store, snap: Snapshot, now_ms: int | None = None) -> bool:
    """Write a classic single-file checkpoint of `snap` and point `_last_checkpoint` at it; False (logged) when it failed.

    Built from the snapshot in memory (its live files' add actions, txn versions, metadata and
    protocol), so it costs a Parquet write of one row per live file, not a reload of the table.
    Two writers checkpointing one version write the same actions (but for idempotence marks one
    of them found expired at `now_ms`, `kept_txns`): either file serves.
    `_last_checkpoint` never moves back (_point_at): a slower checkpointer of an older version
    leaves it at the newer checkpoint, which external readers (delta-rs, Spark) start from.
    """
    try:
        table = checkpoint_table(snap, now_ms)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="snappy")
        path = f"{LOG_DIR}/{snap.version:020d}.checkpoint.parquet"
        store.put(path, sink.getvalue().to_pybytes())
        _point_at(store, snap.version, table.num_rows)
        if deleted_since(store, snap.version):  # the put made the table's folder again: a sender must not find it live
            withdraw(store, [path, LAST_CHECKPOINT])
            log.info("%s was deleted while it was checkpointed at version %d", store.uri, snap.version)
            return False
    except Exception as exc:
        log.warning("checkpoint of %s at version %d skipped: %s", store.uri, snap.version, exc)
        return False
    return True


def kept_txns(snap: Snapshot, now_ms: int | None = None) -> list[tuple[str, int, int]]:
    """The txns a checkpoint at `now_ms` keeps, as (app id, version, lastUpdated): all but expired idempotence marks.

    A mark (MARK_PREFIX) guards against a forwarder repeating an append it may have made; one not
    updated for MARK_RETENTION_MS has no forwarder left to guard against, and kept for good they
    slowed every load (100,000 of them took 0.45 s). A txn whose time the log does not give
    (checkpoints before this one wrote none) counts from `now_ms`.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    horizon = now - MARK_RETENTION_MS
    out = []
    for app, version in sorted(snap.txns.items()):
        updated = snap.txn_times.get(app, now)
        if updated >= horizon or not app.startswith(MARK_PREFIX):
            out.append((app, version, updated))
    return out


def _point_at(store: Store, version: int, size: int) -> None:
    """Point `_last_checkpoint` at a checkpoint unless it names a newer one that exists (any other is replaced).

    A pointer that is missing, unreadable, older, or names a version with no complete checkpoint
    (a future version, one trimmed away, one a copy or a crash left behind) is rewritten: delta-rs
    and Spark start at the version it names and fail when there is no checkpoint there. Only a
    newer pointer costs a look (a stat; a listing for a multi-part checkpoint).

    Read, then write: not atomic. Two checkpointers that both read before either writes can leave
    it at the older of their two versions, until the next checkpoint moves it on (every
    `delta.checkpointInterval` versions, and every maintenance run). The window is one small read
    and write, and trim_log keeps the checkpoint it names and the entries after it, so it still
    names a checkpoint that exists unless a trim read it inside that same window too.
    """
    named = last_checkpoint_version(store)
    if named is not None and (named == version or (named > version and checkpoint_exists(store, named))):
        return
    store.put(LAST_CHECKPOINT, json.dumps({"version": version, "size": size}).encode())


def last_checkpoint_version(store: Store) -> int | None:
    """The version `_last_checkpoint` names; None when it is missing or unreadable (it is a hint: the log is listed anyway)."""
    try:
        version = json.loads(store.get(LAST_CHECKPOINT))["version"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def checkpoint_exists(store: Store, version: int) -> bool:
    """Whether a complete checkpoint of `version` is in the log: its single file, or every part of a multi-part one."""
    if store.exists(f"{LOG_DIR}/{version:020d}.checkpoint.parquet"):
        return True
    return version in complete_checkpoints(e.path for e in store.list(f"{LOG_DIR}/"))


def complete_checkpoints(paths: Iterable[str]) -> set[int]:
    """The versions of the complete checkpoints among these store paths (single-file, or multi-part with every part)."""
    single: set[int] = set()
    parts: dict[tuple[int, int], set[int]] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        m = _LOG_FILE.match(name) if folder == LOG_DIR else None
        if m is None or not m.group(2).startswith("checkpoint"):
            continue
        version = int(m.group(1))
        if m.group(2) == "checkpoint.parquet":
            single.add(version)
        else:
            _, part, total, _ = m.group(2).split(".")
            parts.setdefault((version, int(total)), set()).add(int(part))
    return single | {v for (v, total), got in parts.items() if len(got) == total and got == set(range(1, total + 1))}


def last_checkpoint_problem(store: Store, paths: Iterable[str]) -> str | None:
    """What is wrong with `_last_checkpoint`, given a listing of the table's store (`paths`).

    None when it is absent (a table with no checkpoint yet has none) or names a complete
    checkpoint. One naming a version with no complete checkpoint makes delta-rs fail to open the
    table ("Had a _last_checkpoint hint but didn't find any checkpoints"); one that cannot be read
    is damage too, though readers then list the log. sparkqueue lists the log either way.
    """
    try:
        raw = store.get(LAST_CHECKPOINT)
    except FileNotFoundError:
        return None
    named = last_checkpoint_version(store)
    if named is None:
        return f"{LAST_CHECKPOINT} cannot be read ({raw[:40]!r}); Delta readers list the log instead"
    if named in complete_checkpoints(paths) or checkpoint_exists(store, named):  # one written since the listing is fine
        return None
    return f"{LAST_CHECKPOINT} names version {named}, which has no checkpoint: delta-rs cannot open the table"


def repoint_last_checkpoint(store: Store, paths: Iterable[str]) -> str:
    """Point `_last_checkpoint` at the newest complete checkpoint among `paths`, or remove it when there is none; what it did.

    Read again just before the write, as in _point_at: a pointer a checkpointer moved to an
    existing checkpoint meanwhile is left as it is.
    """
    named = last_checkpoint_version(store)
    if named is not None and checkpoint_exists(store, named):
        return f"left as a checkpointer set it meanwhile (checkpoint {named})"
    listed = list(paths)
    existing = complete_checkpoints(listed)
    if not existing:
        store.delete(LAST_CHECKPOINT)
        return "removed it: the log holds no checkpoint"
    newest = max(existing)
    files = [f"{LOG_DIR}/{newest:020d}.checkpoint.parquet"]
    if not store.exists(files[0]):  # a multi-part checkpoint: its size is the actions of all its parts
        files = sorted(path for path in listed if path.startswith(f"{LOG_DIR}/{newest:020d}.checkpoint."))
    size = sum(pq.read_metadata(pa.BufferReader(store.get(f))).num_rows for f in files)
    store.put(LAST_CHECKPOINT, json.dumps({"version": newest, "size": size}).encode())
    return f"pointed it at checkpoint {newest}"


def checkpoint_table(snap: Snapshot, now_ms: int | None = None) -> pa.Table:
    """The checkpoint rows of a snapshot: protocol, metadata, one per kept txn and one per live file's add action."""
    p, m = snap.protocol, snap.metadata
    rows: list[dict[str, Any]] = [
        {
            "protocol": {
                "minReaderVersion": int(p.get("minReaderVersion", 1)),
                "minWriterVersion": int(p.get("minWriterVersion", 2)),
                "readerFeatures": p.get("readerFeatures"),
                "writerFeatures": p.get("writerFeatures"),
            }
        },
        {
            "metaData": {
                "id": m.get("id"),
                "name": m.get("name"),
                "description": m.get("description"),
                "format": {
                    "provider": (m.get("format") or {}).get("provider", "parquet"),
                    "options": _pairs((m.get("format") or {}).get("options")),
                },
                "schemaString": m.get("schemaString"),
                "partitionColumns": list(m.get("partitionColumns") or []),
                "configuration": _pairs(m.get("configuration")),
                "createdTime": m.get("createdTime"),
            }
        },
    ]
    rows += [{"txn": {"appId": app, "version": v, "lastUpdated": t}} for app, v, t in kept_txns(snap, now_ms)]
    for a in snap.files.actions():
        rows.append(
            {
                "add": {
                    "path": a["path"],
                    "partitionValues": _pairs(a.get("partitionValues")),
                    "size": int(a["size"]),
                    "modificationTime": int(a.get("modificationTime", 0)),
                    "dataChange": False,
                    "stats": a.get("stats"),
                    "tags": _pairs(a.get("tags")) if a.get("tags") else None,
                }
            }
        )
    return pa.Table.from_pylist(rows, schema=CHECKPOINT_SCHEMA)


def _pairs(mapping: Mapping[str, str | None] | None) -> list[tuple[str, str | None]]:
    """A dict as the (key, value) list Arrow map columns take."""
    return [(str(k), None if v is None else str(v)) for k, v in (mapping or {}).items()]


_MAP = pa.map_(pa.string(), pa.string())
CHECKPOINT_SCHEMA = pa.schema(
    [
        pa.field("txn", pa.struct([("appId", pa.string()), ("version", pa.int64()), ("lastUpdated", pa.int64())])),
        pa.field(
            "add",
            pa.struct(
                [
                    ("path", pa.string()),
                    ("partitionValues", _MAP),
                    ("size", pa.int64()),
                    ("modificationTime", pa.int64()),
                    ("dataChange", pa.bool_()),
                    ("stats", pa.string()),
                    ("tags", _MAP),
                ]
            ),
        ),
        pa.field(
            "metaData",
            pa.struct(
                [
                    ("id", pa.string()),
                    ("name", pa.string()),
                    ("description", pa.string()),
                    ("format", pa.struct([("provider", pa.string()), ("options", _MAP)])),
                    ("schemaString", pa.string()),
                    ("partitionColumns", pa.list_(pa.string())),
                    ("configuration", _MAP),
                    ("createdTime", pa.int64()),
                ]
            ),
        ),
        pa.field(
            "protocol",
            pa.struct(
                [
                    ("minReaderVersion", pa.int32()),
                    ("minWriterVersion", pa.int32()),
                    ("readerFeatures", pa.list_(pa.string())),
                    ("writerFeatures", pa.list_(pa.string())),
                ]
            ),
        ),
    ]
)


def trim_log(store: Store, snap: Snapshot) -> int:
    """Delete log entries older than the log retention that precede the newest checkpoint; returns how many.

    Nor those from the checkpoint `_last_checkpoint` names on, when it lags (a checkpointer lost the race
    in _point_at): external readers start there, and the next checkpoint moves it on.
    """
    entries = []
    for e in store.list(f"{LOG_DIR}/"):
        folder, _, name = e.path.rpartition("/")
        m = _LOG_FILE.match(name) if folder == LOG_DIR else None
        if m is not None:
            entries.append((int(m.group(1)), m.group(2), e))
    checkpoints = [v for v, kind, _ in entries if kind.startswith("checkpoint")]
    if not checkpoints:
        return 0
    newest = max(checkpoints)
    named = last_checkpoint_version(store)
    if named is not None and named in checkpoints:
        newest = min(newest, named)
    cutoff = time.time() - log_retention_s(snap.configuration)
    removed = 0
    for version, _, e in sorted(entries, key=lambda x: x[0]):  # in version order: DeltaLog._read_by_others relies on it
        if version < newest and e.mtime_s < cutoff:
            store.delete(e.path)
            removed += 1
    return removed
