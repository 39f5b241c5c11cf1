"""The streaming sink: `df.writeStream.format("sparkqueue")` sends each micro-batch once across restarts (docs/semantics.md §12).

    (df.writeStream.format("sparkqueue").option("namespace", root)
       .option("checkpointLocation", checkpoint).start("orders"))

Columns are named as `Message` fields, as for `send_dataframe` (`body` required; string
properties; `application_properties` as a map, a struct or a JSON object string;
`time_to_live` in seconds or as an interval; `scheduled_enqueue_time_utc`).

How a micro-batch is sent: each Spark task validates its rows with the core's rules (size,
keys, sessions) and writes them, as entity rows, to a staging directory of its own; nothing
reaches the queue yet. When every task succeeded, Spark calls `commit(batch id)` on the driver,
which appends all the batch's rows in ONE Delta commit carrying the txn action
(app id ``sparkqueue.stream.<query id>``, version = batch id). A batch Spark replays after a
restart (it committed here, but the process died before Spark's commit log recorded it) finds
that version in the entity's table and sends nothing. Failed task attempts leave only staging
files, which no commit lists (removed with the staging directories after an hour).

The query id comes from the checkpoint (`<checkpointLocation>/metadata`, stable across restarts
of one query); with `.option("txnAppId", id)` that id is used instead, as with Delta's own
idempotent writes.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from sparkqueue.errors import InvalidOperationError, SparkQueueError, StorageError
from sparkqueue.message import MESSAGE_FIELDS, Message, message_label, to_rows
from sparkqueue.model import limits
from sparkqueue.model.entity import utcnow
from sparkqueue.model.properties import check_status
from sparkqueue.spark.schema import field_renames
from sparkqueue.spark.send import STRING_FIELDS, check_message_types
from sparkqueue.spark.session import task_error
from sparkqueue.spark.staging import Staging, cleanup_staging, filesystem, remove_dirs, require_local_root
from sparkqueue.spark.streaming import EntityAddress, address_of, check_options, idempotence_key
from sparkqueue.storage.schema import constant, with_columns

log = logging.getLogger(__name__)

APP_ID_PREFIX = "sparkqueue.stream."
SINK_OPTIONS = frozenset({"entity", "topic", "checkpointlocation", "txnappid"})  # beside streaming.COMMON_OPTIONS
KEY_COLUMN = "_partition_key"

_namespaces: dict[EntityAddress, Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class SinkConfig:
    """What the sink's tasks and commits need (picklable)."""

    address: EntityAddress
    txn_app_id: str | None
    checkpoint: str | None


def sink_config(options: dict[str, str], schema: StructType) -> SinkConfig:
    """Validate the sink's (lower-cased) options and input columns."""
    check_options(options, SINK_OPTIONS, "streaming sink")
    renamed = field_renames(schema.fieldNames(), MESSAGE_FIELDS)  # as messages_from_arrow reads them
    if "body" not in {renamed.get(name, name) for name in schema.fieldNames()}:
        raise InvalidOperationError(
            f"the sparkqueue sink needs a `body` column (columns are Message fields), got {schema.fieldNames()}"
        )
    # as send_dataframe refuses them: a running query would fail inside its first batch's tasks
    check_message_types({renamed.get(column.name, column.name): column.dataType for column in schema.fields})
    app, checkpoint = options.get("txnappid"), options.get("checkpointlocation")
    if not app and not checkpoint:
        raise InvalidOperationError(
            'the sparkqueue sink keys its exactly-once commits by query: set .option("checkpointLocation", path) '
            '(or .option("txnAppId", stable_id))'
        )
    address = address_of(options, sink=True)
    require_local_root(address.root, "the streaming sink")
    return SinkConfig(address, app or None, checkpoint or None)


@dataclass
class StagedBatch(WriterCommitMessage):
    """What one write task staged: its staging directory (None when it had no rows) and how many rows."""

    staging: str | None
    rows: int


