"""Arrow schemas of the Delta tables sparkqueue writes: entity tables and the namespace catalog.

Column order matters: Delta collects file statistics for the first 32 columns, and the
receive path prunes files by the min/max of `sequence_number`, `available_at_utc`,
`sub_queue` and `state`, so those come first and `body` comes last.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PARTITION_COLUMN = "partition_id"
TIMESTAMP = pa.timestamp("us", tz="UTC")

# Row kinds: a message, or a session's lock-and-state row (one per session).
KIND_MESSAGE = "message"
KIND_SESSION = "session"

# Scope of a topic's own operations: the rows of every subscription.
ANY_SUBSCRIPTION = "*"
# Subscription key of a topic's id records, the rows that record its accepted message ids (duplicate
# detection reads only these and a queue's rows). Subscription names cannot start with '$'.
ID_RECORD = "$accepted"

# Sub-queues.
SUB_QUEUE_MAIN = "main"
SUB_QUEUE_DEAD_LETTER = "deadletter"

# Stored states. "scheduled" is not stored: it is an active row whose scheduled time is ahead.
STATE_ACTIVE = "active"
STATE_DEFERRED = "deferred"
STATE_COMPLETED = "completed"  # tombstone kept for duplicate detection until its window passes

ENTITY_SCHEMA = pa.schema(
    [
        pa.field(PARTITION_COLUMN, pa.int32(), nullable=False),
        pa.field("sequence_number", pa.int64(), nullable=False),
        pa.field("available_at_utc", TIMESTAMP),  # next time a receive may take it; null = never
        pa.field("sub_queue", pa.string(), nullable=False),
        pa.field("subscription", pa.string()),  # topics: the subscription this copy belongs to; null in queues
        pa.field("state", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("enqueued_time_utc", TIMESTAMP, nullable=False),
        pa.field("expires_at_utc", TIMESTAMP),
        pa.field("scheduled_enqueue_time_utc", TIMESTAMP),
        pa.field("locked_until_utc", TIMESTAMP),
        pa.field("lock_token", pa.string()),
        pa.field("delivery_count", pa.int32(), nullable=False),
        pa.field("message_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string()),
        pa.field("partition_key", pa.string()),
        pa.field("correlation_id", pa.string()),
        pa.field("subject", pa.string()),
        pa.field("to", pa.string()),
        pa.field("reply_to", pa.string()),
        pa.field("reply_to_session_id", pa.string()),
        pa.field("content_type", pa.string()),
        pa.field("time_to_live_ms", pa.int64()),
        pa.field("size_in_bytes", pa.int32(), nullable=False),
        pa.field("transfer_hop_count", pa.int32(), nullable=False),
        pa.field("dead_letter_reason", pa.string()),
        pa.field("dead_letter_error_description", pa.string()),
        pa.field("dead_letter_source", pa.string()),
        pa.field("application_properties", pa.string()),  # JSON object: typed values survive
        pa.field("body", pa.binary()),
    ]
)

ENTITY_COLUMNS = ENTITY_SCHEMA.names

# The message's string properties (ids, keys and the rest), as columns of the same names.
STRING_PROPERTY_COLUMNS = (
    "message_id",
    "session_id",
    "partition_key",
    "content_type",
    "correlation_id",
    "subject",
    "to",
    "reply_to",
    "reply_to_session_id",
)

# The columns a settlement reads to validate a lock and write its change: no payload.
STATE_COLUMNS = [
    "sequence_number",
    "available_at_utc",
    "sub_queue",
    "subscription",
    "state",
    "kind",
    "enqueued_time_utc",
    "expires_at_utc",
    "scheduled_enqueue_time_utc",
    "locked_until_utc",
    "lock_token",
    "delivery_count",
    "message_id",
    "session_id",
    "size_in_bytes",
    "dead_letter_reason",
    "dead_letter_error_description",
    "dead_letter_source",
]

CATALOG_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),  # "queue:q1", "topic:t1", "subscription:t1/s1"
        pa.field("entity_type", pa.string(), nullable=False),
        pa.field("table_path", pa.string(), nullable=False),
        pa.field("properties", pa.string(), nullable=False),  # JSON of the entity settings
        pa.field("created_at_utc", TIMESTAMP, nullable=False),
        pa.field("updated_at_utc", TIMESTAMP, nullable=False),
    ]
)


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` cast to `schema`, or as they are when they already have it.

    `Table.cast` casts column by column even when nothing changes (36-85 us on the entity
    schemas, several times per commit); comparing the schemas first costs nothing, and where
    only nullability or metadata differ the columns are relabelled, not cast.
    """
    if rows.schema.equals(schema, check_metadata=True):
        return rows
    same_types = rows.schema.names == schema.names and all(a.type == b.type for a, b in zip(rows.schema, schema, strict=True))
    if same_types and all(f.nullable or col.null_count == 0 for f, col in zip(schema, rows.columns, strict=True)):
        return pa.Table.from_arrays(rows.columns, schema=schema)  # only nullability or metadata differ: no cast needed
    return rows.cast(schema)  # raises, as it should, on nulls in a non-nullable field


