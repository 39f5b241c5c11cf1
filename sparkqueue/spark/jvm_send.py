"""DataFrame sends written by Spark's own Parquet writer: numbering, validation and files all in the JVM, one commit.

The common DataFrame send (unkeyed rows to a queue without duplicate detection) needs nothing
that only Python can do, so no Python task touches its rows (docs/spark-streaming.md, "Sends at
Spark's write speed"):

1. The driver reads every queue partition's fence version (docs/storage.md, "Staged appends").
2. Each input task owns queue partitions of its own (input partition k of T takes available
   partitions k, k + T, ...) and deals its rows to them in blocks of FILE_ROWS consecutive rows.
   A row's counter is then arithmetic on its position in the task: fence + (earlier blocks of
   the same partition) * FILE_ROWS + position in its block + 1 (FILE_ROWS: 4,000). No shuffle, no
   sort, no UDF.
3. Spark's Parquet writer writes the rows, with the engine's column layout and types (the
   entity schema minus the partition column, LZ4, microsecond UTC timestamps), into a staging
   directory inside the table, rolling files every FILE_ROWS rows: each file is exactly one
   block, so it holds one queue partition's rows in sequence order. The per-row checks of
   `send.prepare` (sizes, key lengths, sessions, time to live) run in the same pass as Spark
   expressions: a bad row fails the write job, and nothing is committed.
4. The driver reads the files' Parquet footers for the Delta statistics (numRecords, min, max
   and null count, timestamps in milliseconds as the engine writes them), checks each
   partition's size quota against a bound of its message bytes read off the same footers
   (exact sums only for a partition the bound would put over its quota), moves local files into
   their `partition_id=<p>/` directory and fsyncs them (Spark's local writer does not: the
   engine's durability rule, docs/storage.md), and commits every file in ONE commit that moves the
   fences it read. A concurrent sender that moved one of them makes the commit conflict: the
   files are deleted and the send runs again on fresh fences (send.send_dataframe's retry loop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, NamedTuple

import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as sf

from sparkqueue.errors import StorageError
from sparkqueue.model import limits
from sparkqueue.model.entity import utcnow
from sparkqueue.spark.commit import Written, check_quota, commit_renumbering
from sparkqueue.spark.send import ORD_ROW_MASK, STRING_FIELDS
from sparkqueue.spark.session import spark_errors
from sparkqueue.spark.staging import filesystem, spark_path
from sparkqueue.storage.files import FILE_SCHEMA, MAX_FILE_BYTES, MAX_FILE_ROWS, STATS_COLUMNS, delta_timestamp, file_rows
from sparkqueue.storage.log import AddFile
from sparkqueue.storage.schema import KIND_MESSAGE, PARTITION_COLUMN, STATE_ACTIVE, SUB_QUEUE_MAIN
from sparkqueue.storage.table import SEQUENCE_BITS, SEQUENCE_MASK, partition_of

if TYPE_CHECKING:
    from sparkqueue.spark.send import SendPlan
    from sparkqueue.storage.retry import Deadline
    from sparkqueue.storage.table import EntityTable

log = logging.getLogger(__name__)

# Rows per block and per file. Spark's writer pays 4-6 ms for every file it starts (on 2 cores): at the
# engine's 1,000 rows a file, that tripled a send of 1 KB messages; at 4,000 it costs a third more than
# one file per task. A lock in such a file splits it into files of at most MAX_FILE_ROWS (the locked rows
# apart), so the bound a lock works under comes back after the first touch (docs/storage.md, "Entity tables").
FILE_ROWS = 4 * MAX_FILE_ROWS
# Spark's writer rolls files by rows only: a file of large bodies past this size is cut by the engine's
# byte-aware writer on the driver before the commit (`split_oversized`), as the engine bounds its own files.
SPLIT_BYTES = 4 * MAX_FILE_BYTES
STAGING_PREFIX = "spark-send"  # <table>/spark-send/<id>/: where Spark's writer leaves an attempt's files
# Spark writes what the engine writes: microsecond UTC timestamps (not INT96) and LZ4_RAW. The rest cuts the
# per-file cost of Spark's writer, which dominates with files of 1,000 rows: no dictionaries (Spark builds
# them for every column, and they help little in files this small), no page checksums, no Parquet
# statistics of the body (Delta statistics go in the add action), and no `.crc` side files on local disks
# (without Hadoop's native library, the local filesystem forks `chmod` for every file it creates: one per
# file instead of two).
WRITE_CONF = {"spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS"}
# Spark 4.3 takes the timestamp type from the write's options over the session's setting (checked here: a session
# set to INT96 still wrote INT64 microseconds), so the user's session is left alone. Older Sparks, where that was
# not checked, get it set on the session for the write (see _conf).
OPTIONS_WIN = (4, 3)
WRITE_OPTIONS = {
    **WRITE_CONF,
    "compression": "lz4_raw",
    "maxRecordsPerFile": str(FILE_ROWS),
    "parquet.enable.dictionary": "false",
    "parquet.page.write-checksum.enabled": "false",
    "parquet.column.statistics.enabled#body": "false",
    # Row groups of at most ~8 MB (sizes checked from the 10th row on), so a file of large bodies can be split
    # one row group at a time (split_oversized); 4,000 rows of 1 KB stay one row group.
    "parquet.block.size": str(MAX_FILE_BYTES),
    "parquet.page.size.row.check.min": "10",  # parquet-mr checks row group (and page) sizes from this row on
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.file.impl.disable.cache": "true",
}


# The columns whose bytes size_in_bytes counts (send._checked_size), message_id also where the send generated it.
SIZED_COLUMNS = ("body", *STRING_FIELDS, "application_properties")
PLAIN_ENCODINGS = {"PLAIN", "RLE", "BIT_PACKED"}  # values as they are (levels in RLE): their size bounds the bytes


def numbered_rows(prepared: DataFrame, plan: SendPlan, inputs: int, now: datetime) -> DataFrame:
    """Entity rows (file columns, engine types) of rows `send.prepare(owned=True, block=FILE_ROWS)` placed.

    `inputs`: the prepared DataFrame's partition count (each owns queue partitions; see the module doc).
    """
    count = len(plan.available)
    task = sf.shiftright(sf.col("_ord"), ORD_ROW_MASK.bit_length())
    i = sf.col("_ord").bitwiseAND(sf.lit(ORD_ROW_MASK))
    owned = sf.floor((sf.lit(count + inputs - 1) - task) / inputs)  # queue partitions this task owns
    block = sf.floor(i / FILE_ROWS)
    counter = sf.floor(block / owned) * FILE_ROWS + sf.pmod(i, sf.lit(FILE_ROWS)) + 1
    bases = sf.array(*[sf.lit(plan.bases[p] or 0).cast("long") for p in range(plan.partition_count)])
    qp = sf.col("_qp")
    seq = sf.shiftleft(qp.cast("long"), SEQUENCE_BITS).bitwiseOR(sf.element_at(bases, qp + 1) + counter.cast("long"))
    now_ts = sf.lit(now).cast("timestamp")
    sched = sf.col("scheduled_enqueue_time_utc")
    visible = sf.when(sched > now_ts, sched).otherwise(now_ts)
    ttl = sf.col("time_to_live_ms")
    default = plan.settings.default_message_time_to_live
    if default is not None:
        ttl = sf.least(ttl, sf.lit(limits.ttl_ms(default)).cast("long"))
    # As limits.expiries (the core's rule): no expiry where the sum would lie past the latest storable instant.
    room_ms = (sf.lit(limits.LATEST_US).cast("long") - sf.unix_micros(visible)) / 1000
    expires = sf.when(ttl <= room_ms, sf.timestamp_micros(sf.unix_micros(visible) + ttl * 1000))
    null_ts, null_str = sf.lit(None).cast("timestamp"), sf.lit(None).cast("string")
    values: dict[str, Column] = {
        "sequence_number": seq,
        "available_at_utc": visible,
        "sub_queue": sf.lit(SUB_QUEUE_MAIN),
        "subscription": null_str,
        "state": sf.lit(STATE_ACTIVE),
        "kind": sf.lit(KIND_MESSAGE),
        "enqueued_time_utc": visible,  # a scheduled message is enqueued when it becomes visible (message_rows)
        "expires_at_utc": expires,
        "scheduled_enqueue_time_utc": sched,
        "locked_until_utc": null_ts,
        "lock_token": null_str,
        "delivery_count": sf.lit(0).cast("int"),
        "time_to_live_ms": ttl.cast("long"),
        "size_in_bytes": sf.col("size_in_bytes").cast("int"),
        "transfer_hop_count": sf.lit(0).cast("int"),
        "dead_letter_reason": null_str,
        "dead_letter_error_description": null_str,
        "dead_letter_source": null_str,
    }
    return prepared.select(
        *[values.get(name, sf.col(name)).alias(name) for name in FILE_SCHEMA.names], qp.alias(PARTITION_COLUMN)
    )


def write_attempt(
    table: EntityTable, prepared: DataFrame, plan: SendPlan, inputs: int, deadline: Deadline
) -> tuple[int, list[int]]:
    """One attempt: Spark writes the rows numbered from `plan.bases`, the driver commits them once; (accepted, partitions).

    A concurrent sender that moved some fences gets those partitions renumbered (commit_renumbering).
    Raises CommitConflict when the commit cannot land otherwise (the files are deleted), and the
    send's error when a row is bad or a partition's quota would be passed (nothing committed).
    Files committed where Spark wrote them (object stores) keep their staging directory, and
    Spark's `_SUCCESS` marker with them, which vacuum removes as an orphan.
    """
    spark = prepared.sparkSession
    rows = numbered_rows(prepared, plan, inputs, utcnow())
    staging = f"{STAGING_PREFIX}/{plan.lease}-{uuid.uuid4().hex[:12]}"  # the lease's tag keeps vacuum off (storage/leases.py)
    try:
        with spark_errors(), _write_conf(spark):
            rows.drop(PARTITION_COLUMN).write.options(**WRITE_OPTIONS).parquet(spark_path(f"{table.uri}/{staging}"))
        written = collect(table, staging, plan)
        check_quota(table, written, written.adds)
        placed = place(table, staging, written.adds, plan.lease)
        adds = split_oversized(table, placed)
        # Spark's local writer does not fsync: a commit must not outlive its files (split pieces are the engine's, fsynced).
        as_written = {a.path for a in placed}
        table.store.sync([a.path for a in adds if a.path in as_written])
    except BaseException:
        remove_staging(table, staging)
        raise
    if all(not a.path.startswith(f"{staging}/") for a in adds):
        remove_staging(table, staging)  # every file moved out: what is left is Spark's markers
    if adds:
        commit_renumbering(table, adds, written, dict(zip(range(plan.partition_count), plan.bases, strict=True)), deadline)
    return sum(written.counts.values()), sorted(p for p, c in written.counts.items() if c)


def _write_conf(spark: SparkSession) -> contextlib.AbstractContextManager[None]:
    """The session settings a write needs (WRITE_CONF): none where the write's options carry them (options_win)."""
    return contextlib.nullcontext() if options_win(spark) else _conf(spark, WRITE_CONF)