class QueueStreamWriter(DataSourceStreamArrowWriter):
    """Tasks stage validated rows; the driver's commit appends the whole micro-batch once (see the module docstring)."""

    def __init__(self, config: SinkConfig) -> None:
        self.config = config

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedBatch:
        """Validate this task's rows with the core's rules and stage them as entity rows (nothing is sent yet)."""
        from sparkqueue.message import send_settings

        try:
            ns = _worker_namespace(self.config.address)
            entity = self.config.address.entity(ns)
            check_status(entity.props, "send", entity.name)  # as a sender: refused while sends are disabled
            settings = send_settings(ns.tier, entity.props)
            staging: Staging | None = None
            count = 0
            for i, batch in enumerate(iterator):
                if batch.num_rows == 0:
                    continue
                rows, keys = to_rows(messages_from_arrow(batch), settings, utcnow())
                rows = rows.append_column(KEY_COLUMN, pa.array(keys, pa.string()))
                if staging is None:
                    staging = Staging.create(ns.root, "stream-send")
                try:
                    staging.write(f"part-{i:05d}.parquet", rows)
                except OSError as exc:  # e.g. its directory removed by a staging cleanup (staging.py)
                    raise StorageError(f"staging the batch's rows in {staging.uri} failed: {exc}") from exc
                count += rows.num_rows
        except SparkQueueError as exc:
            raise task_error(exc) from exc
        return StagedBatch(staging.uri if staging else None, count)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - pyspark's name
        """Append the micro-batch in one commit keyed by (query id, batch id); a replayed batch sends nothing."""
        staged = [m for m in messages if isinstance(m, StagedBatch) and m.staging]
        address = self.config.address
        ns = address.namespace()
        try:
            app_id = APP_ID_PREFIX + (self.config.txn_app_id or query_id(self.config.checkpoint or ""))
            dirs = [Staging(m.staging) for m in staged if m.staging]
            tables = [d.read_file(name) for d in dirs for name in d.names()]
            _check_all_staged(tables, staged, batchId)
            if tables:
                rows = pa.concat_tables(tables)
                keys = rows.column(KEY_COLUMN).to_pylist()
                rows = rows.drop_columns([KEY_COLUMN])
                # The rows' "source position" is the batch id: storage drops rows at or below the version
                # it recorded for the app id (a forward's resume point), and skips the whole append when
                # this batch's version is recorded already.
                rows = with_columns(rows, sequence_number=constant(batchId, pa.int64(), rows.num_rows))
                once = idempotence_key(app_id, batchId)
                stored = ns.broker.send(address.entity_type, address.name, rows, keys, once)
                log.info(
                    "streaming batch %d: %d rows staged, %d stored in %s (%s)",
                    batchId,
                    rows.num_rows,
                    stored.num_rows,
                    address.display,
                    "sent" if stored.num_rows else "already sent by an earlier attempt, or all duplicates",
                )
            remove_dirs([m.staging for m in staged if m.staging])
            cleanup_staging(ns.root)
        finally:
            ns.close()

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - pyspark's name
        """A task failed: nothing was sent; drop what the successful tasks staged."""
        remove_dirs([m.staging for m in messages if isinstance(m, StagedBatch) and m.staging])
        log.info("streaming batch %d aborted; nothing was sent to %s", batchId, self.config.address.display)


def _check_all_staged(tables: list[pa.Table], staged: list[StagedBatch], batch_id: int) -> None:
    """StorageError when the staged files hold fewer rows than the tasks reported (a staging cleanup removed some).

    Sending what is left would let Spark record the batch as written with rows missing; failing
    sends nothing, and the restarted query writes the batch again from its source.
    """
    found, reported = sum(t.num_rows for t in tables), sum(m.rows for m in staged)
    if found != reported:
        raise StorageError(
            f"streaming batch {batch_id}: its tasks staged {reported} rows but {found} are left in their staging "
            "directories (removed by a staging cleanup while the batch ran?); nothing of the batch was sent"
        )


def query_id(checkpoint: str) -> str:
    """The streaming query's id, from `<checkpoint>/metadata` (Spark writes it when the query first starts)."""
    location = checkpoint.rstrip("/")
    if location.startswith("dbfs:/"):
        location = "/dbfs/" + location.removeprefix("dbfs:/").lstrip("/")
    elif location.startswith("file:"):
        location = "/" + location.removeprefix("file:").lstrip("/")
    try:
        fs, path = filesystem(location)
        with fs.open_input_stream(f"{path}/metadata") as f:
            return str(json.loads(f.read())["id"])
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidOperationError(
            f"cannot read the query id from {checkpoint}/metadata ({exc}); set .option('txnAppId', stable_id) instead"
        ) from None


