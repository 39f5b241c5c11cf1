"""Settle messages by a DataFrame of lock tokens (docs/semantics.md §12): complete, abandon, defer or dead-letter, per partition.

A lock token begins with its message's sequence number (model.ids), whose top 16 bits are the
partition: Spark routes each token to its partition's task without reading the table. A task
settles its tokens in sequence order, in commits of `SETTLE_CHUNK`, and records per token
whether the lock held ("ok") or not ("lock_lost": expired, superseded, already settled, or not a
token of this entity and sub-queue) in a staging file; the returned DataFrame reads those records, so
evaluating it again never settles again.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql import types as st

from sparkqueue.broker import refuse_in_transaction
from sparkqueue.errors import InvalidOperationError
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.ids import TokenItems, sequences_of_tokens
from sparkqueue.spark.schema import SETTLE_RESULT_SCHEMA, SETTLE_RESULT_SPARK, STATUS_LOCK_LOST, STATUS_OK
from sparkqueue.spark.session import active_session, bucket_key, check_dataframe, failing, spark_errors, task_count
from sparkqueue.spark.staging import Staging, cleanup_staging
from sparkqueue.spark.worker import DATAFRAME_REFUSAL, EntityRef, marking_errors
from sparkqueue.storage.table import SEQUENCE_BITS

if TYPE_CHECKING:
    from sparkqueue.broker import Broker

log = logging.getLogger(__name__)

SETTLE_CHUNK = 20_000  # tokens per settle commit inside a task
OPS = (lifecycle.COMPLETE, lifecycle.ABANDON, lifecycle.DEFER, lifecycle.DEAD_LETTER)
REASON_COLUMN = "dead_letter_reason"
DESCRIPTION_COLUMN = "dead_letter_error_description"
COUNT_DDL = "partition_id int, ok long, lock_lost long"


@dataclass(frozen=True)
class SettleJob:
    """What the settle tasks of one call need (picklable)."""

    ref: EntityRef
    op: str
    partition_count: int
    staging: Staging
    sub_queue: str  # the receiver's: a token of the other sub-queue's message is `lock_lost`
    chunk: int = SETTLE_CHUNK


def settle_dataframe(
    broker: Broker,
    entity_type: str,
    name: str,
    df: DataFrame,
    op: str,
    reason: str | None = None,
    error_description: str | None = None,
    spark: SparkSession | None = None,
    *,
    sub_queue: str,
) -> DataFrame:
    """Settle the messages whose lock tokens `df` holds; returns a DataFrame of (lock_token, status).

    The caller (Receiver's *_dataframe methods) has checked that the receiver is open, holds no
    session and received in peek-lock mode.
    """
    if op not in OPS:
        raise InvalidOperationError(f"op must be one of {OPS}, got {op!r}")
    check_dataframe(df, f"{op}_dataframe")
    refuse_in_transaction(broker, DATAFRAME_REFUSAL)
    for value, field in ((reason, "reason"), (error_description, "error_description")):
        limits.check_text(value, field, limits.MAX_DEAD_LETTER_TEXT)  # as dead_letter_message checks them
    token_type = next((f.dataType for f in df.schema.fields if f.name == "lock_token"), None)
    if not isinstance(token_type, st.StringType):
        raise InvalidOperationError("the DataFrame needs a string `lock_token` column (as receive_dataframe returns)")
    session = active_session(spark or df.sparkSession)
    entity = broker.entity(entity_type, name)
    cleanup_staging(broker.root)
    ref = EntityRef.of(broker, entity_type, name)
    job = SettleJob(ref, op, entity.partition_count, Staging.create(broker.root, "settle"), sub_queue)
    tasks = task_count(session, job.partition_count)
    received = Staging.of_receive(df)
    with spark_errors():
        if received is not None and op != lifecycle.DEAD_LETTER:
            # The DataFrame a receive returned, as it was: tasks read its tokens from the staged files, a
            # partition's files per task, with no scan and shuffle of the tokens (docs/spark-streaming.md).
            groups = staged_groups(received, job.partition_count, tasks)
            counts = (
                session.range(0, len(groups), 1, numPartitions=max(1, len(groups)))
                .mapInArrow(partial(settle_staged_task, job, received, groups), COUNT_DDL)
                .collect()
                if groups
                else []
            )
        else:
            routed = route_tokens(token_columns(df, op, reason, error_description), job.partition_count, tasks)
            counts = routed.mapInArrow(partial(settle_task, job), COUNT_DDL).collect()
    ok, lost = sum(r.ok for r in counts), sum(r.lock_lost for r in counts)
    log.info("%s on %s: %d ok, %d lock lost", op, entity.name, ok, lost)
    return job.staging.read(session, SETTLE_RESULT_SPARK)


def token_columns(df: DataFrame, op: str, reason: str | None, description: str | None) -> DataFrame:
    """The lock tokens, with each row's dead-letter reason and description (a column's value, else the argument).

    A column's value longer than dead_letter_message allows (MAX_DEAD_LETTER_TEXT) fails the row
    here, in the stage before route_tokens' shuffle: the job fails before any settle task starts,
    so nothing is settled (the arguments were checked on the driver).
    """
    if op != lifecycle.DEAD_LETTER:
        return df.select("lock_token")

    def text(column: str, default: str | None) -> Column:
        given = sf.lit(default).cast("string")
        return sf.coalesce(checked_text(column), given) if column in df.columns else given

    return df.select(
        "lock_token", text(REASON_COLUMN, reason).alias("reason"), text(DESCRIPTION_COLUMN, description).alias("description")
    )


def checked_text(column: str) -> Column:
    """A dead-letter text column as a string, failing its row when longer than the 4,096 characters the core allows."""
    value = sf.col(column).cast("string")
    length = sf.char_length(value)  # code points, as Python's len() counts them for dead_letter_message
    too_long = failing(
        InvalidOperationError,
        f"{column} is ",
        length.cast("string"),
        f" characters long; at most {limits.MAX_DEAD_LETTER_TEXT} are allowed (lock token ",
        sf.coalesce(sf.col("lock_token"), sf.lit("null")),
        "); nothing was settled",
    )
    return sf.when(length > limits.MAX_DEAD_LETTER_TEXT, too_long).otherwise(value)


def route_tokens(tokens: DataFrame, partitions: int, tasks: int) -> DataFrame:
    """Tokens grouped by queue partition (the top 16 bits of the token's first field), whole partitions per task."""
    qp = sf.conv(sf.substring("lock_token", 1, 4), 16, 10).cast("int")
    qp = sf.when(qp.isNull() | (qp < 0) | (qp >= partitions), sf.lit(0)).otherwise(qp)
    return tokens.withColumn("_sk", bucket_key(qp, tasks)).repartition(tasks, "_sk").drop("_sk")


@marking_errors
def settle_task(job: SettleJob, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Settle this task's tokens, stage a status per token, and yield the counts per partition."""
    received = [b for b in batches if b.num_rows]
    if not received:
        return
    table = pa.Table.from_batches(received)
    tokens = table.column("lock_token").combine_chunks()

    def texts(name: str) -> pa.Array:
        return table.column(name).combine_chunks() if name in table.column_names else pa.nulls(len(tokens), pa.string())

    yield settle_and_stage(job, tokens, texts("reason"), texts("description"))


def staged_groups(received: Staging, partitions: int, tasks: int) -> tuple[tuple[str, ...], ...]:
    """A receive's staged files grouped for `tasks` settle tasks: queue partition q's files go to task q % tasks.

    Staged files are named per partition (`part-p<partition>-...`, receive.stage_chunk), so no file is opened.
    """
    by_task: dict[int, list[str]] = {}
    for name in received.names("part-p"):
        p = int(name[len("part-p") :].split("-", 1)[0])
        by_task.setdefault(p % tasks if 0 <= p < partitions else 0, []).append(name)
    return tuple(tuple(names) for _, names in sorted(by_task.items()))


@marking_errors
def settle_staged_task(
    job: SettleJob, received: Staging, groups: tuple[tuple[str, ...], ...], batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """Settle the tokens of some staged files of a receive (the rows that hold a lock), as settle_task does."""
    for batch in batches:
        for i in batch.column("id").to_pylist():
            chunks = [c for name in groups[i] for c in received.read_file(name, ["lock_token"]).column(0).chunks]
            tokens = pa.chunked_array(chunks, pa.string()).combine_chunks().drop_null()
            if len(tokens):
                nulls = pa.nulls(len(tokens), pa.string())
                yield settle_and_stage(job, tokens, nulls, nulls)


def settle_and_stage(job: SettleJob, tokens: pa.Array, reasons: pa.Array, descriptions: pa.Array) -> pa.RecordBatch:
    """Settle tokens, stage a status per token, and return the counts (settle_tokens does the settling)."""
    n = len(tokens)
    status, parts = settle_tokens(job, tokens, reasons, descriptions)
    job.staging.write(f"part-{uuid.uuid4().hex}.parquet", pa.table([tokens, status], schema=SETTLE_RESULT_SCHEMA))
    ok = pc.sum(pc.equal(status, STATUS_OK)).as_py() or 0
    return pa.RecordBatch.from_pydict(
        {
            "partition_id": pa.array([parts[0] if parts else -1], pa.int32()),
            "ok": pa.array([ok], pa.int64()),
            "lock_lost": pa.array([n - ok], pa.int64()),
        }
    )


def settle_tokens(job: SettleJob, tokens: pa.Array, reasons: pa.Array, descriptions: pa.Array) -> tuple[pa.Array, list[int]]:
    """Status per token, and the partitions settled: distinct valid tokens go by partition in sequence order.

    Each chunk goes through the broker's one settle path (which forwards dead letters). A repeated
    token shares its first occurrence's status; a token that is no sparkqueue token of this
    entity's partitions is `lock_lost`.
    """
    broker, ref = job.ref.broker(), job.ref
    n = len(tokens)
    seqs = sequences_of_tokens(tokens)
    seq_np = seqs.fill_null(-1).to_numpy()
    part_np = np.where(seq_np >= 0, seq_np >> SEQUENCE_BITS, -1)
    first = first_occurrences(seq_np, tokens)
    settle_me = (first == np.arange(n)) & (part_np >= 0) & (part_np < job.partition_count)
    held = np.zeros(n, bool)
    parts = sorted(int(p) for p in np.unique(part_np[settle_me]))
    for p in parts:
        positions = np.flatnonzero(settle_me & (part_np == p))
        positions = positions[np.argsort(seq_np[positions], kind="stable")]
        for start in range(0, len(positions), job.chunk):
            chunk = pa.array(positions[start : start + job.chunk])
            items = TokenItems(seqs.take(chunk), tokens.take(chunk))
            per_row = job.op == lifecycle.DEAD_LETTER
            reason = reasons.take(chunk).to_pylist() if per_row else None
            description = descriptions.take(chunk).to_pylist() if per_row else None
            result = broker.settle(ref.entity_type, ref.name, items, job.op, reason, description, sub_queue=job.sub_queue)
            assert result is not None  # a task runs outside any transaction
            held[positions[start : start + job.chunk]] = result.ok
    status = np.where(held[first], STATUS_OK, STATUS_LOCK_LOST)
    return pa.array(status, pa.string()), parts


def first_occurrences(seqs: np.ndarray, tokens: pa.Array) -> np.ndarray:
    """For each token, the position of its first occurrence among `tokens`.

    A token begins with its message's sequence number, so distinct sequence numbers (every valid
    token once: the usual case) mean distinct tokens, which a sort of integers shows; only
    otherwise are the tokens hashed (a sort takes 5 ms of 250,000; the hash, 70-120).
    """
    ordered = np.sort(seqs)
    if not (ordered[1:] == ordered[:-1]).any():
        return np.arange(len(seqs))
    first: np.ndarray = pc.index_in(tokens, value_set=tokens).to_numpy(zero_copy_only=False)
    return first
