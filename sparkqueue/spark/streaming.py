"""Structured Streaming (docs/semantics.md §12): what the sparkqueue source and sink share; the data source's factories.

    spark.readStream.format("sparkqueue").option("namespace", root).load("orders")          # streaming_source.py
    df.writeStream.format("sparkqueue").option("namespace", root).option("checkpointLocation", c).start("orders")
                                                                                          # streaming_sink.py

Options (keys are case-insensitive, as Spark passes them):

- `namespace`: the namespace root (required).
- the entity: `.load(name)` / `.start(name)`, or option `entity`. A subscription is
  "<topic>/Subscriptions/<subscription>", or options `topic` and `subscription`.
- `storage_options`: a JSON object, and/or `storage_option.<key>` per key (as the batch reader).
- source only: `sub_queue` ("deadletter"), `maxMessagesPerTrigger`.
- sink only: `checkpointLocation` (its query id keys the idempotent commits) or `txnAppId`.

See docs/spark-streaming.md for the delivery guarantees.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkqueue.broker import sub_entity_name
from sparkqueue.errors import EntityNotFoundError, InvalidOperationError, SparkQueueError
from sparkqueue.model.addresses import QUEUE, SUBSCRIPTION, TOPIC, Address
from sparkqueue.storage.log import Fence

if TYPE_CHECKING:
    from pyspark.sql.datasource import DataSourceStreamReader, DataSourceStreamWriter
    from pyspark.sql.types import StructType

    from sparkqueue.model.entity import Entity
    from sparkqueue.namespace import Namespace

log = logging.getLogger(__name__)

STORAGE_OPTION_PREFIX = "storage_option."
# Options every sparkqueue reader and writer takes (lower-case, as Spark hands them over); `path` is load()'s/start()'s name.
COMMON_OPTIONS = frozenset({"namespace", "path", "storage_options"})


def lowered(options: Mapping[str, str]) -> dict[str, str]:
    """Options with lower-case keys (Spark hands data sources case-insensitive options)."""
    return {str(k).lower(): v for k, v in options.items()}


def check_options(options: Mapping[str, str], known: frozenset[str], what: str) -> None:
    """Refuse options (lower-cased keys) that `what` does not take: a misspelt one would otherwise be ignored silently."""
    if "paths" in options:  # what Spark makes of load([...])
        raise InvalidOperationError(f"the sparkqueue {what} reads one entity: load(name), not a list of names")
    allowed = COMMON_OPTIONS | known
    unknown = sorted(k for k in options if k not in allowed and not k.startswith(STORAGE_OPTION_PREFIX))
    if unknown:
        names = ", ".join(sorted(allowed | {f"{STORAGE_OPTION_PREFIX}<key>"}))
        raise InvalidOperationError(f"the sparkqueue {what} has no option {', '.join(map(repr, unknown))}; its options: {names}")


def storage_options_of(options: Mapping[str, str]) -> dict[str, str]:
    """Storage options from `.option("storage_options", json)` and `.option("storage_option.<key>", value)`."""
    out: dict[str, str] = {}
    text = options.get("storage_options")
    if text:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidOperationError(f"storage_options must be a JSON object: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidOperationError("storage_options must be a JSON object of strings")
        out.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in parsed.items()})  # true -> "true"
    out.update({k[len(STORAGE_OPTION_PREFIX) :]: str(v) for k, v in options.items() if k.startswith(STORAGE_OPTION_PREFIX)})
    return out


def open_namespace(root: str, storage_options: Mapping[str, str] | None = None) -> Namespace:
    """A handle on the existing namespace at `root` (storage options passed only when there are any).

    A reader or writer never creates a namespace: a mistyped root is an error, not a new empty one.
    """
    from sparkqueue.namespace import Namespace

    if storage_options:
        return Namespace(root, storage_options=dict(storage_options), create=False)
    return Namespace(root, create=False)


@dataclass(frozen=True)
class EntityAddress:
    """Where a stream reads or writes: namespace root, storage options, entity type and catalog name (picklable)."""

    root: str
    storage_options: tuple[tuple[str, str], ...]
    entity_type: str  # queue, topic (sink) or subscription (source)
    name: str  # catalog name: "<topic>|<subscription>" for subscriptions

    def namespace(self) -> Namespace:
        """A fresh namespace handle (each thread or process opens its own)."""
        return open_namespace(self.root, dict(self.storage_options))

    def entity(self, ns: Namespace) -> Entity:
        """The entity on a namespace handle (settings at most a second old)."""
        return ns.broker.entity(self.entity_type, self.name)

    @property
    def display(self) -> str:
        """The name as users write it."""
        return Address.of(self.entity_type, self.name).path


def address_of(options: Mapping[str, str], *, sink: bool) -> EntityAddress:
    """The entity the (lower-cased) options name; raises a clear error when it is missing or unknown.

    The source reads queues and subscriptions (option entity_type narrows which); the sink writes queues and topics.
    """
    root = options.get("namespace")
    if not root:
        raise InvalidOperationError('set the namespace root: .option("namespace", root)')
    names = _names(options, sink)
    storage = storage_options_of(options)
    kind = None if sink else entity_type_of(options.get("entity_type"))
    ns = open_namespace(root, storage)
    try:
        found = {form: resolve_name(ns, name, sink=sink, entity_type=kind) for form, name in names.items()}
    finally:
        ns.close()
    if len({(a.entity_type, a.name.lower()) for a in found.values()}) > 1:  # names are case-insensitive
        # which one won used to depend on the option: a stream could drain, or a sink send to, another entity
        forms = {"path": f".{'start' if sink else 'load'}(name)", "entity": 'option "entity"', "topic": 'option "topic"'}
        named = ", ".join(f"{forms[k]} = {v!r}" for k, v in names.items())
        raise InvalidOperationError(f"the options name different entities ({named}); name it one way")
    address = next(iter(found.values()))
    topic = options.get("topic")
    if topic and not sink and "topic" not in names:  # .option("topic", "t").load("t/s"): the same subscription, or refused
        owner = Address.of(SUBSCRIPTION, address.name).topic if address.entity_type == SUBSCRIPTION else None
        if owner is None or owner.lower() != topic.lower():
            raise InvalidOperationError(f'option "topic" = {topic!r}, but {address.display!r} is not one of its subscriptions')
    if sink and "topic" in names and address.entity_type != TOPIC:
        raise InvalidOperationError(f'option "topic" names {names["topic"]!r}, which is a {address.entity_type}, not a topic')
    return address


def _names(options: Mapping[str, str], sink: bool) -> dict[str, str]:
    """The entity names the options give, by form: `.load(name)`/`.start(name)`, option "entity", "topic" (+ "subscription")."""
    topic, subscription = options.get("topic"), options.get("subscription")
    if subscription and not topic:
        raise InvalidOperationError('option "subscription" needs option "topic" too')
    named = options.get("path") or options.get("entity")
    if topic and not sink and not subscription and not named:
        raise InvalidOperationError(f'option "topic" needs option "subscription": the source reads a subscription of {topic!r}')
    by_topic = None  # a topic alone beside a subscription's name: checked against it (address_of)
    if topic and sink:
        by_topic = topic
    elif topic and subscription:
        by_topic = Address.subscription_of(topic, subscription).path
    given = {k: v for k, v in (("path", options.get("path")), ("entity", options.get("entity")), ("topic", by_topic)) if v}
    if not given:
        what = "queue or topic" if sink else "queue or subscription"
        raise InvalidOperationError(f'name the {what}: .{"start" if sink else "load"}(name) or .option("entity", name)')
    return given


def entity_type_of(value: str | None) -> str | None:
    """The `entity_type` option of a read: None, 'queue' or 'subscription' (in any case, as sub_queue is read)."""
    kind = value.lower() if isinstance(value, str) and value else None
    if kind not in (None, QUEUE, SUBSCRIPTION):
        raise InvalidOperationError(f"entity_type must be 'queue' or 'subscription', got {value!r}")
    return kind


def resolve_name(ns: Namespace, name: str, *, sink: bool, entity_type: str | None = None) -> EntityAddress:
    """The entity a name gives, on a namespace handle: a queue or subscription to read, a queue or topic to send to.

    "<topic>/Subscriptions/<subscription>" names a subscription, as Service Bus paths do; "<topic>/<subscription>"
    too, unless a queue has that name (queue names may hold '/'). `entity_type` (reads) takes only that kind.
    """
    frozen = tuple(sorted(ns.storage_options.items()))
    topic, sub = Address.split_path(name)
    if entity_type == SUBSCRIPTION and sub is None:
        short = Address.split_short(name)
        if short is None:
            raise InvalidOperationError(f"name a subscription as '<topic>/Subscriptions/<subscription>', got {name!r}")
        topic, sub = short
    if sub is not None and entity_type != QUEUE:
        if sink:
            raise InvalidOperationError(f"the sink sends to a queue or topic, not to a subscription ({name!r})")
        ns.broker.entry(SUBSCRIPTION, sub_entity_name(topic, sub))  # EntityNotFoundError when absent
        return EntityAddress(ns.root, frozen, SUBSCRIPTION, sub_entity_name(topic, sub))
    # In the CLI's order (cli/ops.resolve): a queue, a topic, then (reads) the short "<topic>/<subscription>" form.
    for kind in (QUEUE, TOPIC):
        with contextlib.suppress(EntityNotFoundError):
            ns.broker.entry(kind, name)
            if kind == TOPIC and not sink:
                raise InvalidOperationError(f"{name!r} is a topic; read one of its subscriptions ('{name}/Subscriptions/<name>')")
            return EntityAddress(ns.root, frozen, kind, name)
    short = None if sink or entity_type == QUEUE else Address.split_short(name)
    if short is not None:
        with contextlib.suppress(EntityNotFoundError):
            ns.broker.entry(SUBSCRIPTION, sub_entity_name(*short))
            return EntityAddress(ns.root, frozen, SUBSCRIPTION, sub_entity_name(*short))
    what = "queue or topic" if sink else "queue, topic or subscription"  # named for all it looked for
    raise EntityNotFoundError(f"no {what} named {name!r} in namespace {ns.root!r}")


def positive_int(options: Mapping[str, str], key: str, default: int) -> int:
    """An integer option that must be positive."""
    raw = options.get(key.lower())
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw))
    except ValueError:
        raise InvalidOperationError(f"{key} must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise InvalidOperationError(f"{key} must be a positive integer, got {raw!r}")
    return value


def idempotence_key(app_id: str, version: int) -> Fence:
    """The storage's idempotent-append key: a Delta `txn` (app id, version)."""
    return Fence(app_id, version)


def stream_reader(options: Mapping[str, str], schema: StructType) -> DataSourceStreamReader:
    """The streaming source's reader (called by the `sparkqueue` data source)."""
    from sparkqueue.spark.schema import check_read_schema
    from sparkqueue.spark.streaming_source import QueueStreamReader, RefusedStreamReader, source_config

    try:
        check_read_schema(schema)
        config = source_config(lowered(options))
    except SparkQueueError as exc:
        return RefusedStreamReader(exc)  # raised at the first offset: pyspark would mask it here
    return QueueStreamReader(config)


def stream_writer(options: Mapping[str, str], schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
    """The streaming sink's writer (called by the `sparkqueue` data source)."""
    from sparkqueue.spark.streaming_sink import QueueStreamWriter, sink_config

    return QueueStreamWriter(sink_config(lowered(options), schema))
