"""Checking an entity table for damage, and repairing what can be repaired safely (docs/storage.md).

Two kinds of damage are found: a newest log entry that is empty or truncated (what a torn write
on a disk without fsync can leave), and live data files that are missing or unreadable. A live
file is judged by its Parquet footer alone (one ranged read of its tail, two for a huge footer):
unreadable when the footer cannot be parsed (truncated, zeroed, not Parquet), lacks a column
reads need, or counts other rows than the file's add action. Its pages are not read, so the
check costs a listing and a few KB per live file however large the table is, and damage inside
a page is found only by the read that meets it (which makes the partition unavailable, faults.py).

A `_last_checkpoint` that cannot be read or names a version with no complete checkpoint is
reported too: sparkqueue lists the log and never trusts it, but delta-rs starts at the version it
names and fails to open the table when there is no checkpoint there. Repair points it at the
newest complete checkpoint, or removes it when the log holds none.

Repair copies such a newest entry to `_delta_log/_damaged/` and replaces it in place with an entry
that changes nothing, and commits the removal of live files that are gone (their messages are
lost; the partition works again). sparkqueue fsyncs every entry before linking it into place, so a
torn entry comes from damage after the fact, and it may have been acknowledged and read by running
processes: its version is never freed, or a new commit there would contradict what they read (and
a second repair racing a writer could delete that writer's entry). An unreadable file is
reported, not repaired: its bytes are still there and may be restored or salvaged, and dropping
it from the log would hand it to vacuum. Deleting it (after saving what can be saved) makes it
missing, which repair then handles. Anything else is reported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from sparkqueue.errors import StorageCorruptedError, StorageError
from sparkqueue.storage.checkpoint import last_checkpoint_problem, repoint_last_checkpoint
from sparkqueue.storage.files import FILE_SCHEMA, remove_action
from sparkqueue.storage.log import LOG_DIR, CommitConflict, empty_entry, entry_actions
from sparkqueue.storage.schema import PARTITION_COLUMN
from sparkqueue.storage.store import Store
from sparkqueue.storage.table import EntityTable

log = logging.getLogger(__name__)
DAMAGED_DIR = f"{LOG_DIR}/_damaged"
FOOTER_READ = 64 * 1024  # one ranged read of a file's tail holds its footer (a few KB for sparkqueue's files)
FOOTER_THREADS = 8  # footers read at once: an object store answers each in a round trip


@dataclass
class Finding:
    """One problem found in a table: where, what, and whether it was repaired."""

    table: str
    problem: str
    repaired: bool = False


def check_table(table: EntityTable, *, repair: bool = False) -> list[Finding]:
    """Problems of one table (repaired where safe when `repair`)."""
    findings: list[Finding] = []
    try:
        snap = table.log.load()
    except StorageCorruptedError as exc:
        finding = Finding(table.uri, str(exc))
        findings.append(finding)
        if not (repair and _replace_torn_newest_entry(table)):
            return findings
        finding.repaired = True
        finding.problem += (
            f"; replaced by an entry that changes nothing, a copy of its bytes kept in {DAMAGED_DIR}/: "
            "what it recorded is lost for readers that had not read it"
        )
        snap = table.log.load()
    entries = table.store.list()
    listed = {e.path: e.size for e in entries if not e.path.startswith(f"{LOG_DIR}/")}
    findings += _last_checkpoint(table, [e.path for e in entries if e.path.startswith(f"{LOG_DIR}/")], repair)
    missing = [f for f in snap.files if f.path not in listed]
    if missing:  # a commit and a vacuum between the load and the listing drop live files: lost only if still live now
        gone = {f.path for f in missing}
        snap = table.log.load()
        missing = [f for f in snap.files if f.path in gone]
    for f in missing:
        findings.append(Finding(table.uri, f"live data file {f.path} (partition {f.partition}, {f.num_records} rows) is missing"))
    if repair and missing:
        try:
            table.log.commit(snap, [], [remove_action(f.path, f.partition, f.size_bytes) for f in missing], operation="REPAIR")
        except CommitConflict:
            log.warning("repair of %s lost a race with a writer; run the check again", table.uri)
        else:
            for finding in findings[-len(missing) :]:
                finding.repaired = True
            table.faults.heal()
    findings += _unreadable_files(table, snap.files.actions(), listed)
    return findings


def _last_checkpoint(table: EntityTable, log_paths: list[str], repair: bool) -> list[Finding]:
    """A finding when `_last_checkpoint` names no existing checkpoint (external readers fail); repair re-points it."""
    problem = last_checkpoint_problem(table.store, log_paths)
    if problem is None:
        return []
    finding = Finding(table.uri, problem)
    if repair:
        finding.problem += f"; {repoint_last_checkpoint(table.store, log_paths)}"
        finding.repaired = True
    return [finding]


def _unreadable_files(table: EntityTable, adds: Iterable[Mapping[str, Any]], listed: Mapping[str, int]) -> list[Finding]:
    """A finding for each listed live file whose Parquet footer cannot be read or disagrees with its add action's row count."""
    files = sorted((path, a) for a in adds if (path := unquote(a["path"])) in listed)

    def problem(item: tuple[str, Mapping[str, Any]]) -> str | None:
        path, add = item
        return _footer_problem(table.store, path, listed[path], _num_records(add))

    with ThreadPoolExecutor(FOOTER_THREADS, thread_name_prefix="sparkqueue-check") as pool:
        problems = list(pool.map(problem, files))
    return [
        Finding(
            table.uri,
            f"live data file {path} (partition {(add.get('partitionValues') or {}).get(PARTITION_COLUMN)}, {listed[path]} bytes) "
            f"is unreadable: {what}; not repaired: restore it from a backup, or delete it so that "
            "`check --repair` drops it (its messages are lost)",
        )
        for (path, add), what in zip(files, problems, strict=True)
        if what is not None
    ]


