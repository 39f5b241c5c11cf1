"""One entity's Delta table: partitioned appends fenced per partition, pruned reads, and copy-on-write changes.

Three storage facts shape this module (docs/storage.md):
- Appends carry a Delta `txn` action per partition they touch (app id `sparkqueue.seq.<p>`, version =
  the partition's last sequence counter). Two appends to one partition conflict on that app id, so
  sequence numbers are unique and strictly increasing, and the counter survives deleted rows.
- Every state change rewrites only the files holding the changed rows (copy-on-write, as a MERGE
  would, but written with pyarrow and committed as add/remove actions by log.py: about a millisecond).
- A change is computed from one snapshot and commits only while the files it removes are still
  live (log.py): a lost race surfaces as a `CommitConflict` and never as a double lock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from sparkqueue.errors import (
    EntityNotFoundError,
    PartitionUnavailableError,
    QuotaExceededError,
    SparkQueueError,
    StorageCorruptedError,
)
from sparkqueue.storage.checkpoint import trim_log, write_checkpoint
from sparkqueue.storage.faults import FaultInjector
from sparkqueue.storage.files import FILE_SCHEMA, MAX_FILE_ROWS, DataFiles, PendingWrites, file_rows, remove_action
from sparkqueue.storage.index import FileIndex, FileInfo
from sparkqueue.storage.log import (
    TOMBSTONE,
    AddFile,
    CommitConflict,
    DeltaLog,
    Fence,
    RemoveFile,
    Snapshot,
    TableDeletedError,
    checkpoint_interval,
)
from sparkqueue.storage.schema import (
    ANY_SUBSCRIPTION,
    ENTITY_SCHEMA,
    ID_RECORD,
    KIND_MESSAGE,
    PARTITION_COLUMN,
    STATE_ACTIVE,
    STATE_COLUMNS,
    STATE_COMPLETED,
    TIMESTAMP,
    conform,
    in_sequence,
    index_of,
    keep_rows,
    member_of,
    with_columns,
)
from sparkqueue.storage.store import Store, delta_rs_errors, open_store

log = logging.getLogger(__name__)

# Log entries older than this and before a checkpoint are deleted: loading lists the log, so it is kept short.
LOG_RETENTION = "interval 2 minutes"
CHECKPOINT_INTERVAL = "100"
TRIM_EVERY = 10  # checkpoints between two trims of the log
SEQUENCE_BITS = 48
SEQUENCE_MASK = (1 << SEQUENCE_BITS) - 1

# Columns a settlement may change; everything else in a row is immutable after send.
MUTABLE_COLUMNS = [
    "available_at_utc",
    "sub_queue",
    "state",
    "locked_until_utc",
    "lock_token",
    "delivery_count",
    "dead_letter_reason",
    "dead_letter_error_description",
    "dead_letter_source",
]
CHANGE_SCHEMA = pa.schema(
    [pa.field("sequence_number", pa.int64()), pa.field("op", pa.string())]
    + [ENTITY_SCHEMA.field(c).with_nullable(True) for c in MUTABLE_COLUMNS]
    + [pa.field("body", pa.binary())]  # written only by OP_SET_BODY (a session's state)
)
OP_SET = "set"  # write the mutable columns from the change row
OP_DELETE = "delete"  # remove the row
OP_TOMBSTONE = "tombstone"  # keep only what duplicate detection needs
OP_SET_BODY = "set_body"  # like OP_SET, and replace the body too (session state)
TOMBSTONE_CLEARED = ["available_at_utc", "locked_until_utc", "lock_token", "body", "application_properties"]


def fence_app_id(partition: int) -> str:
    """Delta txn app id whose version is the partition's last sequence counter."""
    return f"sparkqueue.seq.{partition}"


def accepted_rows(rows: pa.Table) -> pa.Array:
    """Per row (columns subscription, kind): does it record a message id the entity accepted?

    A queue's message rows and a topic's id records (ID_RECORD) do; a topic's subscription copies
    (whose ids a rule action may have changed) and session state rows do not.
    """
    sub = rows.column("subscription")
    accepted = pc.or_(pc.is_null(sub), pc.fill_null(pc.equal(sub, ID_RECORD), False))
    return pc.and_(accepted, pc.equal(rows.column("kind"), KIND_MESSAGE))


def sequence_number(partition: int, counter: int) -> int:
    """Compose a sequence number: partition id in the top 16 bits, counter below."""
    return (partition << SEQUENCE_BITS) | counter


def partition_of(seq: int) -> int:
    """The partition a sequence number belongs to (its top 16 bits)."""
    return seq >> SEQUENCE_BITS


