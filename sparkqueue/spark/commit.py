"""One commit of a DataFrame send's files; partitions a concurrent sender moved meanwhile are renumbered, not resent.

Both DataFrame send paths (Spark's writer, jvm_send; the Python tasks, send) number each queue
partition's rows from the fence the driver read before the job. A concurrent sender that moved
a fence makes the commit conflict; instead of running the whole Spark job again (which a steady
sender would make conflict again, until the operation timeout), the files of just the moved
partitions are rewritten with their sequence numbers shifted past the new fence, the quota is
checked again, and the commit is tried again (docs/storage.md, "Staged appends").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import QuotaExceededError, StorageError
from sparkqueue.storage.leases import require_live
from sparkqueue.storage.log import AddFile, CommitConflict, Fence
from sparkqueue.storage.schema import PARTITION_COLUMN, with_columns
from sparkqueue.storage.table import fence_app_id

if TYPE_CHECKING:
    from sparkqueue.storage.retry import Deadline
    from sparkqueue.storage.table import EntityTable

log = logging.getLogger(__name__)


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
    renumbering: bool = True,
) -> None:
    """Commit the files once, moving the fences from `bases`; when a concurrent sender moved some, renumber only those.

    A conflict whose cause is a moved fence rewrites just the files of the partitions whose fence
    moved (their rows shifted after the new fence, with pyarrow: no Spark job), checks the quota
    again (the other sender's messages count now) and commits again;
    the other partitions' files are committed as Spark wrote them. Any other conflict, or one past
    the deadline, deletes every file and raises (the caller runs the whole send again or gives up).
    After an error other than a conflict the commit may have landed (EntityTable.commit): the files stay.
    `renumbering=False` treats every conflict as the latter kind (duplicate detection: the concurrent
    sender's messages may repeat some of these, which only a fresh attempt can drop).
    """
    adds = list(adds)
    last = dict(written.last)
    while True:
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
            return
        except CommitConflict:
            fresh = fence_bases_of(table, sorted(last))
            moved = {p: (fresh[p] or 0) - (bases[p] or 0) for p in last if fresh[p] != bases[p]}
            if not renumbering or not moved or deadline.expired() or any(d < 0 for d in moved.values()):
                table.data.delete([a.path for a in adds])
                raise
            log.info("a concurrent sender moved the fences of partitions %s: renumbering their files only", sorted(moved))
            adds = renumber(table, adds, moved)
            try:
                check_quota(table, written, adds)  # the concurrent send added bytes to those partitions
            except QuotaExceededError:
                table.data.delete([a.path for a in adds])
                raise
            for p, d in moved.items():
                last[p] += d
                bases[p] = fresh[p]


def fence_bases_of(table: EntityTable, partitions: list[int]) -> dict[int, int | None]:
    """The current fence versions of some partitions, from a fresh snapshot."""
    with table.existing():
        snap = table.snapshot()
    return {p: snap.transaction_version(fence_app_id(p)) for p in partitions}


def renumber(table: EntityTable, adds: list[AddFile], moved: dict[int, int]) -> list[AddFile]:
    """The files of the moved partitions rewritten with their sequence numbers shifted (engine's writer); the rest kept."""
    out = []
    for a in adds:
        p = int(a.partition_values[PARTITION_COLUMN])
        shift = moved.get(p)
        if shift is None:
            out.append(a)
            continue
        rows = table.data.read(a.path)
        seqs = pc.add(rows.column("sequence_number"), pa.scalar(shift, pa.int64()))
        rows = with_columns(rows, sequence_number=seqs)
        try:
            out.append(table.data.write(p, rows))
        except BaseException:
            table.data.delete([x.path for x in out if x not in adds])
            raise
        table.data.delete([a.path])
    return out


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
