"""Send a DataFrame of messages (docs/semantics.md §12): validated and placed in Spark, written by Spark tasks, committed once.

A DataFrame send is all-or-nothing. The driver reads every queue partition's sequence fence
(docs/storage.md) from one snapshot; Spark tasks, each owning whole queue partitions, number their
rows from those fences and write the data files without committing; the driver then commits every
task's files in ONE Delta commit that moves the fences and expects the versions it read. A send
that fails anywhere (a bad row, a quota, a failing task) commits nothing, and the files its tasks
wrote are deleted (vacuum removes what a killed task left). A concurrent sender that moved one of
the fences makes the commit conflict: the files of the partitions it moved are renumbered after
its messages (on a duplicate-detecting queue without the messages whose id it sent meanwhile)
and the commit is tried again (spark/commit.py), so a steady sender cannot starve a long send,
until it lands or the operation timeout passes (OperationTimeoutError). A duplicate-detecting
topic's send runs again instead (commit.Repeats).

Keyed rows (a session id, a partition key, or a message id on a duplicate-detecting entity), or
any send asked to keep the DataFrame's order, take two stages separated by a shuffle:

1. Map stage (JVM expressions plus two small Arrow UDFs that see only the key and the
   properties): fill missing message ids, apply the key precedence of docs/semantics.md §3 and place keyed
   rows by mmh3 exactly as `model.partitioning` does (unkeyed rows go round-robin over the
   available partitions in blocks of ROUND_ROBIN_BLOCK rows), convert application properties to
   the core's JSON, and validate every row (size, key lengths, sessions, time to live). A bad row
   fails the stage with the sparkqueue error, and Spark runs no task of the second stage.
2. Reduce stage: `repartition` by a key whose Spark hash sends each queue partition to exactly
   one task (one task per partition, up to the session's parallelism; see session.task_count);
   each task builds entity rows and stages them in its partitions STAGE_ROWS at a time
   (duplicate detection against the table and across the task's chunks, quota, numbering from
   the driver's fence base; `EntityTable.stage`), returning the add actions of its files.

Unkeyed rows need no shuffle (see `in_place`): a validation pass over the rows (the map stage's
checks) comes first, then each input task stages its own rows in queue partitions that it alone
owns. Unkeyed rows to a queue without duplicate detection skip Python entirely: Spark's own
Parquet writer numbers, checks and writes them in one pass, and the driver commits its files
(jvm_send.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import Accumulator, AccumulatorParam
from pyspark.sql import Column, DataFrame, Row, SparkSession
from pyspark.sql import functions as sf
from pyspark.sql import types as st
from pyspark.sql.functions import arrow_udf  # type: ignore[attr-defined]  # PySpark 4.1+, not yet in its stubs

from sparkqueue.broker import refuse_in_transaction
from sparkqueue.errors import InvalidOperationError, MessageSizeExceededError, PartitionUnavailableError, StorageError
from sparkqueue.message import SendSettings, message_rows, properties_json, send_settings
from sparkqueue.model import limits
from sparkqueue.model.addresses import QUEUE, TOPIC
from sparkqueue.model.entity import utcnow
from sparkqueue.model.partitioning import partition_for_key
from sparkqueue.model.properties import check_status
from sparkqueue.spark.commit import Repeats, Written, commit_renumbering
from sparkqueue.spark.schema import field_renames
from sparkqueue.spark.session import (
    bucket_key,
    check_dataframe,
    failing,
    input_partitions,
    marked,
    spark_errors,
    task_count,
    task_error,
)
from sparkqueue.spark.worker import DATAFRAME_REFUSAL, EntityRef, marking_errors
from sparkqueue.storage.leases import WriteLease
from sparkqueue.storage.log import AddFile
from sparkqueue.storage.retry import retry_commit
from sparkqueue.storage.schema import TIMESTAMP
from sparkqueue.storage.store import is_local
from sparkqueue.storage.table import fence_app_id

if TYPE_CHECKING:
    from sparkqueue.broker import Broker
    from sparkqueue.model.entity import Entity
    from sparkqueue.storage.log import Snapshot
    from sparkqueue.storage.retry import Deadline
    from sparkqueue.storage.table import EntityTable, Expand

log = logging.getLogger(__name__)

ROUND_ROBIN_BLOCK = 1024  # unkeyed rows go round-robin in blocks: a small DataFrame touches few partitions
ORD_ROW_MASK = (1 << 33) - 1  # monotonically_increasing_id: the row number within its partition (below bit 33)
STAGE_ROWS = 32_768  # rows a send task numbers and writes at a time (storage splits them into bounded files)
STAGE_BYTES = 32 << 20  # and at most this many message bytes at a time

KEY_FIELDS = ("message_id", "session_id", "partition_key")
STRING_FIELDS = (*KEY_FIELDS, "correlation_id", "subject", "to", "reply_to", "reply_to_session_id", "content_type")
MESSAGE_FIELDS = ("body", *STRING_FIELDS, "application_properties", "time_to_live", "scheduled_enqueue_time_utc")
WRITE_COLUMNS = (
    "body",
    *STRING_FIELDS,
    "application_properties",
    "time_to_live_ms",
    "scheduled_enqueue_time_utc",
    "size_in_bytes",
    "_qp",
)
RESULT_DDL = "partition_id int, accepted long, last long, adds string"
_TTL_TOO_SHORT = f"time_to_live {limits.TTL_TOO_SHORT}, got "
_PROPERTY_VALUE_TYPES = (st.StringType, st.IntegralType, st.FloatType, st.DoubleType, st.BooleanType, st.NullType)


@dataclass(frozen=True)
class SendPlan:
    """Everything the tasks of one DataFrame send need (picklable)."""

    ref: EntityRef
    settings: SendSettings
    partition_count: int
    available: tuple[int, ...]
    stage_rows: int = STAGE_ROWS
    stage_bytes: int = STAGE_BYTES
    bases: tuple[int | None, ...] = ()  # per queue partition: its fence version as the driver read it (None: no fence yet)
    lease: str = ""  # the tag of the driver's write lease, in every file name (storage/leases.py)


def send_dataframe(
    broker: Broker,
    entity_type: str,
    name: str,
    df: DataFrame,
    *,
    preserve_order: bool | None = None,
    stage_rows: int = STAGE_ROWS,
    stage_bytes: int = STAGE_BYTES,
) -> int:
    """Send every row of `df` as a message, all or nothing; returns how many were accepted (duplicates dropped are not counted).

    `preserve_order` keeps the DataFrame's row order within each queue partition (a shuffle and
    a sort per task). By default it is on when rows may carry a session id or partition key, the
    messages whose order a broker keeps; unkeyed rows are then written in place by the tasks
    holding them, each queue partition in the order of the one input partition that owns it.
    """
    check_dataframe(df, "send_dataframe")
    refuse_in_transaction(broker, DATAFRAME_REFUSAL)
    if renamed := field_renames(df.columns, MESSAGE_FIELDS):
        df = df.withColumnsRenamed(renamed)
    entity = broker.entity(entity_type, name)
    check_status(entity.props, "send", entity.name)
    available = tuple(p for p in range(entity.partition_count) if entity.available(p))
    if not available:
        raise PartitionUnavailableError(f"no partition of {entity.name!r} is available; nothing was sent")
    plan = SendPlan(
        EntityRef.of(broker, entity_type, name),
        send_settings(broker.tier, entity.props),
        entity.partition_count,
        available,
        limits.check_int(stage_rows, "stage_rows"),
        limits.check_int(stage_bytes, "stage_bytes"),
    )
    if preserve_order is None:
        preserve_order = bool(_key_columns(df))
    limits.check_bool(preserve_order, "preserve_order")
    # The tasks' files wait for the driver's commit as long as the job runs: a write lease keeps vacuum off them.
    with WriteLease(entity.table.store) as lease:
        accepted, touched, how = _send(entity, df, replace(plan, lease=lease.tag), preserve_order, entity_type)
    if touched:
        broker.after_send(entity_type, name, touched)
    log.info("sent %d messages to %s over %d partitions in one commit%s", accepted, entity.name, len(touched), how)
    return accepted


def _send(entity: Entity, df: DataFrame, plan: SendPlan, preserve_order: bool, entity_type: str) -> tuple[int, list[int], str]:
    """Write and commit the rows by the fastest path that takes them; (accepted, partitions touched, the path for the log)."""
    inputs = input_partitions(df)
    table = entity.table
    if not preserve_order and inputs is not None and jvm_writable(df, plan, entity_type):
        return (*send_in_jvm(table, df, plan, inputs, entity.deadline()), " (Spark's writer)")
    check: DataFrame | None = None
    if preserve_order or _may_have_keys(df, plan) or inputs is None:
        staged = shuffle_by_partition(prepare(df, plan), task_count(df.sparkSession, plan.partition_count), preserve_order)
    else:
        staged, check = in_place(df, plan, inputs)

    deadline = entity.deadline()
    repeats = Repeats.NONE  # what a concurrent sender's messages repeating some of the DataFrame's need
    if plan.settings.requires_duplicate_detection:
        repeats = Repeats.RERUN if entity_type == TOPIC else Repeats.DROP

    def attempt() -> tuple[int, list[int]]:
        bases = fence_bases(table, plan.partition_count)
        if check is not None:  # a bad row fails this pass, before any task writes a file
            with spark_errors():
                check.collect()
        results = write_files(table, staged, replace(plan, bases=bases))
        return commit_send(table, results, bases, deadline, repeats=repeats)

    return (*retry_commit(attempt, deadline, f"DataFrame send to {entity.name}"), "")


def jvm_writable(df: DataFrame, plan: SendPlan, entity_type: str) -> bool:
    """True when Spark's own writer can do the whole send (see jvm_send): unkeyed rows to a queue, no duplicate detection.

    Keyed rows need mmh3 placement, a topic its fan-out, duplicate detection a look at the
    table, and a timestamp without time zone a conversion: those take the staged path.
    """
    sched = next((f.dataType for f in df.schema.fields if f.name == "scheduled_enqueue_time_utc"), None)
    local = is_local(plan.ref.root)  # Spark's writer needs the store's Hadoop file system; tasks write through obstore
    return local and entity_type == QUEUE and not _may_have_keys(df, plan) and not isinstance(sched, st.TimestampNTZType)


def send_in_jvm(table: EntityTable, df: DataFrame, plan: SendPlan, inputs: int, deadline: Deadline) -> tuple[int, list[int]]:
    """Unkeyed rows written by Spark's Parquet writer into the table and committed once (jvm_send); (accepted, partitions)."""
    from sparkqueue.spark.jvm_send import FILE_ROWS, write_attempt

    if inputs > len(plan.available):  # each input partition owns queue partitions of its own (see in_place)
        df = df.coalesce(len(plan.available))
        inputs = len(plan.available)
    prepared = prepare(df, plan, owned=True, block=FILE_ROWS)

    def attempt() -> tuple[int, list[int]]:
        return write_attempt(table, prepared, replace(plan, bases=fence_bases(table, plan.partition_count)), inputs, deadline)

    return retry_commit(attempt, deadline, f"DataFrame send to {table.uri}")


