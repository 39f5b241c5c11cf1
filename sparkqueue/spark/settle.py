"""Settle messages by a DataFrame of lock tokens (docs/semantics.md §12): complete, abandon, defer or dead-letter, per partition.

A lock token begins with its message's sequence number (model.ids), whose top 16 bits are the
partition: Spark routes each token to its partition's task without reading the table. A task
settles its tokens in sequence order, in commits of `SETTLE_CHUNK`, and records per token
whether the lock held ("ok") or not ("lock_lost": expired, superseded, already settled, or not a
token of this entity) in a staging file; the returned DataFrame reads those records, so
evaluating it again never settles again.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql import types as st

from sparkqueue.constants import ReceiveMode
from sparkqueue.errors import InvalidOperationError
from sparkqueue.model import lifecycle
from sparkqueue.model.entity import Entity, utcnow
from sparkqueue.model.ids import sequences_of_tokens
from sparkqueue.spark.receive import check_dataframe_receiver
from sparkqueue.spark.schema import SETTLE_RESULT_SCHEMA, SETTLE_RESULT_SPARK, STATUS_LOCK_LOST, STATUS_OK
from sparkqueue.spark.session import active_session, bucket_key, spark_errors, task_count
from sparkqueue.spark.staging import Staging, cleanup_staging
from sparkqueue.spark.worker import EntityRef, marking_errors
from sparkqueue.storage.retry import retry_commit
from sparkqueue.storage.table import SEQUENCE_BITS

if TYPE_CHECKING:
    from sparkqueue.receiver import Receiver

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
    chunk: int = SETTLE_CHUNK


def settle_dataframe(
    receiver: Receiver,
    df: DataFrame,
    op: str,
    reason: str | None = None,
    error_description: str | None = None,
    spark: SparkSession | None = None,
) -> DataFrame:
    """Settle the messages whose lock tokens `df` holds; returns a DataFrame of (lock_token, status)."""
    if op not in OPS:
        raise InvalidOperationError(f"op must be one of {OPS}, got {op!r}")
    check_dataframe_receiver(receiver)
    if receiver.receive_mode == ReceiveMode.RECEIVE_AND_DELETE:
        raise InvalidOperationError("messages received in RECEIVE_AND_DELETE mode are already settled")
    for value, name in ((reason, "reason"), (error_description, "error_description")):
        if value is not None and not isinstance(value, str):
            raise InvalidOperationError(f"{name} must be a str, got {type(value).__name__}")
    token_type = next((f.dataType for f in df.schema.fields if f.name == "lock_token"), None)
    if not isinstance(token_type, st.StringType):
        raise InvalidOperationError("the DataFrame needs a string `lock_token` column (as receive_dataframe returns)")
    ns = receiver._ns
    session = active_session(spark or df.sparkSession)
    entity = receiver._entity()
    cleanup_staging(ns.root)
    job = SettleJob(
        EntityRef.of(ns.broker, receiver.entity_type, receiver.entity_name),
        op,
        entity.partition_count,
        Staging.create(ns.root, "settle"),
    )
    tasks = task_count(session, job.partition_count)
    routed = route_tokens(token_columns(df, op, reason, error_description), job.partition_count, tasks)
    with spark_errors():
        counts = routed.mapInArrow(partial(settle_task, job), COUNT_DDL).collect()
    ok, lost = sum(r.ok for r in counts), sum(r.lock_lost for r in counts)
    log.info("%s on %s: %d ok, %d lock lost", op, entity.name, ok, lost)
    return job.staging.read(session, SETTLE_RESULT_SPARK)


def token_columns(df: DataFrame, op: str, reason: str | None, description: str | None) -> DataFrame:
    """The lock tokens, with each row's dead-letter reason and description (a column's value, else the argument)."""
    if op != lifecycle.DEAD_LETTER:
        return df.select("lock_token")

    def text(column: str, default: str | None) -> Column:
        given = sf.lit(default).cast("string")
        return sf.coalesce(sf.col(column).cast("string"), given) if column in df.columns else given

    return df.select(
        "lock_token", text(REASON_COLUMN, reason).alias("reason"), text(DESCRIPTION_COLUMN, description).alias("description")
    )


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
    n = len(tokens)

    def texts(name: str) -> pa.Array:
        return table.column(name).combine_chunks() if name in table.column_names else pa.nulls(n, pa.string())

    entity = job.ref.entity()
    status, parts = settle_tokens(entity, job, tokens, texts("reason"), texts("description"))
    job.staging.write(f"part-{uuid.uuid4().hex}.parquet", pa.table([tokens, status], schema=SETTLE_RESULT_SCHEMA))
    if job.op == lifecycle.DEAD_LETTER and parts:
        job.ref.broker().pump(entity, parts)
    ok = pc.sum(pc.equal(status, STATUS_OK)).as_py() or 0
    yield pa.RecordBatch.from_pydict(
        {
            "partition_id": pa.array([parts[0] if parts else -1], pa.int32()),
            "ok": pa.array([ok], pa.int64()),
            "lock_lost": pa.array([n - ok], pa.int64()),
        }
    )


def settle_tokens(
    entity: Entity, job: SettleJob, tokens: pa.Array, reasons: pa.Array, descriptions: pa.Array
) -> tuple[pa.Array, list[int]]:
    """Status per token, and the partitions settled: distinct valid tokens go by partition in sequence order.

    A repeated token shares its first occurrence's status; a token that is no sparkqueue token of
    this entity's partitions is `lock_lost`.
    """
    n = len(tokens)
    seqs = sequences_of_tokens(tokens)
    seq_np = seqs.fill_null(-1).to_numpy()
    part_np = np.where(seq_np >= 0, seq_np >> SEQUENCE_BITS, -1)
    first = pc.index_in(tokens, value_set=tokens).to_numpy(zero_copy_only=False)
    settle_me = (first == np.arange(n)) & (part_np >= 0) & (part_np < job.partition_count)
    held = np.zeros(n, bool)
    parts = sorted(int(p) for p in np.unique(part_np[settle_me]))
    for p in parts:
        positions = np.flatnonzero(settle_me & (part_np == p))
        positions = positions[np.argsort(seq_np[positions], kind="stable")]
        for start in range(0, len(positions), job.chunk):
            chunk = pa.array(positions[start : start + job.chunk])
            items = list(zip(seqs.take(chunk).to_pylist(), tokens.take(chunk).to_pylist(), strict=True))
            ok = settle_chunk(entity, p, items, job.op, reasons.take(chunk).to_pylist(), descriptions.take(chunk).to_pylist())
            held[positions[start : start + job.chunk]] = ok
    status = np.where(held[first], STATUS_OK, STATUS_LOCK_LOST)
    return pa.array(status, pa.string()), parts


def settle_chunk(
    entity: Entity, p: int, items: list[tuple[int, str]], op: str, reasons: list[str | None], descriptions: list[str | None]
) -> list[bool]:
    """Settle items of one partition in one commit; per item, whether its lock held."""
    if op != lifecycle.DEAD_LETTER or (len(set(reasons)) <= 1 and len(set(descriptions)) <= 1):
        reason = reasons[0] if reasons else None
        description = descriptions[0] if descriptions else None
        return entity.settle(items, op, reason, description).ok
    return dead_letter_each(entity, p, items, reasons, descriptions)


def dead_letter_each(
    entity: Entity, p: int, items: Sequence[tuple[int, str]], reasons: list[str | None], descriptions: list[str | None]
) -> list[bool]:
    """Dead-letter items of one partition in one commit, each with its own reason and description."""
    verdict: list[bool] = []
    by_seq = {seq: (r, d) for (seq, _), r, d in zip(items, reasons, descriptions, strict=True)}

    def attempt() -> None:
        dt = entity.table.snapshot()
        now = utcnow()
        good, valid = entity.locked_rows(dt, p, items, now)
        if good.num_rows:
            changes = lifecycle.settle(good, lifecycle.DEAD_LETTER, now, entity.policy)
            held = changes.column("sequence_number").to_pylist()
            for pos, name in ((0, "dead_letter_reason"), (1, "dead_letter_error_description")):
                i = changes.schema.get_field_index(name)
                values = pa.array([by_seq[s][pos] for s in held], pa.string())
                changes = changes.set_column(i, changes.schema.field(i), values)
            entity.table.apply(dt, p, changes)
        verdict[:] = valid

    retry_commit(attempt, entity.deadline(), f"dead-letter on {entity.name}")
    return verdict