def _worker_namespace(address: EntityAddress) -> Any:
    """This process's namespace handle for the address (Python workers are reused between tasks)."""
    with _lock:
        ns = _namespaces.get(address)
        if ns is None:
            ns = _namespaces[address] = address.namespace()
        return ns


def messages_from_arrow(batch: pa.RecordBatch) -> list[Message]:
    """Rows of a micro-batch as Messages (columns named as Message fields, in any case; others ignored)."""
    if renamed := field_renames(batch.schema.names, MESSAGE_FIELDS):
        batch = batch.rename_columns([renamed.get(name, name) for name in batch.schema.names])
    names = set(batch.schema.names)
    n = batch.num_rows
    cols: dict[str, list[Any]] = {name: batch.column(name).to_pylist() for name in (*STRING_FIELDS, "body") if name in names}
    props = _properties(batch.column("application_properties")) if "application_properties" in names else [None] * n
    ttls = _ttls(batch.column("time_to_live")) if "time_to_live" in names else [None] * n
    sched = batch.column("scheduled_enqueue_time_utc").to_pylist() if "scheduled_enqueue_time_utc" in names else [None] * n
    out = []
    for i in range(n):
        body = cols["body"][i]
        if body is None:  # as send_dataframe and Message: a body is bytes or str
            mid = cols["message_id"][i] if "message_id" in cols else None
            raise InvalidOperationError(f"body must be bytes or str, got null ({message_label(mid)})")
        out.append(
            Message(
                body,
                **{f: cols[f][i] for f in STRING_FIELDS if f in cols},
                application_properties=props[i],
                time_to_live=ttls[i],
                scheduled_enqueue_time_utc=sched[i],
            )
        )
    return out


def _properties(column: pa.Array) -> list[dict[str, Any] | None]:
    """Application properties from a map, a struct or a JSON object string column (null values kept, as send_dataframe does)."""
    values = column.to_pylist()
    out: list[dict[str, Any] | None] = []
    for v in values:
        if v is None:
            out.append(None)
        elif isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError:
                raise InvalidOperationError(f"application_properties must be a JSON object, got {v[:80]!r}") from None
            if not isinstance(parsed, dict):
                raise InvalidOperationError(f"application_properties must be a JSON object, got {v[:80]!r}")
            out.append(parsed or None)
        elif isinstance(v, list):  # a map: (key, value) pairs
            out.append(dict(v) or None)
        elif isinstance(v, dict):  # a struct
            out.append(v or None)
        else:
            raise InvalidOperationError(
                f"application_properties must be a map, a struct or a JSON string, got {type(v).__name__}"
            )
    return out


def _ttls(column: pa.Array) -> list[timedelta | None]:
    """Time to live from seconds (a number) or an interval."""
    if pa.types.is_duration(column.type):
        ttls: list[timedelta | None] = column.to_pylist()
        return ttls
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_decimal(column.type):
        return [None if v is None else _seconds_ttl(float(v)) for v in column.to_pylist()]
    raise InvalidOperationError(f"time_to_live must be seconds (a number) or an interval, got {column.type}")


def _seconds_ttl(seconds: float) -> timedelta | None:
    """A TTL from seconds by send_dataframe's rule (send._ttl_us), checked before a timedelta could overflow."""
    if not math.isfinite(seconds):
        raise InvalidOperationError(f"time_to_live must be a finite number of seconds, got {seconds!r}")
    if seconds >= limits.TTL_NEVER.total_seconds():
        return None  # as limits.check_ttl: Service Bus's infinite TTL or more never expires
    if seconds <= 0:
        raise InvalidOperationError(f"time_to_live must be positive, got {seconds!r} seconds")
    if int(seconds * 1_000_000) < limits.MIN_TTL_US:  # truncated as send._ttl_rule: 1e-9 s is too short, not "0"
        raise InvalidOperationError(f"time_to_live {limits.TTL_TOO_SHORT}, got {seconds!r} seconds")
    return timedelta(seconds=seconds)