def fence_bases(table: EntityTable, partition_count: int) -> tuple[int | None, ...]:
    """Every partition's sequence fence in a fresh snapshot of the table: where this attempt's numbering starts."""
    with table.existing():
        snap = table.snapshot()
    return tuple(snap.transaction_version(fence_app_id(p)) for p in range(partition_count))


def write_files(table: EntityTable, staged: DataFrame, plan: SendPlan) -> list[Row]:
    """Run the write tasks: per queue partition, the rows accepted, the last counter used and the files (no commit).

    When the job fails, the files of the tasks that had finished are deleted (an accumulator
    collects their paths; a failing task deletes its own).
    """
    written = _paths_accumulator(staged.sparkSession)
    try:
        with spark_errors():
            return staged.mapInArrow(partial(write_task, plan, written), RESULT_DDL).collect()
    except BaseException:
        if written is not None:
            log.info("the DataFrame send failed: deleting %d files its tasks wrote", len(written.value))
            table.data.delete(written.value)
        raise
    finally:
        if written is not None:
            written.value = []


def commit_send(
    table: EntityTable, results: list[Row], bases: tuple[int | None, ...], deadline: Deadline, *, repeats: Repeats
) -> tuple[int, list[int]]:
    """Commit every task's files in one commit that moves the fences of the partitions written; (accepted, partitions).

    The tasks numbered each partition from `bases`. A concurrent append to some of them makes the
    commit conflict: their files are then renumbered after it (without the messages it repeated,
    `repeats`) and the commit tried again, or the send runs again (commit.commit_renumbering).
    """
    adds: list[AddFile] = []
    last: dict[int, int] = {}
    touched: list[int] = []
    for r in results:
        adds += [AddFile(**a) for a in json.loads(r.adds)]
        if r.last != (bases[r.partition_id] or 0):
            if r.partition_id in last:  # two tasks numbered one partition: never commit that (see in_place, shuffle_by_partition)
                table.data.delete([a.path for a in adds])
                raise StorageError(f"partition {r.partition_id} of {table.uri} was written by two send tasks; nothing was sent")
            last[r.partition_id] = r.last
        if r.accepted:
            touched.append(r.partition_id)
    dropped = 0
    if adds:
        counts = {p: n - (bases[p] or 0) for p, n in last.items()}
        written = Written(adds, counts, last, dict.fromkeys(last))  # no bound of the bytes: a recheck sums them
        dropped = commit_renumbering(table, adds, written, dict(enumerate(bases)), deadline, repeats=repeats)
    return sum(r.accepted for r in results) - dropped, sorted(touched)


