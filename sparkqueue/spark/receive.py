"""Receive messages as a DataFrame (docs/semantics.md §12): Spark tasks lock them in parallel, one task per queue partition.

(One task per partition up to the session's parallelism; beyond it a task takes several
partitions in turn, see session.task_count.) Each task locks (or, in RECEIVE_AND_DELETE mode,
removes) up to its share of messages in its partition, in commits of `RECEIVE_CHUNK`, and stages
them: a lock commit writes the messages it locks to one data file of their own, which is
hard-linked into a staging directory (no copy; copied on object stores), while removed messages
are written there. The returned DataFrame reads the staging directory and maps the rows to the
received-message layout, so counting or collecting it again reads the same locked messages and
never receives again (see staging.py for cleanup).

Shares: the call splits `max_message_count` over the partitions whose file statistics show
receivable messages, none getting more than its files could hold; partitions that filled their
share may hold more, so further rounds split what is still missing among them and the partitions
not asked yet. A receive therefore gathers from several partitions and never locks more than
asked for.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as sf

from sparkqueue.broker import refuse_in_transaction
from sparkqueue.errors import PartitionUnavailableError, SparkQueueError
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.entity import Entity, utcnow
from sparkqueue.spark.schema import ENTITY_FILE_SPARK, received_from_entity_rows
from sparkqueue.spark.session import active_session, spark_errors, task_count
from sparkqueue.spark.staging import LOCKED_ATTRIBUTE, STAGING_ATTRIBUTE, Staging, cleanup_staging
from sparkqueue.spark.worker import DATAFRAME_REFUSAL, EntityRef, marking_errors
from sparkqueue.storage.files import FILE_SCHEMA
from sparkqueue.storage.schema import KIND_MESSAGE, SUB_QUEUE_MAIN, member_of

if TYPE_CHECKING:
    from sparkqueue.broker import Broker

log = logging.getLogger(__name__)

RECEIVE_CHUNK = 16_384  # messages per lock commit inside a task (two send files)
CLOCK_SKEW = timedelta(seconds=30)  # how far apart the driver's and executors' clocks may be
MAX_ROUNDS = 64  # a safety bound: rounds end on their own (see gather)
POLL_MIN_S, POLL_MAX_S = 0.05, 1.0
ROUND_DDL = "partition_id int, requested long, received long, unavailable boolean"


@dataclass(frozen=True)
class ReceiveJob:
    """What the lock tasks of one receive need (picklable)."""

    ref: EntityRef
    sub_queue: str
    delete: bool
    staging: Staging
    started: datetime  # when the call began: no lock it takes can lapse before started + lock duration
    chunk: int = RECEIVE_CHUNK


def receive_dataframe(
    broker: Broker,
    entity_type: str,
    name: str,
    max_message_count: int,
    spark: SparkSession | None = None,
    *,
    sub_queue: str = SUB_QUEUE_MAIN,
    delete: bool = False,
    wait_s: float = 0.0,
    chunk: int = RECEIVE_CHUNK,
) -> DataFrame:
    """Lock (`delete`: remove) up to max_message_count messages in Spark tasks; a DataFrame of ReceivedMessage columns.

    Waits up to `wait_s` for the first messages. The caller (Receiver.receive_dataframe) has
    checked that the receiver is open and holds no session.
    """
    want = limits.check_int(max_message_count, "max_message_count")
    refuse_in_transaction(broker, DATAFRAME_REFUSAL)
    session = active_session(spark)
    entity = broker.entity(entity_type, name)
    cleanup_staging(broker.root)
    job = ReceiveJob(
        EntityRef.of(broker, entity_type, name),
        sub_queue,
        delete,
        Staging.create(broker.root, "receive"),
        utcnow(),
        limits.check_int(chunk, "chunk"),
    )
    give_up = time.monotonic() + wait_s
    poll = POLL_MIN_S
    rounds = 0
    try:  # a round or task failing after others committed: what they locked is given back too
        while True:
            got, rounds, down = gather(session, job, entity, want, rounds)
            if got:
                break
            if time.monotonic() >= give_up:
                hidden = entity.hidden_partitions(sub_queue, down)
                if hidden:  # damaged storage is reported, never read as empty (docs/semantics.md §10), as core receives do
                    raise entity.unavailable(hidden, "nothing was received")
                break
            time.sleep(min(poll, max(0.0, give_up - time.monotonic())))
            poll = min(POLL_MAX_S, poll * 2)
        log.info("received %d of %d messages from %s into %s", got, want, job.ref.name, job.staging.uri)
        return read_staged(session, job, utcnow())
    except BaseException:
        give_back(entity, job)
        raise


def give_back(entity: Entity, job: ReceiveJob) -> None:
    """After a receive whose DataFrame could not be made: release its locks without counting a delivery.

    RECEIVE_AND_DELETE messages are gone from the queue already; their staged files are kept and named in the log.
    """
    if job.delete:
        log.error("the messages received and deleted by this call are in %s (the DataFrame failed)", job.staging.uri)
        return
    held = [job.staging.read_file(name, ["sequence_number", "lock_token"]) for name in job.staging.names()]
    rows = pa.concat_tables(held) if held else None
    if rows is None or rows.num_rows == 0:
        return
    rows = rows.filter(pc.is_valid(rows.column("lock_token")))
    items = list(zip(rows.column("sequence_number").to_pylist(), rows.column("lock_token").to_pylist(), strict=True))
    try:
        entity.settle(job.sub_queue, items, lifecycle.RELEASE)
    except SparkQueueError as exc:  # the locks lapse at expiry instead
        log.warning("could not release the %d locks of a failed receive: %s", len(items), exc)


def read_staged(spark: SparkSession, job: ReceiveJob, now: datetime) -> DataFrame:
    """The received messages a staging directory holds (entity rows), in the ReceivedMessage layout.

    Peek-lock stages the lock commits' files, whose rows are the messages locked (with a token)
    and any the same commit dead-lettered or expired (without); RECEIVE_AND_DELETE stages the
    messages removed.
    """
    rows = job.staging.read(spark, ENTITY_FILE_SPARK)
    if not job.delete:
        rows = rows.where(sf.col("lock_token").isNotNull())
    df = rows.selectExpr(*received_from_entity_rows(now))
    setattr(df, STAGING_ATTRIBUTE, job.staging.uri)
    setattr(df, LOCKED_ATTRIBUTE, not job.delete)
    return df


def gather(spark: SparkSession, job: ReceiveJob, entity: Entity, want: int, rounds: int) -> tuple[int, int, set[int]]:
    """Receive up to `want` messages in rounds of parallel lock tasks; returns (received, rounds run so far, and the
    partitions a task found unavailable: damage found on an executor marks the partition there, not in the driver).

    Each round splits what is missing over the candidate partitions, no partition getting more
    than its files could hold. A partition that returned less than its share is exhausted for this
    call; one that filled it (or got no share yet) stays a candidate. Every round takes messages or
    drops candidates, so the rounds end.
    """
    estimate = candidate_partitions(entity, job.sub_queue)
    candidates = list(estimate)
    if candidates:
        shift = random.randrange(len(candidates))
        candidates = candidates[shift:] + candidates[:shift]
    total = 0
    down: set[int] = set()
    stop_at = time.monotonic() + entity.locking_time_s(job.delete)
    for _ in range(MAX_ROUNDS):
        plan = shares(want - total, candidates, estimate)
        if not plan:
            break
        with spark_errors():
            results = (
                spark.range(0, len(plan), 1, numPartitions=task_count(spark, len(plan)))
                .mapInArrow(partial(lock_task, job, tuple(plan), rounds), ROUND_DDL)
                .collect()
            )
        rounds += 1
        total += sum(r.received for r in results)
        down |= {r.partition_id for r in results if r.unavailable}
        for r in results:
            estimate[r.partition_id] = max(0, estimate[r.partition_id] - r.received)
        planned = {p for p, _ in plan}
        full = [r.partition_id for r in results if r.received >= r.requested and estimate[r.partition_id] > 0]
        candidates = full + [p for p in candidates if p not in planned]  # untried partitions go last
        if total >= want or (total and time.monotonic() >= stop_at):
            break
    return total, rounds, down


def candidate_partitions(entity: Entity, sub_queue: str) -> dict[int, int]:
    """Available partitions that may hold a message of the sub-queue receivable now, with an upper bound of how many.

    Read from the file statistics only: files whose earliest availability is ahead (locked,
    scheduled) or that hold no row of the sub-queue and entity do not count.
    """
    dt = entity.table.snapshot()
    now = utcnow()
    out: dict[int, int] = {}
    for p in range(entity.partition_count):
        if not entity.available(p):
            continue
        try:
            files = entity.table.files(dt, p)
        except PartitionUnavailableError:
            continue
        due = [f for f in files if f.min_available_at is not None and f.min_available_at <= now]
        bound = sum(f.num_records or 0 for f in due if f.may_hold(KIND_MESSAGE, sub_queue, entity.subscription))
        if bound:
            out[p] = bound
    return out


def shares(count: int, partitions: list[int], bound: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """Split `count` messages over partitions as evenly as their bounds allow: (partition, share) with share > 0."""
    room = {p: (bound or {}).get(p, count) for p in partitions}
    given = dict.fromkeys(partitions, 0)
    left = count
    while left > 0:
        open_ = [p for p in partitions if given[p] < room[p]]
        if not open_:
            break
        base, extra = divmod(left, len(open_))
        for i, p in enumerate(open_):
            add = min(base + (1 if i < extra else 0), room[p] - given[p])
            given[p] += add
            left -= add
    return [(p, given[p]) for p in partitions if given[p] > 0]


@marking_errors
def lock_task(
    job: ReceiveJob, plan: tuple[tuple[int, int], ...], round_no: int, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """Lock this task's share of its partition, stage the messages, and report how many."""
    entity = job.ref.entity()
    for batch in batches:
        for i in batch.column("id").to_pylist():
            p, share = plan[i]
            got = lock_partition(job, entity, p, share, round_no)
            yield pa.RecordBatch.from_pydict(
                {
                    "partition_id": pa.array([p], pa.int32()),
                    "requested": pa.array([share], pa.int64()),
                    "received": pa.array([got], pa.int64()),
                    "unavailable": pa.array([not got and not entity.available(p)], pa.bool_()),
                }
            )


