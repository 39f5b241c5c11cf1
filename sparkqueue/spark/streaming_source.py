"""The streaming source: `spark.readStream.format("sparkqueue")` receives with peek-lock in micro-batches (docs/semantics.md §12).

How a micro-batch flows (see docs/spark-streaming.md for the guarantee):

1. Spark asks `latestOffset(start)`. Batches up to `start` have been committed by the sink (Spark
   plans a batch only after the previous one committed), so their messages are completed first.
   Then the source locks up to `maxMessagesPerTrigger` messages, in the driver's source process,
   and records the batch under the namespace root: ``_spark_streams/<stream id>/batch-<n>/`` holds
   the lock commits' data files (hard-linked, as `receive_dataframe` stages them: no copy) and a
   manifest of the (sequence number, lock token) pairs emitted. The offset is
   ``{"stream": <id>, "batch": n}``; it names that record, never a position in the queue.
2. `partitions(start, end)` reads the manifests of the batches in (start, end], one input
   partition per queue partition, and `read` returns the manifest's rows of the linked files. A
   batch replayed after a restart therefore returns exactly the messages it returned before.
3. The sink commits; Spark records the batch in the checkpoint's commit log; the next
   `latestOffset` (or `commit(end)`) completes the batch's messages and deletes its record.

On an entity that requires sessions a batch holds whole sessions instead: the source accepts free
sessions and takes their messages in order, records the session locks in the manifest, renews
them, and completes the messages under them and releases the sessions after the commit, so a
session's messages keep their order within and across batches (docs/spark-streaming.md, "Sessions").

While a batch is in flight a thread in the source process renews its locks a third of the entity's
lock duration after they were taken (or last renewed), oldest first and in commits of RENEW_CHUNK
messages, so a large batch's first locks are renewed well before they lapse. A lock lost anyway
(the query was down longer than a lock duration) is handled on completion: the sequence numbers
whose completion failed are kept in the stream's `_skip.json`, and when this stream receives such
a message again it completes it instead of emitting it, so committed output is not repeated (nor
counted again against a Trigger.AvailableNow run's budget). Batch records that Spark never logged (the
process died between recording a batch and Spark writing its offset) are discarded at the next
`latestOffset`, their locks abandoned.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from sparkqueue.errors import InvalidOperationError, OperationTimeoutError, SessionLockLostError, SparkQueueError
from sparkqueue.model import lifecycle
from sparkqueue.model.entity import Entity, SettleResult, utcnow
from sparkqueue.model.properties import check_receivable
from sparkqueue.model.sessions import SessionLock, Sessions
from sparkqueue.spark.datasource import sub_queue_of
from sparkqueue.spark.receive import RECEIVE_CHUNK, ReceiveJob, candidate_partitions, shares, stage_chunk
from sparkqueue.spark.schema import received_arrow, staged_rows
from sparkqueue.spark.staging import Staging, filesystem, require_local_root
from sparkqueue.spark.streaming import EntityAddress, address_of, check_options, positive_int
from sparkqueue.spark.worker import EntityRef
from sparkqueue.storage.files import FILE_SCHEMA
from sparkqueue.storage.schema import STATE_ACTIVE, SUB_QUEUE_DEAD_LETTER, member_of
from sparkqueue.storage.table import partition_of

if TYPE_CHECKING:
    from sparkqueue.namespace import Namespace

log = logging.getLogger(__name__)

RELEASE_COLUMNS = ["sequence_number", "sub_queue", "state", "lock_token"]  # what tells an abandon from a lapsed lock

STREAMS_DIR = "_spark_streams"
DEFAULT_MAX_MESSAGES_PER_TRIGGER = 10_000
# beside COMMON_OPTIONS; all but maxMessagesPerTrigger are the batch reader's too (datasource.READ_OPTIONS)
SOURCE_OPTIONS = frozenset({"entity", "entity_type", "topic", "subscription", "sub_queue", "maxmessagespertrigger"})
ALL_AVAILABLE_CAP = 1_000_000  # a batch Spark asks to hold "everything" still locks at most this many
SKIP_RETENTION = timedelta(days=14)  # how long a committed-but-not-completed message is remembered
MAX_ROUNDS = 64
SESSION_TAKE = 1_000  # messages of one session taken per call (a session is taken whole, up to the batch's limit)
MAX_SESSIONS_PER_BATCH = 256  # renewing (and completing) a session is a commit each: this bounds a round
SESSIONS_JOURNAL = "_sessions.json"  # a batch's session locks as they are taken (released if the batch is never logged)
Held = tuple[SessionLock, list[int]]  # a session lock and the sequence numbers the batch emits under it
LOCK_THREADS = 4  # partitions locked (and completed) at once by the source's driver process
RENEW_CHUNK = RECEIVE_CHUNK  # messages per renewal commit: a large batch's oldest locks are renewed first, not last
RENEW_RETRY_S = 0.5  # a renewal that failed (or a renewer round that raised) is tried again after this
ROWS_PER_TASK = 20_000  # a batch is read by one Spark task per this many messages (at most one per queue partition)
MANIFEST = "_manifest.json"
SKIP_FILE = "_skip.json"
Item = tuple[int, str]  # (sequence number, lock token)


@dataclass(frozen=True)
class SourceConfig:
    """What the source needs (picklable: Spark ships the reader to executors for `read`)."""

    address: EntityAddress
    sub_queue: str
    max_per_trigger: int


def source_config(options: dict[str, str]) -> SourceConfig:
    """Validate the source's (lower-cased) options; the entity must exist."""
    check_options(options, SOURCE_OPTIONS, "streaming source")
    address = address_of(options, sink=False)
    require_local_root(address.root, "the streaming source")
    sub_queue = sub_queue_of(options.get("sub_queue"))
    config = SourceConfig(address, sub_queue, positive_int(options, "maxMessagesPerTrigger", DEFAULT_MAX_MESSAGES_PER_TRIGGER))
    ns = address.namespace()
    try:
        entity = address.entity(ns)  # it must exist and take receives: an error before the query starts
        check_receivable(entity.props, entity.name, dead_letters=sub_queue == SUB_QUEUE_DEAD_LETTER)
    finally:
        ns.close()
    return config