class _PathList(AccumulatorParam[list[str]]):
    """Accumulates lists of file paths."""

    def zero(self, value: list[str]) -> list[str]:
        return []

    def addInPlace(self, value1: list[str], value2: list[str]) -> list[str]:  # noqa: N802 - pyspark's name
        value1.extend(value2)
        return value1


def _paths_accumulator(spark: SparkSession) -> Accumulator[list[str]] | None:
    """An accumulator of the files finished tasks wrote; None without a SparkContext (Spark Connect)."""
    try:
        return spark.sparkContext.accumulator([], _PathList())
    except Exception:  # no SparkContext: a failed send's files are left to vacuum
        return None


def in_place(df: DataFrame, plan: SendPlan, inputs: int) -> tuple[DataFrame, DataFrame]:
    """Unkeyed rows, written by the tasks that hold them: each owns queue partitions of its own, so nothing is shuffled.

    Input partition k of T takes available partitions k, k + T, ... in turn (a DataFrame with
    more partitions than the queue is coalesced first), so no two tasks stage rows in one queue
    partition and each keeps its rows' order. Returns the rows to write and a validation pass
    over them (one row) that the send runs first: a bad row fails it before any task writes. It
    reads the input once more, which costs less than shuffling every body.
    """
    if inputs > len(plan.available):  # `inputs`: df's partition count
        df = df.coalesce(len(plan.available))
    prepared = prepare(df, plan, owned=True)
    return prepared.select(*WRITE_COLUMNS), prepared.agg(sf.max("size_in_bytes"))