def options_win(spark: SparkSession) -> bool:
    """True when Spark takes WRITE_CONF from the write's options (OPTIONS_WIN), so the session need not change."""
    try:
        version = tuple(int(part) for part in spark.version.split(".")[:2])
    except ValueError:  # a vendor's version string: set the session, which every Spark honours
        return False
    return version >= OPTIONS_WIN


class _Shared(NamedTuple):
    """Session settings that the sends of one session in flight hold: how many, and the user's values to restore."""

    users: int
    saved: dict[str, str | None]


_shared_lock = threading.Lock()  # process-wide: threads of one session send at once
_shared: dict[int, _Shared] = {}  # per session (id of the SparkSession object) with sends in flight


@contextlib.contextmanager
def _conf(spark: SparkSession, conf: dict[str, str]) -> Iterator[None]:
    """Session settings for the duration of one write; the user's values come back when the session's last write ends.

    Concurrent sends of one session (threads) share the settings: the first saves the user's values
    and sets them, the last restores those. Each saving and restoring what it found instead would
    let a later send save an earlier one's setting and write it back last, for good. Every caller
    passes the same settings (WRITE_CONF).
    """
    key = id(spark)
    with _shared_lock:
        held = _shared.get(key)
        if held is None:
            held = _Shared(0, {k: spark.conf.get(k, None) for k in conf})
            for k, v in conf.items():
                spark.conf.set(k, v)
        _shared[key] = _Shared(held.users + 1, held.saved)
    try:
        yield
    finally:
        with _shared_lock:
            held = _shared.pop(key)
            if held.users > 1:
                _shared[key] = _Shared(held.users - 1, held.saved)
            else:
                _restore(spark, held.saved)


