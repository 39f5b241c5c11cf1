"""Data files of an entity table: write a partition's rows as Parquet with Delta statistics, read them back.

sparkqueue writes its own files through the table's store and commits them as Delta add/remove
actions (log.py), which costs a millisecond or two where a delta-rs MERGE costs tens. Files are
plain Parquet without the partition column, as every Delta reader expects.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkqueue.errors import StorageCorruptedError
from sparkqueue.storage.log import AddFile, RemoveFile
from sparkqueue.storage.schema import ENTITY_SCHEMA, PARTITION_COLUMN, conform
from sparkqueue.storage.store import Store

log = logging.getLogger(__name__)

# Columns with min/max statistics: what sparkqueue prunes on, and what Spark's data skipping can use.
STATS_COLUMNS = [
    f.name
    for f in ENTITY_SCHEMA
    if f.name != PARTITION_COLUMN and not pa.types.is_binary(f.type) and f.name != "application_properties"
]
FILE_SCHEMA = pa.schema([f for f in ENTITY_SCHEMA if f.name != PARTITION_COLUMN])
BODY_COLUMN = "body"
LIGHT_COLUMNS = [c for c in FILE_SCHEMA.names if c != BODY_COLUMN]  # what every check reads: all but the payload
MAX_FILE_ROWS = 1000
MIN_SPLIT_ROWS = 100  # a receive splitting a file leaves the rest in files of its count, or of a multiple of it this large
MAX_FILE_BYTES = 8 * 1024 * 1024
SMALL_STATS_ROWS = 64  # files up to this many rows get their statistics from Python values (see _stats)
CACHE_BYTES = 64 * 1024 * 1024  # per table handle: recently touched files, which settles re-read
ENCODING_SLACK = 16 * 1024  # bytes an encoding may need beyond its rows' Arrow buffers: magic, schema, footer
COLUMN_SLACK = 1024  # and per column: page header, levels, column chunk metadata
SLICE_CHECK_BYTES = 1024 * 1024  # buffers past this size are measured as sliced (see _encoded_bound)


class DataFiles:
    """Reads and writes the Parquet files under one table's store (a local directory or an object store).

    Data files are immutable, so recently written or read files are kept in a small in-memory
    cache keyed by path: a receive that locks rows and the settle that follows read no file twice.
    """

    def __init__(
        self, store: Store, cache_bytes: int = CACHE_BYTES, on_damage: Callable[[str, str, bool], Exception] | None = None
    ) -> None:
        """`on_damage(path, what, missing)` turns a missing or unreadable file into the error to raise.

        Without it, that error is StorageCorruptedError.
        """
        self.store = store
        self.on_damage = on_damage
        self._cache: OrderedDict[str, pa.Table] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        self._lock = threading.Lock()

    def read(self, path: str, columns: Sequence[str] | None = None) -> pa.Table:
        """A file's rows (selected columns), typed as the entity schema declares.

        Bodies are read only when asked for: a lock check or a settle that drops whole files reads
        the small columns, a fraction of a file of 1 KB messages.
        """
        cols = list(columns) if columns is not None else FILE_SCHEMA.names
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and (cached.num_columns == len(FILE_SCHEMA) or set(cols) <= set(cached.column_names)):
                self._cache.move_to_end(path)
                return cached.select(cols)
        wanted = FILE_SCHEMA.names if BODY_COLUMN in cols else LIGHT_COLUMNS
        try:
            data = self.store.get(path)
        except FileNotFoundError as exc:
            raise self._damage(path, f"live data file {path} of table {self.store.uri} is missing", missing=True) from exc
        try:
            t = _decode(data, wanted)
        except (pa.ArrowInvalid, OSError) as exc:
            raise self._damage(path, f"data file {path} of table {self.store.uri} is damaged ({exc})") from exc
        self._remember(path, t)
        return t.select(cols)

    def _damage(self, path: str, what: str, *, missing: bool = False) -> Exception:
        return self.on_damage(path, what, missing) if self.on_damage is not None else StorageCorruptedError(what)

    def _remember(self, path: str, rows: pa.Table) -> None:
        """Cache a file's rows (all columns, or all but the body), evicting the least recently used beyond the budget.

        Rows that slice larger buffers (a send's batch) count with what they keep alive.
        """
        size = rows.get_total_buffer_size()
        if size > self._cache_bytes // 4:
            return
        with self._lock:
            old = self._cache.pop(path, None)
            if old is not None:
                self._cached -= old.get_total_buffer_size()
                if old.num_columns >= rows.num_columns:
                    rows, size = old, old.get_total_buffer_size()
            self._cache[path] = rows
            self._cached += size
            while self._cached > self._cache_bytes and self._cache:
                _, evicted = self._cache.popitem(last=False)
                self._cached -= evicted.get_total_buffer_size()

    def write(self, partition: int, rows: pa.Table, tag: str = "") -> AddFile:
        """Write one partition's rows (file schema, no partition column) and describe the file as an add action.

        `tag` goes into the file's name (a write lease's, storage/leases.py).
        """
        rel, rows, data, add = self._encoded(partition, rows, tag)
        self._put(rel, rows, data)
        return add

    def _encoded(self, partition: int, rows: pa.Table, tag: str) -> tuple[str, pa.Table, pa.Buffer, AddFile]:
        """A new file's name, rows, Parquet bytes and add action (its size and statistics), before it is written."""
        rel = f"{PARTITION_COLUMN}={partition}/part-{tag + '-' if tag else ''}{uuid.uuid4().hex}.lz4.parquet"
        rows = file_rows(rows)
        data = _encode(rows)
        add = AddFile(rel, {PARTITION_COLUMN: str(partition)}, data.size, json.dumps(_stats(rows), separators=(",", ":")))
        return rel, rows, data, add

    def _put(self, rel: str, rows: pa.Table, data: pa.Buffer) -> None:
        """Store an encoded file durably and keep its rows in the cache."""
        self.store.put_new(rel, memoryview(data))
        self._remember(rel, rows)

    def _write_job(self, partition: int, rows: pa.Table, tag: str, described: Future[AddFile]) -> None:
        """Encode a file, publish its add action in `described`, then store it (a writer thread's job)."""
        try:
            rel, rows, data, add = self._encoded(partition, rows, tag)
        except BaseException as exc:
            described.set_exception(exc)
            raise
        described.set_result(add)
        self._put(rel, rows, data)

    def write_chunks(self, partition: int, rows: pa.Table, max_rows: int = MAX_FILE_ROWS) -> list[AddFile]:
        """Write rows (in their order) as files of at most `max_rows` rows and about as many KB (MAX_FILE_BYTES per 1,000).

        Bounded files keep a lock or settle proportional to the messages it touches: MERGE-style
        copy-on-write rewrites a whole file, never more than one bounded file per touched run.
        """
        (adds,) = self.write_all([(partition, rows, max_rows)])
        return adds

    def write_all(self, pieces: Sequence[tuple[int, pa.Table, int]], tag: str = "") -> list[list[AddFile]]:
        """Write (partition, rows, max rows per file) pieces as in `write_chunks`; each piece's adds, once all are durable.

        All or nothing: when one write fails, the files already written are deleted and the error raised.
        `tag`: as in `write`.
        """
        pending = self.start_all(pieces, tag)
        pending.wait()
        return pending.adds

    def start_all(self, pieces: Sequence[tuple[int, pa.Table, int]], tag: str = "") -> PendingWrites:
        """Start writing pieces as `write_all` does, side by side; returns once every file is encoded and described.

        A commit's files are written concurrently (encoding releases the GIL; fsyncs and object
        puts overlap), so a send to many partitions or subscriptions costs about one file's latency.
        The caller writes its log entry while the files are stored and links it only after
        `PendingWrites.wait()` (docs/storage.md, "Committing"). An encoding that fails raises here,
        once the other writes ended, their files deleted.
        """
        jobs = [(i, p, chunk) for i, (p, rows, max_rows) in enumerate(pieces) for chunk in _chunks(rows, max_rows)]
        described: list[Future[AddFile]] = [Future() for _ in jobs]
        if len(jobs) == 1:  # one file (a single send, a lock): encoded here, only its storing handed to a writer
            rel, rows, data, add = self._encoded(jobs[0][1], jobs[0][2], tag)
            described[0].set_result(add)
            puts = [_in_writer(self._put, rel, rows, data)]
        else:
            puts = [_in_writer(self._write_job, p, chunk, tag, d) for (_, p, chunk), d in zip(jobs, described, strict=True)]
        pending = PendingWrites(self, [[] for _ in pieces], described, puts)
        try:
            for (i, _, _), d in zip(jobs, described, strict=True):
                if d.exception() is None:  # waits for the encoding; raises only when this thread is interrupted
                    pending.adds[i].append(d.result())
        except BaseException as exc:  # interrupted (Ctrl-C): no file of the batch may stay half-described
            pending.abandon(exc)
            raise
        if any(d.exception() is not None for d in described):
            pending.wait()  # raises the encoding's error once the other writes ended, their files deleted
        return pending

    def delete(self, paths: Sequence[str]) -> None:
        """Best-effort removal of files written by a commit that was abandoned (vacuum catches the rest)."""
        for p in paths:
            try:
                self.store.delete(p)
            except Exception as exc:
                log.debug("could not delete abandoned file %s: %s", p, exc)