def shuffle_by_partition(prepared: DataFrame, tasks: int, preserve_order: bool) -> DataFrame:
    """Rows grouped so each of `tasks` Spark partitions holds whole queue partitions (q % tasks), in DataFrame order."""
    out = prepared.withColumn("_sk", bucket_key(sf.col("_qp"), tasks)).repartition(tasks, "_sk")
    if preserve_order:
        out = out.sortWithinPartitions("_ord")
    return out.select(*WRITE_COLUMNS)


# ---- map stage: columns, placement and validation ----------------------------------------------


def prepare(df: DataFrame, plan: SendPlan, owned: bool = False, block: int = ROUND_ROBIN_BLOCK) -> DataFrame:
    """The DataFrame's messages as normalized columns with their queue partition (`_qp`), validated row by row.

    Unkeyed rows go round-robin in blocks of `block` consecutive rows of an input partition.
    """
    types = {f.name: f.dataType for f in df.schema.fields}
    if "body" not in types:
        raise InvalidOperationError(f"the DataFrame needs a `body` column (binary or string); it has {sorted(types)}")
    ignored = sorted(set(types) - set(MESSAGE_FIELDS))
    if ignored:
        log.debug("columns that are not message fields are ignored: %s", ignored)
    first = df.select(
        _body(types["body"]).alias("body"),
        sf.coalesce(_string(types, "message_id"), sf.expr("uuid()")).alias("message_id"),
        *[_string(types, name).alias(name) for name in STRING_FIELDS if name != "message_id"],
        _string(types, "message_id").alias("_user_message_id"),
        _properties_json(types).alias("application_properties"),
        _ttl_us(types).alias("_ttl_us"),
        _scheduled(types).alias("scheduled_enqueue_time_utc"),
        sf.monotonically_increasing_id().alias("_ord"),
        sf.spark_partition_id().alias("_task"),
    )
    start = random.randrange(len(plan.available))
    # Consecutive rows of an input partition share a queue partition (a block); input partition k takes
    # blocks k, k + T, k + 2T, ... of the round (T input partitions), so a small DataFrame touches few
    # queue partitions and a large one covers them all evenly.
    inputs, count = input_partitions(df) or 1, len(plan.available)
    if owned:  # input partition k owns available[k], available[k + T], ... (T <= count) and takes them in turn
        owned_count = sf.floor((sf.lit(count + inputs - 1) - sf.col("_task")) / inputs)
        row = sf.col("_ord").bitwiseAND(sf.lit(ORD_ROW_MASK))  # the row's position in its input partition
        rr = sf.col("_task") + sf.lit(inputs) * sf.pmod(sf.floor(row / block) + start, owned_count)
    else:
        blocks = sf.floor(sf.col("_ord") / block) * sf.lit(inputs) + sf.col("_task")
        rr = sf.pmod(blocks + sf.lit(start), sf.lit(count))
    round_robin = sf.element_at(sf.array(*[sf.lit(p) for p in plan.available]), rr.cast("int") + 1)
    return first.select(
        *[sf.col(c) for c in ("body", *STRING_FIELDS, "application_properties", "scheduled_enqueue_time_utc", "_ord")],
        (sf.col("_ttl_us") / 1000).cast("long").alias("time_to_live_ms"),
        _checked_size(plan.settings).alias("size_in_bytes"),
        _partition(plan, round_robin, _may_have_keys(df, plan)).alias("_qp"),
    )


