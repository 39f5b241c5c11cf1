"""Column layouts of the Spark API: received-message DataFrames, settle results, and their Arrow forms.

A received DataFrame has the `ReceivedMessage` fields as columns. `application_properties` is a
map<string,string> (string values as they are; numbers and booleans as their JSON text) and
`time_to_live` a day-time interval. Staged files keep the time to live as milliseconds, because
Parquet has no interval type; the DataFrame over them computes the interval.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import types as st

from sparkqueue.errors import InvalidOperationError
from sparkqueue.model.lifecycle import scheduled_rows
from sparkqueue.storage.files import FILE_SCHEMA
from sparkqueue.storage.schema import STATE_ACTIVE, SUB_QUEUE_MAIN, TIMESTAMP

PROPS_TYPE = pa.map_(pa.string(), pa.string())


def field_renames(columns: Iterable[str], fields: Iterable[str]) -> dict[str, str]:
    """Columns that name one of `fields` in another case (`Message_ID`), each mapped to its field; as Spark resolves names.

    Such columns were ignored by sends, so a duplicate-detecting queue stored repeats under fresh
    ids. Two columns naming one field are refused.
    """
    by_lower = {f.lower(): f for f in fields}
    seen: dict[str, str] = {}
    for column in columns:
        field = by_lower.get(column.lower())
        if field is None:
            continue
        if field in seen:
            raise InvalidOperationError(f"columns {seen[field]!r} and {column!r} both name the message field {field!r}")
        seen[field] = column
    return {column: field for field, column in seen.items() if column != field}


# Received messages as staged (Arrow / Parquet): time to live in milliseconds.
STAGED_SCHEMA = pa.schema(
    [
        pa.field("body", pa.binary()),
        pa.field("message_id", pa.string()),
        pa.field("sequence_number", pa.int64()),
        pa.field("partition_id", pa.int32()),
        pa.field("enqueued_time_utc", TIMESTAMP),
        pa.field("delivery_count", pa.int32()),
        pa.field("state", pa.string()),
        pa.field("lock_token", pa.string()),
        pa.field("locked_until_utc", TIMESTAMP),
        pa.field("expires_at_utc", TIMESTAMP),
        pa.field("session_id", pa.string()),
        pa.field("partition_key", pa.string()),
        pa.field("application_properties", PROPS_TYPE),
        pa.field("content_type", pa.string()),
        pa.field("correlation_id", pa.string()),
        pa.field("subject", pa.string()),
        pa.field("to", pa.string()),
        pa.field("reply_to", pa.string()),
        pa.field("reply_to_session_id", pa.string()),
        pa.field("time_to_live_ms", pa.int64()),
        pa.field("scheduled_enqueue_time_utc", TIMESTAMP),
        pa.field("dead_letter_reason", pa.string()),
        pa.field("dead_letter_error_description", pa.string()),
        pa.field("dead_letter_source", pa.string()),
        pa.field("size_in_bytes", pa.int32()),
    ]
)

# Received messages as users see them (Arrow form, as the data source yields it).
RECEIVED_ARROW_SCHEMA = pa.schema(
    [pa.field("time_to_live", pa.duration("us")) if f.name == "time_to_live_ms" else f for f in STAGED_SCHEMA]
)

_ARROW_TO_SPARK: dict[pa.DataType, st.DataType] = {
    pa.int32(): st.IntegerType(),
    pa.int64(): st.LongType(),
    pa.string(): st.StringType(),
    pa.binary(): st.BinaryType(),
    TIMESTAMP: st.TimestampType(),
    PROPS_TYPE: st.MapType(st.StringType(), st.StringType()),
    pa.duration("us"): st.DayTimeIntervalType(),
}


def _struct(schema: pa.Schema) -> st.StructType:
    """The Spark schema of an Arrow layout of sparkqueue's (every field nullable, as Spark reads files)."""
    return st.StructType([st.StructField(f.name, _ARROW_TO_SPARK[f.type]) for f in schema])


RECEIVED_SCHEMA = _struct(RECEIVED_ARROW_SCHEMA)
RECEIVED_COLUMNS = RECEIVED_ARROW_SCHEMA.names

SETTLE_RESULT_SCHEMA = pa.schema([pa.field("lock_token", pa.string()), pa.field("status", pa.string())])
SETTLE_RESULT_SPARK = st.StructType([st.StructField("lock_token", st.StringType()), st.StructField("status", st.StringType())])
STATUS_OK = "ok"
STATUS_LOCK_LOST = "lock_lost"


