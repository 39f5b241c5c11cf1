"""Read an entity as a DataFrame without locking: the `sparkqueue` Python data source (docs/semantics.md §12).

    df = spark.read.format("sparkqueue").option("namespace", root).load("orders")
    dlq = spark.read.format("sparkqueue").option("namespace", root).option("sub_queue", "deadletter").load("orders")

Any SparkSession finds the format by itself: Spark discovers the installed module
`pyspark_sparkqueue` (its `DefaultSource` delegates here), provided Spark's Python workers run
an interpreter where sparkqueue is installed (PYSPARK_PYTHON / spark.pyspark.python).
`register(spark)` registers it explicitly, e.g. on a session whose workers cannot discover it.

The reader pins the table version when the query is planned and reads that version's Parquet
files directly (delta-rs writes no deletion vectors or column mapping), one reader partition
per Delta partition. Spark applies every filter itself: the reader takes no pushed filters,
because Spark keeps one reader per loaded DataFrame and a partition set pushed by one query
would narrow the next query on the same DataFrame. Rows are the live messages of the sub-queue
(completed tombstones excluded) in the received-message layout, with `state` active, deferred
or scheduled; lock columns show current locks.

Subscriptions load as "<topic>/Subscriptions/<subscription>" or "<topic>/<subscription>" (or option entity_type=subscription);
options `entity`, or `topic` with `subscription`, name the entity instead of `load(name)`, as for the streaming source.

With the Delta Lake jars on the cluster, `spark.read.format("delta").load(table_path(ns, name))`
reads the same table; `row_filter(...)` gives the predicate that selects an entity's live messages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.types import StructType

from sparkqueue.broker import split_subscription_path
from sparkqueue.errors import InvalidOperationError, StorageCorruptedError
from sparkqueue.model.addresses import QUEUE, SUBSCRIPTION
from sparkqueue.model.entity import ROW_COLUMNS, utcnow
from sparkqueue.spark import streaming
from sparkqueue.spark.schema import RECEIVED_SCHEMA, check_read_schema, received_arrow, staged_rows
from sparkqueue.storage.files import DataFiles
from sparkqueue.storage.index import FileIndex
from sparkqueue.storage.log import DeltaLog
from sparkqueue.storage.schema import (
    KIND_MESSAGE,
    STATE_COMPLETED,
    SUB_QUEUE_DEAD_LETTER,
    SUB_QUEUE_MAIN,
)
from sparkqueue.storage.store import open_store

log = logging.getLogger(__name__)

SUB_QUEUES = {
    None: SUB_QUEUE_MAIN,
    "": SUB_QUEUE_MAIN,
    "main": SUB_QUEUE_MAIN,
    "deadletter": SUB_QUEUE_DEAD_LETTER,
    "dead_letter": SUB_QUEUE_DEAD_LETTER,
    "$deadletterqueue": SUB_QUEUE_DEAD_LETTER,
}
WRITE_REFUSED = (
    'df.write.format("sparkqueue") is not supported: send a DataFrame with sender.send_dataframe(df), '
    'or stream one with df.writeStream.format("sparkqueue")'
)
READ_COLUMNS = list(dict.fromkeys([*ROW_COLUMNS, "kind", "subscription"]))
READ_OPTIONS = frozenset({"entity_type", "sub_queue", "entity", "topic", "subscription"})  # beside streaming.COMMON_OPTIONS
NAMING_OPTIONS = frozenset({"entity", "topic", "subscription"})  # another way to name the entity, as the stream source


def register(spark: SparkSession) -> None:
    """Register the `sparkqueue` data source on a session, unless Spark found it installed (`pyspark_sparkqueue`)."""
    try:
        found = bool(spark._jsparkSession.sessionState().dataSourceManager().dataSourceExists(SparkQueueDataSource.name()))
    except Exception:  # Spark Connect, or a JVM API that moved: registering again is harmless
        found = False
    if not found:
        spark.dataSource.register(SparkQueueDataSource)


def resolve(
    namespace: object, name: str, entity_type: str | None = None, storage_options: dict[str, str] | None = None
) -> tuple[str, str, str | None]:
    """(Delta table URI, entity type, subscription key or None) of a queue or subscription name (streaming.resolve_name).

    "<topic>/Subscriptions/<subscription>" names a subscription, as Service Bus paths do; "<topic>/<subscription>"
    too, unless a queue has that name (queue names may hold '/').
    """
    from sparkqueue.namespace import Namespace

    kind = streaming.entity_type_of(entity_type)
    ns = namespace if isinstance(namespace, Namespace) else streaming.open_namespace(str(namespace), storage_options)
    address = streaming.resolve_name(ns, name, sink=False, entity_type=kind)
    table = ns.broker.entry(address.entity_type, address.name).table_path
    if address.entity_type == SUBSCRIPTION:
        path, key = split_subscription_path(table)
        return ns.table_uri(path), SUBSCRIPTION, key
    return ns.table_uri(table), QUEUE, None


def table_path(namespace: object, name: str, entity_type: str | None = None) -> str:
    """The Delta table that stores a queue or subscription (subscriptions share their topic's table)."""
    return resolve(namespace, name, entity_type)[0]


def row_filter(namespace: object, name: str, entity_type: str | None = None, sub_queue: str | None = None) -> str:
    """A SQL predicate selecting an entity's live messages of a sub-queue in its Delta table."""
    _, _, key = resolve(namespace, name, entity_type)
    scope = "subscription IS NULL" if key is None else f"subscription = '{key}'"
    return f"kind = '{KIND_MESSAGE}' AND {scope} AND sub_queue = '{sub_queue_of(sub_queue)}' AND state <> '{STATE_COMPLETED}'"


def sub_queue_of(value: str | None) -> str:
    key = value.lower() if isinstance(value, str) else value
    if key not in SUB_QUEUES:
        raise InvalidOperationError(f"sub_queue must be 'deadletter' or unset, got {value!r}")
    return SUB_QUEUES[key]


class EntityPartition(InputPartition):
    """One Delta partition of the pinned version: its data files, ordered by lowest sequence number."""

    def __init__(self, partition_id: int, paths: list[str]) -> None:
        super().__init__(partition_id)
        self.partition_id = partition_id
        self.paths = paths


class SparkQueueDataSource(DataSource):
    """`spark.read.format("sparkqueue").option("namespace", root).load(entity)`: an entity's messages, unlocked."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "sparkqueue"

    def schema(self) -> StructType:
        """The received-message layout, once the options pass `check_load` (so a mistake fails `load()`)."""
        check_load(dict(self.options))
        return RECEIVED_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader pinned to the table's current version."""
        return make_reader(dict(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """Refused with the calls that send a DataFrame (a batch write would have no sender's checks and no fences)."""
        raise InvalidOperationError(WRITE_REFUSED)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802 - pyspark's name
        """`spark.readStream.format("sparkqueue")`: peek-locked micro-batches (sparkqueue.spark.streaming_source)."""
        return streaming.stream_reader(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802 - pyspark's name
        """`df.writeStream.format("sparkqueue")`: each micro-batch sent once (sparkqueue.spark.streaming_sink)."""
        return streaming.stream_writer(self.options, schema, overwrite)


def check_load(options: dict[str, str]) -> None:
    """Check at `load()` what the read needs, so a mistake fails there and not in a started streaming query.

    Spark asks for the schema before it knows whether a batch read or a stream follows. Options
    only the streaming source takes (`entity`, `maxMessagesPerTrigger` ...) get the source's whole
    check; otherwise the reader's, which a stream needs as well (an option the reader does not take
    is then neither's).
    """
    from sparkqueue.spark.streaming_source import SOURCE_OPTIONS, source_config

    options = streaming.lowered(options)
    if options.keys() & (SOURCE_OPTIONS - READ_OPTIONS):
        source_config(options)
    else:
        ReadTarget.of(options)


def make_reader(options: dict[str, str], schema: StructType) -> DataSourceReader:
    """The entity's reader (pinned to the table's current version), for the schema it emits."""
    check_read_schema(schema)
    return EntityReader(options)


@dataclass(frozen=True)
class ReadTarget:
    """What a batch read's (lower-cased) options name: the entity's table, its subscription key, the sub-queue."""

    table_uri: str
    subscription: str | None
    sub_queue: str
    storage_options: dict[str, str]

    @classmethod
    def of(cls, options: dict[str, str]) -> ReadTarget:
        """The options checked and the entity resolved (its namespace and it must exist); no table is read."""
        streaming.check_options(options, READ_OPTIONS, "reader")
        root = options.get("namespace")
        name, entity_type = options.get("path"), options.get("entity_type")
        if options.keys() & NAMING_OPTIONS:  # named as the stream source names it, checked the same way
            address = streaming.address_of(options, sink=False)
            name, entity_type = address.display, entity_type or address.entity_type
        if not root or not name:
            raise InvalidOperationError('use spark.read.format("sparkqueue").option("namespace", root).load(entity_name)')
        storage = streaming.storage_options_of(options)
        table_uri, _, subscription = resolve(root, name, entity_type, storage)
        return cls(table_uri, subscription, sub_queue_of(options.get("sub_queue")), storage)


class EntityReader(DataSourceReader):
    """Reads the pinned version's files of one entity, a Delta partition per reader partition."""

    def __init__(self, options: dict[str, str]) -> None:
        target = ReadTarget.of(streaming.lowered(options))
        self.table_uri, self.subscription, self.sub_queue = target.table_uri, target.subscription, target.sub_queue
        self.storage_options = target.storage_options
        try:
            snap = DeltaLog(open_store(self.table_uri, self.storage_options), FileIndex).load()
        except FileNotFoundError as exc:  # resolve() found the entity in the catalog: its table is lost, not deleted
            raise StorageCorruptedError(f"table {self.table_uri} is missing, though the namespace catalog names it") from exc
        self.version = snap.version
        self.files = _files_by_partition(snap.files)
        log.debug("reading %s at version %d (%d partitions)", self.table_uri, self.version, len(self.files))

    def partitions(self) -> list[InputPartition]:
        """One input partition per Delta partition holding files (at least one, possibly empty)."""
        parts: list[InputPartition] = [EntityPartition(p, paths) for p, paths in sorted(self.files.items())]
        return parts or [EntityPartition(-1, [])]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The partition's live messages of the sub-queue, file by file in sequence order."""
        assert isinstance(partition, EntityPartition)
        data = DataFiles(open_store(self.table_uri, self.storage_options))
        now = utcnow()
        for path in partition.paths:
            t = data.read(path, READ_COLUMNS)
            sub = t.column("subscription")
            scope = pc.is_null(sub) if self.subscription is None else pc.fill_null(pc.equal(sub, self.subscription), False)
            mask = pc.and_(
                pc.and_(pc.equal(t.column("kind"), KIND_MESSAGE), scope),
                pc.and_(pc.equal(t.column("sub_queue"), self.sub_queue), pc.not_equal(t.column("state"), STATE_COMPLETED)),
            )
            t = t.filter(mask)
            if t.num_rows:
                yield from received_arrow(staged_rows(t.sort_by("sequence_number"), now)).to_batches()


def _files_by_partition(index: FileIndex) -> dict[int, list[str]]:
    """Relative paths of the version's data files per partition, ordered by lowest sequence number."""
    return {p: [f.path for f in index.partition(p)] for p in sorted({f.partition for f in index})}