def check_message_types(types: Mapping[str, st.DataType]) -> None:
    """Refuse message-field columns (by field name) of a type no send takes: InvalidOperationError, before any task runs.

    Types alone, no Spark: the streaming sink runs it when its query starts (a query given such a
    column failed inside its first batch's tasks); the sends' column builders below make the same checks.
    """
    for name, dtype in types.items():
        if name == "body":
            _check_body(dtype)
        elif name in STRING_FIELDS:
            check_string_field(name, dtype)
        elif name == "application_properties":
            _check_properties(dtype)
        elif name == "time_to_live":
            _check_ttl(dtype)
        elif name == "scheduled_enqueue_time_utc":
            _check_scheduled(dtype)


def _body(dtype: st.DataType) -> Column:
    _check_body(dtype)
    return sf.col("body") if isinstance(dtype, st.BinaryType) else sf.col("body").cast("binary")


def _check_body(dtype: st.DataType) -> None:
    if not isinstance(dtype, (st.BinaryType, st.StringType)):
        raise InvalidOperationError(f"body must be binary or string, got {dtype.simpleString()}")


def _string(types: dict[str, st.DataType], name: str) -> Column:
    dtype = types.get(name)
    if dtype is None or isinstance(dtype, st.NullType):
        return sf.lit(None).cast("string")
    check_string_field(name, dtype)
    return sf.col(name)


def check_string_field(name: str, dtype: st.DataType) -> None:
    """A message's string field (STRING_FIELDS) must be a string or all-null column; the sends and the sink refuse others."""
    if not isinstance(dtype, (st.StringType, st.NullType)):
        raise InvalidOperationError(f"{name} must be a string column, got {dtype.simpleString()} (cast it to a string)")


def _properties_json(types: dict[str, st.DataType]) -> Column:
    """application_properties (a map, a struct or a JSON object string) as the core's JSON text."""
    dtype = types.get("application_properties")
    if dtype is None or isinstance(dtype, st.NullType):
        return sf.lit(None).cast("string")
    _check_properties(dtype)
    column: Column = properties_udf(sf.col("application_properties"))
    return column


def _check_properties(dtype: st.DataType) -> None:
    if isinstance(dtype, st.NullType):
        return
    if isinstance(dtype, st.MapType):
        if not isinstance(dtype.keyType, st.StringType) or not isinstance(dtype.valueType, _PROPERTY_VALUE_TYPES):
            raise InvalidOperationError(
                f"application_properties must map strings to strings, numbers or booleans; got {dtype.simpleString()}"
            )
    elif isinstance(dtype, st.StructType):
        bad = [f.name for f in dtype.fields if not isinstance(f.dataType, _PROPERTY_VALUE_TYPES)]
        if bad:
            raise InvalidOperationError(f"application_properties fields {bad} must be string, integer, float, double or boolean")
    elif not isinstance(dtype, st.StringType):
        raise InvalidOperationError(
            f"application_properties must be a map, a struct or a JSON object string, got {dtype.simpleString()}"
        )


@arrow_udf(st.StringType())  # type: ignore[untyped-decorator]
def properties_udf(values: pa.Array) -> pa.Array:
    """Per row: the properties as the core stores and counts them (message.properties_json), None when empty."""
    out: list[str | None] = []
    for v in values.to_pylist():
        props = _as_dict(v)
        try:
            out.append(properties_json(props) if props else None)  # checked as a send checks them
        except InvalidOperationError as exc:
            raise task_error(exc) from exc
    return pa.array(out, pa.string())