def _restore(spark: SparkSession, saved: dict[str, str | None]) -> None:
    """Put the user's session settings back (unset where the user had none)."""
    for k, before in saved.items():
        if before is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, before)


def collect(table: EntityTable, staging: str, plan: SendPlan) -> Written:
    """The add actions of the files Spark wrote (statistics from their footers) and the rows per partition.

    Every file must hold one partition's rows numbered without gaps after that partition's base,
    which the block layout guarantees; anything else (a file spanning two partitions) is refused.
    """
    fs, root = filesystem(table.uri)
    infos = [
        i
        for i in fs.get_file_info(pafs.FileSelector(f"{root}/{staging}", allow_not_found=True))
        if i.is_file and i.base_name.endswith(".parquet") and not i.base_name.startswith(("_", "."))
    ]
    # Read in this thread: footer-reading threads would leave their allocator heaps behind, and the driver's
    # memory would grow with the files of a send (about 50 MB per 1,000) instead of staying flat.
    described = [describe(fs, i.path, f"{staging}/{i.base_name}", i.size) for i in infos]
    counts: dict[int, int] = {}
    last: dict[int, int] = {}
    bounds: dict[int, int | None] = {}
    adds = []
    for found in described:
        if found is None:  # Spark writes an empty file for a task without rows: nothing to commit
            continue
        p = found.partition
        adds.append(found.add)
        counts[p] = counts.get(p, 0) + found.rows
        last[p] = max(last.get(p, 0), found.last)
        bound = bounds.get(p, 0)
        bounds[p] = None if bound is None or found.bound is None else bound + found.bound
    for p, n in counts.items():
        if last[p] - (plan.bases[p] or 0) != n:
            raise StorageError(f"partition {p} of {table.uri}: the send's files are not numbered densely; nothing was sent")
    return Written(adds, counts, last, bounds)