class PendingWrites:
    """A commit's data files being stored by the writer threads (DataFiles.start_all).

    `adds` describes them already; `wait()` returns once every one is durable. When a write
    fails, or the wait is interrupted, every write still ends first, then the batch's files are
    deleted and the error raised, on this and every later call: a commit never links a log entry
    naming a file that is not stored, and no write outlives its commit.
    """

    def __init__(
        self, files: DataFiles, adds: list[list[AddFile]], described: list[Future[AddFile]], puts: list[Future[None]]
    ) -> None:
        self.adds = adds
        self._files = files
        self._described = described
        self._puts = puts
        self._waited = False
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Block until every file is durable; raise the first write error (after deleting the batch's files)."""
        if not self._waited:
            try:
                futures.wait(self._puts)
            except BaseException as exc:  # interrupted while waiting
                self.abandon(exc)
            else:
                self._end(next((e for e in (f.exception() for f in self._puts) if e is not None), None))
        if self._error is not None:
            raise self._error

    def abandon(self, reason: BaseException) -> None:
        """Let every write end, then delete the batch's files; `wait()` raises `reason` from now on."""
        futures.wait(self._puts)
        self._end(reason)

    def _end(self, error: BaseException | None) -> None:
        self._waited, self._error = True, error
        if error is not None:
            described = [d.result() for d in self._described if d.done() and d.exception() is None]
            self._files.delete([a.path for a in described])


def _chunks(rows: pa.Table, max_rows: int) -> list[pa.Table]:
    """Rows cut (in order) into files of at most `max_rows` rows and MAX_FILE_BYTES (more for files past 1,000 rows:
    MAX_FILE_BYTES per 1,000). A smaller row cap keeps the byte cap: files of large messages stay a few MB."""
    if rows.num_rows <= 1:  # a single send or lock: no size to weigh (Table.nbytes costs a tenth of a millisecond)
        return [rows] if rows.num_rows else []
    size = rows.get_total_buffer_size()  # at least the rows' size: when it fits one file the cut is the same
    if size > MAX_FILE_BYTES:
        size = rows.nbytes  # the sliced size, for rows cut from a larger table
    per_row = max(1, size // rows.num_rows)
    step = max(1, min(max_rows, MAX_FILE_BYTES * max(max_rows, MAX_FILE_ROWS) // MAX_FILE_ROWS // per_row))
    return [rows.slice(i, step) for i in range(0, rows.num_rows, step)]


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
WRITERS = 8  # concurrent file writes per process: enough to overlap a 16-partition send's fsyncs or object puts


def _in_writer(job: Callable[..., None], *args: Any) -> Future[None]:
    """Run `job` in a writer thread; in the caller's own once the interpreter is exiting (the pool then takes no job)."""
    try:
        return _writers().submit(job, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown": a thread still sending at exit
        done: Future[None] = Future()
        try:
            job(*args)
            done.set_result(None)
        except Exception as exc:
            done.set_exception(exc)
        return done


def _writers() -> ThreadPoolExecutor:
    """This process's pool of file writers (a forked child makes its own: threads do not survive a fork)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(WRITERS, thread_name_prefix="sparkqueue-write"))
        return _POOL[1]


def file_rows(rows: pa.Table) -> pa.Table:
    """Entity rows as a data file holds them: the file columns (no partition column), in the file schema."""
    return conform(rows.select(FILE_SCHEMA.names), FILE_SCHEMA)


def encode_parquet(rows: pa.Table) -> bytes:
    """Rows as the bytes of one Parquet file (see `_encode`)."""
    data: bytes = _encode(rows).to_pybytes()
    return data


def _encode(rows: pa.Table) -> pa.Buffer:
    """Rows as the bytes of one Parquet file.

    LZ4 (Parquet's LZ4_RAW, read by Spark 3.4+, Databricks and delta-rs) encodes and decodes 1 KB
    bodies faster than Snappy, incompressible or JSON, and packs JSON a little tighter. No column
    has dictionaries or Parquet statistics: a message's columns are mostly distinct or null, and
    LZ4 packs the repeated ones as tight, so dictionaries made files larger; min/max statistics
    live in the Delta log (`_stats`), which every Delta reader prunes by, and a file is one row
    group. The two cost a quarter of a 1,000-row file's encoding and a third of a small one's. The
    file is encoded in memory and written in one call, a fifth faster than the writer's many
    small writes, and its size needs no stat afterwards.

    The buffer is allocated once at a bound of the file's size (docs/storage.md, "Encoding into
    one buffer"): a growing stream reallocates and copies as it doubles, touching two to four
    times the file's size in fresh memory, which made a 16 MB file's encoding 2.4x slower. The
    returned slice keeps the whole allocation while the file is written out; its untouched part
    (compressible rows leave much of it) is address space, not memory in use.
    """
    buffer = pa.allocate_buffer(_encoded_bound(rows))
    sink = pa.FixedSizeBufferWriter(buffer)
    try:
        _write_parquet(rows, sink)
    except OSError as exc:  # past the bound ("Write out of bounds"): a growing stream takes any size
        log.debug("encoding a data file of %d rows again in a growing stream: %s", rows.num_rows, exc)
        stream = pa.BufferOutputStream()
        _write_parquet(rows, stream)
        grown: pa.Buffer = stream.getvalue()
        return grown
    return buffer.slice(0, sink.tell())


def _write_parquet(rows: pa.Table, sink: pa.NativeFile) -> None:
    """The engine's Parquet encoding of `rows` into `sink`: LZ4, no dictionaries, no Parquet statistics (see _encode)."""
    pq.write_table(rows, sink, compression="lz4", use_dictionary=False, write_statistics=False)


def _encoded_bound(rows: pa.Table) -> int:
    """An upper bound of the Parquet encoding of `rows`: their Arrow buffers, LZ4's worst-case growth (1/255),
    and room for the page headers, levels and footer of every column.

    The buffers' total counts whole buffers, also of a slice (a file cut from a larger table);
    past SLICE_CHECK_BYTES the sliced size is asked for (0.1 ms), so a small file cut from a
    large table does not hold the whole table's size.
    """
    size: int = rows.get_total_buffer_size()
    if size > SLICE_CHECK_BYTES:
        size = min(size, int(rows.nbytes))
    columns: int = rows.num_columns
    return size + size // 128 + ENCODING_SLACK + COLUMN_SLACK * columns


def _decode(data: bytes, columns: list[str]) -> pa.Table:
    """The named columns of one Parquet file's bytes, typed as the file schema declares.

    `ParquetFile.read` takes half the time of `pq.read_table` on the small files a lock or a
    session writes (0.4 ms against 1 ms: no dataset discovery), but passes over a column the
    file lacks: a file without one of them is damaged. One thread decodes a file's columns faster
    than Arrow's pool does, from one row to 4,000 (0.36 ms against 0.58 for a one-row file): a
    file is one row group, and handing 29 small columns to the pool costs more than decoding them.
    """
    t = pq.ParquetFile(pa.BufferReader(data)).read(columns=columns, use_threads=False)
    if t.column_names != columns:
        missing = sorted(set(columns) - set(t.column_names))
        raise pa.ArrowInvalid(f"columns {missing} are missing")
    return conform(t, _schema_of(columns))


def remove_action(path: str, partition: int, size: int) -> RemoveFile:
    """A remove action for a live file."""
    return RemoveFile(path, {PARTITION_COLUMN: str(partition)}, size)


def _schema_of(columns: Sequence[str]) -> pa.Schema:
    """The file schema restricted to some columns."""
    return pa.schema([FILE_SCHEMA.field(c) for c in columns])


def _stats(rows: pa.Table) -> dict[str, object]:
    """Delta file statistics: numRecords and per-column min, max and null count.

    A file of up to SMALL_STATS_ROWS rows (a send, a lock, a session's file) takes its bounds from
    each column's Python values: a compute call per column cost 0.4 ms for an 11-row file and
    converting one row as a dict 0.2 ms, about a tenth of a round trip's CPU. Timestamps are
    bounded as their int64 microseconds, which needs no datetime objects.
    """
    mins: dict[str, object] = {}
    maxs: dict[str, object] = {}
    nulls: dict[str, int] = {}
    small = rows.num_rows <= SMALL_STATS_ROWS
    for name in STATS_COLUMNS:
        col = rows.column(name)
        nulls[name] = col.null_count
        if col.null_count == len(col):
            continue
        is_time = pa.types.is_timestamp(col.type)
        if is_time:
            col = pa.chunked_array([c.view(pa.int64()) for c in col.chunks], pa.int64())
        if small:
            values = [v for v in col.to_pylist() if v is not None]
            lo, hi = min(values), max(values)
        else:
            mm = pc.min_max(col)
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if is_time:  # Delta stats hold milliseconds: the min rounded down and the max up keep pruning safe
            lo, hi = delta_timestamp(lo, up=False), delta_timestamp(hi, up=True)
        mins[name], maxs[name] = lo, hi
    return {"numRecords": rows.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


_EPOCH = datetime(1970, 1, 1)


def delta_timestamp(micros: int, *, up: bool) -> str:
    """Microseconds since the epoch (UTC) as Delta's statistics timestamp: ISO 8601 in whole milliseconds.

    `up` rounds a part millisecond up (a max), else down (a min), so pruning by the statistics stays safe.
    """
    ms = micros // 1000 + (1 if up and micros % 1000 else 0)
    t = _EPOCH + timedelta(milliseconds=ms)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"