class RefusedStreamReader(DataSourceStreamReader):
    """A source whose options or entity were refused: it raises the refusal when Spark first asks it for an offset.

    PySpark's source runner stops the reader in a `finally`, so an error raised while the reader
    is created reaches the user as an UnboundLocalError; raised from here, the message is kept.
    """

    def __init__(self, error: SparkQueueError) -> None:
        self.error = error

    def initialOffset(self) -> dict[str, Any]:  # noqa: N802 - pyspark's name
        """The refusal."""
        raise self.error

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:  # noqa: N802 - pyspark's name
        """The refusal (a restart from a checkpoint asks this first)."""
        raise self.error

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The refusal."""
        raise self.error

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The refusal."""
        raise self.error

    def stop(self) -> None:
        """Nothing to stop."""


class BatchPartition(InputPartition):
    """Queue partitions of a recorded batch read by one Spark task: their linked data files and the tokens the batch emits."""

    def __init__(self, batch: int, index: int, files: list[str], tokens: list[str]) -> None:
        super().__init__((batch, index))
        self.batch = batch
        self.index = index
        self.files = files
        self.tokens = tokens


class QueueStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of peek-locked messages, completed after the sink commits them (see the module docstring).

    Spark creates readers in several processes; only the source process's reader (the one Spark
    asks for offsets) opens a namespace and keeps state, lazily, so creating and pickling a
    reader is cheap.
    """

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self._stream_id: str | None = None
        self._state: StreamState | None = None
        self._available_now = False

    def __getstate__(self) -> dict[str, object]:
        return {"config": self.config, "_stream_id": None, "_state": None, "_available_now": False}

    # ---- offsets -----------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:  # noqa: N802 - pyspark's name
        """A new stream: a fresh id, before batch 0."""
        if self._stream_id is None:
            self._stream_id = uuid.uuid4().hex
        return {"stream": self._stream_id, "batch": -1}

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - pyspark's name
        """maxMessagesPerTrigger messages per batch."""
        return ReadMaxRows(self.config.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - pyspark's name
        """Trigger.AvailableNow: the run stops after as many messages as the sub-queue holds now (or when it is empty)."""
        self._available_now = True

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:  # noqa: N802 - pyspark's name
        """Complete the batches Spark committed, then lock and record the next batch; `start` when nothing arrived."""
        state = self._state_for(start)
        done = int(start["batch"])
        state.complete_through(done)
        state.discard_after(done)
        if isinstance(limit, ReadMaxRows):
            want = limit.max_rows
        elif isinstance(limit, ReadAllAvailable):
            want = ALL_AVAILABLE_CAP
        else:
            want = self.config.max_per_trigger
        got = state.receive(done + 1, want)
        return {"stream": state.stream_id, "batch": done + 1} if got else start

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The recorded batches in (start, end], one input partition per queue partition they hold."""
        state = self._state_for(end)
        return state.partitions(int(start["batch"]) + 1, int(end["batch"]))

    def commit(self, end: dict[str, Any]) -> None:
        """Spark committed every batch up to `end`: complete their messages."""
        self._state_for(end).complete_through(int(end["batch"]))

    def stop(self) -> None:
        """Stop lock renewal (locks of an uncommitted batch lapse, and its messages come back)."""
        if self._state is not None:
            self._state.stop()

    # ---- data ----------------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The batch's messages of one queue partition, in sequence order (ReceivedMessage columns)."""
        assert isinstance(partition, BatchPartition)
        tokens = pa.array(partition.tokens, pa.string())
        now = utcnow()
        parts = []
        for uri in partition.files:
            fs, path = filesystem(uri)
            t = pq.read_table(path, filesystem=fs)
            parts.append(t.filter(pc.fill_null(pc.is_in(t.column("lock_token"), value_set=tokens), False)))
        if parts:
            rows = pa.concat_tables(parts, promote_options="permissive").sort_by("sequence_number")
            yield from received_arrow(staged_rows(rows, now)).to_batches()

    # ---- state ---------------------------------------------------------------------------------

    def _state_for(self, offset: dict[str, Any]) -> StreamState:
        stream_id = str(offset["stream"])
        if self._state is None or self._state.stream_id != stream_id:
            if self._state is not None:
                self._state.stop()
            self._stream_id = stream_id
            self._state = StreamState(self.config, stream_id, self._available_now)
        return self._state