class EntityTable:
    """Thread-safe handle on one entity's Delta table; every method works on a fresh snapshot."""

    def __init__(
        self,
        uri: str,
        partition_count: int,
        faults: FaultInjector | None = None,
        storage_options: dict[str, str] | None = None,
        named: Callable[[], bool] | None = None,
    ) -> None:
        """`named()` tells whether the namespace catalog still names this table: a missing log it names is damage."""
        self.uri = uri.rstrip("/")
        self.named = named
        self.partition_count = partition_count
        self.max_partition_bytes: int | None = None  # the entity's size quota per partition
        self.deleted = False  # a commit found the table deleted under this handle (TableDeletedError)
        self.faults = faults or FaultInjector()
        self.storage_options = dict(storage_options or {})
        self.store: Store = open_store(self.uri, self.storage_options)
        self.data = DataFiles(self.store, on_damage=self._damaged)
        self.log = DeltaLog(self.store, FileIndex, after_commit=self._after_commit)
        self._local = threading.local()

    # ---- lifecycle -------------------------------------------------------------------------

    @staticmethod
    def create(uri: str, storage_options: dict[str, str] | None = None) -> None:
        """Create the empty, partitioned entity table with delta-rs (the path must not hold a table yet)."""
        from deltalake import DeltaTable

        with delta_rs_errors(uri, "creating table"):
            DeltaTable.create(
                uri,
                schema=ENTITY_SCHEMA,
                partition_by=[PARTITION_COLUMN],
                mode="error",
                # A short log keeps loading a table cheap (loading lists the log); checkpoints every 100
                # commits let the rest be trimmed (checkpoint.py).
                configuration={"delta.checkpointInterval": CHECKPOINT_INTERVAL, "delta.logRetentionDuration": LOG_RETENTION},
                storage_options=storage_options or None,
            )

    def snapshot(self) -> Snapshot:
        """This thread's snapshot of the table, brought to the latest version (reads only new log entries).

        Snapshots are per thread: a commit is checked against exactly the version its thread read,
        and no other thread moves that snapshot underneath it.
        """
        snap: Snapshot | None = getattr(self._local, "snap", None)
        with self.existing():
            if snap is None:
                snap = self._local.snap = self.log.load()
            else:
                self.log.update(snap)
        return snap

    @contextmanager
    def existing(self) -> Iterator[None]:
        """Turn a missing log into EntityNotFoundError (another process deleted the entity: the catalog names the
        table no more), or StorageCorruptedError (the catalog still names it: its files were lost)."""
        try:
            yield
        except FileNotFoundError as exc:
            if not self.log.exists():
                if self.named is not None and self.named():
                    raise StorageCorruptedError(
                        f"table {self.uri} is missing, though the namespace catalog names it: damaged storage "
                        "(Namespace.check, `sparkqueue check`)"
                    ) from exc
                raise EntityNotFoundError(f"the entity stored at {self.uri} was deleted") from exc
            raise StorageCorruptedError(f"table {self.uri}: {exc}") from exc

    def _after_commit(self, snap: Snapshot) -> None:
        """Checkpoint every `delta.checkpointInterval` versions; every TRIM_EVERY checkpoints, trim the log behind it.

        Trimming lists the log, which holds a retention's worth of entries at a busy table's
        commit rate: done at every checkpoint it would cost a busy table more than its commits.
        """
        interval = checkpoint_interval(snap.configuration)
        if snap.version % interval == 0 and write_checkpoint(self.store, snap) and snap.version % (interval * TRIM_EVERY) == 0:
            trim_log(self.store, snap)

    def commit(
        self,
        snap: Snapshot,
        adds: Sequence[AddFile],
        removes: Sequence[RemoveFile],
        fences: Sequence[Fence] = (),
        seen: dict[str, int | None] | None = None,
        operation: str = "WRITE",
        *,
        keep_on_conflict: bool = False,
        pending: PendingWrites | None = None,
    ) -> int:
        """Commit actions computed from `snap`, deleting the added files when it conflicts (unless `keep_on_conflict`).

        `pending`: the added files, still being written (DataFiles.start_all); the log entry is
        put once they are durable. After any other error the commit may have landed
        (DeltaLog.commit), so its files stay: vacuum removes them if no version references them.
        """
        try:
            return self.log.commit(snap, adds, removes, fences, seen, operation, pending.wait if pending else None)
        except BaseException as exc:
            _settled(pending)  # no write of this commit is left running once it returns
            if isinstance(exc, CommitConflict) and not keep_on_conflict:
                self.data.delete([a.path for a in adds])
            elif isinstance(exc, TableDeletedError):
                self.deleted = True  # handles cached on this table are stale: the broker looks the entity up again
            raise

    def _damaged(self, path: str, what: str, missing: bool) -> Exception:
        """A missing or unreadable data file makes its partition unavailable, not the whole table (faults.py).

        A file missing only because the read's snapshot is old (a compaction replaced it, and a
        vacuum at a short retention deleted it, while the read was under way) is no damage: the
        partition is skipped by this read alone. Nor is one whose table is being deleted (another
        handle deleted its entity): that is TableDeletedError, and the broker looks the entity up again.
        """
        partition = path.split("/", 1)[0].removeprefix(f"{PARTITION_COLUMN}=")
        if missing and self._being_deleted():  # its entity's delete is under way: no damage, and no mark on the name
            self.deleted = True
            return TableDeletedError(f"table {self.uri} was deleted while this read was under way; nothing was read")
        if missing and not self._live_now(path):
            log.info("data file %s was replaced since this read's snapshot; the partition is skipped this time", path)
            return PartitionUnavailableError(f"partition {partition} changed under this read (file {path} was replaced)")
        log.error("storage damage: %s", what)
        return self.faults.damaged(int(partition), what) if partition.isdigit() else StorageCorruptedError(what)

    def _being_deleted(self) -> bool:
        """Whether the table's delete has begun (its tombstone is there: storage.log.delete_table); False when unknown."""
        try:
            return self.store.exists(TOMBSTONE)
        except (SparkQueueError, OSError):
            return False

    def _live_now(self, path: str) -> bool:
        """Whether a data file is live at the newest version (a fresh load: callers hold their snapshots).

        True when the log cannot be read either (the table was deleted, the store fails): the read then
        reports what it found.
        """
        try:
            return any(f.path == path for f in self.log.load().files)
        except (SparkQueueError, OSError):
            return True

    def available(self, partition: int) -> bool:
        """False while a fault is injected on the partition or damage was found in it."""
        return not self.faults.failing(partition)

    def holds_files(self, dt: Snapshot, partition: int) -> bool:
        """True when the partition has a live file at `dt`'s version (read off the snapshot, nothing opened)."""
        return bool(dt.files.partition(partition))

    def may_hold_messages(
        self, dt: Snapshot, partition: int, sub_queue: str, subscription: str | None, from_seq: int | None = None
    ) -> bool:
        """Whether a live file of the partition at `dt`'s version may hold messages of the sub-queue and subscription.

        Read off the file statistics, nothing opened (what an unavailable partition may be hiding);
        with `from_seq`, messages numbered from it on.
        """
        return any(
            f.may_hold(KIND_MESSAGE, sub_queue, subscription) and (from_seq is None or f.max_seq >= from_seq)
            for f in dt.files.partition(partition)
        )

    def files(self, dt: Snapshot, partition: int) -> list[FileInfo]:
        """The partition's live files at `dt`'s version, ordered by lowest sequence number."""
        self.faults.check(partition, "read")
        index: FileIndex = dt.files
        return index.partition(partition)

    # ---- send --------------------------------------------------------------------------------

    def append(
        self,
        rows: pa.Table,
        dedupe_since: datetime | None,
        expand: Expand | None = None,
        once: Fence | None = None,
        stamp: Callable[[pa.Table], pa.Table] | None = None,
    ) -> pa.Table:
        """Append rows (partition ids set, sequence numbers not yet) in one commit; one attempt.

        `stamp` (the model's enqueue stamp) runs on the rows once this attempt has read its
        snapshot: every commit numbered before these rows landed before their stamp.

        Assigns sequence numbers from each partition's fence, drops rows whose message_id was
        accepted in the partition since `dedupe_since` (when given) or repeats within the batch,
        and returns the stored rows. `expand` (topic fan-out) turns the surviving rows into the rows
        to store. `once` makes the append idempotent: it commits with that txn (app id, version),
        even when no row is left to store, and is skipped, returning no rows, when the table already
        has the app id at that version or later; rows whose `sequence_number` (the source's, for a
        forward) is at most the recorded version were appended by an earlier attempt and are
        dropped. Raises CommitConflict when another sender to one of the partitions won the race
        (the caller retries on a fresh snapshot).
        """
        with self.existing():
            return self._append(rows, dedupe_since, expand, once, stamp)

    def _append(
        self,
        rows: pa.Table,
        dedupe_since: datetime | None,
        expand: Expand | None,
        once: Fence | None,
        stamp: Callable[[pa.Table], pa.Table] | None,
    ) -> pa.Table:
        dt = self.snapshot()
        if stamp is not None:
            rows = stamp(rows)
        if once is not None:
            done = dt.transaction_version(once.app_id)
            if done is not None and done >= once.version:
                return rows.schema.empty_table()
            if done is not None:  # an earlier (crashed or concurrent) forward moved the rows up to `done`
                rows = rows.filter(pc.greater(rows.column("sequence_number"), done))
        partitions = sorted(set(rows.column(PARTITION_COLUMN).to_pylist()))
        one = len(partitions) == 1  # a one-partition batch (a Spark send task's) needs no copying filter
        staged = [
            self._stage(dt, p, rows if one else rows.filter(pc.equal(rows.column(PARTITION_COLUMN), p)), dedupe_since, expand)
            for p in partitions
        ]
        stored = [st.rows for st in staged if st.rows.num_rows]
        if not stored:
            if once is not None:  # nothing to store (duplicates, no subscriber): the append still happened, once
                self.commit(dt, [], [], [once], {once.app_id: dt.transaction_version(once.app_id)}, "WRITE")
            return rows.schema.empty_table()
        fences = [st.fence for st in staged if st.fence is not None]
        seen = {st.app: st.seen for st in staged}
        if once is not None:
            fences.append(once)
            seen[once.app_id] = dt.transaction_version(once.app_id)
        self.log.precheck(dt, [], seen)  # a concurrent send that moved a fence: found before writing any file
        pending = self.data.start_all([x for st in staged for x in st.pieces])
        adds = [a for piece in pending.adds for a in piece]
        self.commit(dt, adds, [], fences, seen, "WRITE", pending=pending)
        return pa.concat_tables(stored)

    def stage(
        self,
        dt: Snapshot,
        partition: int,
        rows: pa.Table,
        base: int,
        dedupe_since: datetime | None = None,
        expand: Expand | None = None,
        pending_bytes: int = 0,
        lease: str = "",
    ) -> tuple[pa.Table, list[AddFile]]:
        """Number one partition's new rows after `base` and write their files, without committing.

        For a writer that commits elsewhere (a Spark send commits every task's files in one commit
        from the driver). `base` is the partition's fence version as the committer read it; that
        commit must carry `Fence(fence_app_id(partition), base + stored rows)` and expect `base`, so a
        concurrent append to the partition makes it conflict. Duplicates are dropped against `dt` as
        in `append`; `pending_bytes` (rows staged for the partition, not committed yet) counts
        toward the size quota. `lease`: the tag of the committer's write lease (storage/leases.py),
        which keeps vacuum off the files until the commit. Returns the stored rows and the add
        actions of their files.
        """
        with self.existing():
            staged = self._stage(dt, partition, rows, dedupe_since, expand, base, pending_bytes)
            written = self.data.write_all(staged.pieces, lease)
        return staged.rows, [a for adds in written for a in adds]

    def _stage(
        self,
        dt: Snapshot,
        p: int,
        part: pa.Table,
        dedupe_since: datetime | None,
        expand: Expand | None = None,
        base: int | None = None,
        pending_bytes: int = 0,
    ) -> _Staged:
        """Number new rows of one partition from its fence (or `base`) and cut them into files to write, one per subscription."""
        self.faults.check(p, "write")
        if dedupe_since is not None:
            part = self._drop_duplicates(dt, p, part, dedupe_since)
        if expand is not None and part.num_rows:
            part = expand(part)
        self._check_quota(dt, p, part, pending_bytes)
        app = fence_app_id(p)
        seen = dt.transaction_version(app)
        if part.num_rows == 0:
            return _Staged(app, seen, None, part, [])
        last = (seen or 0) if base is None else base
        first = sequence_number(p, last + 1)
        seqs = pa.array(range(first, first + part.num_rows), pa.int64())
        part = with_columns(part, sequence_number=seqs)
        subs = part.column("subscription")
        groups = (
            [part]
            if subs.null_count == len(subs)
            else [
                part.filter(pc.is_null(subs) if v is None else pc.fill_null(pc.equal(subs, v), False))
                for v in pc.unique(subs).to_pylist()
            ]
        )
        return _Staged(app, seen, Fence(app, last + part.num_rows), part, [(p, g, MAX_FILE_ROWS) for g in groups])

    def _check_quota(self, dt: Snapshot, p: int, part: pa.Table, pending_bytes: int = 0) -> None:
        """Raise QuotaExceededError when new rows (after `pending_bytes` staged ones) would take a partition beyond its quota."""
        if self.max_partition_bytes is None or part.num_rows == 0:
            return
        self.check_room(dt, p, pc.sum(part.column("size_in_bytes")).as_py() or 0, pending_bytes)

    def check_room(self, dt: Snapshot, p: int, added: int, pending_bytes: int = 0) -> None:
        """QuotaExceededError when `added` message bytes (after `pending_bytes` staged) would take partition p past its quota."""
        if self.max_partition_bytes is None:
            return
        used = self.partition_bytes(dt, p) + pending_bytes
        if used + added > self.max_partition_bytes:
            raise QuotaExceededError(
                f"partition {p} holds {used} bytes; adding {added} would pass its {self.max_partition_bytes // 2**20} MB "
                "limit (max_size_in_megabytes). Receive or purge messages, or raise the limit; nothing was stored"
            )

    def _drop_duplicates(self, dt: Snapshot, p: int, part: pa.Table, since: datetime) -> pa.Table:
        """Remove rows whose message_id repeats within the batch or was accepted since `since`.

        Accepted ids are a queue's message rows and a topic's id records (ID_RECORD), not its
        subscriptions' copies, whose ids a rule action may have changed, nor session state rows.
        """
        seen: set[str] = set()
        keep = []
        for mid in part.column("message_id").to_pylist():
            keep.append(mid not in seen)
            seen.add(mid)
        part = part.filter(pa.array(keep))
        files = [
            f
            for f in self.files(dt, p)
            if (f.max_enqueued is None or f.max_enqueued >= since)
            and (f.may_hold_subscription(None) or f.may_hold_subscription(ID_RECORD))
        ]
        if not files:
            return part
        existing = self._read(files, ["message_id", "enqueued_time_utc", "subscription", "kind"])
        accepted = accepted_rows(existing)
        recent = existing.filter(
            pc.and_(accepted, pc.greater_equal(existing.column("enqueued_time_utc"), pa.scalar(since, TIMESTAMP)))
        )
        dup = pc.is_in(part.column("message_id"), value_set=recent.column("message_id"))
        return part.filter(pc.invert(dup))

    # ---- reads ---------------------------------------------------------------------------------

    def _read(self, files: Sequence[FileInfo], columns: Sequence[str]) -> pa.Table:
        """Rows of the given files (selected columns)."""
        if not files:
            return _empty(tuple(columns))
        return pa.concat_tables([self.data.read(f.path, columns) for f in files])

    def candidates(
        self,
        dt: Snapshot,
        partition: int,
        sub_queue: str,
        now: datetime,
        limit: int,
        columns: Sequence[str] = STATE_COLUMNS,
        subscription: str | None = None,
    ) -> pa.Table:
        """The oldest message rows of a sub-queue that a receive may take now (by sequence number).

        Files whose min(available_at_utc) is after `now`, or whose statistics show no row of the
        sub-queue or subscription, are skipped unopened, so in-flight and scheduled backlogs cost
        nothing to step over.
        """
        picked: list[pa.Table] = []
        count = 0
        max_picked: int | None = None
        for f in self.files(dt, partition):
            after_picked = max_picked is None or f.min_seq > max_picked  # nothing picked lies in or after this file
            if count >= limit and after_picked:
                break
            if f.min_available_at is None or f.min_available_at > now or not f.may_hold(KIND_MESSAGE, sub_queue, subscription):
                continue
            t = self.data.read(f.path, columns)
            mask = pc.and_(
                pc.and_(_in_scope(t, KIND_MESSAGE, subscription), pc.equal(t.column("sub_queue"), sub_queue)),
                pc.and_(
                    pc.equal(t.column("state"), STATE_ACTIVE),
                    pc.less_equal(t.column("available_at_utc"), pa.scalar(now, TIMESTAMP)),
                ),
            )
            t = keep_rows(t, mask)
            if t.num_rows:
                picked.append(t)
                count += t.num_rows
                top = pc.max(t.column("sequence_number")).as_py()
                max_picked = top if max_picked is None else max(max_picked, top)
        if not picked:
            return self._read([], columns)
        return in_sequence(pa.concat_tables(picked)).slice(0, limit)

    def rows_by_sequence(
        self,
        dt: Snapshot,
        partition: int,
        seqs: Sequence[int] | pa.Int64Array,
        columns: Sequence[str] | None = None,
        subscription: str | None = ANY_SUBSCRIPTION,
    ) -> pa.Table:
        """Current rows of the given sequence numbers in one partition (missing ones are absent), in sequence order.

        `subscription` (a subscription's key; None: a queue's rows) skips the files of the topic's other
        subscriptions: a send numbers a message's copies together, so every subscription's file spans
        the same numbers.
        """
        cols = list(columns or FILE_SCHEMA.names)
        wanted = seqs if isinstance(seqs, pa.Array) else pa.array(list(seqs), pa.int64())
        if len(wanted) == 0:
            return self._read([], cols)
        bounds = pc.min_max(wanted)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        t = self._read(self._files_between(dt, partition, lo, hi, subscription), cols)
        return in_sequence(keep_rows(t, member_of(t.column("sequence_number"), wanted)))

    def rows_between(self, dt: Snapshot, partition: int, lo: int, hi: int, columns: Sequence[str]) -> pa.Table:
        """Current rows of one partition numbered lo..hi (inclusive), of every kind and state, in sequence order."""
        cols = list(dict.fromkeys(["sequence_number", *columns]))
        t = self._read(self._files_between(dt, partition, lo, hi), cols)
        seqs = t.column("sequence_number")
        return in_sequence(keep_rows(t, pc.and_(pc.greater_equal(seqs, lo), pc.less_equal(seqs, hi))))

    def _files_between(
        self, dt: Snapshot, partition: int, lo: int, hi: int, subscription: str | None = ANY_SUBSCRIPTION
    ) -> list[FileInfo]:
        """The partition's live files that may hold rows numbered lo..hi of `subscription` (None: a queue's rows)."""
        return [
            f for f in self.files(dt, partition) if f.max_seq >= lo and f.min_seq <= hi and f.may_hold_subscription(subscription)
        ]

    def scan(
        self,
        dt: Snapshot,
        partition: int,
        columns: Sequence[str],
        from_seq: int | None = None,
        limit: int | None = None,
        subscription: str | None = None,
        kind: str = KIND_MESSAGE,
        session_id: str | None = None,
        sub_queue: str | None = None,
    ) -> pa.Table:
        """Live rows of one kind (messages by default) in a partition, in sequence order.

        Optionally from a sequence number, of one session or sub-queue (files whose statistics rule
        it out are not read), and at most `limit` of them. Completed tombstones are never returned.
        """
        files = [f for f in self.files(dt, partition) if f.may_hold(kind, sub_queue, subscription, session_id)]
        if from_seq is not None:
            files = [f for f in files if f.max_seq >= from_seq]
        scoped = ["sub_queue"] if sub_queue is not None else []  # read only when it filters
        cols = list(dict.fromkeys(["sequence_number", "kind", "subscription", "state", "session_id", *scoped, *columns]))
        out: list[pa.Table] = []
        count = 0
        for f in files:
            t = self.data.read(f.path, cols)
            mask = pc.and_(_in_scope(t, kind, subscription), pc.not_equal(t.column("state"), STATE_COMPLETED))
            if from_seq is not None:
                mask = pc.and_(mask, pc.greater_equal(t.column("sequence_number"), from_seq))
            if session_id is not None:
                mask = pc.and_(mask, pc.fill_null(pc.equal(t.column("session_id"), session_id), False))
            if sub_queue is not None:
                mask = pc.and_(mask, pc.equal(t.column("sub_queue"), sub_queue))
            t = keep_rows(t, mask)
            out.append(t)
            count += t.num_rows
            if limit is not None and count >= limit:
                break
        t = in_sequence(pa.concat_tables(out)) if out else self._read([], cols)
        return t if limit is None else t.slice(0, limit)

    def partition_bytes(self, dt: Snapshot, partition: int) -> int:
        """Bytes of the partition's live files: what its size quota counts."""
        return sum(f.size_bytes for f in self.files(dt, partition))

    # ---- changes ---------------------------------------------------------------------------------

    def apply(
        self,
        dt: Snapshot,
        partition: int,
        changes: pa.Table,
        new_rows: pa.Table | None = None,
        dedupe_since: datetime | None = None,
        expand: Expand | None = None,
        *,
        changed_file_rows: int = MAX_FILE_ROWS,
        kept_file_rows: int = MAX_FILE_ROWS,
        written: list[str] | None = None,
        group_by: str | None = None,
        where: Callable[[FileInfo], bool] | None = None,
        numbered_rows: pa.Table | None = None,
    ) -> pa.Table | None:
        """Apply per-row changes (CHANGE_SCHEMA), and append new rows, to one partition in one commit; one attempt.

        Rewrites only the files holding changed rows. `dt` must be the snapshot the changes were
        computed from: if any of those files (or, with new rows, the partition's fence) changed
        since, this raises CommitConflict. Returns the stored new rows, if any were given.

        The changed rows go to files of their own, apart from the untouched rows of their files,
        in files of up to `changed_file_rows` (a large receive passes its batch size, so that its
        locked messages sit in one file that their settlement drops whole). Once committed, the
        paths of those files are added to `written`, when given. The untouched rows of a rewritten
        file go to files of up to `kept_file_rows` (a receive passes its count, so that the next
        receive of that count takes whole files instead of rewriting the rest again).

        With `group_by` (a column), the rows of every rewritten file, changed or not, and the new
        rows are written one file per value of that column: a session entity keeps each session's
        rows together and apart from other sessions', so later changes to one session rewrite one
        small file and never another session's rows.

        `where` (a file test) narrows the files searched for the changed rows, when the caller knows
        by statistics which files can hold them (a session's rows: their sequence ranges interleave
        with other sessions', so the range alone would open every file of the partition).

        `numbered_rows` are new rows that already carry sequence numbers unique in the partition
        (a session's lock row, docs/storage.md): they are added without the partition's fence, so
        they do not conflict with sends and other sessions' accepts; the caller guarantees that
        two commits adding the same row conflict (both remove one of the same files).
        """
        with self.existing():
            return self._apply(
                dt,
                partition,
                changes,
                new_rows,
                dedupe_since,
                expand,
                changed_file_rows,
                kept_file_rows,
                written,
                group_by,
                where,
                numbered_rows,
            )

    def _apply(
        self,
        dt: Snapshot,
        partition: int,
        changes: pa.Table,
        new_rows: pa.Table | None,
        dedupe_since: datetime | None,
        expand: Expand | None,
        changed_file_rows: int,
        kept_file_rows: int,
        written: list[str] | None,
        group_by: str | None = None,
        where: Callable[[FileInfo], bool] | None = None,
        numbered_rows: pa.Table | None = None,
    ) -> pa.Table | None:
        self.faults.check(partition, "write")
        changes = conform(changes, CHANGE_SCHEMA)
        removed: list[FileInfo] = []
        changed: list[pa.Table] = []
        kept: list[pa.Table] = []
        if changes.num_rows:
            seqs = changes.column("sequence_number").combine_chunks()
            bounds = pc.min_max(seqs)
            lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
            deleted = changes.filter(pc.equal(changes.column("op"), OP_DELETE)).column("sequence_number").combine_chunks()
            for f in self.files(dt, partition):
                if f.max_seq < lo or f.min_seq > hi or (where is not None and not where(f)):
                    continue
                in_file = self.data.read(f.path, ["sequence_number"]).column(0)
                hit = member_of(in_file, seqs)
                if not pc.any(hit).as_py():
                    continue
                removed.append(f)
                if len(deleted) and pc.all(member_of(in_file, deleted)).as_py():
                    continue  # every row of the file goes: drop it without reading (or rewriting) its bodies
                split = _apply_changes(self.data.read(f.path), changes)
                if split is not None:
                    changed.append(split[0])
                    kept.append(split[1])
            if not removed:
                raise CommitConflict("none of the changed rows is live any more")
        # Untouched rows keep files of their own per rewritten file; changed rows go together. With
        # group_by, every row of a group (changed, untouched or new) goes to one file of its own.
        staged = self._stage(dt, partition, new_rows, dedupe_since, expand) if new_rows is not None else None
        new_pieces = staged.pieces if staged is not None else []
        numbered = [file_rows(numbered_rows)] if numbered_rows is not None else []
        if group_by is None:
            new_pieces = new_pieces + [(partition, t, MAX_FILE_ROWS) for t in numbered if t.num_rows]
            changed_pieces = [(partition, pa.concat_tables(changed), changed_file_rows)] if changed else []
            kept_pieces = [(partition, k, kept_file_rows) for k in kept]
        else:
            fresh = [file_rows(staged.rows)] if staged is not None else []
            changed_pieces = [(partition, g, MAX_FILE_ROWS) for g in _groups(changed + kept + fresh + numbered, group_by)]
            kept_pieces, new_pieces = [], []
        fences: list[Fence] = []
        seen: dict[str, int | None] = {}
        if staged is not None and staged.fence is not None:
            fences.append(staged.fence)
            seen[staged.app] = staged.seen
        pieces = changed_pieces + kept_pieces + new_pieces
        if not any(rows.num_rows for _, rows, _ in pieces) and not removed:
            return staged.rows if staged else None
        self.log.precheck(dt, [f.path for f in removed], seen)  # a racing commit took the files: found before writing
        pending = self.data.start_all(pieces)
        files = pending.adds
        changed_adds = [a for piece in files[: len(changed_pieces)] for a in piece]
        adds = [a for piece in files for a in piece]
        removes = [remove_action(f.path, f.partition, f.size_bytes) for f in removed]
        self.commit(dt, adds, removes, fences, seen, "UPDATE", pending=pending)
        if written is not None:
            written += [a.path for a in changed_adds]
        return staged.rows if staged else None


