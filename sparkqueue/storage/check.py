"""Checking an entity table for damage, and repairing what can be repaired safely (docs/storage.md).

Two kinds of damage are found: a newest log entry that is empty or truncated (what a torn write
on a disk without fsync can leave), and live data files that are missing or unreadable. Repair
moves such a newest entry aside to `_delta_log/_damaged/` (sparkqueue fsyncs every entry before
acknowledging it, so a torn entry was never acknowledged), and commits the removal of live files
that are gone (their messages are lost; the partition works again). Anything else is reported.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from sparkqueue.errors import StorageCorruptedError
from sparkqueue.storage.files import remove_action
from sparkqueue.storage.log import LOG_DIR, CommitConflict
from sparkqueue.storage.table import EntityTable

log = logging.getLogger(__name__)
DAMAGED_DIR = f"{LOG_DIR}/_damaged"


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
        if not (repair and _set_aside_torn_newest_entry(table)):
            return findings
        finding.repaired = True
        snap = table.log.load()
    listed = {e.path for e in table.store.list() if not e.path.startswith(f"{LOG_DIR}/")}
    missing = [f for f in snap.files if f.path not in listed]
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
    return findings


def _set_aside_torn_newest_entry(table: EntityTable) -> bool:
    """Move the newest log entry aside when it is empty or not JSON; True when it did."""
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
        lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
        torn = not lines or not all(isinstance(json.loads(line), dict) for line in lines)
    except (UnicodeDecodeError, ValueError):
        torn = True
    if not torn:
        return False
    table.store.put(f"{DAMAGED_DIR}/{versions[-1]:020d}.json", data)
    table.store.delete(newest)
    log.warning("moved the torn log entry %s of %s aside to %s", newest, table.uri, DAMAGED_DIR)
    return True