class Described(NamedTuple):
    """One written file: its add action (Delta statistics), partition, rows, last counter and a bound of its message bytes."""

    add: AddFile
    partition: int
    rows: int
    last: int
    bound: int | None  # None when a sized column is not plain-encoded (its size then bounds nothing)


def describe(fs: pafs.FileSystem, path: str, rel: str, size: int) -> Described | None:
    """A written file as described by its Parquet footer; None for a file without rows.

    The bound of its message bytes is the uncompressed size of the columns size_in_bytes counts:
    plain-encoded (WRITE_OPTIONS), each value is its bytes and a length prefix, so it is never less.
    """
    with fs.open_input_file(path) as f:
        meta = pq.ParquetFile(f).metadata
    if meta.num_rows == 0:
        return None
    schema = meta.schema.to_arrow_schema()
    index = {name: schema.get_field_index(name) for name in STATS_COLUMNS}
    sized = [schema.get_field_index(name) for name in SIZED_COLUMNS]
    mins: dict[str, object] = {}
    maxs: dict[str, object] = {}
    nulls = dict.fromkeys(STATS_COLUMNS, 0)
    bounds: dict[str, list[object]] = {}
    bound: int | None = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in sized:
            chunk = group.column(c)
            plain = not chunk.has_dictionary_page and set(chunk.encodings) <= PLAIN_ENCODINGS
            bound = bound + chunk.total_uncompressed_size if bound is not None and plain else None
        for name, c in index.items():
            st = group.column(c).statistics
            if st is None:
                nulls.pop(name, None)  # unknown: leave the column's statistics out (readers then open the file)
                bounds[name] = [None]
                continue
            if name in nulls:
                nulls[name] += st.null_count
            if st.has_min_max:
                bounds.setdefault(name, []).extend([st.min, st.max])
            elif st.null_count != group.num_rows:
                bounds[name] = [None]
    for name, vals in bounds.items():
        if not vals or any(v is None for v in vals):
            continue
        lo, hi = min(vals), max(vals)  # type: ignore[type-var]
        if isinstance(lo, datetime) and isinstance(hi, datetime):
            lo, hi = delta_timestamp(_micros(lo), up=False), delta_timestamp(_micros(hi), up=True)
        mins[name], maxs[name] = lo, hi
    lo_seq, hi_seq = mins.get("sequence_number"), maxs.get("sequence_number")
    if not isinstance(lo_seq, int) or not isinstance(hi_seq, int) or partition_of(lo_seq) != partition_of(hi_seq):
        raise StorageError(f"{rel}: a DataFrame send's file must hold one partition's rows; nothing was sent")
    p = partition_of(lo_seq)
    stats = {"numRecords": meta.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}
    add = AddFile(rel, {PARTITION_COLUMN: str(p)}, size, json.dumps(stats, separators=(",", ":"), default=str))
    return Described(add, p, meta.num_rows, hi_seq & SEQUENCE_MASK, bound)