def _settled(pending: PendingWrites | None) -> None:
    """Wait out a failed commit's file writes still running (their own errors add nothing to the commit's)."""
    if pending is not None:
        with contextlib.suppress(Exception):
            pending.wait()


Expand = Callable[[pa.Table], pa.Table]


@functools.lru_cache(maxsize=64)
def _empty(columns: tuple[str, ...]) -> pa.Table:
    """A table of the given file columns with no rows (shared: Arrow tables are immutable)."""
    return pa.schema([FILE_SCHEMA.field(c) for c in columns]).empty_table()


@dataclass
class _Staged:
    """New rows of one partition, numbered, and the files to write them as (DataFiles.write_all pieces)."""

    app: str
    seen: int | None
    fence: Fence | None
    rows: pa.Table
    pieces: list[tuple[int, pa.Table, int]]


def _apply_changes(rows: pa.Table, changes: pa.Table) -> tuple[pa.Table, pa.Table] | None:
    """A file's rows split into (changed rows with the changes applied, untouched rows); None when none changed.

    Writing the two apart keeps what a receiver locked in a file of its own: its settlement then
    drops that file whole, and the next receive skips it by statistics without opening it.
    A change of every row in the file's order (one message, a whole file locked) takes the change
    columns as they are: each take or cast is a compute call, and a single send's round trip made dozens.
    """
    idx = index_of(rows.column("sequence_number"), changes.column("sequence_number"))
    hit = pc.is_valid(idx)
    changed = pc.sum(hit).as_py() or 0
    if not changed:
        return None
    if changed == rows.num_rows:  # every row changes: no copy of the rows
        kept = rows.slice(0, 0)
    else:
        kept = rows.filter(pc.invert(hit))
        rows, idx = rows.filter(hit), idx.filter(hit)
    aligned = changes.num_rows == rows.num_rows and changes.column("sequence_number").equals(rows.column("sequence_number"))
    if not aligned:  # the changes in the file's row order: one take of the table, not one per column
        changes = changes.take(idx)

    def change(column: str) -> pa.Array | pa.ChunkedArray:
        values = changes.column(column)
        wanted = rows.field(column).type
        return values if values.type == wanted else values.cast(wanted)

    ops = changes.column("op")
    present = set(pc.unique(ops).to_pylist())
    for c in MUTABLE_COLUMNS:
        rows = rows.set_column(rows.schema.get_field_index(c), rows.field(c), change(c))
    if OP_SET_BODY in present:
        body = pc.fill_null(pc.equal(ops, OP_SET_BODY), False)
        pos = rows.schema.get_field_index("body")
        rows = rows.set_column(pos, rows.field("body"), pc.if_else(body, change("body"), rows.column("body")))
    if OP_TOMBSTONE in present:
        tomb = pc.fill_null(pc.equal(ops, OP_TOMBSTONE), False)
        state = rows.schema.get_field_index("state")
        rows = rows.set_column(state, rows.field("state"), pc.if_else(tomb, pa.scalar(STATE_COMPLETED), rows.column("state")))
        for c in TOMBSTONE_CLEARED:
            pos = rows.schema.get_field_index(c)
            rows = rows.set_column(pos, rows.field(c), pc.if_else(tomb, pa.scalar(None, rows.field(c).type), rows.column(c)))
    if OP_DELETE in present:
        rows = keep_rows(rows, pc.invert(pc.fill_null(pc.equal(ops, OP_DELETE), False)))
    return rows, kept