def constant(value: object, type_: pa.DataType, n: int) -> pa.Array:
    """n copies of one value (None: n nulls), without converting n Python objects.

    `pa.array([value] * n)` converts every copy: for 1,000 datetimes, 60 times the cost of this.
    """
    return pa.repeat(pa.scalar(value, type_), n)


def with_columns(rows: pa.Table, **cols: pa.Array | pa.ChunkedArray) -> pa.Table:
    """`rows` with whole columns replaced, each keeping its field (name, type, nullability: no cast later)."""
    for name, values in cols.items():
        i = rows.schema.get_field_index(name)
        rows = rows.set_column(i, rows.schema.field(i), values)
    return rows


def keep_rows(rows: pa.Table, mask: pa.Array | pa.ChunkedArray) -> pa.Table:
    """The rows where `mask` is true (null: dropped), as `Table.filter`; `rows` itself when every row is kept.

    `Table.filter` copies every column even when it keeps them all, bodies included: a lock of
    whole files filtered the same 16 MB of bodies three times before writing them once.
    """
    if len(mask) == 0 or (mask.null_count == 0 and pc.all(mask).as_py()):
        return rows
    return rows.filter(mask)


def in_sequence(rows: pa.Table) -> pa.Table:
    """Entity rows sorted by sequence number; `rows` itself when they already are (a sort copies every column)."""
    seqs = rows.column("sequence_number")
    if rows.num_rows < 2 or pc.all(pc.less(seqs.slice(0, rows.num_rows - 1), seqs.slice(1))).as_py():
        return rows
    return rows.sort_by("sequence_number")


def index_of(values: pa.Array | pa.ChunkedArray, keys: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per value, the position of its first occurrence in `keys`, null where it has none: `pc.index_in` for numbers.

    Sequence numbers (int64, no nulls) are looked up by a binary search of the sorted keys: a
    hash set built per call (`pc.index_in`, `pc.is_in`) cost 1-2 ms for every file a lock of
    16,384 messages touched, against a tenth of that. Other input goes to `pc.index_in`.
    The positions come as one int64 array (`pc.index_in` gives int32, chunked for chunked input):
    callers filter, take and test validity, which take either.
    """
    found = _search(values, keys)
    if found is None:
        return pc.index_in(values, value_set=keys)
    at, hit = found
    return pa.array(at, pa.int64(), mask=~hit)


def member_of(values: pa.Array | pa.ChunkedArray, keys: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Mask of the `values` found among `keys` (never null for values that are not): `pc.is_in` for numbers, see index_of."""
    found = _search(values, keys)
    if found is None:
        return pc.is_valid(pc.index_in(values, value_set=keys))
    return pa.array(found[1])


def _search(values: pa.Array | pa.ChunkedArray, keys: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per value, a position in `keys` and whether the value is there (binary search); None for input that is not
    int64 without nulls. Of equal keys the first is found (a stable sort of unsorted keys)."""
    if values.null_count or keys.null_count or not pa.types.is_int64(values.type) or not pa.types.is_int64(keys.type):
        return None
    v, k = _numbers(values), _numbers(keys)
    if len(k) == 0:
        return np.zeros(len(v), np.int64), np.zeros(len(v), bool)
    order = None if bool(np.all(k[1:] >= k[:-1])) else np.argsort(k, kind="stable")
    ordered = k if order is None else k[order]
    at = np.minimum(np.searchsorted(ordered, v), len(ordered) - 1)
    hit = ordered[at] == v
    return (at if order is None else order[at]), hit


def _numbers(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An int64 array without nulls as numpy (a view where Arrow allows it)."""
    out: np.ndarray = values.to_numpy() if isinstance(values, pa.ChunkedArray) else values.to_numpy(zero_copy_only=False)
    return out
