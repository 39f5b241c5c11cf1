"""One commit of a DataFrame send's files; partitions a concurrent sender moved meanwhile are renumbered, not resent.

Both DataFrame send paths (Spark's writer, jvm_send; the Python tasks, send) number each queue
partition's rows from the fence the driver read before the job. A concurrent sender that moved
a fence makes the commit conflict; instead of running the whole Spark job again (which a steady
sender would make conflict again, until the operation timeout), the files of just the moved
partitions are rewritten numbered densely after the new fence, the quota is checked again, and
the commit is tried again (docs/storage.md, "Staged appends"). On a duplicate-detecting queue
the rewrite also drops the messages whose id the concurrent sender sent meanwhile: its messages
are the rows numbered between the old fence and the new one (see Repeats for topics).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import QuotaExceededError, StorageError
from sparkqueue.model.entity import enqueued_at, utcnow
from sparkqueue.storage.leases import require_live
from sparkqueue.storage.log import AddFile, CommitConflict, Fence
from sparkqueue.storage.schema import PARTITION_COLUMN, index_of, with_columns
from sparkqueue.storage.table import accepted_rows, fence_app_id, sequence_number

if TYPE_CHECKING:
    from sparkqueue.storage.retry import Deadline
    from sparkqueue.storage.table import EntityTable

log = logging.getLogger(__name__)


class Repeats(Enum):
    """What a renumbering does about a concurrent sender's messages repeating the send's (duplicate detection)."""

    NONE = "none"  # no duplicate detection: nothing to drop
    DROP = "drop"  # a queue's: its rows repeating an id the concurrent sender sent are dropped
    RERUN = "rerun"  # a topic's: a copy's id may be a rule action's, so only a fresh send can drop repeats


@dataclass(frozen=True)
class Written:
    """What one attempt of a DataFrame send wrote (not yet committed), per queue partition."""

    adds: list[AddFile]
    counts: dict[int, int]  # rows per partition
    last: dict[int, int]  # the last counter numbered per partition
    bounds: dict[int, int | None]  # an upper bound of the message bytes per partition (None: unknown)


def commit_renumbering(
    table: EntityTable,
    adds: list[AddFile],
    written: Written,
    bases: dict[int, int | None],
    deadline: Deadline,
    *,
    repeats: Repeats = Repeats.NONE,
) -> int:
    """Commit the files once, moving the fences from `bases`; when a concurrent sender moved some, renumber only those.

    A conflict whose cause is a moved fence rewrites just the files of the partitions whose fence
    moved (`renumber`, with pyarrow: no Spark job), checks the quota again (the other sender's
    messages count now) and commits again; the other partitions' files are committed as Spark
    wrote them. Any other conflict, or one past the deadline, deletes every file and raises (the
    caller runs the whole send again or gives up). After an error other than a conflict the
    commit may have landed (EntityTable.commit): the files stay. Returns how many messages were
    dropped as repeats of a concurrent sender's (Repeats.DROP); with Repeats.RERUN any conflict is
    of the latter kind.
    """
    adds = list(adds)
    last = dict(written.last)
    dropped = 0
    while True:
        adds = restamp_expired(table, adds, utcnow())
        fences = [Fence(fence_app_id(p), c) for p, c in sorted(last.items())]
        seen = {fence_app_id(p): bases[p] for p in last}
        try:
            require_live(table.store, [a.path for a in adds])
        except StorageError:
            table.data.delete([a.path for a in adds])
            raise
        try:
            with table.existing():
                table.commit(table.snapshot(), adds, [], fences, seen, "WRITE", keep_on_conflict=True)
            return dropped
        except CommitConflict:
            fresh = fence_bases_of(table, sorted(last))
            moved = {p: (bases[p] or 0, fresh[p] or 0) for p in last if fresh[p] != bases[p]}
            stale = repeats is Repeats.RERUN or deadline.expired() or any(new < old for old, new in moved.values())
            if not moved or stale:
                table.data.delete([a.path for a in adds])
                raise
            log.info("a concurrent sender moved the fences of partitions %s: renumbering their files only", sorted(moved))
            adds, renumbered = renumber(table, adds, moved, repeats is Repeats.DROP)
            try:
                check_quota(table, written, adds)  # the concurrent send added bytes to those partitions
            except QuotaExceededError:
                table.data.delete([a.path for a in adds])
                raise
            for p, (count, repeated) in renumbered.items():
                dropped += repeated
                bases[p] = fresh[p]
                if count:
                    last[p] = moved[p][1] + count
                else:  # every message of the partition repeated one: the commit leaves its fence alone
                    del last[p]


def restamp_expired(table: EntityTable, adds: list[AddFile], now: datetime) -> list[AddFile]:
    """The adds, with files holding a message that would arrive expired rewritten as enqueued `now`.

    A send stamps its rows (enqueue, visibility, expiry) when its Spark job starts; a job that took
    longer than a message's time to live would store it expired, counted as sent and never
    delivered. Such files (their statistics tell: the earliest expiry has passed) are stamped
    again at the commit, as a send of `now` would stamp them; the others are committed as written.
    """
    out: list[AddFile] = []
    replaced: list[str] = []
    try:
        for add in adds:
            earliest = json.loads(add.stats).get("minValues", {}).get("expires_at_utc")
            if earliest is None or datetime.fromisoformat(earliest) > now:
                out.append(add)
                continue
            stamped = enqueued_at(table.data.read(add.path), now)
            out.append(table.data.write(int(add.partition_values[PARTITION_COLUMN]), stamped))
            replaced.append(add.path)
    except BaseException:
        table.data.delete([a.path for a in out if a not in adds])
        raise
    if replaced:
        table.data.delete(replaced)
        log.info("%d file(s) of a DataFrame send held messages past their time to live: stamped again at %s", len(replaced), now)
    return out


def fence_bases_of(table: EntityTable, partitions: list[int]) -> dict[int, int | None]:
    """The current fence versions of some partitions, from a fresh snapshot."""
    with table.existing():
        snap = table.snapshot()
    return {p: snap.transaction_version(fence_app_id(p)) for p in partitions}


def renumber(
    table: EntityTable, adds: list[AddFile], moved: dict[int, tuple[int, int]], drop_repeats: bool
) -> tuple[list[AddFile], dict[int, tuple[int, int]]]:
    """Rewrite the files of partitions whose fence moved from old to new, numbered densely after new; the rest kept.

    With `drop_repeats` (a queue's files), rows whose message id the concurrent sender's accepted
    messages (numbered old+1..new) carry are dropped. Returns the adds and, per moved partition,
    (numbers used, messages dropped); numbers map through the sorted distinct old ones.
    """
    out = [a for a in adds if int(a.partition_values[PARTITION_COLUMN]) not in moved]
    done: dict[int, tuple[int, int]] = {}
    snap = None
    if drop_repeats:
        with table.existing():
            snap = table.snapshot()
    written: list[AddFile] = []
    try:
        for p, (old, new) in moved.items():
            mine = [a for a in adds if int(a.partition_values[PARTITION_COLUMN]) == p]
            files = [table.data.read(a.path) for a in mine]
            repeats = 0
            if snap is not None and files:
                span = sequence_number(p, old + 1), sequence_number(p, new)
                theirs = table.rows_between(snap, p, *span, ["message_id", "subscription", "kind"])
                ids = theirs.filter(accepted_rows(theirs)).column("message_id").combine_chunks()
                gone = [pc.is_in(f.column("message_id"), value_set=ids, skip_nulls=True) for f in files]
                dropped_ids = [f.filter(g).column("message_id") for f, g in zip(files, gone, strict=True)]
                repeats = len(pc.unique(pa.chunked_array(dropped_ids, pa.string())))
                files = [f.filter(pc.invert(g)) for f, g in zip(files, gone, strict=True)]
            numbers = pc.unique(pa.chunked_array([f.column("sequence_number") for f in files], pa.int64())).sort()
            first = pa.scalar(sequence_number(p, new + 1), pa.int64())
            for rows in files:
                if rows.num_rows:
                    seqs = pc.add(index_of(rows.column("sequence_number"), numbers), first)
                    written.append(table.data.write(p, with_columns(rows, sequence_number=seqs.cast(pa.int64()))))
            done[p] = (len(numbers), repeats)
    except BaseException:
        table.data.delete([a.path for a in written])
        raise
    table.data.delete([a.path for a in adds if a not in out])
    return out + written, done


def check_quota(table: EntityTable, written: Written, adds: list[AddFile]) -> None:
    """QuotaExceededError when a partition's live bytes plus the message bytes written for it pass its quota.

    A bound of the bytes written (Spark's writer: read off the files' footers) settles almost every
    partition; one without a bound, or that the bound would put over the quota, has its written
    files (`adds`: where they are now) summed exactly.
    """
    if table.max_partition_bytes is None:
        return
    with table.existing():
        snap = table.snapshot()
    for p in sorted(written.counts):
        used, bound = table.partition_bytes(snap, p), written.bounds.get(p)
        if bound is not None and used + bound <= table.max_partition_bytes:
            continue
        table.check_room(snap, p, message_bytes(table, [a.path for a in adds if a.partition_values[PARTITION_COLUMN] == str(p)]))


def message_bytes(table: EntityTable, paths: list[str]) -> int:
    """The sum of size_in_bytes over written files (paths relative to the table).

    Each file is fetched whole through the table's store (object stores too) and only its small columns decoded.
    """
    return sum(int(pc.sum(table.data.read(path, ["size_in_bytes"]).column(0)).as_py() or 0) for path in paths)