def _footer_problem(store: Store, path: str, size: int, num_records: int | None) -> str | None:
    """What is wrong with a data file's Parquet footer (read from its tail only), or None when it reads and counts right."""
    try:
        tail = store.get_range(path, max(0, size - FOOTER_READ), size) if size else b""
        if len(tail) >= 8 and tail[-4:] == b"PAR1":
            footer = int.from_bytes(tail[-8:-4], "little") + 8
            if len(tail) < footer <= size:  # a footer larger than the first read: read exactly it
                tail = store.get_range(path, size - footer, size)
    except FileNotFoundError:
        return None  # removed since the listing (a concurrent commit, then vacuum): not live any more
    except StorageError as exc:
        return str(exc)
    try:
        meta = pq.read_metadata(pa.BufferReader(tail))
        columns = set(meta.schema.to_arrow_schema().names)
    except (pa.ArrowException, OSError) as exc:
        return f"its Parquet footer cannot be read ({exc})"
    if lacking := [c for c in FILE_SCHEMA.names if c not in columns]:
        return f"it lacks the columns {lacking[:3]}{' ...' if len(lacking) > 3 else ''} every read needs"
    if num_records is not None and meta.num_rows != num_records:
        return f"its Parquet footer counts {meta.num_rows} rows, its add action {num_records}"
    return None


def _num_records(add: Mapping[str, Any]) -> int | None:
    """The add action's numRecords statistic, None when it has none (then the row count is not compared)."""
    try:
        stats = json.loads(add["stats"]) if add.get("stats") else (add.get("stats_parsed") or {})
        n = stats.get("numRecords")
        return None if n is None else int(n)
    except (ValueError, TypeError, AttributeError):
        return None


def _replace_torn_newest_entry(table: EntityTable) -> bool:
    """Replace the newest log entry, when it is empty, not JSON or cut short, by one that changes nothing; True when it did.

    Replaced in place, never deleted: the version stays taken (see the module's docstring). Two
    repairs at once both write the same kind of entry; a writer's commit can never land there.
    """
    versions = sorted(
        int(name[:20])
        for e in table.store.list(f"{LOG_DIR}/")
        if e.path.rpartition("/")[0] == LOG_DIR and (name := e.path.rpartition("/")[2]).endswith(".json") and name[:20].isdigit()
    )
    if not versions:
        return False
    newest = f"{LOG_DIR}/{versions[-1]:020d}.json"
    data = table.store.get(newest)
    try:
        entry_actions(data)
        return False
    except ValueError:  # torn: empty, not JSON, or cut short
        pass
    table.store.put(f"{DAMAGED_DIR}/{versions[-1]:020d}.json", data)
    table.store.put(newest, empty_entry("REPAIR", f"replaced a torn entry of {len(data)} bytes, kept in {DAMAGED_DIR}/"))
    log.warning("replaced the torn log entry %s of %s (its bytes are in %s)", newest, table.uri, DAMAGED_DIR)
    return True