def place(table: EntityTable, staging: str, adds: list[AddFile], lease: str) -> list[AddFile]:
    """Local files moved into their `partition_id=<p>/` directory (a rename), so the table keeps the engine's layout.

    Their names keep the write lease's tag (`lease`), so vacuum keeps them until the commit as it
    kept them in the staging directory.

    On object stores, where a rename is a copy, the files are committed where Spark wrote them
    (Delta readers take a file's partition from its add action, not from its path).
    """
    out = []
    made: set[str] = set()
    for a in adds:
        src = table.store.local_path(a.path)
        if src is None:
            out.append(a)
            continue
        name = a.path.rsplit("/", 1)[-1]
        rel = f"{PARTITION_COLUMN}={a.partition_values[PARTITION_COLUMN]}/{name if lease in name else f'{lease}-{name}'}"
        dst = table.store.local_path(rel)
        assert dst is not None
        parent = os.path.dirname(dst)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        os.rename(src, dst)
        out.append(AddFile(rel, a.partition_values, a.size, a.stats))
    return out


def split_oversized(table: EntityTable, adds: list[AddFile]) -> list[AddFile]:
    """Files larger than SPLIT_BYTES rewritten as the engine's files (at most MAX_FILE_ROWS rows and about 8 MB each).

    Only large bodies make such files (4,000 rows of 1 KB are 4 MB). Rows and numbering are
    kept; the first lock of a file this size would otherwise read and rewrite all of it. The
    file is read one row group at a time (Spark closes one every ~8 MB: WRITE_OPTIONS), so the
    driver holds a few row groups, never a whole file of up to 4,000 large bodies.
    """
    out: list[AddFile] = []
    fs, root = filesystem(table.uri)
    for a in adds:
        if a.size <= SPLIT_BYTES:
            out.append(a)
            continue
        p = int(a.partition_values[PARTITION_COLUMN])
        pieces: list[AddFile] = []
        try:
            with fs.open_input_file(f"{root}/{a.path}") as f:
                parquet = pq.ParquetFile(f)
                for g in range(parquet.num_row_groups):
                    pieces += table.data.write_chunks(p, file_rows(parquet.read_row_group(g, columns=FILE_SCHEMA.names)))
        except BaseException:
            table.data.delete([x.path for x in out + pieces if x not in adds])  # nothing committed: no orphans left
            raise
        out += pieces
        table.data.delete([a.path])
    return out


def remove_staging(table: EntityTable, staging: str) -> None:
    """Delete an attempt's staging directory and whatever is left in it (Spark's checksums, markers, unplaced files)."""
    fs, root = filesystem(table.uri)
    with contextlib.suppress(OSError):
        fs.delete_dir(f"{root}/{staging}")


def _micros(ts: datetime) -> int:
    """A Parquet statistic's timestamp (UTC; naive ones are read as UTC) as microseconds since the epoch."""
    aware = ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    return (aware - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