def group_partitions(batch: int, parts: list[tuple[list[str], list[str]]]) -> list[BatchPartition]:
    """Spread a batch's queue partitions over ceil(messages / ROWS_PER_TASK) tasks, balancing messages per task.

    Tasks cost a Python worker round each, so a small batch is read by one task and a large one
    by as many as its size warrants.
    """
    total = sum(len(tokens) for _, tokens in parts)
    tasks = max(1, min(len(parts), -(-total // ROWS_PER_TASK)))
    groups: list[tuple[list[str], list[str]]] = [([], []) for _ in range(tasks)]
    for files, tokens in sorted(parts, key=lambda ft: -len(ft[1])):
        files_g, tokens_g = min(groups, key=lambda g: len(g[1]))
        files_g += files
        tokens_g += tokens
    return [BatchPartition(batch, i, f, t) for i, (f, t) in enumerate(groups) if t]


class StreamState:
    """The source process's state of one stream: its directory under the namespace root, in-flight batches, renewal."""

    def __init__(self, config: SourceConfig, stream_id: str, available_now: bool) -> None:
        self.config = config
        self.stream_id = stream_id
        self.ns = config.address.namespace()
        self.uri = f"{self.ns.root}/{STREAMS_DIR}/{stream_id}"
        self.fs, self.path = filesystem(self.uri)
        self.fs.create_dir(self.path, recursive=True)
        self.inflight: dict[int, list[Item]] = {}
        self.renewed_at: dict[int, float] = {}  # in-flight batch -> when (monotonic) its locks were taken or last renewed
        self.held: dict[int, list[Held]] = {}  # session batches: the session locks that cover their messages
        self.session_ops = threading.Lock()  # renewal never runs beside a completion or release of a batch's sessions
        self.lock = threading.Lock()
        # Held while one batch's locks are renewed: its completion waits rather than racing the renewal, whose
        # commits would make the completion retry on and on while the locks aged unrenewed.
        self.renewal = threading.Lock()
        self.skip = self._load_skip()
        self._stopping = threading.Event()
        self._wake = threading.Event()  # a batch was recorded (or the source stops): the renewer looks again
        self._renewer: threading.Thread | None = None
        self.pool = ThreadPoolExecutor(LOCK_THREADS, thread_name_prefix=f"sparkqueue-stream-{stream_id[:8]}")
        # Renewal commits have threads of their own: stop() need not wait for one, and locking never delays them.
        self.renew_pool = ThreadPoolExecutor(LOCK_THREADS, thread_name_prefix=f"sparkqueue-renew-{stream_id[:8]}")
        self._sessions_now = False  # a replayed session batch: its session locks are renewed at once
        self._local = threading.local()
        self._thread_namespaces: list[Namespace] = []
        self.budget: int | None = self._available_count() if available_now else None

    def entity(self) -> Entity:
        """The streamed entity (settings at most a second old)."""
        return self.config.address.entity(self.ns)

    @property
    def by_session(self) -> bool:
        """Whether batches hold whole sessions (a session-requiring entity's main queue; docs/spark-streaming.md)."""
        return bool(getattr(self.entity().props, "requires_session", False)) and self.config.sub_queue != SUB_QUEUE_DEAD_LETTER

    def _available_count(self) -> int | None:
        """What Trigger.AvailableNow takes at most: the sub-queue's count now, or None (no bound) while a partition
        is unavailable, whose messages are not counted: the run then reports the damage instead of ending as empty."""
        props = self.entity().runtime_properties()
        if props.availability_status != "Available":
            return None
        if self.config.sub_queue == SUB_QUEUE_DEAD_LETTER:
            return props.dead_letter_message_count
        return props.active_message_count

    # ---- batch records -----------------------------------------------------------------------

    def batch_staging(self, n: int) -> Staging:
        """The directory of batch n's linked files."""
        return Staging(f"{self.uri}/batch-{n:012d}")

    def batches(self) -> list[int]:
        """Batch ids with a directory (recorded, or interrupted while recording)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        out = []
        for i in infos:
            if i.type == pafs.FileType.Directory and i.base_name.startswith("batch-"):
                try:
                    out.append(int(i.base_name.removeprefix("batch-")))
                except ValueError:
                    continue
        return sorted(out)

    def manifest(self, n: int) -> dict[str, Any] | None:
        """Batch n's manifest, or None when the batch was never fully recorded."""
        manifest: dict[str, Any] | None = self._read_json(f"{self.path}/batch-{n:012d}/{MANIFEST}")
        return manifest

    def _read_json(self, path: str) -> Any:
        """A JSON file the stream wrote (_write_json), or None when there is none."""
        try:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read())
        except (FileNotFoundError, OSError):
            return None

    def _write_json(self, path: str, value: object) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with self.fs.open_output_stream(tmp) as out:
            out.write(json.dumps(value).encode())
        self.fs.move(tmp, path)

    def _remove_batch(self, n: int) -> None:
        try:
            self.fs.delete_dir(f"{self.path}/batch-{n:012d}")
        except (FileNotFoundError, OSError) as exc:
            log.debug("could not remove batch %d of stream %s: %s", n, self.stream_id, exc)

    def _items(self, n: int) -> list[Item]:
        """The (sequence, token) pairs batch n holds locks for: its manifest's, else those of its linked files."""
        m = self.manifest(n)
        if m is not None:
            return [(int(s), str(t)) for s, t in m["items"]]
        staging = self.batch_staging(n)
        items: list[Item] = []
        for name in staging.names():
            t = staging.read_file(name).select(["sequence_number", "lock_token"])
            t = t.filter(pc.is_valid(t.column("lock_token")))
            items += list(zip(t.column("sequence_number").to_pylist(), t.column("lock_token").to_pylist(), strict=True))
        return items

    # ---- receive ---------------------------------------------------------------------------------

    def receive(self, n: int, want: int) -> int:
        """Lock up to `want` messages as batch n and record it; returns how many the batch emits (0: no batch)."""
        if self.budget is not None:
            want = min(want, self.budget)
        if want <= 0:
            return 0
        entity = self.entity()  # checked at each batch: the settings may have changed
        check_receivable(entity.props, entity.name, dead_letters=self.config.sub_queue == SUB_QUEUE_DEAD_LETTER)
        staging = self.batch_staging(n)
        self.fs.create_dir(f"{self.path}/batch-{n:012d}", recursive=True)
        items: list[Item] = []
        held: list[Held] = []
        down: set[int] = set()
        started = time.monotonic()
        try:
            while not items:
                if self.by_session:
                    got = self._lock_sessions(n, staging, want, items, held)
                else:
                    got = self._lock(staging, want, items, down)
                if self.budget is not None:  # what the batch emits: a message completed at once was counted when emitted
                    self.budget -= len(items)
                if got == 0 or (self.budget is not None and self.budget <= 0):
                    break
        except BaseException:
            self._release(held)  # sessions taken so far come back at once (message locks lapse at expiry)
            raise
        if not items:
            self._release(held)
            self._remove_batch(n)
            hidden = entity.hidden_partitions(self.config.sub_queue, down)
            if hidden:  # damaged storage is reported, never read as empty (docs/semantics.md §10): as core receives do,
                # only when every partition that may hold messages is unavailable; readable ones keep streaming
                raise entity.unavailable(hidden, f"batch {n} of the stream locked nothing")
            return 0
        manifest = {"batch": n, "items": items, "at": utcnow().isoformat(), "sessions": [_held_record(h) for h in held]}
        self._write_json(f"{self.path}/batch-{n:012d}/{MANIFEST}", manifest)
        with self.lock:
            self.inflight[n] = items
            self.renewed_at[n] = started
            if held:
                self.held[n] = held
        self._ensure_renewer()
        self._wake.set()
        log.info("stream %s: batch %d holds %d messages of %s", self.stream_id, n, len(items), self.config.address.display)
        return len(items)

    def _lock(self, staging: Staging, want: int, items: list[Item], down: set[int]) -> int:
        """Lock up to `want` messages spread over the partitions (as receive_dataframe does); returns how many.

        Partitions a locking thread found unavailable (damage found there marks that thread's handle
        only) are added to `down`.

        Nothing renews these locks before the batch is recorded, so locking stops after a sixth of
        the lock duration (its first renewal, of every message at once, needs time too): a batch
        that kept locking past the lock duration lost its first locks before it was emitted.
        """
        entity = self.entity()
        stop_at = time.monotonic() + entity.locking_time_s()
        job = ReceiveJob(
            EntityRef.of(self.ns.broker, self.config.address.entity_type, self.config.address.name),
            self.config.sub_queue,
            False,
            staging,
            utcnow(),
        )
        estimate = candidate_partitions(entity, self.config.sub_queue)
        candidates = list(estimate)
        if candidates:
            shift = random.randrange(len(candidates))
            candidates = candidates[shift:] + candidates[:shift]
        total = 0
        for round_no in range(MAX_ROUNDS):
            plan = shares(want - total, candidates, estimate)
            if not plan:
                break
            full = []
            # Partitions lock in parallel threads (commits on different partitions never conflict),
            # each thread on a namespace handle of its own.
            locked = self.pool.map(partial(self._lock_partition, job, round_no, stop_at), plan)
            for (p, share), (got, pairs, unavailable) in zip(plan, locked, strict=True):
                if unavailable:
                    down.add(p)
                items += self._drop_committed(pairs)
                total += got
                estimate[p] = max(0, estimate[p] - got)
                if got >= share and estimate[p] > 0:
                    full.append(p)
            planned = {p for p, _ in plan}
            candidates = full + [p for p in candidates if p not in planned]
            if total >= want or time.monotonic() >= stop_at:
                break
        return total

    def _lock_sessions(self, n: int, staging: Staging, want: int, items: list[Item], held: list[Held]) -> int:
        """Accept free sessions and take their messages, in order, until `want` (docs/spark-streaming.md, "Sessions").

        Each session stays locked until the batch is completed (or discarded), so its next messages
        go to a later batch only after these are completed: a session's order holds across batches.
        Nothing renews these locks before the batch is recorded, so taking stops after a third of
        the lock duration and MAX_SESSIONS_PER_BATCH sessions, and never takes a session this batch
        holds again. Each session is journaled as it is taken, so a batch never logged releases it.
        Returns how many messages were taken (including those completed at once: see _drop_committed).
        """
        entity = self.entity()
        sessions = Sessions(entity)
        stop_at = time.monotonic() + entity.policy.lock_duration.total_seconds() / 3
        total = 0
        while total < want and len(held) < MAX_SESSIONS_PER_BATCH and time.monotonic() < stop_at:
            mine = frozenset(lock.session_id for lock, _ in held)
            try:
                lock, rows = sessions.accept(None, 0.0, prefetch=min(want - total, SESSION_TAKE), exclude=mine)
            except OperationTimeoutError:
                break  # no free session with a message available now
            emitted: list[int] = []
            held.append((lock, emitted))  # from here on a failure releases it (receive)
            taken = [rows]
            count = rows.num_rows
            while rows.num_rows and total + count < want:
                rows = sessions.receive(lock, min(SESSION_TAKE, want - total - count), delete=False, wait_s=0.0)
                taken.append(rows)
                count += rows.num_rows
            got = pa.concat_tables(taken)
            total += got.num_rows
            pairs = list(zip(got.column("sequence_number").to_pylist(), got.column("lock_token").to_pylist(), strict=True))
            kept = self._drop_committed(pairs, lock)
            emitted += [s for s, _ in kept]
            if kept:
                keep = pa.array([s for s, _ in kept], pa.int64())
                rows = got.filter(member_of(got.column("sequence_number"), keep))
                staging.write(f"part-p{lock.partition:05d}-s{len(held):05d}.parquet", rows.select(FILE_SCHEMA.names))
                items += kept
            self._write_json(f"{self.path}/batch-{n:012d}/{SESSIONS_JOURNAL}", [_held_record(h) for h in held])
        return total

    def _release(self, held: list[Held]) -> None:
        """Give sessions up at once (their unsettled messages come back, first in their session)."""
        sessions = Sessions(self.entity())
        for lock, _ in held:
            try:
                sessions.release(lock)
            except SparkQueueError as exc:  # its lock lapses at expiry instead
                log.info("stream %s: releasing session %r failed (%s)", self.stream_id, lock.session_id, exc)

    def _held_of(self, b: int) -> list[Held]:
        """The session locks batch b holds: in memory, else from its manifest, else from its journal (never logged)."""
        with self.lock:
            held = self.held.get(b)
        if held is not None:
            return held
        m = self.manifest(b)
        if m is not None:
            return [_held_of_record(r) for r in m.get("sessions", [])]
        try:
            return [_held_of_record(r) for r in self._read_json(f"{self.path}/batch-{b:012d}/{SESSIONS_JOURNAL}") or []]
        except ValueError:
            return []

    def _settle_sessions(self, held: list[Held], items: list[Item], op: str) -> list[bool]:
        """Settle a session batch's items, each under the session lock it was taken with, then release the sessions.

        Per item: did it settle. Where a session's lock was lost, an item that no longer exists
        counts as settled (a completion that landed before a restart, or another receiver's).
        """
        entity = self.entity()
        sessions = Sessions(entity)
        token_of = dict(items)
        where = {s: i for i, (s, _) in enumerate(items)}
        ok = [False] * len(items)
        for lock, seqs in held:
            mine = [(s, token_of[s]) for s in seqs if s in token_of]
            try:
                if mine:
                    result = sessions.settle(lock, mine, op)
                    for (s, _), v in zip(mine, result.ok, strict=True):
                        ok[where[s]] = v
                sessions.release(lock)
            except SessionLockLostError:
                log.info("stream %s: session %r lost its lock before its batch completed", self.stream_id, lock.session_id)
                live = entity.table.rows_by_sequence(
                    entity.table.snapshot(), lock.partition, [s for s, _ in mine], ["sequence_number"], entity.subscription
                )
                left = set(live.column("sequence_number").to_pylist())
                for s, _ in mine:
                    ok[where[s]] = s not in left
        return ok

    def _thread_namespace(self) -> Namespace:
        """The calling thread's own namespace handle."""
        ns = getattr(self._local, "ns", None)
        if ns is None:
            ns = self._local.ns = self.config.address.namespace()
            self._thread_namespaces.append(ns)
        return ns

    def _thread_entity(self) -> Entity:
        """The entity on the calling thread's own namespace handle."""
        return self.config.address.entity(self._thread_namespace())

    def _settle_on(self, ns: Namespace, items: list[Item], op: str) -> SettleResult:
        """Settle through the broker's one settle path (a stream's threads hold no transaction)."""
        address = self.config.address
        result = ns.broker.settle(address.entity_type, address.name, items, op, sub_queue=self.config.sub_queue)
        assert result is not None
        return result

    def _lock_partition(
        self, job: ReceiveJob, round_no: int, stop_at: float, plan: tuple[int, int]
    ) -> tuple[int, list[Item], bool]:
        """Lock up to `share` messages of partition p into the batch's directory, in commits until `stop_at` (monotonic).

        Returns how many were locked, their (sequence, token) pairs, and whether none was because p is unavailable.
        """
        p, share = plan
        entity = self._thread_entity()
        got = 0
        chunk = 0
        pairs: list[Item] = []
        while got < share and (got == 0 or time.monotonic() < stop_at):
            ask = min(RECEIVE_CHUNK, share - got)
            written: list[str] = []
            rows = entity.receive_partition(entity.table.snapshot(), p, job.sub_queue, ask, False, written)
            if rows.num_rows:
                stage_chunk(job, entity, p, f"r{round_no:03d}-c{chunk:03d}", rows, written)
                chunk += 1
                got += rows.num_rows
                pairs += zip(rows.column("sequence_number").to_pylist(), rows.column("lock_token").to_pylist(), strict=True)
            if rows.num_rows < ask:
                break
        return got, pairs, not got and not entity.available(p)

    def _settle(self, items: list[Item], op: str) -> list[bool]:
        """Settle items partition by partition in parallel threads; per item: did its lock hold."""
        ok = [False] * len(items)
        idx = partition_groups(items)
        results = self.pool.map(lambda ii: self._settle_on(self._thread_namespace(), [items[i] for i in ii], op).ok, idx)
        for ii, res in zip(idx, results, strict=True):
            for i, v in zip(ii, res, strict=True):
                ok[i] = v
        return ok

    def _drop_committed(self, pairs: list[Item], session: SessionLock | None = None) -> list[Item]:
        """Complete at once the messages whose output an earlier batch committed (their first completion lost the lock).

        A session's messages are completed under its lock (`session`).
        """
        if not self.skip:
            return pairs
        table = self._table_id()
        again = [(s, t) for s, t in pairs if f"{s}@{table}" in self.skip]
        if not again:
            return pairs
        if session is not None:
            result = Sessions(self.entity()).settle(session, again, lifecycle.COMPLETE)
        else:
            result = self._settle_on(self.ns, again, lifecycle.COMPLETE)
        for (s, _), ok in zip(again, result.ok, strict=True):
            if ok:
                self.skip.pop(f"{s}@{table}", None)
        self._save_skip()
        log.info("stream %s: completed %d redelivered messages whose output was already committed", self.stream_id, len(again))
        keep = {s for s, _ in again}
        return [(s, t) for s, t in pairs if s not in keep]

    # ---- replay --------------------------------------------------------------------------------

    def partitions(self, first: int, last: int) -> list[BatchPartition]:
        """Input partitions of the recorded batches first..last (a replay after a restart reads the same records)."""
        out: list[BatchPartition] = []
        for n in range(first, last + 1):
            m = self.manifest(n)
            if m is None:
                raise InvalidOperationError(
                    f"batch {n} of stream {self.stream_id} has no record under {self.uri}: the checkpoint belongs to "
                    "another namespace, or the stream's directory was removed; start the query with a new checkpoint"
                )
            items = [(int(s), str(t)) for s, t in m["items"]]
            with self.lock:
                replayed = n not in self.inflight  # no renewed_at entry either: its locks are renewed at once
                self.inflight.setdefault(n, items)
                if m.get("sessions"):
                    self.held.setdefault(n, [_held_of_record(r) for r in m["sessions"]])
                    self._sessions_now = self._sessions_now or replayed
            tokens: dict[int, list[str]] = defaultdict(list)
            for s, t in items:
                tokens[partition_of(s)].append(t)
            files: dict[int, list[str]] = defaultdict(list)
            staging = self.batch_staging(n)
            for name in staging.names("part-p"):
                files[int(name.split("-")[1].removeprefix("p"))].append(f"{staging.uri}/{name}")
            out += group_partitions(n, [(files[p], tokens[p]) for p in sorted(tokens)])
        if out:
            self._ensure_renewer()
            self._wake.set()  # batches replayed after a restart hold locks of unknown age: renewed at once
        return out

    # ---- completion ------------------------------------------------------------------------------

    def complete_through(self, n: int) -> None:
        """Complete the messages of every recorded batch up to n (the sink committed them) and drop their records."""
        for b in self.batches():
            if b > n:
                break
            with self.renewal, self.lock:
                renewed = self.inflight.pop(b, None)  # the renewer leaves locks being completed alone
                self.renewed_at.pop(b, None)  # if the completion fails, the restored batch is renewed at once
            held = self._held_of(b)
            items = self._items(b)
            try:
                if held:
                    with self.session_ops:
                        done = self._settle_sessions(held, items, lifecycle.COMPLETE)
                else:
                    done = self._settle(items, lifecycle.COMPLETE)
            except SparkQueueError as exc:  # e.g. a partition unavailable: keep the record, retry at the next call
                if renewed is not None:  # and keep the locks renewed until then: another receiver must not take them
                    with self.lock:
                        self.inflight.setdefault(b, renewed)  # with no renewed_at entry: renewed at once
                    self._wake.set()
                log.warning("stream %s: completing batch %d failed (%s); will retry", self.stream_id, b, exc)
                return
            lost = [s for (s, _), ok in zip(items, done, strict=True) if not ok]
            released = set() if held or not lost else self._released(lost)
            if released:
                log.info("stream %s: batch %d: %d abandoned by its sink come again", self.stream_id, b, len(released))
            lapsed = [s for s in lost if s not in released]
            if lapsed:
                now = utcnow().isoformat()
                table = self._table_id()
                self.skip.update({f"{s}@{table}": now for s in lapsed})
                self._save_skip()
                log.warning(
                    "stream %s: %d messages of batch %d lost their locks before completion; "
                    "if this stream receives them again it completes them without emitting them",
                    self.stream_id,
                    len(lapsed),
                    b,
                )
            with self.lock:
                self.held.pop(b, None)
            self._remove_batch(b)
            log.info("stream %s: completed batch %d (%d messages)", self.stream_id, b, len(items) - len(lost))

    def _released(self, seqs: list[int]) -> set[int]:
        """The messages among `seqs` waiting unlocked in the streamed sub-queue: an abandon released them.

        A lock that lapsed leaves its token on the row (or another receiver's); an abandon (a
        foreachBatch rejecting a message) clears it. Those messages must come again, not be
        completed unseen as the output of a batch whose lock merely lapsed would be.
        """
        entity = self.entity()
        dt = entity.table.snapshot()
        by_partition: dict[int, list[int]] = defaultdict(list)
        for s in seqs:
            by_partition[partition_of(s)].append(s)
        out: set[int] = set()
        for p, ss in by_partition.items():
            rows = entity.table.rows_by_sequence(dt, p, ss, RELEASE_COLUMNS, entity.subscription)
            for r in rows.to_pylist():
                if r["lock_token"] is None and r["sub_queue"] == self.config.sub_queue and r["state"] == STATE_ACTIVE:
                    out.add(int(r["sequence_number"]))
        return out

    def discard_after(self, n: int) -> None:
        """Drop batch records beyond n, which Spark never logged; their locks are released so the messages return now.

        No query ever saw those messages, so the release takes their delivery back: a query that keeps
        crashing in that window does not push them toward max_delivery_count and the dead letters.
        """
        for b in self.batches():
            if b <= n:
                continue
            with self.renewal, self.lock:
                self.inflight.pop(b, None)
                self.renewed_at.pop(b, None)
            held = self._held_of(b)
            with self.lock:
                self.held.pop(b, None)
            items = self._items(b)
            if held:
                with self.session_ops:
                    self._release(held)  # the sessions and their messages come back at once
            elif items:
                try:  # released uncounted: no query saw this batch (as a failed receive_dataframe gives its messages back)
                    self.entity().settle(self.config.sub_queue, items, lifecycle.RELEASE)
                except SparkQueueError as exc:
                    log.info("stream %s: releasing unlogged batch %d failed (%s); its locks lapse", self.stream_id, b, exc)
            self._remove_batch(b)
            log.info(
                "stream %s: discarded batch %d, which Spark never logged (%d messages released)", self.stream_id, b, len(items)
            )

    # ---- skip list -------------------------------------------------------------------------------

    def _load_skip(self) -> dict[str, str]:
        skip = dict(self._read_json(f"{self.path}/{SKIP_FILE}") or {})
        cutoff = utcnow() - SKIP_RETENTION
        table = self._table_id() if skip else ""
        return {  # a bare number: written before keys named their table, for the entity's table then
            (s if "@" in s else f"{s}@{table}"): at for s, at in skip.items() if datetime.fromisoformat(at) >= cutoff
        }

    def _table_id(self) -> str:
        """The entity's table (and subscription), which skip-list keys name with the sequence number (<seq>@<table>).

        An entity deleted and made again under the same name has another table, which numbers its
        messages from the start again: the old table's entries must not match them.
        """
        entity = self.entity()
        return entity.table.uri.rsplit("/", 1)[-1] + (f"#{entity.subscription}" if entity.subscription else "")

    def _save_skip(self) -> None:
        self._write_json(f"{self.path}/{SKIP_FILE}", self.skip)

    # ---- lock renewal ----------------------------------------------------------------------------

    def _ensure_renewer(self) -> None:
        if self._renewer is None or not self._renewer.is_alive():
            self._stopping.clear()
            self._renewer = threading.Thread(target=self._renew_loop, name=f"sparkqueue-renew-{self.stream_id[:8]}", daemon=True)
            self._renewer.start()

    def _renew_loop(self) -> None:
        """Renew each in-flight batch's locks a third of the lock duration after they were taken or last renewed, and the
        session locks of session batches every third (own namespace handle: own thread).

        A round that raises is logged and tried again: the thread must outlive any one failure,
        or the batches in flight would lose their locks.
        """
        ns = self.config.address.namespace()
        sessions_due = math.inf  # set in the first round
        try:
            while not self._stopping.is_set():
                try:
                    third = max(0.5, self.config.address.entity(ns).policy.lock_duration.total_seconds() / 3)
                    now = time.monotonic()
                    sessions_due = min(sessions_due, now + third)
                    if now >= sessions_due or self._sessions_now:
                        self._sessions_now = False
                        self._renew_sessions(ns)
                        sessions_due = now + third
                    due = min(self._renew_due(third), sessions_due)
                except Exception:
                    log.exception("stream %s: lock renewal failed; retrying", self.stream_id)
                    due = time.monotonic() + RENEW_RETRY_S
                self._wake.wait(max(0.0, due - time.monotonic()))
                self._wake.clear()
        finally:
            ns.close()

    def _renew_due(self, third: float) -> float:
        """Renew the message locks of batches taken or renewed a third of the lock duration ago (batches with no such
        time, replayed after a restart or restored after a failed completion, at once); returns when (monotonic) the
        next renewal is due.

        Oldest batch first, and within a batch in the order its locks were taken (each partition's
        first messages first), RENEW_CHUNK messages at a time with partitions in parallel. A
        partition whose renewal fails does not stop the others, nor later batches: its batch is
        tried again after RENEW_RETRY_S.
        """
        with self.lock:
            batches = sorted(b for b in self.inflight if b not in self.held)
        for b in batches:
            with self.renewal:
                with self.lock:
                    items = self.inflight.get(b)
                    last = self.renewed_at.get(b, -math.inf)
                if items is None or time.monotonic() < last + third:
                    continue
                start = time.monotonic()
                lost, failed = self._renew_batch(items)
                with self.lock:
                    if b in self.inflight:  # a failed batch is due again after RENEW_RETRY_S
                        self.renewed_at[b] = time.monotonic() - third + RENEW_RETRY_S if failed else start
            if lost:
                log.info("stream %s: %d in-flight messages of batch %d no longer hold their lock", self.stream_id, lost, b)
        with self.lock:
            pending = [self.renewed_at.get(b, -math.inf) for b in self.inflight if b not in self.held]
        return min(pending, default=math.inf) + third

    def _renew_batch(self, items: list[Item]) -> tuple[int, bool]:
        """Renew a batch's message locks in the order they were taken, RENEW_CHUNK at a time.

        Returns how many locks were lost, and whether a partition's renewal failed (its items are
        then neither renewed nor counted lost; the other partitions are renewed).
        """
        lost = 0
        failed = False
        ordered = in_lock_order(items)
        for i in range(0, len(ordered), RENEW_CHUNK):
            if self._stopping.is_set():
                break
            chunk = ordered[i : i + RENEW_CHUNK]
            groups = [[chunk[j] for j in ii] for ii in partition_groups(chunk)]
            for result in self.renew_pool.map(self._renew_partition, groups):
                if result is None:
                    failed = True
                else:
                    lost += result
        return lost, failed

    def _renew_partition(self, items: list[Item]) -> int | None:
        """Renew one partition's items on the calling thread's handle: how many locks were lost, None when it failed."""
        try:
            return self._settle_on(self._thread_namespace(), items, lifecycle.RENEW).ok.count(False)
        except SparkQueueError as exc:
            log.warning("stream %s: renewing %d locks failed (%s); retrying", self.stream_id, len(items), exc)
            return None

    def _renew_sessions(self, ns: Namespace) -> None:
        """Renew the session locks of in-flight batches (they cover their messages' locks), one commit each.

        Serialized with completions and releases (session_ops), and a lock is renewed only while its
        batch is in flight: a released lock is never taken again (Sessions.release).
        """
        with self.session_ops:
            with self.lock:
                held = [lock for b in sorted(self.held) if b in self.inflight for lock, _ in self.held[b]]
            if not held:
                return
            sessions = Sessions(self.config.address.entity(ns))
            for lock in held:
                if self._stopping.is_set():
                    return
                try:
                    sessions.renew(lock)
                except SessionLockLostError:
                    log.info("stream %s: session %r no longer holds its lock", self.stream_id, lock.session_id)
                except SparkQueueError as exc:
                    log.warning("stream %s: renewing session %r failed (%s); retrying", self.stream_id, lock.session_id, exc)

    def stop(self) -> None:
        """Stop renewing; close the namespace handle."""
        self._stopping.set()
        self._wake.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        self.renew_pool.shutdown(wait=False, cancel_futures=True)  # a renewal commit under way is not waited for
        self.pool.shutdown(wait=True)
        for ns in self._thread_namespaces:
            ns.close()
        self.ns.close()


def partition_groups(items: list[Item]) -> list[list[int]]:
    """The indexes of `items` grouped by queue partition (settles and renewals commit a partition at a time)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, (s, _) in enumerate(items):
        groups[partition_of(s)].append(i)
    return list(groups.values())


def in_lock_order(items: list[Item]) -> list[Item]:
    """A batch's items in the order their locks were taken: partitions lock in parallel, each its messages in order."""
    rank: dict[int, int] = defaultdict(int)
    keyed = []
    for item in items:
        p = partition_of(item[0])
        keyed.append((rank[p], item))
        rank[p] += 1
    return [item for _, item in sorted(keyed, key=lambda k: k[0])]


def _held_record(held: Held) -> list[Any]:
    """A session lock and its batch's sequence numbers, as a manifest (or journal) records them."""
    lock, seqs = held
    return [lock.session_id, lock.partition, lock.token, lock.locked_until.isoformat(), seqs]


def _held_of_record(record: Sequence[Any]) -> Held:
    """The session lock (and sequence numbers) a manifest or journal recorded."""
    session_id, partition, token, until, seqs = record
    return SessionLock(str(session_id), int(partition), str(token), datetime.fromisoformat(str(until))), [int(x) for x in seqs]