# An entity table's data file as Spark reads it (the partition id lives in the path, not the file).
ENTITY_FILE_SPARK = _struct(FILE_SCHEMA)


def received_from_entity_rows(now: datetime) -> list[str]:
    """SQL expressions turning entity rows (ENTITY_FILE_SPARK) into the received-message layout; Spark's staged_rows.

    For `DataFrame.selectExpr`: one call to the JVM, where building the same projection from
    Column objects made about 900 (0.2 s of every DataFrame receive). `now` decides which active
    messages report the state "scheduled", as staged_rows does.
    """
    at = pa.scalar(now, TIMESTAMP).value  # epoch microseconds: a literal no session time zone reinterprets
    # lifecycle.scheduled_rows in Spark: a dead letter whose scheduled time is ahead is no scheduled message
    scheduled = (
        f"sub_queue = '{SUB_QUEUE_MAIN}' AND state = '{STATE_ACTIVE}' AND scheduled_enqueue_time_utc > timestamp_micros({at})"
    )
    computed = {
        "partition_id": "CAST(shiftright(sequence_number, 48) AS INT)",
        "state": f"CASE WHEN {scheduled} THEN 'scheduled' ELSE state END",
        # from_json keeps string values as they are and gives numbers and booleans as their JSON text (props_map)
        "application_properties": "from_json(application_properties, 'map<string,string>')",
        "time_to_live": "time_to_live_ms * INTERVAL '0.001' SECOND",
        # a locked row is stored with this delivery counted; a message reports the ended ones (0 first)
        "delivery_count": "CAST(CASE WHEN lock_token IS NOT NULL THEN delivery_count - 1 ELSE delivery_count END AS INT)",
    }
    return [f"{computed.get(name, f'`{name}`')} AS `{name}`" for name in RECEIVED_COLUMNS]


def props_map(json_props: pa.ChunkedArray | pa.Array) -> pa.Array:
    """JSON application properties as map<string,string>: strings as they are, other values as their JSON text."""
    out: list[list[tuple[str, str | None]] | None] = []
    for text in json_props.to_pylist():
        if text is None:
            out.append(None)
            continue
        out.append([(k, v if isinstance(v, str) or v is None else json.dumps(v)) for k, v in json.loads(text).items()])
    return pa.array(out, PROPS_TYPE)


def staged_rows(rows: pa.Table, now: datetime) -> pa.Table:
    """Entity rows (ROW_COLUMNS) as staged received messages, with partition id and the reported state."""
    seq = rows.column("sequence_number")
    state = pc.if_else(scheduled_rows(rows, now), "scheduled", rows.column("state"))
    computed = {
        "partition_id": pc.shift_right(seq, 48).cast(pa.int32()),
        "state": state,
        "application_properties": props_map(rows.column("application_properties")),
        "body": pc.fill_null(rows.column("body"), b""),
        # a live lock's delivery is stored already; the SDK counts only deliveries that ended
        "delivery_count": pc.if_else(
            pc.fill_null(pc.greater(rows.column("locked_until_utc"), pa.scalar(now, TIMESTAMP)), False),
            pc.subtract(rows.column("delivery_count"), 1),
            rows.column("delivery_count"),
        ).cast(pa.int32()),
    }
    arrays = [computed[f.name] if f.name in computed else rows.column(f.name) for f in STAGED_SCHEMA]
    return pa.Table.from_arrays([pa.chunked_array(a) if isinstance(a, pa.Array) else a for a in arrays], schema=STAGED_SCHEMA)


def received_arrow(staged: pa.Table) -> pa.Table:
    """Staged rows in the user-facing Arrow layout (time to live as a duration)."""
    ttl = pc.multiply(staged.column("time_to_live_ms"), 1000).cast(pa.duration("us"))
    i = staged.schema.get_field_index("time_to_live_ms")
    return staged.set_column(i, RECEIVED_ARROW_SCHEMA.field("time_to_live"), ttl)


def check_read_schema(schema: st.StructType) -> None:
    """A read's schema (a user's `.schema(...)` replaces the source's) must be the received-message layout it emits."""
    if [(f.name, f.dataType) for f in schema.fields] != [(f.name, f.dataType) for f in RECEIVED_SCHEMA.fields]:
        raise InvalidOperationError(
            "the sparkqueue source has a fixed schema (sparkqueue.spark.RECEIVED_SCHEMA): load without .schema(...) "
            "and select the columns you need"
        )