def lock_partition(job: ReceiveJob, entity: Entity, p: int, share: int, round_no: int) -> int:
    """Lock up to `share` messages of partition p in commits of job.chunk, staging each commit's messages in a file.

    After the first commit, no new one starts once the locking time (`Entity.locking_time_s`) has passed.
    """
    got = 0
    chunk_no = 0
    stop_at = time.monotonic() + entity.locking_time_s(job.delete)
    # A retried task: drop what a failed attempt staged (its locks lapse). Removed messages have no
    # other copy, so in RECEIVE_AND_DELETE mode they stay (their files are named per attempt).
    if not job.delete and job.staging.remove(f"part-p{p:05d}-r{round_no:03d}-"):
        log.info("partition %d: discarded what a failed attempt of this lock task had staged", p)
    while got < share and (got == 0 or time.monotonic() < stop_at):
        ask = min(job.chunk, share - got)
        written: list[str] = []
        rows = entity.receive_partition(entity.table.snapshot(), p, job.sub_queue, ask, job.delete, written)
        if rows.num_rows:
            stage_chunk(job, entity, p, f"r{round_no:03d}-c{chunk_no:03d}", rows, written)
            chunk_no += 1
            got += rows.num_rows
        if rows.num_rows < ask:
            break
    return got


def stage_chunk(job: ReceiveJob, entity: Entity, p: int, tag: str, rows: pa.Table, written: list[str]) -> None:
    """Stage the messages one lock (or delete) commit of partition p delivered, in files named part-p<p>-<tag>...

    A lock commit wrote the rows it changed to a file of their own (`written`): it is linked into
    the staging directory, not copied (the DataFrame keeps its rows that hold a lock token; rows
    the same commit dead-lettered or expired hold none). Messages removed by RECEIVE_AND_DELETE
    have no such file and are written out.

    A message is delivered twice in one call only when its first lock lapsed during the call,
    which needs the call to have run for a lock duration (give or take clock skew between
    machines); only then are earlier staged files of the partition checked for it.
    """
    prefix = f"part-p{p:05d}-{tag}"
    if utcnow() - job.started + CLOCK_SKEW >= entity.policy.lock_duration:
        drop_superseded(job.staging, f"part-p{p:05d}-", rows.column("sequence_number"))
    if job.delete:
        job.staging.write(f"{prefix}-{uuid.uuid4().hex[:12]}.parquet", rows.select(FILE_SCHEMA.names))
        return
    data = entity.table.data
    for i, path in enumerate(written):
        job.staging.link(f"{prefix}-f{i:03d}.parquet", data, path)


def drop_superseded(staging: Staging, prefix: str, seqs: pa.ChunkedArray) -> None:
    """Remove from earlier staged files of this partition the messages delivered again (their locks lapsed meanwhile).

    A staged file is replaced, never changed in place: a linked table file stays as it is.
    """
    again_total = 0
    for name in staging.names(prefix):
        old = staging.read_file(name)
        again = member_of(old.column("sequence_number"), seqs)
        if pc.any(again).as_py():
            again_total += pc.sum(again).as_py()
            staging.write(name, old.filter(pc.invert(again)))
    if again_total:
        log.info("%d staged messages lost their locks during the call and were delivered again", again_total)