def _groups(tables: list[pa.Table], column: str) -> list[pa.Table]:
    """The rows of `tables` split by the value of `column` (nulls together), each group in sequence order."""
    rows = [t for t in tables if t.num_rows]
    if not rows:
        return []
    t = pa.concat_tables(rows)
    if len(set(t.column(column).to_pylist())) == 1:  # one group (one session's commit): no sort by group, no copy
        # (its pieces hold only the group's rows: filtered copies, or the session's own file read whole)
        return [in_sequence(t)]
    t = t.sort_by([(column, "ascending"), ("sequence_number", "ascending")])
    keys = t.column(column).to_pylist()
    out, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            # a copy, not a slice: each group's file is cached, and a slice would keep (and count) the whole table
            out.append(t.take(pa.array(range(start, i), pa.int64())))
            start = i
    return out


def _in_scope(t: pa.Table, kind: str, subscription: str | None) -> pa.ChunkedArray:
    """Rows of a kind that belong to the queue (subscription None) or to one subscription."""
    is_kind = pc.equal(t.column("kind"), kind)
    if subscription == ANY_SUBSCRIPTION:
        return is_kind
    sub = t.column("subscription")
    in_sub = pc.is_null(sub) if subscription is None else pc.fill_null(pc.equal(sub, subscription), False)
    return pc.and_(is_kind, in_sub)


def empty_changes() -> pa.Table:
    """A change table with no rows."""
    return CHANGE_SCHEMA.empty_table()