def _as_dict(value: object) -> dict[str, Any] | None:
    """A map (list of pairs), struct (dict) or JSON text as a dict."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, list):
        return dict(value)
    try:
        parsed = json.loads(str(value))
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise RuntimeError(marked(InvalidOperationError(f"application_properties must be a JSON object, got {value!r}")))
    return parsed


def _ttl_us(types: dict[str, st.DataType]) -> Column:
    """time_to_live (seconds, or a day-time interval) in microseconds."""
    dtype = types.get("time_to_live")
    if dtype is None or isinstance(dtype, st.NullType):
        return sf.lit(None).cast("long")
    _check_ttl(dtype)
    if isinstance(dtype, st.DayTimeIntervalType):  # any day-time interval fits a long of microseconds
        micros = sf.expr("unix_micros(timestamp_micros(0) + time_to_live)")
        never_us = int(limits.TTL_NEVER.total_seconds()) * 1_000_000
        return _ttl_rule(micros, never_us, micros, sf.col("time_to_live").cast("string"))
    seconds = sf.col("time_to_live").cast("double")  # a number: as the core, NaN and infinities refused
    bad = sf.isnan(seconds) | (sf.abs(seconds) == float("inf"))
    shown = sf.concat(seconds.cast("string"), sf.lit(" seconds"))
    not_finite = failing(InvalidOperationError, "time_to_live must be a finite number of seconds, got ", seconds)
    ttl = _ttl_rule(seconds, limits.TTL_NEVER.total_seconds(), seconds * 1_000_000, shown)
    return sf.when(bad, not_finite).otherwise(ttl)


def _check_ttl(dtype: st.DataType) -> None:
    if not isinstance(dtype, (st.NullType, st.DayTimeIntervalType, st.NumericType)):
        raise InvalidOperationError(f"time_to_live must be seconds (a number) or a day-time interval, got {dtype.simpleString()}")


def _ttl_rule(value: Column, never: float, micros: Column, shown: Column) -> Column:
    """The core's TTL rule (limits.check_ttl), before a cast could overflow: `never` or more never expires, <= 0 is refused.

    So is a positive TTL under 1 ms (limits.MIN_TTL_US): kept in whole milliseconds it would be stored as 0,
    a message expired on arrival, counted as sent and never delivered.
    """
    return (
        sf.when(value >= never, sf.lit(None))
        .when(value <= 0, failing(InvalidOperationError, "time_to_live must be positive, got ", shown))
        .when(micros.cast("long") < limits.MIN_TTL_US, failing(InvalidOperationError, _TTL_TOO_SHORT, shown))
        .otherwise(micros.cast("long"))
        .cast("long")
    )


def _scheduled(types: dict[str, st.DataType]) -> Column:
    """scheduled_enqueue_time_utc as a timestamp; a timestamp without time zone is read as UTC (converted in the task)."""
    dtype = types.get("scheduled_enqueue_time_utc")
    if dtype is None or isinstance(dtype, st.NullType):
        return sf.lit(None).cast("timestamp")
    _check_scheduled(dtype)
    return sf.col("scheduled_enqueue_time_utc")


def _check_scheduled(dtype: st.DataType) -> None:
    if not isinstance(dtype, (st.NullType, st.TimestampType, st.TimestampNTZType)):
        raise InvalidOperationError(f"scheduled_enqueue_time_utc must be a timestamp, got {dtype.simpleString()}")


def _size(c: str) -> Column:
    return sf.coalesce(sf.octet_length(sf.col(c)), sf.lit(0))


def _checked_size(settings: SendSettings) -> Column:
    """size_in_bytes as the core counts it (body, user-given strings, properties JSON), failing invalid rows."""
    max_bytes = limits.MAX_MESSAGE_BYTES[settings.tier]
    counted = ["_user_message_id", *[c for c in STRING_FIELDS if c != "message_id"], "application_properties"]
    size = sf.octet_length("body")
    for c in counted:
        size = size + _size(c)
    user_id = sf.col("_user_message_id")  # a generated id means nothing to the user: name the row as the core does
    which = sf.when(user_id.isNull(), sf.lit("a message")).otherwise(sf.concat(sf.lit("message '"), user_id, sf.lit("'")))
    checks: list[tuple[Column, Column]] = [
        (sf.col("body").isNull(), failing(InvalidOperationError, "body must be bytes or str, got null (", which, ")")),
        (user_id == "", failing(InvalidOperationError, "message_id must not be empty (null lets sparkqueue assign one)")),
    ]
    for name, col in (("message_id", "_user_message_id"), ("session_id", "session_id"), ("partition_key", "partition_key")):
        length = sf.char_length(sf.col(col))
        checks.append(
            (
                length > limits.MAX_KEY_LENGTH,
                failing(
                    InvalidOperationError,
                    f"{name} is ",
                    length.cast("string"),
                    f" characters long; at most {limits.MAX_KEY_LENGTH} are allowed",
                ),
            )
        )
    if settings.requires_session:
        checks.append(
            (
                sf.col("session_id").isNull(),
                failing(InvalidOperationError, "the entity requires sessions: every message needs a session_id"),
            )
        )
    checks += [
        (
            sf.col("partition_key").isNotNull()
            & sf.col("session_id").isNotNull()
            & (sf.col("partition_key") != sf.col("session_id")),
            failing(
                InvalidOperationError,
                "partition_key '",
                sf.col("partition_key"),
                "' differs from session_id '",
                sf.col("session_id"),
                "'; a session's messages are placed by the session id, so leave partition_key unset or equal",
            ),
        ),
        (
            sf.col("_ttl_us") < limits.MIN_TTL_US,  # _ttl_rule refuses these first; never store a TTL of 0 ms
            failing(InvalidOperationError, _TTL_TOO_SHORT, sf.col("_ttl_us").cast("string"), " microseconds"),
        ),
        (
            size > max_bytes,
            failing(
                MessageSizeExceededError,
                which,
                " is ",
                size.cast("string"),
                f" bytes; the {settings.tier} tier allows {max_bytes}",
            ),
        ),
    ]
    out = sf.when(checks[0][0], checks[0][1])
    for cond, fail in checks[1:]:
        out = out.when(cond, fail)
    return out.otherwise(size).cast("int")


def _key_columns(df: DataFrame) -> list[str]:
    """The session id and partition key columns the DataFrame has (a NullType column holds no key)."""
    types = {f.name: f.dataType for f in df.schema.fields}
    return [n for n in ("session_id", "partition_key") if n in types and not isinstance(types[n], st.NullType)]


def _may_have_keys(df: DataFrame, plan: SendPlan) -> bool:
    """False when no row can have a partition key (no key columns, no duplicate detection): no hashing needed."""
    return bool(_key_columns(df)) or plan.settings.requires_duplicate_detection


def _partition(plan: SendPlan, round_robin: Column, keyed: bool = True) -> Column:
    """The queue partition: by mmh3 of the key (docs/semantics.md §3 precedence), else round-robin over available partitions."""
    if not keyed:
        return round_robin
    key = sf.coalesce(
        sf.col("session_id"),
        sf.col("partition_key"),
        sf.col("message_id") if plan.settings.requires_duplicate_detection else sf.lit(None).cast("string"),
    )
    hashed = sf.lit(0) if plan.partition_count == 1 else mmh3_udf(plan.partition_count)(key)
    unavailable = ~sf.array_contains(sf.array(*[sf.lit(p) for p in plan.available]), hashed)
    return (
        sf.when(key.isNull(), round_robin)
        .when(
            unavailable,
            failing(
                PartitionUnavailableError,
                "partition ",
                hashed.cast("string"),
                f" of {plan.ref.name!r}, which key '",
                key,
                "' maps to, is unavailable; nothing was sent",
            ),
        )
        .otherwise(hashed)
        .cast("int")
    )


def mmh3_udf(partition_count: int) -> Callable[[Column], Column]:
    """An Arrow UDF: the partition of each key, exactly as model.partitioning.partition_for_key computes it."""

    @arrow_udf(st.IntegerType())  # type: ignore[untyped-decorator]
    def partition_of(keys: pa.Array) -> pa.Array:
        return pa.array([None if k is None else partition_for_key(k, partition_count) for k in keys.to_pylist()], pa.int32())

    udf: Callable[[Column], Column] = partition_of
    return udf


# ---- reduce stage: rows numbered and written per partition, committed by the driver -----------------


@marking_errors
def write_task(
    plan: SendPlan, written: Accumulator[list[str]] | None, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """Stage this task's rows in their queue partition(s) STAGE_ROWS at a time; yields per partition counts and files.

    Nothing is committed here. If the task fails, it deletes the files it wrote; once it has
    finished, `written` tells the driver its files, which it deletes if another task fails.
    """
    stager = PartitionStager(plan)
    try:
        for batch in batches:
            stager.add(pa.Table.from_batches([batch]))
        stager.finish()
    except BaseException:
        stager.discard()
        raise
    if written is not None:
        written.add(stager.paths())
    yield stager.summary()


class PartitionStager:
    """Buffers a task's rows per queue partition, numbering them from the driver's fence bases and writing their files."""

    def __init__(self, plan: SendPlan) -> None:
        self.plan = plan
        self._entity: Entity | None = None
        self._snap: Snapshot | None = None
        self.expand: Expand | None = None
        self.pending: dict[int, list[pa.Table]] = {}
        self.accepted: dict[int, int] = {}
        self.last: dict[int, int] = {}  # the last counter numbered per partition
        self.staged_bytes: dict[int, int] = {}  # message bytes staged per partition (the quota counts them)
        self.ids: dict[int, list[pa.Array]] = {}  # message ids staged per partition (duplicate detection)
        self.adds: dict[int, list[AddFile]] = {}

    def add(self, rows: pa.Table) -> None:
        """Buffer rows, staging full chunks as they fill."""
        for p, part in partition_runs(rows):
            buffered = [*self.pending.get(p, []), part]
            table = pa.concat_tables(buffered)
            limit = self._chunk_limit(table)
            while table.num_rows >= limit:
                self._stage(p, table.slice(0, limit))
                table = table.slice(limit)
            self.pending[p] = [table] if table.num_rows else []

    def finish(self) -> None:
        """Stage what is left."""
        for p, tables in self.pending.items():
            if tables:
                self._stage(p, pa.concat_tables(tables))
        self.pending.clear()

    def paths(self) -> list[str]:
        """Every file this task wrote."""
        return [a.path for adds in self.adds.values() for a in adds]

    def discard(self) -> None:
        """Delete the files written so far (the task failed: nothing of it will be committed)."""
        if self._entity is not None and self.adds:
            self._entity.table.data.delete(self.paths())
        self.adds.clear()

    def summary(self) -> pa.RecordBatch:
        """Per partition staged: messages accepted, the last counter numbered, and the files' add actions (JSON)."""
        parts = sorted(self.adds)
        return pa.RecordBatch.from_pydict(
            {
                "partition_id": pa.array(parts, pa.int32()),
                "accepted": pa.array([self.accepted.get(p, 0) for p in parts], pa.int64()),
                "last": pa.array([self.last[p] for p in parts], pa.int64()),
                "adds": pa.array([json.dumps([asdict(a) for a in self.adds[p]]) for p in parts], pa.string()),
            }
        )

    def _chunk_limit(self, rows: pa.Table) -> int:
        """Rows staged at a time: the row cap, lowered so a chunk's message bytes stay under the byte cap."""
        if rows.num_rows == 0:
            return self.plan.stage_rows
        mean = max(1, int(pc.sum(rows.column("size_in_bytes")).as_py() or 0) // rows.num_rows)
        limit: int = max(1, min(self.plan.stage_rows, self.plan.stage_bytes // mean))
        return limit

    @property
    def entity(self) -> Entity:
        """The entity (resolved on first use: a task without rows never opens the namespace)."""
        if self._entity is None:
            self._entity = self.plan.ref.entity()
            self.expand = self.plan.ref.broker().expander(self.plan.ref.entity_type, self.plan.ref.name)
        return self._entity

    def _stage(self, p: int, chunk: pa.Table) -> None:
        """Number and write one chunk of partition p (duplicates dropped, quota checked) after what is staged already."""
        rows = entity_rows(chunk, self.plan.settings)
        table = self.entity.table
        if self._snap is None:  # one view of the table for every chunk of the task
            with table.existing():
                self._snap = table.snapshot().copy()
        since = self.entity.dedupe_since()
        if since is not None:
            rows = self._unseen(p, rows)
        counted = [0]

        def expand(survivors: pa.Table) -> pa.Table:
            counted[0] = survivors.num_rows
            return self.expand(survivors) if self.expand is not None else survivors

        base = self.last.get(p, self.plan.bases[p] or 0)
        adds = self.adds.setdefault(p, [])
        self.last[p] = base
        if rows.num_rows == 0:  # every row repeats one an earlier chunk staged
            return
        stored, new = table.stage(self._snap, p, rows, base, since, expand, self.staged_bytes.get(p, 0), self.plan.lease)
        adds += new
        self.last[p] = base + stored.num_rows
        self.accepted[p] = self.accepted.get(p, 0) + counted[0]
        self.staged_bytes[p] = self.staged_bytes.get(p, 0) + (pc.sum(stored.column("size_in_bytes")).as_py() or 0)

    def _unseen(self, p: int, rows: pa.Table) -> pa.Table:
        """Rows whose message id no earlier chunk of the partition staged (the table's check sees only committed rows)."""
        prior = self.ids.setdefault(p, [])
        if prior:
            rows = rows.filter(pc.invert(pc.is_in(rows.column("message_id"), value_set=pa.concat_arrays(prior))))
        prior.append(rows.column("message_id").combine_chunks())
        return rows


def partition_runs(rows: pa.Table) -> Iterator[tuple[int, pa.Table]]:
    """The rows as (queue partition, rows) runs in their order; zero-copy slices where the rows come in blocks.

    Unkeyed rows arrive in round-robin blocks of one partition, so slicing at each change of
    partition copies no body. Keyed rows scatter over partitions: one stable sort by partition
    (a single copy, row order kept within each partition) then makes the runs.
    """
    qp = rows.column("_qp").to_numpy()
    cuts = np.flatnonzero(qp[1:] != qp[:-1]) + 1
    if len(cuts) >= max(16, rows.num_rows // 256):
        order = np.argsort(qp, kind="stable")
        rows, qp = rows.take(pa.array(order)), qp[order]
        cuts = np.flatnonzero(qp[1:] != qp[:-1]) + 1
    bounds = [0, *cuts.tolist(), rows.num_rows]
    for start, end in itertools.pairwise(bounds):
        if end > start:
            yield int(qp[start]), rows.slice(start, end - start)


def entity_rows(chunk: pa.Table, settings: SendSettings) -> pa.Table:
    """Prepared message columns as entity rows in their queue partitions (`_qp`), through the core's one row conversion."""
    columns = dict(zip(chunk.column_names, chunk.columns, strict=True))
    columns["scheduled_enqueue_time_utc"] = _as_utc(columns["scheduled_enqueue_time_utc"])
    return message_rows(columns, chunk.num_rows, settings.default_message_time_to_live, utcnow(), columns["_qp"])


def _as_utc(ts: pa.ChunkedArray) -> pa.ChunkedArray:
    """Timestamps as UTC microseconds; values without a time zone are read as UTC."""
    if isinstance(ts.type, pa.TimestampType) and ts.type.tz is None:
        return ts.cast(pa.timestamp("us")).cast(pa.int64()).cast(TIMESTAMP)
    return ts.cast(TIMESTAMP)
