"""The broker core: one namespace's catalog, entity handles and caches, the send and settle paths, fan-out and forwarding.

Everything that touches entities goes through a Broker: the public API (`Namespace`, senders,
receivers, the management client) holds one, and Spark tasks open their own from an entity
reference. It sits under the public API and over the model and storage layers (README
"Architecture"), so nothing here imports the API or Spark.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from sparkqueue.broker.transaction import Transaction, open_transaction
from sparkqueue.errors import EntityNotFoundError, InvalidOperationError, SparkQueueError, StorageCorruptedError
from sparkqueue.model import lifecycle, limits
from sparkqueue.model.addresses import QUEUE, RULE, SUBSCRIPTION, TOPIC, Address
from sparkqueue.model.deadlines import effective
from sparkqueue.model.entity import Entity, SettleResult
from sparkqueue.model.filters import action_from_dict, filter_from_dict
from sparkqueue.model.forwarding import MAX_HOPS, cancel_lapsed_claims, forward, routes, settle_delivered
from sparkqueue.model.properties import (
    AnyEntityProperties,
    QueueProperties,
    RuleProperties,
    SubscriptionProperties,
    TopicProperties,
)
from sparkqueue.model.sessions import SessionLock, Sessions
from sparkqueue.model.sql_parser import stored_rules
from sparkqueue.model.topics import Rule, Subscriber, fan_out, without_markers
from sparkqueue.storage.catalog import Catalog, CatalogEntry
from sparkqueue.storage.faults import FaultInjector
from sparkqueue.storage.log import Fence, TableDeletedError
from sparkqueue.storage.retry import Deadline
from sparkqueue.storage.schema import ANY_SUBSCRIPTION
from sparkqueue.storage.store import Store, check_storage_options, open_store, resolve_root, with_deadline_options
from sparkqueue.storage.table import EntityTable, Expand, partition_of

log = logging.getLogger(__name__)

PROPERTIES_TTL_S = 1.0  # how long a process trusts cached settings and rules before re-reading the catalog
OWED_EVERY_S = 5.0  # how often receives of an entity forward what other entities owe it, per process (Broker.forward_owed)
OWED_BUDGET_S = 0.25  # how long such a pass may hold up the receive that runs it (one batch more at most)
# The turns' offsets: neither the application's (perhaps seeded) global generator nor a private one, which a forked
# process would share with its parent: every forked receiver would start at the same source.
_RANDOM = random.SystemRandom()

PROPERTY_TYPES: dict[str, type[AnyEntityProperties]] = {
    QUEUE: QueueProperties,
    TOPIC: TopicProperties,
    SUBSCRIPTION: SubscriptionProperties,
}


def _sources_of(target: str, entries: Sequence[CatalogEntry]) -> list[tuple[str, str]]:
    """The queues and subscriptions whose forwarding reaches queue or topic `target`, directly or over up to MAX_HOPS hops.

    (kind, name) pairs, the farthest first (forward_owed's order); names compare without case, as entity names do.
    """
    edges = []
    for entry in entries:
        if entry.entity_type in (QUEUE, SUBSCRIPTION):
            settings = json.loads(entry.properties)  # two keys of every entry: PROPERTY_TYPES' from_json costs 4x as much
            routes_to = {d.lower() for d in (settings.get("forward_to"), settings.get("forward_dead_lettered_messages_to")) if d}
            address = Address.parse(entry.name)
            edges.append((entry.entity_type, address.name, address.topic.lower(), routes_to))
    found: dict[tuple[str, str], None] = {}
    reached = {target.lower()}
    for _ in range(MAX_HOPS):
        step = {(kind, name): at for kind, name, at, to in edges if to & reached and (kind, name) not in found}
        if not step:
            break
        found.update(dict.fromkeys(step))
        reached = set(step.values())  # a source is a queue, or a subscription of a topic: what forwards there comes next
    return list(found)[::-1]


def _alike_entry(entries: Sequence[CatalogEntry], key: str) -> CatalogEntry | None:
    """The entry whose key equals `key` but for case (queue and topic names are unique without it), or None."""
    lower = key.lower()
    return next((e for e in entries if e.name.lower() == lower), None)


def sub_entity_name(topic_name: str, subscription_name: str) -> str:
    """Catalog name of a subscription: topic and subscription joined by '|' (neither may contain it)."""
    limits.check_name_type(topic_name, "topic")
    limits.check_name_type(subscription_name, "subscription")
    return Address.subscription_of(topic_name, subscription_name).name


def split_subscription_path(table_path: str) -> tuple[str, str]:
    """A subscription's catalog table path is '<topic table>#<subscription key>'."""
    path, _, key = table_path.rpartition("#")
    return path, key


def rule_from_entry(entry: CatalogEntry) -> RuleProperties:
    """A rule rebuilt from its catalog row."""
    raw = json.loads(entry.properties)
    name = Address.parse(entry.name).leaf
    with stored_rules():  # a rule stored before a check of new rules existed still parses
        action = action_from_dict(raw["action"]) if raw.get("action") else None
        return RuleProperties(name, filter_from_dict(raw["filter"]), action, entry.created_at_utc)


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


class Broker:
    """One namespace root's catalog and entities, as this process sees them (settings cached for PROPERTIES_TTL_S)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        tier: str | None = None,
        *,
        operation_timeout: float = 60.0,
        storage_options: Mapping[str, str] | None = None,
        create: bool = True,
    ) -> None:
        limits.check_bool(create, "create")  # Namespace(root, create="false") must not make a namespace
        self.root = resolve_root(root)
        asked = None if tier is None else limits.check_tier(tier)
        self.operation_timeout = limits.check_seconds(operation_timeout, "operation_timeout")  # finite: NaN never expires
        # As given: what a Spark task or a pickle reopens with.
        self.storage_options = check_storage_options(storage_options, self.root)
        # What this process's stores use: request timeouts and retries fitted to the operation timeout.
        self.store_options = with_deadline_options(self.root, self.storage_options, self.operation_timeout)
        self.store: Store = open_store(self.root, self.store_options)
        self.catalog = Catalog(self.store, self.store_options)
        marker = self.catalog.open({"tier": asked or limits.STANDARD}, create=create)
        self.tier = limits.namespace_tier(self.root, marker.get("tier"), asked)
        self.cache: dict[str, _Cached] = {}
        self.tables: dict[str, EntityTable] = {}
        self.rules: dict[str, _CachedRules] = {}
        self.faults: dict[str, FaultInjector] = {}
        self.owed_at: dict[str, float] = {}  # when forward_owed last ran per destination (lower-cased name)
        # Per destination: the turn of forward_owed's passes over its sources (Broker._in_turn).
        self.owed_offset: dict[str, int] = {}
        self.owed_seen: dict[str, set[tuple[str, str]]] = {}
        self.lock = threading.RLock()

    def close(self) -> None:
        """Drop cached handles and settings; the broker may be used again afterwards."""
        with self.lock:
            self.cache.clear()
            self.tables.clear()
            self.rules.clear()

    def __repr__(self) -> str:
        return f"Broker({self.root!r}, tier={self.tier!r})"

    # ---- faults (tests and drills) ---------------------------------------------------------------

    def fault_injector(self, entity_name: str, entity_type: str = QUEUE) -> FaultInjector:
        """This process's fault hook on a queue's or topic's table (a topic's covers its subscriptions)."""
        if entity_type not in (QUEUE, TOPIC):
            raise InvalidOperationError("faults are injected on a queue's or a topic's table")
        with self.lock:
            return self.faults.setdefault(Address.of(entity_type, entity_name).key, FaultInjector())

    # ---- entity resolution ---------------------------------------------------------------------

    def deadline(self) -> Deadline:
        return Deadline(effective(self.operation_timeout))

    def entry(self, entity_type: str, name: str) -> CatalogEntry:
        """An entity's catalog row; a name that differs from the stored one only in case finds it too (canonical)."""
        entry = self.catalog.get(Address.of(entity_type, name).key)
        if entry is None:
            stored = self._spelled_alike(entity_type, name)
            entry = self.catalog.get(Address.of(entity_type, stored).key) if stored != name else None
        if entry is None:
            shown = Address.of(entity_type, name).path
            raise EntityNotFoundError(
                f"{entity_type} {shown!r} does not exist in namespace {self.root!r}{self._is_other(entity_type, name)}"
            )
        return entry

    def _is_other(self, entity_type: str, name: str) -> str:
        """For an error: " ('t' is a topic)" when a queue name names a topic instead, or the other way round; else ""."""
        other = {QUEUE: TOPIC, TOPIC: QUEUE}.get(entity_type)
        if other is None or self.catalog.get(Address.of(other, self._spelled_alike(other, name)).key) is None:
            return ""
        return f" ({name!r} is a {other})"

    def canonical(self, entity_type: str, name: str) -> str:
        """The stored spelling of an entity name given in another case, as Service Bus names ignore case; else `name`.

        Queue and topic names are unique without case (docs/semantics.md §1), and so are a topic's
        subscriptions and a subscription's rules. A subscription's or rule's parents are matched the
        same way, and its own name when exactly one stored name matches it (names stored before
        uniqueness without case may differ only in case).
        """
        if self.catalog.get(Address.of(entity_type, name).key) is not None:
            return name  # stored as given: the common case, one lookup
        return self._spelled_alike(entity_type, name)

    def _spelled_alike(self, entity_type: str, name: str) -> str:
        """canonical() for a name not stored as given (see there)."""
        if entity_type in (QUEUE, TOPIC):
            found = _alike_entry(self.catalog.entries(entity_type), Address.of(entity_type, name).key)
            return Address.parse(found.name).name if found is not None else name
        if entity_type not in (SUBSCRIPTION, RULE):
            return name
        address = Address.of(entity_type, name)
        parent_kind = TOPIC if entity_type == SUBSCRIPTION else SUBSCRIPTION
        parent = Address.of(parent_kind, self.canonical(parent_kind, Address(parent_kind, address.parts[:-1]).name))
        siblings = [Address.parse(e.name) for e in self.catalog.entries(entity_type)]
        leaves = [a.leaf for a in siblings if a.is_child_of(parent)]
        alike = [leaf for leaf in leaves if leaf.lower() == address.leaf.lower()]
        leaf = address.leaf if address.leaf in leaves or len(alike) != 1 else alike[0]
        return Address(entity_type, (*parent.parts, leaf)).name

    def forget(self, key: str) -> None:
        """Drop cached settings of an entity (after an update or delete), under every spelling it was looked up by."""
        lower = key.lower()
        with self.lock:
            for cache in (self.cache, self.rules):
                for k in [k for k in cache if k.lower() == lower]:
                    del cache[k]

    def entity(self, entity_type: str, name: str) -> Entity:
        """The entity with settings at most PROPERTIES_TTL_S old; raises EntityNotFoundError."""
        key = Address.of(entity_type, name).key
        with self.lock:
            cached = self.cache.get(key)
            if cached is not None and time.monotonic() - cached.loaded_at < PROPERTIES_TTL_S and not cached.entity.table.deleted:
                return cached.entity
        read_at = time.monotonic()  # settings are as old as the read's start: a slow read must not extend their life
        entry = self.entry(entity_type, name)
        name = Address.parse(entry.name).name  # as stored, when `name` differs in case
        props = PROPERTY_TYPES[entity_type].from_json(entry.properties)
        with self.lock:
            cached = self.cache.get(key)
            if cached is not None and cached.table_path == entry.table_path:
                cached.entity.props = props
                cached.loaded_at = read_at
                return cached.entity
            sub_key: str | None
            if entity_type == SUBSCRIPTION:
                path, sub_key = split_subscription_path(entry.table_path)
                owner = Address.of(SUBSCRIPTION, name).owner().key
            else:
                path, sub_key = entry.table_path, ANY_SUBSCRIPTION if entity_type == TOPIC else None
                owner = key
            table = self.table(path, props.partition_count, owner)
            entity = Entity(props, table, self.operation_timeout, sub_key, self._forward_dead_letters)
            self.cache[key] = _Cached(entity, entry.table_path, read_at)
            return entity

    def table_uri(self, table_path: str) -> str:
        """Where a catalog table path lives: paths are recorded relative to the root (so a copied namespace is its own)."""
        return table_path if "://" in table_path or table_path.startswith("/") else f"{self.root}/{table_path}"

    def table(self, path: str, partition_count: int, owner: str) -> EntityTable:
        """One table handle per Delta table, shared by a topic and its subscriptions."""
        with self.lock:
            table = self.tables.get(path)
            if table is None:
                faults = self.faults.setdefault(owner, FaultInjector())
                faults.forget_damage()  # found in a table this name had before (deleted and made again): not this one's
                named = lambda: any(e.table_path.partition("#")[0] == path for e in self.catalog.entries())
                table = EntityTable(self.table_uri(path), partition_count, faults, self.store_options, named)
                self.tables[path] = table
            return table

    def expander(self, entity_type: str, name: str) -> Expand | None:
        """How a send to the entity turns messages into rows: topic fan-out, or as-is for a queue."""
        if entity_type != TOPIC:
            return None
        cached = self.topic_rules(name)
        subscribers, record_ids = cached.subscribers, cached.record_ids
        cap = limits.MAX_MESSAGE_BYTES[self.tier]
        return lambda rows: fan_out(rows, subscribers, record_ids, cap)

    def topic_rules(self, name: str) -> _CachedRules:
        """A topic's subscribers with their rules, and which of them forward; cached for PROPERTIES_TTL_S."""
        key = Address.of(TOPIC, name).key
        with self.lock:
            cached = self.rules.get(key)
        if cached is None or time.monotonic() - cached.loaded_at >= PROPERTIES_TTL_S:
            read_at = time.monotonic()  # as in entity(): the rules are as old as the read's start
            entries = self.catalog.entries()  # one read for the topic, its subscriptions and rules
            topic = next((e for e in entries if e.name == key), None) or _alike_entry(entries, key)  # canonical
            if topic is None:
                raise EntityNotFoundError(f"topic {name!r} does not exist in namespace {self.root!r}")
            name = Address.parse(topic.name).name
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
            cached = _CachedRules(self.subscribers(name, entries), record_ids, read_at, forwarding)
            with self.lock:
                self.rules[key] = cached
        return cached

    def subscribers(self, topic_name: str, entries: list[CatalogEntry] | None = None) -> list[Subscriber]:
        """The topic's subscriptions with their rules, read from the catalog in one pass."""
        entries = self.catalog.entries() if entries is None else entries
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
                forwards = bool(props.forward_to)
                dead_letter_errors = bool(props.dead_lettering_on_filter_evaluation_exceptions)
                out.append(
                    Subscriber(key, tuple(rules.get(sub, ())), ttl, bool(props.requires_session), forwards, dead_letter_errors)
                )
        return out

    # ---- auto-forwarding ------------------------------------------------------------------------

    def resolve(self, name: str) -> tuple[Entity, Expand | None]:
        """A forwarding destination by name: a queue, else a topic (with its fan-out)."""
        try:
            return self.entity(QUEUE, name), None
        except EntityNotFoundError:
            return self.entity(TOPIC, name), self.expander(TOPIC, name)

    def pump(self, entity: Entity, partitions: list[int] | None = None, until: float | None = None) -> bool:
        """Forward what waits on the entity, then, hop by hop, on every forwarding entity it reached.

        Each round forwards from every entity the previous round reached, however many (a topic may
        have any number of forwarding subscriptions). A message travels at most MAX_HOPS hops, so
        chains and cycles end within MAX_HOPS + 1 rounds. `until`: as in model.forwarding.forward; the
        first batch of `entity` runs whatever the time (a pass always gets somewhere), later hops'
        only before it. Returns whether any message may have moved.
        """
        level: list[tuple[Entity, list[int] | None]] = [(entity, partitions)]
        moved = False
        for hop in range(MAX_HOPS + 2):
            reached: dict[tuple[str, str | None], Entity] = {}
            for source, parts in level:
                if hop and until is not None and time.monotonic() >= until:
                    return moved  # a later hop starts no source once the time is spent (each costs reads)
                if not routes(source):
                    continue
                for dest in forward(source, self.resolve, parts, until, first_free=hop == 0):
                    moved = True
                    if until is not None and time.monotonic() >= until:
                        continue  # out of time: the next hop (every forwarding subscription's reads) waits too
                    for e in self.forwarding_entities(dest, until):
                        reached.setdefault((e.table.uri, e.subscription), e)
            if not reached:
                return moved
            level = [(e, None) for e in reached.values()]
        return moved

    def forward_now(self, entity: Entity, partitions: list[int], until: float | None = None) -> bool:
        """Forward right after an operation that landed (send, settle, receive): a failure is logged, never raised.

        The operation stands whatever forwarding does, so its caller must not see an error and
        repeat it; what is left waits for the next forward (forward_pending_messages, maintenance).
        `until`: as in model.forwarding.forward. Returns whether any message may have moved.
        """
        try:
            return self.pump(entity, partitions, until)
        except SparkQueueError as exc:
            log.warning("forwarding from %s deferred: %s", entity.name, exc)
            return False

    def forward_after_route_change(self, entity_type: str, name: str, left: str | None, new_route: bool) -> None:
        """After an update changed an entity's routes: settle what reached the destination it `left`, then forward what waits.

        Other processes forward and send by settings up to PROPERTIES_TTL_S old, so right after the
        change they may still forward to the old destination (one killed before its settle leaves
        originals that only that destination knows went out, `forwarding.settle_delivered`), or store
        messages without forwarding them. A changed main route rests meanwhile (Entity.mark_route_change).
        Once the rest is over, the originals are settled and, on a `new_route`, what waits moves on.
        Originals are settled at once too, before receivers that see the route removed take them.
        """
        try:
            entity = self.entity(entity_type, name)
            if left:
                settle_delivered(entity, left, self.resolve)
            time.sleep(1.5 * PROPERTIES_TTL_S)  # and for an operation that read its settings just in time
            entity = self._after_rest(entity_type, name)
            if left:
                settle_delivered(entity, left, self.resolve)
            if new_route:
                self.pump(entity)
        except SparkQueueError as exc:
            log.warning("forwarding from %s after its route changed deferred: %s", name, exc)

    def _forward_dead_letters(self, entity: Entity, partitions: list[int]) -> None:
        """Forward what a receive just dead-lettered, when the entity forwards its dead letters."""
        if getattr(entity.props, "forward_dead_lettered_messages_to", None):
            self.forward_now(entity, partitions)

    def forwarding_entities(self, name: str, until: float | None = None) -> list[Entity]:
        """The entities under a destination name that forward further: the queue, or the topic's subscriptions.

        `until` (a time.monotonic() value): load no subscription after it (each load may read the catalog).
        """
        try:
            return [self.entity(QUEUE, name)]
        except EntityNotFoundError:
            return self.forwarding_subscriptions(name, until)

    def forwarding_subscriptions(self, topic_name: str, until: float | None = None) -> list[Entity]:
        """The topic's subscriptions that forward (none when the topic is gone); `until` as in forwarding_entities."""
        try:
            names = self.topic_rules(topic_name).forwarding
        except EntityNotFoundError:
            return []
        out = []
        for sub in names:
            if until is not None and time.monotonic() >= until:
                break  # the others wait for a later pass (they are sources of the destination too)
            try:
                entity = self.entity(SUBSCRIPTION, sub_entity_name(topic_name, sub))
            except EntityNotFoundError:  # deleted since the rules were cached
                continue
            if routes(entity):
                out.append(entity)
        return out

    def forward_owed(self, entity_type: str, name: str) -> None:
        """Before a receive: forward what other entities owe a queue or a subscription's topic, every OWED_EVERY_S at most.

        A forward runs after the operation that stored its messages, on the partitions it touched; one
        that failed (its destination unavailable for a moment) or whose process died waits for the
        next such operation on that partition, or for forward_pending_messages. Receivers of the
        destination move it too, at most every OWED_EVERY_S per destination in this process, from
        every entity whose forwarding reaches it (a chain's far end holds the only receivers).

        The pass starts no source and no batch after OWED_BUDGET_S (half the call's timeout when that
        is tighter), but each source it starts forwards one batch (its later hops wait for the next
        pass): a receive is not held up by a large owed backlog or many sources on a slow store. Passes
        take the sources in turn (Broker._in_turn), farthest first, so every source is reached and a
        message moving down a chain is met at its next hop. A pass that ran out of time after moving
        messages lets the next receive go on at once (more may be owed); one that moved nothing waits
        OWED_EVERY_S as usual.
        """
        target = Address.of(entity_type, name).topic  # a queue's name, or a subscription's topic
        key = target.lower()
        now = time.monotonic()
        with self.lock:
            if now - self.owed_at.get(key, -OWED_EVERY_S) < OWED_EVERY_S:
                return
            self.owed_at[key] = now
        until = now + min(OWED_BUDGET_S, effective(self.operation_timeout) / 2)
        try:
            entries = self.catalog.entries()
        except SparkQueueError as exc:  # the receive goes on; its own read reports what it finds
            log.info("forwards owed to %s deferred: %s", target, exc)
            return
        sources = _sources_of(target, entries)
        moved = False
        for i, (kind, source) in enumerate(self._in_turn(key, sources)):
            if i and time.monotonic() >= until:
                break
            with self.lock:
                self.owed_seen.setdefault(key, set()).add((kind, source))
            try:
                entity = self.entity(kind, source)
            except SparkQueueError as exc:  # deleted meanwhile, or its table unreadable: the receive goes on
                log.info("forwarding from %s to %s deferred: %s", source, target, exc)
                continue
            moved = self.forward_now(entity, list(range(entity.partition_count)), until) or moved
        if moved and time.monotonic() >= until:  # perhaps not done: the next receive goes on with it
            with self.lock:
                self.owed_at.pop(key, None)
            log.debug("forwards owed to %s: the pass ran out of time; the next receive goes on", target)

    def _in_turn(self, key: str, sources: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`sources` in the order forward_owed takes them for destination `key`: those not reached yet in this turn first.

        Both parts keep `sources`' order, turned by an offset drawn once per destination in this process (so short-lived
        receivers do not all start at the same source). A turn ends once every current source was reached.
        """
        if not sources:
            return []
        with self.lock:
            offset = self.owed_offset.setdefault(key, _RANDOM.randrange(len(sources) * 1_000))
            seen = self.owed_seen.setdefault(key, set())
            seen &= set(sources)  # sources gone since no longer count
            if len(seen) == len(sources):
                seen.clear()
            start = offset % len(sources)
            order = sources[start:] + sources[:start]
            return [s for s in order if s not in seen] + [s for s in order if s in seen]

    def _after_rest(self, entity_type: str, name: str) -> Entity:
        """The entity once its main route has ended any rest after a change, with settings read after that."""
        wait = self.entity(entity_type, name).route_rest_left_s()
        if wait > 0:
            time.sleep(wait + 0.01)
            self.forget(Address.of(entity_type, name).key)
        return self.entity(entity_type, name)

    def forward_pending_messages(self) -> None:
        """Finish every pending auto-forward in the namespace (after a crash, or when forward_to was set later).

        An entity that no longer forwards its dead letters gets the claims a dead forwarder left on them
        cancelled (model/forwarding.py), so they become receivable again.
        """
        for entry in self.catalog.entries():
            if entry.entity_type in (QUEUE, SUBSCRIPTION):
                name = Address.parse(entry.name).name
                try:
                    entity = self.entity(entry.entity_type, name)
                    if routes(entity):
                        self.pump(self._after_rest(entry.entity_type, name))
                    if not getattr(entity.props, "forward_dead_lettered_messages_to", None):
                        cancel_lapsed_claims(entity, self.resolve)
                except SparkQueueError as exc:  # one faulty entity never blocks the others
                    log.error("forwarding from %s skipped: %s", entry.name, exc)

    def send(
        self, entity_type: str, name: str, rows: pa.Table, keys: Sequence[str | None], once: Fence | None = None
    ) -> pa.Table:
        """The one send path: store rows (a topic's fanned out to its subscriptions) in one commit, then forward.

        Returns the stored messages (a topic's id records left out), with their sequence numbers.
        `once` makes the append idempotent (see EntityTable.append). Inside an open transaction
        the rows are recorded for its commit instead, and nothing is returned yet.
        """
        tx = open_transaction(self)
        if tx is not None:
            if once is not None:
                raise InvalidOperationError("an idempotent send cannot join a transaction")
            tx.add_send(entity_type, name, rows, keys)
            return rows.slice(0, 0)
        try:
            stored = self._send_once(entity_type, name, rows, keys, once)
        except (TableDeletedError, StorageCorruptedError) as exc:
            if not isinstance(exc, TableDeletedError) and not self._stale(entity_type, name):
                raise  # damage in the table the catalog still names
            # deleted under a cached handle (half-deleted tables read as damaged), maybe made again: once more, afresh
            self.forget(Address.of(entity_type, name).key)
            stored = self._send_once(entity_type, name, rows, keys, once)
        if stored.num_rows:
            self.after_send(entity_type, name, sorted({partition_of(s) for s in stored.column("sequence_number").to_pylist()}))
        return stored

    def _stale(self, entity_type: str, name: str) -> bool:
        """True when the catalog no longer names the table this broker holds for the entity (deleted, maybe made again)."""
        with self.lock:
            cached = self.cache.get(Address.of(entity_type, name).key)
        if cached is None:
            return False
        try:
            return self.entry(entity_type, name).table_path != cached.table_path
        except EntityNotFoundError:
            return True

    def _send_once(self, entity_type: str, name: str, rows: pa.Table, keys: Sequence[str | None], once: Fence | None) -> pa.Table:
        """Store rows in the entity as this broker knows it (a topic's fanned out); the stored messages, markers left out."""
        entity = self.entity(entity_type, name)
        return without_markers(entity.send(rows, keys, self.expander(entity_type, name), once))

    def after_send(self, entity_type: str, name: str, stored_partitions: list[int]) -> None:
        """Forward what a send just stored, when the queue or any of the topic's subscriptions forwards."""
        try:
            sources = [self.entity(QUEUE, name)] if entity_type == QUEUE else self.forwarding_subscriptions(name)
        except EntityNotFoundError:  # deleted since the send landed: nothing to forward from
            return
        except SparkQueueError as exc:  # the send stands: its caller must not see an error and send again
            log.warning("forwarding from %s deferred: %s", name, exc)
            return
        for e in sources:
            self.forward_now(e, stored_partitions)

    # ---- settle ---------------------------------------------------------------------------------

    def settle(
        self,
        entity_type: str,
        name: str,
        items: Sequence[tuple[int, str]],
        op: str,
        reason: lifecycle.Texts = None,
        description: lifecycle.Texts = None,
        *,
        sub_queue: str,
        session: SessionLock | None = None,
        owners: Sequence[tuple[str | None, str | None]] = (),
    ) -> SettleResult | None:
        """The one settle path: apply `op` to (sequence_number, lock_token) items, then forward what was dead-lettered.

        Only rows of the receiver's `sub_queue` are settled; an item of the other is reported as not
        held. A held session's items settle under its lock, in its own files (model/sessions.py). A dead
        letter's reason and description are one text, or a list with one per item. Inside an open
        transaction the settlement is recorded for its commit instead, and None is returned; `owners`
        (the messages' session_id and partition_key) are checked against its key and session.
        """
        entity = self.entity(entity_type, name)
        tx = open_transaction(self)
        if tx is not None:
            if op == lifecycle.RENEW:
                raise InvalidOperationError("locks cannot be renewed inside a transaction")
            guard = Sessions(entity).guard(session) if session is not None else None  # checked at commit
            tx.add_settle(entity_type, name, sub_queue, items, op, reason, description, guard, owners)
            return None
        if session is not None:
            result = Sessions(entity).settle(session, items, op, reason, description)
        else:
            result = entity.settle(sub_queue, items, op, reason, description)
        # Forward the dead letters (forward_dead_lettered_messages_to), and what an abandon unblocked on an entity
        # whose forward_to was set while a receiver held its messages (model/forwarding.py forwards in order).
        if op == lifecycle.DEAD_LETTER or (op == lifecycle.ABANDON and getattr(entity.props, "forward_to", None)):
            held = sorted({partition_of(seq) for (seq, _), ok in zip(items, result.ok, strict=True) if ok})
            if held:
                self.forward_now(entity, held)
        return result

    # ---- transactions ---------------------------------------------------------------------------

    def transaction(self) -> Transaction:
        """A transaction on this broker: `with broker.transaction():` records sends and settlements for one commit."""
        return Transaction(self)
