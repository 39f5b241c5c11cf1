"""The namespace: client and administration client in one (SDK: ServiceBusClient + ServiceBusAdministrationClient)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sparkqueue.constants import ReceiveMode, SubQueue
from sparkqueue.errors import EntityNotFoundError, InvalidOperationError, SparkQueueError
from sparkqueue.management import (
    PROPERTY_TYPES,
    Management,
    rule_from_entry,
    split_subscription_path,
    sub_entity_name,
)
from sparkqueue.model import limits
from sparkqueue.model.addresses import QUEUE, RULE, SUBSCRIPTION, TOPIC, Address
from sparkqueue.model.deadlines import effective
from sparkqueue.model.entity import Entity
from sparkqueue.model.forwarding import MAX_HOPS, forward, routes
from sparkqueue.model.properties import SubscriptionProperties, TopicProperties
from sparkqueue.model.sessions import SessionInfo, Sessions
from sparkqueue.model.topics import Rule, Subscriber, fan_out
from sparkqueue.receiver import Receiver
from sparkqueue.sender import Sender
from sparkqueue.storage.catalog import Catalog, CatalogEntry
from sparkqueue.storage.faults import FaultInjector
from sparkqueue.storage.retry import Deadline
from sparkqueue.storage.schema import ANY_SUBSCRIPTION
from sparkqueue.storage.store import check_storage_options, open_store, resolve_root
from sparkqueue.storage.table import EntityTable, Expand
from sparkqueue.transaction import Transaction

log = logging.getLogger(__name__)

PROPERTIES_TTL_S = 1.0  # how long a process trusts cached settings and rules before re-reading the catalog


@dataclass
class _Cached:
    entity: Entity
    table_path: str
    loaded_at: float


@dataclass
class _CachedRules:
    subscribers: list[Subscriber]
    record_ids: bool
    loaded_at: float
    forwarding: list[str]  # names of the subscriptions that forward (forward_to or dead letters)


class Namespace(Management):
    """A root location holding a catalog and one Delta table per queue or topic; opened (and created) by path or URI."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        tier: str = limits.STANDARD,
        *,
        operation_timeout: float = 60.0,
        storage_options: Mapping[str, str] | None = None,
    ) -> None:
        self.root = resolve_root(root)
        self.tier = limits.check_tier(tier)
        self.operation_timeout = limits.check_seconds(operation_timeout, "operation_timeout")  # finite: NaN never expires
        self.storage_options = check_storage_options(storage_options)
        self.store = open_store(self.root, self.storage_options)
        self._catalog = Catalog(self.store, self.storage_options)
        self._catalog.open()
        self._cache: dict[str, _Cached] = {}
        self._tables: dict[str, EntityTable] = {}
        self._rules: dict[str, _CachedRules] = {}
        self._faults: dict[str, FaultInjector] = {}
        self._lock = threading.RLock()
        self._local = threading.local()

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop cached handles and settings; the namespace may be entered again afterwards."""
        with self._lock:
            self._cache.clear()
            self._tables.clear()
            self._rules.clear()

    def __repr__(self) -> str:
        return f"Namespace({self.root!r}, tier={self.tier!r})"

    # ---- faults (tests and drills) ---------------------------------------------------------------

    def fault_injector(self, entity_name: str, entity_type: str = QUEUE) -> FaultInjector:
        """This process's fault hook on a queue's or topic's table (a topic's covers its subscriptions)."""
        if entity_type not in (QUEUE, TOPIC):
            raise InvalidOperationError("faults are injected on a queue's or a topic's table")
        with self._lock:
            return self._faults.setdefault(Address.of(entity_type, entity_name).key, FaultInjector())

    # ---- entity resolution ---------------------------------------------------------------------

    def _deadline(self) -> Deadline:
        return Deadline(effective(self.operation_timeout))

    def _entry(self, entity_type: str, name: str) -> CatalogEntry:
        entry = self._catalog.get(Address.of(entity_type, name).key)
        if entry is None:
            shown = name.replace("|", "/")
            raise EntityNotFoundError(f"{entity_type} {shown!r} does not exist in namespace {self.root!r}")
        return entry

    def _forget(self, key: str) -> None:
        """Drop cached settings of an entity (after an update or delete)."""
        with self._lock:
            self._cache.pop(key, None)
            self._rules.pop(key, None)

    def _entity(self, entity_type: str, name: str) -> Entity:
        """The entity with settings at most PROPERTIES_TTL_S old; raises EntityNotFoundError."""
        key = Address.of(entity_type, name).key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and time.monotonic() - cached.loaded_at < PROPERTIES_TTL_S:
                return cached.entity
        entry = self._entry(entity_type, name)
        props = PROPERTY_TYPES[entity_type].from_json(entry.properties)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.table_path == entry.table_path:
                cached.entity.props = props
                cached.loaded_at = time.monotonic()
                return cached.entity
            sub_key: str | None
            if entity_type == SUBSCRIPTION:
                path, sub_key = split_subscription_path(entry.table_path)
                owner = Address.of(SUBSCRIPTION, name).owner().key
            else:
                path, sub_key = entry.table_path, ANY_SUBSCRIPTION if entity_type == TOPIC else None
                owner = key
            entity = Entity(props, self._table(path, props.partition_count, owner), self.operation_timeout, sub_key)
            self._cache[key] = _Cached(entity, entry.table_path, time.monotonic())
            return entity

    def table_uri(self, table_path: str) -> str:
        """Where a catalog table path lives: paths are recorded relative to the root (so a copied namespace is its own)."""
        return table_path if "://" in table_path or table_path.startswith("/") else f"{self.root}/{table_path}"

    def _table(self, path: str, partition_count: int, owner: str) -> EntityTable:
        """One table handle per Delta table, shared by a topic and its subscriptions."""
        with self._lock:
            table = self._tables.get(path)
            if table is None:
                faults = self._faults.setdefault(owner, FaultInjector())
                table = EntityTable(self.table_uri(path), partition_count, faults, self.storage_options)
                self._tables[path] = table
            return table

    def _props(self, entity_type: str, name: str) -> Any:
        return self._entity(entity_type, name).props

    def _expander(self, entity_type: str, name: str) -> Expand | None:
        """How a send to the entity turns messages into rows: topic fan-out, or as-is for a queue."""
        if entity_type != TOPIC:
            return None
        cached = self._topic_rules(name)
        subscribers, record_ids = cached.subscribers, cached.record_ids
        cap = limits.MAX_MESSAGE_BYTES[self.tier]
        return lambda rows: fan_out(rows, subscribers, record_ids, cap)

    def _topic_rules(self, name: str) -> _CachedRules:
        """A topic's subscribers with their rules, and which of them forward; cached for PROPERTIES_TTL_S."""
        key = Address.of(TOPIC, name).key
        with self._lock:
            cached = self._rules.get(key)
        if cached is None or time.monotonic() - cached.loaded_at >= PROPERTIES_TTL_S:
            entries = self._catalog.entries()  # one read for the topic, its subscriptions and rules
            topic = next((e for e in entries if e.name == key), None)
            if topic is None:
                raise EntityNotFoundError(f"topic {name!r} does not exist in namespace {self.root!r}")
            record_ids = TopicProperties.from_json(topic.properties).requires_duplicate_detection
            forwarding = []
            for e in entries:
                address = Address.parse(e.name)
                if e.entity_type != SUBSCRIPTION or address.topic != name:
                    continue
                sub = address.leaf
                props = SubscriptionProperties.from_json(e.properties)
                if props.forward_to or props.forward_dead_lettered_messages_to:
                    forwarding.append(sub)
            cached = _CachedRules(self._subscribers(name, entries), record_ids, time.monotonic(), forwarding)
            with self._lock:
                self._rules[key] = cached
        return cached

    def _subscribers(self, topic_name: str, entries: list[CatalogEntry] | None = None) -> list[Subscriber]:
        """The topic's subscriptions with their rules, read from the catalog in one pass."""
        entries = self._catalog.entries() if entries is None else entries
        rules: dict[str, list[Rule]] = {}
        for e in entries:
            address = Address.parse(e.name)
            if e.entity_type == RULE and address.topic == topic_name and address.subscription is not None:
                sub = address.subscription
                rp = rule_from_entry(e)
                rules.setdefault(sub, []).append(Rule(rp.name, rp.filter, rp.action))
        out = []
        for e in entries:
            address = Address.parse(e.name)
            if e.entity_type == SUBSCRIPTION and address.topic == topic_name:
                sub = address.leaf
                props = SubscriptionProperties.from_json(e.properties)
                key, ttl = split_subscription_path(e.table_path)[1], props.default_message_time_to_live
                out.append(Subscriber(key, tuple(rules.get(sub, ())), ttl, bool(props.requires_session)))
        return out

    # ---- auto-forwarding ------------------------------------------------------------------------

    def _resolve(self, name: str) -> tuple[Entity, Expand | None]:
        """A forwarding destination by name: a queue, else a topic (with its fan-out)."""
        try:
            return self._entity(QUEUE, name), None
        except EntityNotFoundError:
            return self._entity(TOPIC, name), self._expander(TOPIC, name)

    def _pump(self, entity: Entity, partitions: list[int] | None = None) -> None:
        """Forward what waits on the entity, then on every forwarding entity it reached (chains end at the hop limit)."""
        todo: list[tuple[Entity, list[int] | None]] = [(entity, partitions)]
        for _ in range(2 * (MAX_HOPS + 1)):
            if not todo:
                return
            source, parts = todo.pop(0)
            if not routes(source):
                continue
            for dest in forward(source, self._resolve, parts):
                todo.extend((e, None) for e in self._forwarding_entities(dest))

    def _forwarding_entities(self, name: str) -> list[Entity]:
        """The entities under a destination name that forward further: the queue, or the topic's subscriptions."""
        try:
            return [self._entity(QUEUE, name)]
        except EntityNotFoundError:
            return self._forwarding_subscriptions(name)

    def _forwarding_subscriptions(self, topic_name: str) -> list[Entity]:
        """The topic's subscriptions that forward (none when the topic is gone)."""
        try:
            names = self._topic_rules(topic_name).forwarding
        except EntityNotFoundError:
            return []
        out = []
        for sub in names:
            try:
                entity = self._entity(SUBSCRIPTION, sub_entity_name(topic_name, sub))
            except EntityNotFoundError:  # deleted since the rules were cached
                continue
            if routes(entity):
                out.append(entity)
        return out

    def forward_pending_messages(self) -> None:
        """Finish every pending auto-forward in the namespace (after a crash, or when forward_to was set later)."""
        for entry in self._catalog.entries():
            if entry.entity_type in (QUEUE, SUBSCRIPTION):
                try:
                    entity = self._entity(entry.entity_type, Address.parse(entry.name).name)
                    if routes(entity):
                        self._pump(entity)
                except SparkQueueError as exc:  # one faulty entity never blocks the others
                    log.error("forwarding from %s skipped: %s", entry.name, exc)

    def _after_send(self, entity_type: str, name: str, stored_partitions: list[int]) -> None:
        """Forward what a send just stored, when the queue or any of the topic's subscriptions forwards."""
        if entity_type == QUEUE:
            self._pump(self._entity(QUEUE, name), stored_partitions)
        else:
            for e in self._forwarding_subscriptions(name):
                self._pump(e, stored_partitions)

    # ---- senders and receivers -----------------------------------------------------------------

    def get_queue_sender(self, queue_name: str) -> Sender:
        """A sender to the queue."""
        return Sender(self, QUEUE, queue_name)

    def get_topic_sender(self, topic_name: str) -> Sender:
        """A sender to the topic: each message is copied to every subscription whose rules match."""
        return Sender(self, TOPIC, topic_name)

    def get_queue_receiver(
        self,
        queue_name: str,
        *,
        receive_mode: ReceiveMode | str = ReceiveMode.PEEK_LOCK,
        sub_queue: SubQueue | str | None = None,
        session_id: Any = None,
        prefetch_count: int = 0,
        max_wait_time: float | timedelta | None = None,
        auto_lock_renewer: Any = None,
    ) -> Receiver:
        """A receiver of the queue, of its dead-letter sub-queue, or (session_id) of one of its sessions."""
        return Receiver(
            self,
            QUEUE,
            queue_name,
            receive_mode=receive_mode,
            sub_queue=sub_queue,
            prefetch_count=prefetch_count,
            max_wait_time=max_wait_time,
            session_id=session_id,
            auto_lock_renewer=auto_lock_renewer,
        )

    def get_subscription_receiver(
        self,
        topic_name: str,
        subscription_name: str,
        *,
        receive_mode: ReceiveMode | str = ReceiveMode.PEEK_LOCK,
        sub_queue: SubQueue | str | None = None,
        session_id: Any = None,
        prefetch_count: int = 0,
        max_wait_time: float | timedelta | None = None,
        auto_lock_renewer: Any = None,
    ) -> Receiver:
        """A receiver of a subscription, of its dead-letter sub-queue, or of one of its sessions."""
        return Receiver(
            self,
            SUBSCRIPTION,
            sub_entity_name(topic_name, subscription_name),
            receive_mode=receive_mode,
            sub_queue=sub_queue,
            prefetch_count=prefetch_count,
            max_wait_time=max_wait_time,
            session_id=session_id,
            auto_lock_renewer=auto_lock_renewer,
        )

    # ---- transactions and sessions ------------------------------------------------------------

    @property
    def _active_transaction(self) -> Transaction | None:
        return getattr(self._local, "transaction", None)

    def transaction(self) -> Transaction:
        """`with ns.transaction() as tx:` groups sends and settlements on one entity into one atomic commit."""
        return Transaction(self)

    def list_queue_sessions(self, queue_name: str) -> list[SessionInfo]:
        """Sessions of a session-enabled queue, with their state, lock expiry and message counts."""
        return Sessions(self._entity(QUEUE, queue_name)).list()

    def list_subscription_sessions(self, topic_name: str, subscription_name: str) -> list[SessionInfo]:
        """Sessions of a session-enabled subscription."""
        return Sessions(self._entity(SUBSCRIPTION, sub_entity_name(topic_name, subscription_name))).list()
